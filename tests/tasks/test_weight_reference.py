"""Weight-quantized engines against tests/weight_reference.py: PyTorch with the dequantized weights of the same codes."""

from __future__ import annotations

import json

import numpy as np
import onnxruntime as ort
import pytest
import torch
from engine_testkit import TARGETS, qwen_adapter, tiny_engine, tiny_qwen  # noqa: F401  (fixtures)
from weight_reference import reference_backbone
from weight_testkit import prefill_and_decode

from kernels.weight_quant import dequantize_groups, quantize_groups
from runtime.engine.adapter import load_adapter
from runtime.engine.backends.onnxruntime import OrtEngine
from tasks.weights.engines import open_on_cpu, quantize_engine_dir


def _reference_logits(model, ids, lora, names):
    with torch.no_grad():
        t = torch.from_numpy(ids)
        pos = torch.arange(ids.shape[1])[None].expand_as(t)
        logits, _ = model(t, pos, torch.ones_like(t), model.empty_past(ids.shape[0]),
                          tuple(torch.from_numpy(lora[n]) for n in names))
    return logits.numpy()


@pytest.mark.parametrize(
    "bits,fold,keep",
    [(8, False, ("lm_head", "embed")), (4, False, ("lm_head", "embed")), (4, True, ("lm_head", "embed")), (4, True, ("embed",))],
    ids=["int8", "int4", "int4-fold", "int4-fold-head"],
)
def test_quantized_engine_matches_pytorch_reference_of_same_quantization(tiny_qwen, tiny_engine, qwen_adapter, tmp_path, bits, fold, keep):
    # Given the float engine quantized with fp32 compute (accuracy_level 0: no activation rounding)
    out = tmp_path / "q"
    record = quantize_engine_dir(tiny_engine, out, f"int{bits}", 32, fold, keep, accuracy_level=0)
    engine = OrtEngine(out)
    lora = load_adapter(qwen_adapter, engine.interface)
    engine.set_adapter(lora)
    ids = np.random.default_rng(0).integers(0, 96, (2, 9))
    # When it runs prefill + one cached decode step with the LoRA as inputs
    got = prefill_and_decode(engine, ids)
    # Then it matches PyTorch with the dequantized weights of the same codes, LoRA in float
    ref = reference_backbone(tiny_qwen, bits, 32, fold, keep, lora_modules=TARGETS)
    want = _reference_logits(ref, ids, lora, engine.interface.lora_names)
    assert np.abs(got - want).max() < 1e-4
    # and it differs from the float engine (the weights really are quantized)
    float_engine = OrtEngine(tiny_engine)
    float_engine.set_adapter(lora)
    assert np.abs(got - prefill_and_decode(float_engine, ids)).max() > 1e-3
    n_layers = 2
    assert len(record["quantized"]) == 4 * n_layers + ("lm_head" not in keep)  # qkv, o, gate_up, down (+ head)
    assert record["folded_norms"] == (2 * n_layers + ("lm_head" not in keep) if fold else 0)


@pytest.mark.parametrize("bits,fold", [(8, False), (4, False), (4, True)], ids=["int8", "int4", "int4-fold"])
def test_tensorrt_qdq_engine_matches_pytorch_reference_of_same_symmetric_quantization(
        tiny_qwen, tiny_engine, qwen_adapter, tmp_path, bits, fold):
    # Given the float engine written in TensorRT's weight-only form with fp32 GEMMs
    record = quantize_engine_dir(tiny_engine, tmp_path / "q", f"int{bits}", 32, fold, fmt="qdq")
    engine = open_on_cpu(tmp_path / "q")
    lora = load_adapter(qwen_adapter, engine.interface)
    engine.set_adapter(lora)
    ids = np.random.default_rng(0).integers(0, 96, (2, 9))
    # When ONNX Runtime runs it (exact dequantization, as TensorRT computes it)
    got = prefill_and_decode(engine, ids)
    # Then it matches PyTorch with the symmetric codes dequantized: the same numbers TensorRT is given
    ref = reference_backbone(tiny_qwen, bits, 32, fold, lora_modules=TARGETS, symmetric=True)
    assert np.abs(got - _reference_logits(ref, ids, lora, engine.interface.lora_names)).max() < 1e-4
    assert record["symmetric"] is True and record["format"] == "qdq" and record["accuracy_level"] is None


