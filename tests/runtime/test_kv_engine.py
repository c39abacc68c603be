"""The quantized-KV engine: same stored integers and logits as the PyTorch reference cache, refusals."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch
from engine_testkit import TARGETS, calibrate, engine_run

from kernels.kv_quant import QuantizedKVCache
from kernels.kv_spec import PRE_ROPE_SCHEME, KVQuantSpec
from runtime.engine.adapter import load_adapter
from runtime.engine.backends.onnxruntime import OrtEngine
from runtime.engine.errors import RefusedInput
from runtime.engine.generate import greedy_generate
from runtime.engine.interface import LOGIT_POSITIONS_INTERFACE_VERSION, read_interface
from runtime.engine.kv_scales import KVScales
from runtime.engine.model import load_backbone
from tasks.config import PARITY_MAX_LOGIT_ERROR
from tasks.kv_stats import cache_kwargs

# The other corner: 8-bit symmetric post-RoPE keys (ORT GroupQueryAttention's layout), asymmetric
# 3-bit per-token values (a zero point input, a non-byte-aligned width), no sink.
OTHER = KVQuantSpec(k_bits=8, v_bits=3, k_granularity="channel", v_granularity="token", k_symmetric=True,
                    v_symmetric=False, sink_tokens=0, pre_rope_keys=False)


def reference_run(model_dir, iface, lora: dict, spec: KVQuantSpec, scales: KVScales, ids: np.ndarray, split: int):
    """Backbone + kernels' QuantizedKVCache: prefill ``split`` tokens, then one token per step."""
    model = load_backbone(model_dir, iface.target_modules)
    lora_t = tuple(torch.from_numpy(lora[n]) for n in iface.lora_names)
    L = model.cfg.num_layers
    cache = QuantizedKVCache(spec, L, model.cfg.head_dim, inv_freq=model.inv_freq, **cache_kwargs(scales))
    B, T = ids.shape
    pos = torch.arange(T).expand(B, T)
    mask = torch.ones(B, T, dtype=torch.long)
    ids_t = torch.from_numpy(ids)
    out = []
    with torch.inference_mode():
        for a, b in [(0, split)] + [(t, t + 1) for t in range(split, T)]:
            past = cache.past() if a else model.empty_past(B)
            logits, present = model(ids_t[:, a:b], pos[:, a:b], mask[:, :b], past, lora_t)
            for i in range(L):
                cache.append(i, present[2 * i][:, :, a:], present[2 * i + 1][:, :, a:], pos[:, a:b])
            out.append(logits.numpy())
    return np.concatenate(out, axis=1), cache


@pytest.fixture(scope="module", params=[PRE_ROPE_SCHEME, OTHER], ids=["K4c-pre-V4t-sink1", "K8c-post-V3ta-sink0"])
def quant_engine(request, tiny_qwen, tmp_path_factory):
    from tasks.stages.compile import compile_engine

    engine_dir = tmp_path_factory.mktemp("kv_engines") / "engine"
    compile_engine(tiny_qwen, engine_dir, max_rank=8, target_modules=TARGETS, kv_spec=request.param.to_dict())
    return request.param, OrtEngine(engine_dir, threads=2)


