"""Weight-only quantization of the engine: MatMulNBits graph vs a PyTorch reference of the same codes."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from engine_testkit import TARGETS, make_adapter, tiny_engine, tiny_qwen  # noqa: F401  (fixtures)

from runtime.adapter import load_adapter
from runtime.backends.onnxruntime import OrtEngine
from runtime.model import rms_norm
from tasks.data import Example
from tasks.evaluate import accuracy_report
from tasks.quantize_weights import (
    DEFAULT_BLOCK_SIZE,
    WeightQuantError,
    accuracy_gate,
    calibrate_activations,
    dequantize_groups,
    ensure_quantized_engine,
    fake_quantize,
    open_on_cpu,
    pack_codes,
    quantize_engine_dir,
    quantize_groups,
    reference_backbone,
)


@pytest.fixture(scope="module")
def adapter(tiny_qwen, tmp_path_factory):
    return make_adapter(tiny_qwen, tmp_path_factory.mktemp("wq_adapter"))


def _prefill_and_decode(engine, ids):
    """Logits of a prefill of all but the last token, then one decode step with the cache."""
    B, T = ids.shape
    pos, mask = np.arange(T)[None].repeat(B, 0), np.ones((B, T), np.int64)
    first, cache = engine.forward(ids[:, :-1], pos[:, :-1], mask[:, :-1], None)
    last, _ = engine.forward(ids[:, -1:], pos[:, -1:], mask, cache)
    return np.concatenate([first, last], axis=1)  # (B, T, V)


def _reference_logits(model, ids, lora, names):
    with torch.no_grad():
        t = torch.from_numpy(ids)
        pos = torch.arange(ids.shape[1])[None].expand_as(t)
        logits, _ = model(t, pos, torch.ones_like(t), model.empty_past(ids.shape[0]),
                          tuple(torch.from_numpy(lora[n]) for n in names))
    return logits.numpy()


def test_norm_fold_is_exact_in_float():
    # Given an RMSNorm scale g far from 1 and a projection W (out, in)
    torch.manual_seed(0)
    x, g, w = torch.randn(5, 64, dtype=torch.float64), torch.rand(64, dtype=torch.float64) * 3, torch.randn(32, 64, dtype=torch.float64)
    # When g is folded into W
    folded = rms_norm(x, torch.ones(64, dtype=torch.float64), 1e-6) @ (w * g[None, :]).t()
    # Then the product is unchanged (to float64 rounding)
    assert torch.allclose(rms_norm(x, g, 1e-6) @ w.t(), folded, atol=1e-12, rtol=0)


@pytest.mark.parametrize("bits", [4, 8])
def test_packing_matches_onnxruntime_own_quantizer_bit_for_bit(bits):
    from onnxruntime.capi._pybind_state import quantize_matmul_4bits, quantize_matmul_8bits

    # Given a random (K, N) weight, quantized by ORT's C++ helper (the MatMulNBits reference layout)
    K, N, block = 128, 48, 32
    w = np.random.default_rng(bits).normal(size=(K, N)).astype(np.float32)
    packed = np.zeros((N, K // block, block * bits // 8), np.uint8)
    zp = np.zeros((N, (K // block * bits + 7) // 8), np.uint8)
    scale = np.zeros((N, K // block), np.float32)
    (quantize_matmul_4bits if bits == 4 else quantize_matmul_8bits)(packed, w, scale, zp, block, N, K, False)
    # When ours quantizes the same weight
    q, s, z = quantize_groups(torch.from_numpy(w.T.copy()), bits, block)
    # Then codes, scales and zero points are identical
    assert np.array_equal(pack_codes(q.numpy(), bits), packed)
    assert np.array_equal(s.numpy(), scale)
    assert np.array_equal(pack_codes(z.numpy(), bits), zp)


def test_rtn_error_is_bounded_by_half_a_step():
    w = torch.randn(16, 96)
    q, scale, zp = quantize_groups(w, 4, 32)
    err = (fake_quantize(w, 4, 32) - w).abs().view(16, 3, 32)
    assert (err <= scale[..., None] / 2 + 1e-6).all()
    assert pack_codes(np.array([[1, 2, 15, 4]], np.uint8), 4).tolist() == [[0x21, 0x4F]]  # low nibble first


@pytest.mark.parametrize(
    "bits,fold,keep",
    [(8, False, ("lm_head", "embed")), (4, False, ("lm_head", "embed")), (4, True, ("lm_head", "embed")), (4, True, ("embed",))],
    ids=["int8", "int4", "int4-fold", "int4-fold-head"],
)
def test_quantized_engine_matches_pytorch_reference_of_same_quantization(tiny_qwen, tiny_engine, adapter, tmp_path, bits, fold, keep):
    # Given the float engine quantized with fp32 compute (accuracy_level 0: no activation rounding)
    out = tmp_path / "q"
    record = quantize_engine_dir(tiny_engine, out, f"int{bits}", 32, fold, keep, accuracy_level=0)
    engine = OrtEngine(out)
    lora = load_adapter(adapter, engine.interface)
    engine.set_adapter(lora)
    ids = np.random.default_rng(0).integers(0, 96, (2, 9))
    # When it runs prefill + one cached decode step with the LoRA as inputs
    got = _prefill_and_decode(engine, ids)
    # Then it matches PyTorch with the dequantized weights of the same codes, LoRA in float
    ref = reference_backbone(tiny_qwen, bits, 32, fold, keep, lora_modules=TARGETS)
    want = _reference_logits(ref, ids, lora, engine.interface.lora_names)
    assert np.abs(got - want).max() < 1e-4
    # and it differs from the float engine (the weights really are quantized)
    float_engine = OrtEngine(tiny_engine)
    float_engine.set_adapter(lora)
    assert np.abs(got - _prefill_and_decode(float_engine, ids)).max() > 1e-3
    n_layers = 2
    assert len(record["quantized"]) == 4 * n_layers + ("lm_head" not in keep)  # qkv, o, gate_up, down (+ head)
    assert record["folded_norms"] == (2 * n_layers + ("lm_head" not in keep) if fold else 0)


@pytest.mark.parametrize("bits,fold", [(8, False), (4, False), (4, True)], ids=["int8", "int4", "int4-fold"])
def test_tensorrt_qdq_engine_matches_pytorch_reference_of_same_symmetric_quantization(
        tiny_qwen, tiny_engine, adapter, tmp_path, bits, fold):
    # Given the float engine written in TensorRT's weight-only form with fp32 GEMMs
    record = quantize_engine_dir(tiny_engine, tmp_path / "q", f"int{bits}", 32, fold, fmt="qdq")
    engine = open_on_cpu(tmp_path / "q")
    lora = load_adapter(adapter, engine.interface)
    engine.set_adapter(lora)
    ids = np.random.default_rng(0).integers(0, 96, (2, 9))
    # When ONNX Runtime runs it (exact dequantization, as TensorRT computes it)
    got = _prefill_and_decode(engine, ids)
    # Then it matches PyTorch with the symmetric codes dequantized: the same numbers TensorRT is given
    ref = reference_backbone(tiny_qwen, bits, 32, fold, lora_modules=TARGETS, symmetric=True)
    assert np.abs(got - _reference_logits(ref, ids, lora, engine.interface.lora_names)).max() < 1e-4
    assert record["symmetric"] is True and record["format"] == "qdq" and record["accuracy_level"] is None


def test_tensorrt_qdq_graph_holds_only_what_its_onnx_parser_takes(tiny_engine, adapter, tmp_path):
    from onnx import TensorProto, numpy_helper

    # Given the int4 weights in the fp16-GEMM form (TensorRT's W4A16 weight-only kernels)
    record = quantize_engine_dir(tiny_engine, tmp_path / "q", "int4", 32, fmt="qdq_fp16")
    model = onnx.load(str(tmp_path / "q" / "model.onnx"))
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    dqs = [n for n in graph.node if n.op_type == "DequantizeLinear"]
    # Then: standard ops at opset 21, one DequantizeLinear per projection (2 layers x qkv, o, gate_up, down)
    assert {n.domain for n in graph.node} == {""} and max(o.version for o in model.opset_import if o.domain == "") == 21
    assert len(dqs) == len(record["quantized"]) == 8
    for dq in dqs:
        weight, scale = (inits[name] for name in dq.input)
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in dq.attribute}
        # a constant signed int4 weight (K, N), no zero point, positive fp16 scales blocked along K
        assert len(dq.input) == 2 and weight.data_type == TensorProto.INT4 and scale.data_type == TensorProto.FLOAT16
        assert attrs == {"axis": 0, "block_size": 32} and list(scale.dims) == [weight.dims[0] // 32, weight.dims[1]]
        assert (numpy_helper.to_array(scale) > 0).all()
        codes = numpy_helper.to_array(weight).astype(np.int8)
        assert codes.min() >= -7 and codes.max() <= 7 and codes.min() < 0 < codes.max()
    # each MatMul reading a dequantized weight runs in fp16 between two Casts; the LoRA inputs are untouched
    consumers = {i: n for n in graph.node for i in n.input}
    for dq in dqs:
        matmul = consumers[dq.output[0]]
        assert matmul.op_type == "MatMul" and consumers[matmul.output[0]].op_type == "Cast"
    assert not any(i.startswith("lora_") for dq in dqs for i in dq.input)
    # and its logits stay within fp16 rounding of the same codes with fp32 GEMMs
    quantize_engine_dir(tiny_engine, tmp_path / "q32", "int4", 32, fmt="qdq")
    lora = load_adapter(adapter, open_on_cpu(tmp_path / "q").interface)
    ids = np.random.default_rng(2).integers(0, 96, (2, 9))
    got = {}
    for name in ("q", "q32"):
        engine = open_on_cpu(tmp_path / name)
        engine.set_adapter(lora)
        got[name] = _prefill_and_decode(engine, ids)
    diff = np.abs(got["q"] - got["q32"]).max()
    assert 0 < diff < 1e-2 * np.abs(got["q32"]).max()


def test_lora_stays_a_float_input_of_the_quantized_graph(tiny_engine, adapter, tmp_path):
    quantize_engine_dir(tiny_engine, tmp_path / "q", "int4", fold_norms=True)
    graph = onnx.load(str(tmp_path / "q" / "model.onnx")).graph
    engine = OrtEngine(tmp_path / "q")

    assert [i.name for i in graph.input] == engine.interface.input_names
    nbits = [n for n in graph.node if n.op_type == "MatMulNBits"]
    assert not any(i.startswith("lora_") for n in nbits for i in n.input)
    assert {n.op_type for n in graph.node if n.op_type.startswith("MatMul")} == {"MatMul", "MatMulNBits"}
    # A swapped adapter changes the output: the LoRA path is live, not folded into constants.
    ids = np.arange(6)[None]
    base = _prefill_and_decode(engine, ids)
    engine.set_adapter(load_adapter(adapter, engine.interface))
    assert np.abs(_prefill_and_decode(engine, ids) - base).max() > 1e-3


@pytest.mark.parametrize("bits,K,block", [(4, 256, 128), (8, 256, 32), (4, 96, 64)], ids=["int4", "int8", "int4-partial-block"])
def test_int8_rounded_linear_is_what_matmulnbits_computes_at_accuracy_level_4(bits, K, block):
    from onnx import TensorProto, helper

    from tasks.quantize_weights import _matmulnbits_nodes, int8_rounded_linear

    # Given one MatMulNBits node with int8 compute and the dequantized weight of its codes
    torch.manual_seed(0)
    w, x = torch.randn(48, K) * 0.05, torch.randn(5, K)
    q, scale, zp = quantize_groups(w, bits, block)
    nodes, inits, _ = _matmulnbits_nodes("m", "x", "y", q, scale, zp, bits, K, block, False, 4)
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [5, K])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [5, 48])], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    got = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x.numpy()})[0]
    w_dq = dequantize_groups(q, scale, zp, K)
    # Then rounding the input per block to int8 reproduces it to float precision, and a float input does not
    assert np.abs(got - int8_rounded_linear(x, w_dq, block_size=block).numpy()).max() < 1e-5
    assert np.abs(got - (x @ w_dq.t()).numpy()).max() > 1e-3


@pytest.mark.parametrize("bits,keep", [(8, ("lm_head", "embed")), (4, ("lm_head", "embed")), (4, ("embed",))],
                         ids=["int8", "int4", "int4-head"])
def test_int8_compute_engine_matches_the_reference_that_rounds_activations_like_it(
        tiny_qwen, tiny_engine, adapter, tmp_path, bits, keep):
    # Given the engine at accuracy_level 4 (the default, the fast path: activations rounded per block to int8)
    quantize_engine_dir(tiny_engine, tmp_path / "q", f"int{bits}", 32, False, keep, accuracy_level=4)
    engine = OrtEngine(tmp_path / "q")
    lora = load_adapter(adapter, engine.interface)
    engine.set_adapter(lora)
    ids = np.random.default_rng(0).integers(0, 96, (16, 12))
    got = _prefill_and_decode(engine, ids)

    def prompt_diffs(accuracy_level):
        ref = reference_backbone(tiny_qwen, bits, 32, keep=keep, lora_modules=TARGETS, accuracy_level=accuracy_level)
        want = _reference_logits(ref, ids, lora, engine.interface.lora_names)
        return np.abs(got - want).max(axis=(1, 2)), np.abs(want).max()

    # Then the reference that rounds as the kernel does matches it exactly on nearly every prompt: the
    # exceptions are prompts where float noise (~1e-7) lands an activation on the other side of a
    # rounding boundary, which moves logits by ~1e-3 (measured: 15, 16 and 15 of 16 prompts exact)
    rounded, scale = prompt_diffs(4)
    assert (rounded < 1e-4).sum() >= 14
    assert rounded.max() < 1e-2 * scale
    # and the fp32-compute reference matches it on none
    unrounded, _ = prompt_diffs(0)
    assert (unrounded < 1e-4).sum() == 0


def test_reference_refuses_int8_rounding_with_folded_norms(tiny_qwen):
    with pytest.raises(ValueError, match="folded norm"):
        reference_backbone(tiny_qwen, 4, 32, fold_norms=True, accuracy_level=4)


def test_cache_key_and_record_separate_precisions(tiny_engine, tmp_path):
    keys = {}
    for name, weights, fold in (("fp32", "fp32", False), ("int8", "int8", False), ("int4", "int4", False), ("int4f", "int4", True)):
        quantize_engine_dir(tiny_engine, tmp_path / name, weights, fold_norms=fold)
        keys[name] = json.loads((tmp_path / name / "cache_key.json").read_text())
        assert json.loads((tmp_path / name / "weights.json").read_text())["weights"] == weights
    float_key = json.loads((tiny_engine / "cache_key.json").read_text())

    # A float copy keeps the float key (cached float builds stay valid); each precision gets its own.
    assert keys["fp32"]["key"] == float_key["key"]
    assert len({k["key"] for k in keys.values()}) == 4
    assert keys["int4f"]["weights_fold_norms"] is True and keys["int8"]["backbone_hash"] == float_key["backbone_hash"]
    # Same settings, same key: a rebuild is reproducible and a cache hit stays possible.
    quantize_engine_dir(tiny_engine, tmp_path / "again", "int8")
    assert json.loads((tmp_path / "again" / "cache_key.json").read_text())["key"] == keys["int8"]["key"]


def test_a_different_block_size_is_a_different_build(tiny_engine, tmp_path):
    # given an int4 copy built at the default block size; when the release asks for block 32; then the
    # cached copy is not reused, and asking again for 32 reuses the new one
    first = ensure_quantized_engine(tiny_engine, tmp_path / "engine-int4", "int4")
    assert first["weights_builds"] == 1 and first["weights_record"]["block_size"] == DEFAULT_BLOCK_SIZE == 128
    other = ensure_quantized_engine(tiny_engine, tmp_path / "engine-int4", "int4", block_size=32)
    assert other["weights_builds"] == 1 and other["weights_record"]["block_size"] == 32
    assert ensure_quantized_engine(tiny_engine, tmp_path / "engine-int4", "int4", block_size=32)["weights_builds"] == 0
    # and TensorRT's form of the same codes is another build again
    trt = ensure_quantized_engine(tiny_engine, tmp_path / "engine-int4", "int4", block_size=32, fmt="qdq_fp16")
    assert trt["weights_builds"] == 1 and trt["weights_record"]["format"] == "qdq_fp16"


def test_refuses_unknown_precision_and_bad_block(tiny_engine, tmp_path):
    with pytest.raises(WeightQuantError, match="weights must be one of"):
        quantize_engine_dir(tiny_engine, tmp_path / "a", "int3")
    with pytest.raises(WeightQuantError, match="block_size"):
        quantize_engine_dir(tiny_engine, tmp_path / "b", "int4", block_size=24)
    with pytest.raises(WeightQuantError, match="format must be one of"):
        quantize_engine_dir(tiny_engine, tmp_path / "c", "int4", fmt="gguf")


def _report(hits_new: int, hits_reg: int) -> dict:
    examples = [Example("p", "a", "crack", True)] * 100 + [Example("p", "a", "void", False)] * 100
    preds = ["a"] * hits_new + ["b"] * (100 - hits_new) + ["a"] * hits_reg + ["b"] * (100 - hits_reg)
    return accuracy_report(examples, preds) | {"perplexity": 2.0}


def test_gate_fails_when_a_precision_breaks_accuracy():
    fp32 = _report(100, 100)
    # int8 losing 1 point on new rules breaks its 0.5-point budget
    gate = accuracy_gate(fp32, _report(99, 100), "int8")
    assert not gate["passed"] and "accuracy_new dropped 1.00 points" in gate["failures"][0]
    # the same loss is within int4's 2 points; 3 points on regression rules are not
    assert accuracy_gate(fp32, _report(99, 100), "int4")["passed"]
    assert not accuracy_gate(fp32, _report(100, 97), "int4")["passed"]


def test_calibrated_clip_search_never_increases_the_expected_output_error():
    # Given a weight with outliers and activations whose channels differ in energy
    torch.manual_seed(0)
    w = torch.randn(32, 128) * torch.where(torch.rand(32, 128) < 0.02, 8.0, 1.0)
    act_sq = torch.rand(128) * 4

    def expected_error(q, scale, zp):
        deq = dequantize_groups(q, scale, zp, 128)
        return float((((deq - w) ** 2) * act_sq).sum())

    # When groups may shrink their range (the ratio 1.0, plain RTN, is among the candidates)
    rtn = expected_error(*quantize_groups(w, 4, 32))
    clipped = expected_error(*quantize_groups(w, 4, 32, act_sq=act_sq))
    # Then the activation-weighted error does not grow, and here it shrinks
    assert clipped < rtn


def test_calibration_reads_every_projection_input_from_the_float_graph(tiny_engine, tiny_qwen, adapter, tmp_path):
    stats = calibrate_activations(tiny_engine / "model.onnx", [[1, 2, 3, 4, 5], [7, 8, 9]])
    # 2 layers x (qkv, o, gate_up, down) + the LM head
    assert len(stats) == 9 and all(v.ndim == 1 and (v >= 0).all() and np.isfinite(v).all() for v in stats.values())
    assert sorted(v.shape[0] for v in stats.values()) == [64] * 7 + [128] * 2  # down_proj reads the 128-wide MLP
    record = quantize_engine_dir(tiny_engine, tmp_path / "c", "int4", act_sq=stats)
    key = json.loads((tmp_path / "c" / "cache_key.json").read_text())
    assert record["clip_search"] is True and len(key["weights_calibration"]) == 64
    engine = OrtEngine(tmp_path / "c")
    engine.set_adapter(load_adapter(adapter, engine.interface))
    assert np.isfinite(_prefill_and_decode(engine, np.arange(5)[None])).all()


def test_compile_stage_builds_the_int8_serving_engine_once_beside_the_float_ones(tiny_llama_dir, tmp_path):
    import yaml

    from runtime.interface import read_interface
    from tasks import compile as compile_stage
    from tasks.config import load_config

    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({
        "base_model": {"source": "local", "path": str(tiny_llama_dir)},
        "train": {"output_dir": str(tmp_path / "artifacts")},
        "engine": {"dir": str(tmp_path / "engine"), "weights": "int8", "threads": 1},
    }))
    cfg = load_config(params)
    first = compile_stage.run_stage(cfg)
    # The float-cache engine (adapters bind to it), the quantized-cache engine, and its int8 copy.
    assert (first["engine_builds"], first["kv_engine"]["engine_builds"], first["weights_builds"]) == (2, 1, 1)
    serving = tmp_path / "engine-kv-int8"
    assert cfg.engine.serving_dir() == serving
    assert json.loads((serving / "weights.json").read_text())["weights"] == "int8"
    # Same LoRA contract: an adapter bound to the float engine runs on the int8 copy of the quantized-cache one.
    assert read_interface(serving).interface_hash == read_interface(tmp_path / "engine-kv").interface_hash
    assert read_interface(serving).float_interface_hash == read_interface(tmp_path / "engine").interface_hash
    # and the interface records what the device runs, outside the hash
    assert read_interface(serving).weights == {"precision": "int8", "format": "matmulnbits", "block_size": 128}
    assert read_interface(serving).weight_precision == "int8" and read_interface(tmp_path / "engine-kv").weights is None
    again = compile_stage.run_stage(cfg)
    assert (again["engine_builds"], again["weights_builds"]) == (0, 0)


def test_quantized_weights_are_refused_on_a_backend_that_cannot_run_them():
    from tasks.config import ConfigError, parse_config

    with pytest.raises(ConfigError, match=r"engine: Value error, weights int4 needs backend onnxruntime or tensorrt, not torch"):
        parse_config({"engine": {"weights": "int4", "backend": "torch", "kv_cache": "float"}})


def test_tensorrt_release_gets_the_qdq_serving_engine_from_the_compile_stage(tiny_llama_dir, tmp_path):
    import yaml

    from tasks import compile as compile_stage
    from tasks.config import load_config

    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({
        "base_model": {"source": "local", "path": str(tiny_llama_dir)},
        "train": {"output_dir": str(tmp_path / "artifacts")},
        "engine": {"dir": str(tmp_path / "engine"), "weights": "int4", "backend": "tensorrt", "kv_cache": "float",
                   "threads": 1},
        "kv": {"enabled": False},
    }))
    cfg = load_config(params)
    metrics = compile_stage.run_stage(cfg)
    serving = tmp_path / "engine-int4-qdq_fp16"
    assert cfg.engine.serving_dir() == serving and metrics["weights_builds"] == 1
    record = json.loads((serving / "weights.json").read_text())
    assert (record["format"], record["symmetric"], record["block_size"]) == ("qdq_fp16", True, 128)
    assert not any(n.op_type == "MatMulNBits" for n in onnx.load(str(serving / "model.onnx")).graph.node)


def _external_copy(engine_dir, out_dir):
    """The engine with its graph's weights in model.onnx.data, as the compile stage writes a large one."""
    import shutil

    out_dir.mkdir()
    for name in ("interface.json", "cache_key.json"):
        shutil.copy(engine_dir / name, out_dir / name)
    onnx.save(onnx.load(str(engine_dir / "model.onnx")), str(out_dir / "model.onnx"), save_as_external_data=True,
              location="model.onnx.data")
    return out_dir