def _run_x_to_y(nodes, inits, x: np.ndarray, n_out: int) -> np.ndarray:
    """``nodes`` (reading ``x``, writing ``y``) and their initializers as one graph, run by ONNX Runtime on ``x``."""
    from onnx import TensorProto, helper

    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x.shape))],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [x.shape[0], n_out])],
                              initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


@pytest.mark.parametrize("bits,K,block", [(4, 256, 128), (8, 256, 32), (4, 96, 64)], ids=["int4", "int8", "int4-partial-block"])
def test_int8_rounded_linear_is_what_matmulnbits_computes_at_accuracy_level_4(bits, K, block):
    from weight_reference import int8_rounded_linear

    from tasks.weights.graph import matmulnbits_nodes

    # Given one MatMulNBits node with int8 compute and the dequantized weight of its codes
    torch.manual_seed(0)
    w, x = torch.randn(48, K) * 0.05, torch.randn(5, K)
    q, scale, zp = quantize_groups(w, bits, block)
    nodes, inits, _ = matmulnbits_nodes("m", "x", "y", q, scale, zp, bits, K, block, False, 4)
    got = _run_x_to_y(nodes, inits, x.numpy(), 48)
    w_dq = dequantize_groups(q, scale, zp, K)
    # Then rounding the input per block to int8 reproduces it to float precision, and a float input does not
    assert np.abs(got - int8_rounded_linear(x, w_dq, block_size=block).numpy()).max() < 1e-5
    assert np.abs(got - (x @ w_dq.t()).numpy()).max() > 1e-3


def test_a_head_over_the_slice_size_is_written_in_slices_that_compute_its_logits():
    from tasks.weights.graph import matmulnbits_nodes

    # Given an 8-bit head of 1,000 columns over 128 inputs (128,000 code bytes), whole and in slices of 32 kB
    torch.manual_seed(0)
    K, N = 128, 1000
    w, x = torch.randn(N, K) * 0.05, torch.randn(3, K)
    q, scale, zp = quantize_groups(w, 8, 32)

    def logits(max_code_bytes):
        nodes, inits, n_bytes = matmulnbits_nodes("head", "x", "y", q, scale, zp, 8, K, 32, False, 4, max_code_bytes)
        return _run_x_to_y(nodes, inits, x.numpy(), N), [n.op_type for n in nodes], n_bytes

    whole, whole_ops, whole_bytes = logits(None)
    sliced, sliced_ops, sliced_bytes = logits(32_000)
    # Then the slices are four MatMulNBits joined by a Concat, with the same bytes and the same logits (to float
    # rounding: the kernel's column tiles differ, measured 2.4e-7 at most)
    assert whole_ops == ["MatMulNBits"] and sliced_ops == ["MatMulNBits"] * 4 + ["Concat"]
    assert sliced_bytes == whole_bytes
    assert sliced.shape == (3, N) and np.abs(sliced - whole).max() < 1e-6 * np.abs(whole).max()


@pytest.mark.parametrize("bits,keep", [(8, ("lm_head", "embed")), (4, ("lm_head", "embed")), (4, ("embed",))],
                         ids=["int8", "int4", "int4-head"])
def test_int8_compute_engine_matches_the_reference_that_rounds_activations_like_it(
        tiny_qwen, tiny_engine, qwen_adapter, tmp_path, bits, keep):
    # Given the engine at accuracy_level 4 (the default, the fast path: activations rounded per block to int8)
    quantize_engine_dir(tiny_engine, tmp_path / "q", f"int{bits}", 32, False, keep, accuracy_level=4)
    engine = OrtEngine(tmp_path / "q")
    lora = load_adapter(qwen_adapter, engine.interface)
    engine.set_adapter(lora)
    ids = np.random.default_rng(0).integers(0, 96, (16, 12))
    got = prefill_and_decode(engine, ids)

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


def test_int4_engine_with_an_int8_head_matches_the_reference_of_the_same_codes(tiny_qwen, tiny_engine, qwen_adapter, tmp_path):
    # Given: the int4 engine with its LM head quantized at 8 bits (fp32 compute: no activation rounding)
    record = quantize_engine_dir(tiny_engine, tmp_path / "h8", "int4", 32, keep=("embed",), accuracy_level=0, head_bits=8)
    engine = OrtEngine(tmp_path / "h8")
    lora = load_adapter(qwen_adapter, engine.interface)
    engine.set_adapter(lora)
    ids = np.random.default_rng(2).integers(0, 96, (2, 9))

    # When: it runs prefill + one cached decode step
    got = prefill_and_decode(engine, ids)

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