def test_quantized_engine_stores_the_reference_integers_and_matches_its_logits_within_1e4(quant_engine, tiny_qwen, qwen_adapter):
    spec, engine = quant_engine
    lora = load_adapter(qwen_adapter, engine.interface)  # bound to the float engine: same LoRA contract
    scales = calibrate(tiny_qwen, spec, lora)
    engine.set_adapter(lora, kv_scales=scales)
    ids = np.random.default_rng(0).integers(0, 96, (2, 14))

    got, cache = engine_run(engine, ids, split=7)
    want, ref = reference_run(tiny_qwen, engine.interface, lora, spec, scales, ids, split=7)

    stored = engine.cache_to_numpy(cache)
    for i in range(engine.interface.num_layers):
        layer = ref.layers[i]
        for kind, short in (("key", "k"), ("value", "v")):
            assert np.array_equal(stored[f"past_{kind}.{i}"], torch.cat(layer[short].packed, 2).numpy())
            if layer[short].scales:  # per-token scales and zero points, fp16
                assert np.array_equal(stored[f"past_{kind}_scale.{i}"], torch.cat(layer[short].scales, 2).numpy())
            if f"past_{kind}_zero.{i}" in stored:
                assert np.array_equal(stored[f"past_{kind}_zero.{i}"], torch.cat(layer[short].zeros, 2).numpy())
            sink = layer[f"sink_{short}"]
            want_sink = torch.cat(sink, 2).numpy() if sink else np.zeros((2, 2, 0, 16), np.float16)
            # fp16 values, not integers: the engine's float K/V differ from eager by ~1e-7, which
            # may flip the last fp16 bit (one ulp = 2^-10 relative).
            np.testing.assert_allclose(stored[f"sink_{kind}.{i}"].astype(np.float32), want_sink.astype(np.float32),
                                       rtol=2.0**-10, atol=1e-6)
    assert stored["past_key.0"].shape == (2, 2, 14 - spec.sink_tokens, 16 * spec.k_bits // 8)
    assert np.abs(got - want).max() <= 1e-4
    # The quantization is really there: the logits moved away from the float cache's.
    float_like, _ = reference_run(tiny_qwen, engine.interface, lora, replace(PRE_ROPE_SCHEME, k_bits=8, v_bits=8, k_granularity="token", sink_tokens=64),
                                  scales, ids, split=7)
    assert np.abs(got - float_like).max() > 1e-3


def assert_decodes_alike_batched_with_left_padding_and_per_row(engine, spec: KVQuantSpec, model_dir, adapter_dir):
    lora = load_adapter(adapter_dir, engine.interface)
    engine.set_adapter(lora, kv_scales=calibrate(model_dir, spec, lora))
    prompts = [[3, 14, 15, 92, 65], [35, 89, 7]]

    batched = greedy_generate(engine, prompts, max_new_tokens=10)
    per_row = greedy_generate(engine, prompts, max_new_tokens=10, batch_size=1)

    assert [len(t) for t in per_row] == [10, 10]
    assert batched == per_row  # left padding: a padded slot is masked, so the rows decode alike


def test_quantized_engine_generates_like_the_reference_batched_and_per_row(quant_engine, tiny_qwen, qwen_adapter):
    spec, engine = quant_engine
    assert_decodes_alike_batched_with_left_padding_and_per_row(engine, spec, tiny_qwen, qwen_adapter)


def test_quantized_engine_refuses_to_run_without_scales(quant_engine):
    spec, engine = quant_engine
    fresh = OrtEngine(engine.engine_dir)
    ids = np.zeros((1, 3), dtype=np.int64)
    with pytest.raises(RefusedInput, match="without KV scales"):
        fresh.forward(ids, np.arange(3)[None], np.ones((1, 3), np.int64), None)
    with pytest.raises(RefusedInput, match="needs the release's kv_scales"):
        fresh.set_adapter(None)


def test_scales_of_the_wrong_shape_spec_or_values_are_refused_all_at_once(quant_engine, tiny_qwen):
    spec, engine = quant_engine
    good = calibrate(tiny_qwen, spec)
    bad_shape = KVScales(spec.to_dict(), good.k_scale[:, :, :8], good.k_zero, good.v_scale, good.v_zero, {})
    with pytest.raises(RefusedInput, match=r"k_scale has shape \(2, 2, 8\), the engine needs \(2, \*\(2, 16\)\)"):
        engine.set_adapter(None, kv_scales=bad_shape)
    zero = good.k_scale.copy()
    zero[1, 0, 3] = 0.0
    other_spec = spec.to_dict() | {"k_bits": 2}
    with pytest.raises(RefusedInput, match="calibrated for KV spec.*k_scale.1 has zero or negative scales"):
        engine.set_adapter(None, kv_scales=KVScales(other_spec, zero, good.k_zero, good.v_scale, good.v_zero, {}))
    with pytest.raises(RefusedInput, match="calibrated on backbone 000000000000"):
        engine.set_adapter(None, kv_scales=KVScales(spec.to_dict(), good.k_scale, good.k_zero, good.v_scale, good.v_zero,
                                                    {"base_model_hash": "0" * 64}))


def test_float_engine_is_unchanged_and_takes_no_scales(tiny_engine, tiny_qwen):
    iface = read_interface(tiny_engine)
    written = json.loads((tiny_engine / "interface.json").read_text())
    engine = OrtEngine(tiny_engine)

    assert iface.version == LOGIT_POSITIONS_INTERFACE_VERSION and iface.kv_dtype == "float32" and "kv_spec" not in written
    with pytest.raises(ValueError, match="float KV cache; it takes no kv_scales"):
        engine.set_adapter(None, kv_scales=calibrate(tiny_qwen, PRE_ROPE_SCHEME))


def test_quantized_interface_records_its_spec_and_the_float_contract(quant_engine, tiny_engine):
    spec, engine = quant_engine
    iface = engine.interface
    assert iface.version == LOGIT_POSITIONS_INTERFACE_VERSION and iface.kv_spec == spec.to_dict()
    assert iface.float_interface_hash == read_interface(tiny_engine).float_interface_hash  # one LoRA contract
    assert read_interface(engine.engine_dir).interface_hash == iface.interface_hash


def test_window_tokens_are_refused_at_compile(tiny_qwen, tmp_path):
    from tasks.stages.compile import compile_engine

    with pytest.raises(ValueError, match="window_tokens=4: the engine's quantized cache has no fp16 window"):
        compile_engine(tiny_qwen, tmp_path / "e", 8, TARGETS, kv_spec=replace(PRE_ROPE_SCHEME, window_tokens=4).to_dict())


# ---------------------------------------------------------------- GroupQueryAttention engine

GQA = KVQuantSpec()  # the defaults: the scheme the release ships, the one the op implements


@pytest.fixture(scope="module")
def gqa_engine(tiny_qwen, tmp_path_factory):
    from tasks.stages.compile import compile_engine

    engine_dir = tmp_path_factory.mktemp("kv_engines") / "engine-gqa"
    compile_engine(tiny_qwen, engine_dir, max_rank=8, target_modules=TARGETS, kv_spec=GQA.to_dict(), kv_attention="gqa")
    return OrtEngine(engine_dir, threads=2)


def eager_gqa_run(model_dir, iface, lora: dict, scales: KVScales, ids: np.ndarray, split: int):
    """The same steps through the PyTorch module the engine was exported from (the op's eager reference)."""
    from runtime.engine.kv_model import QuantizedKVBackbone

    module = QuantizedKVBackbone(load_backbone(model_dir, iface.target_modules), GQA, "gqa")
    static = [torch.from_numpy(t[i]) for i in range(iface.num_layers)
              for t in (scales.k_scale, scales.v_scale, scales.rotation_or_identity())]
    bounds = [(0, split)] + [(t, t + 1) for t in range(split, ids.shape[1])]
    with torch.inference_mode():
        logits, packed = module.run_gqa_chunks(torch.from_numpy(ids), bounds, static,
                                               tuple(torch.from_numpy(lora[n]) for n in iface.lora_names))
    return torch.cat(logits, 1).numpy(), packed


@pytest.mark.parametrize("rotated", [False, True], ids=["unrotated", "hadamard"])
def test_gqa_engine_is_one_group_query_attention_node_per_layer_storing_the_eager_integers(gqa_engine, tiny_qwen, qwen_adapter,
                                                                                            rotated):
    import onnx

    graph = onnx.load(gqa_engine.engine_dir / "model.onnx").graph
    assert [n.op_type for n in graph.node].count("GroupQueryAttention") == gqa_engine.interface.num_layers
    lora = load_adapter(qwen_adapter, gqa_engine.interface)
    scales = calibrate(tiny_qwen, GQA, lora, rotated=rotated)
    assert (scales.rotation is not None) == rotated
    gqa_engine.set_adapter(lora, kv_scales=scales)
    ids = np.random.default_rng(0).integers(0, 96, (2, 14))

    got, cache = engine_run(gqa_engine, ids, split=7)
    want, packed = eager_gqa_run(tiny_qwen, gqa_engine.interface, lora, scales, ids, split=7)

    stored = gqa_engine.cache_to_numpy(cache)
    for i in range(gqa_engine.interface.num_layers):
        assert np.array_equal(stored[f"past_key.{i}"], packed[2 * i].numpy())
        assert np.array_equal(stored[f"past_value.{i}"], packed[2 * i + 1].numpy())
    assert stored["past_key.0"].shape == (2, 2, 14, 8)  # 16 channels, two per byte
    assert np.abs(got - want).max() <= 1e-4
    # The first layer's prompt keys are quantized from the same inputs as kernels' reference cache.
    _, ref = reference_run(tiny_qwen, gqa_engine.interface, lora, GQA, scales, ids[:, :7], split=7)
    assert np.array_equal(stored["past_key.0"][:, :, :7], torch.cat(ref.layers[0]["k"].packed, 2).numpy())


def test_gqa_engine_generates_alike_batched_with_left_padding_and_per_row(gqa_engine, tiny_qwen, qwen_adapter):
    assert_decodes_alike_batched_with_left_padding_and_per_row(gqa_engine, GQA, tiny_qwen, qwen_adapter)


def test_a_scheme_group_query_attention_cannot_run_is_refused_at_compile_naming_what_differs(tiny_qwen, tmp_path):
    from tasks.stages.compile import compile_engine

    with pytest.raises(ValueError, match=r"cannot run on GroupQueryAttention: v_granularity='token' \(the op needs 'channel'\)"
                                         r".*sink_tokens=1 \(the op needs 0\).*pre_rope_keys=True"):
        compile_engine(tiny_qwen, tmp_path / "e", 8, TARGETS, kv_spec=PRE_ROPE_SCHEME.to_dict(), kv_attention="gqa")
    assert not (tmp_path / "e").exists()


def test_a_version_4_engine_takes_unrotated_scales_and_refuses_a_rotation(tiny_qwen):
    """An engine compiled before the rotation input (interface version 4) still binds a release
    without one; a rotated release needs a recompiled engine, said in words."""
    from runtime.engine.hashing import backbone_hash
    from runtime.engine.interface import KV_ROTATION_INPUT, build_interface
    from runtime.engine.kv_scales import kv_scale_inputs
    from runtime.engine.model import read_config

    current = build_interface(read_config(tiny_qwen), backbone_hash(tiny_qwen), 8, TARGETS, GQA.to_dict())
    v4 = replace(current, version=4, inputs=tuple(t for t in current.inputs if not t.name.startswith(KV_ROTATION_INPUT)))
    plain, turned = calibrate(tiny_qwen, GQA), calibrate(tiny_qwen, GQA, rotated=True)
    assert not any(name.startswith(KV_ROTATION_INPUT) for name in kv_scale_inputs(v4, plain))
    assert np.array_equal(kv_scale_inputs(current, plain)[f"{KV_ROTATION_INPUT}.1"], np.eye(16, dtype=np.float32))
    assert np.array_equal(kv_scale_inputs(current, turned)[f"{KV_ROTATION_INPUT}.1"], turned.rotation[1])
    with pytest.raises(RefusedInput, match="come with a KV rotation and this engine has no rotation input "
                                           r"\(interface version 4\); recompile the engine"):
        kv_scale_inputs(v4, turned)


def test_engine_parity_reads_the_engines_codes_and_finds_no_quantizer_difference(gqa_engine, tiny_qwen):
    """``tasks.checks.engine_parity``: the module attends over the engine's stored codes while it stores its
    own from the same layer inputs; on the same quantizer nothing differs and logits agree."""
    from tasks.checks.engine_parity import quantized_prefill_parity

    scales = calibrate(tiny_qwen, GQA, rotated=True)
    gqa_engine.set_adapter(None, kv_scales=scales)
    rng = np.random.default_rng(3)
    prompts = [" ".join(map(str, rng.integers(0, 96, n))) for n in (5, 17, 40)]
    report = quantized_prefill_parity(gqa_engine, load_backbone(tiny_qwen), scales, "gqa",
                                      lambda text, add_special_tokens=True: {"input_ids": [int(t) for t in text.split()]}, prompts)
    assert report["kv_codes_read_from_engine"] and report["kv_bytes_compared"] == 2 * 2 * 2 * 62 * 8
    assert report["kv_code_mismatch"] == 0 and report["kv_code_mismatch_free_running"] == 0
    assert report["logits_codes_agree"]["max_logit_error"] <= PARITY_MAX_LOGIT_ERROR


def test_the_module_reading_its_own_codes_computes_what_it_computes_freely(tiny_qwen):
    from runtime.engine.kv_model import QuantizedKVBackbone

    module = QuantizedKVBackbone(load_backbone(tiny_qwen), GQA, "gqa").eval()
    scales = calibrate(tiny_qwen, GQA, rotated=True)
    static = [torch.from_numpy(t[i]) for i in range(2) for t in (scales.k_scale, scales.v_scale, scales.rotation_or_identity())]
    ids = torch.from_numpy(np.random.default_rng(4).integers(0, 96, (1, 12)))
    empty_packed, empty_sink = torch.zeros(1, 2, 0, 8, dtype=torch.uint8), torch.zeros(1, 2, 0, 16, dtype=torch.float16)
    args = (ids, torch.arange(12)[None], torch.ones(1, 12, dtype=torch.long),
            [empty_packed, empty_packed, empty_sink, empty_sink] * 2, static, ())
    with torch.no_grad():
        logits, *outputs = module(*args)
        codes = [outputs[4 * i + j] for i in range(2) for j in (0, 1)]
        again, *outputs_again = module.forward_reading(codes, *args)
    assert torch.equal(logits, again) and all(torch.equal(a, b) for a, b in zip(outputs, outputs_again))