def _locations(onnx_file) -> set[str]:
    graph = onnx.load(str(onnx_file), load_external_data=False).graph
    return {e.value for i in graph.initializer for e in i.external_data if e.key == "location"}


@pytest.mark.parametrize("weights", ["fp32", "int4"])
def test_copy_of_a_large_engine_keeps_its_weights_in_a_data_file(tiny_engine, tmp_path, monkeypatch, weights):
    # Given: an engine whose weights are in a data file, and a size threshold every graph exceeds
    # (as the 0.5B shape's do at the real one), beside the inline copy of the same engine
    from runtime.backends import onnxruntime as ort_backend

    quantize_engine_dir(tiny_engine, tmp_path / "inline", weights)
    source = _external_copy(tiny_engine, tmp_path / "source")
    monkeypatch.setattr(ort_backend, "EXTERNAL_DATA_MIN_BYTES", 0)

    # When: the copy is written from it
    quantize_engine_dir(source, tmp_path / "large", weights)

    # Then: its graph reads the weights from its own model.onnx.data and computes what the inline copy does
    assert _locations(tmp_path / "large" / "model.onnx") == {"model.onnx.data"}
    ids = np.random.default_rng(4).integers(0, 96, (1, 6))
    args = (ids, np.arange(6)[None], np.ones((1, 6), np.int64), None)
    want = OrtEngine(tmp_path / "inline").forward(*args)[0]
    np.testing.assert_array_equal(OrtEngine(tmp_path / "large").forward(*args)[0], want)


def test_calibration_reads_a_graph_whose_weights_are_in_a_data_file(tiny_engine, tmp_path):
    source = _external_copy(tiny_engine, tmp_path / "source")
    ids = [[1, 5, 9, 2], [7, 3]]

    got = calibrate_activations(source / "model.onnx", ids)

    want = calibrate_activations(tiny_engine / "model.onnx", ids)
    assert got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in want)


def test_int4_engine_with_an_int8_head_matches_the_reference_of_the_same_codes(tiny_qwen, tiny_engine, adapter, tmp_path):
    # Given: the int4 engine with its LM head quantized at 8 bits (fp32 compute: no activation rounding)
    record = quantize_engine_dir(tiny_engine, tmp_path / "h8", "int4", 32, keep=("embed",), accuracy_level=0, head_bits=8)
    engine = OrtEngine(tmp_path / "h8")
    lora = load_adapter(adapter, engine.interface)
    engine.set_adapter(lora)
    ids = np.random.default_rng(2).integers(0, 96, (2, 9))

    # When: it runs prefill + one cached decode step
    got = _prefill_and_decode(engine, ids)

    # Then: it matches PyTorch with the same int4 body and int8 head codes, not the all-int4 reference,
    # and its cache key tells it from the int4-head and fp32-head builds
    ref = reference_backbone(tiny_qwen, 4, 32, keep=("embed",), lora_modules=TARGETS, head_bits=8)
    assert np.abs(got - _reference_logits(ref, ids, lora, engine.interface.lora_names)).max() < 1e-4
    all_int4 = reference_backbone(tiny_qwen, 4, 32, keep=("embed",), lora_modules=TARGETS)
    assert np.abs(got - _reference_logits(all_int4, ids, lora, engine.interface.lora_names)).max() > 1e-3
    assert record["head_bits"] == 8 and any("(lm_head, 8 bits)" in q for q in record["quantized"])
    keys = {json.loads((tmp_path / "h8" / "cache_key.json").read_text())["key"]}
    for name, keep, head in (("h4", ("embed",), None), ("h32", ("lm_head", "embed"), None)):
        quantize_engine_dir(tiny_engine, tmp_path / name, "int4", 32, keep=keep, accuracy_level=0, head_bits=head)
        keys.add(json.loads((tmp_path / name / "cache_key.json").read_text())["key"])
    assert len(keys) == 3


def test_the_scheme_comparison_renders_a_month_without_changed_labels():
    from tasks.quantize_weights import render_comparison

    quality = {"accuracy": 0.75, "accuracy_new": None, "accuracy_regression": None, "perplexity": 2.5}
    table = render_comparison({"int4_rtn": {"quality": quality, "calib_error": {"kl_mean": 1e-4, "top1_agreement": 0.95}}})
    assert "| int4_rtn | 1.00e-04 | 0.9500 | 0.7500 | n/a | n/a | 2.5000 | - |" in table
