"""``engine.kv_block_size``: the monthly flow's paged serving engine (a float cache here; quantized pages, which are
pages of it: tests/tasks/test_quantized_pages_stage.py). The compile stage's own function builds it (and its
weight-quantized copy), and the evaluate stage's checks run on it as on the padded engine."""

from __future__ import annotations

import json

import numpy as np
import pytest
from engine_testkit import engine_run, make_adapter

from runtime.engine.adapter import load_adapter
from runtime.engine.backends.onnxruntime import OrtEngine
from runtime.engine.generate import generate_text
from runtime.engine.interface import BLOCK_TABLE, LOGIT_POSITIONS_INTERFACE_VERSION, read_interface
from tasks.config import parse_config, with_settings
from tasks.models import load_tokenizer
from tasks.stages.compile import compile_profile_engines
from tasks.stages.evaluate import decode_latency, engine_perplexity
from tasks.weights.engines import quantize_engine_dir
from tasks.weights.graph import calibrate_activations

# Prompts of 11, 31 and 85 tokens: decoding 20 takes every row across a block boundary of 16.
PROMPTS = ["inspect board=PCB-0001 verdict:", "inspect board=PCB-0042 line=L3 part=P7 defect=void size=12 verdict:",
           "a held-out line of text, 12345 and more text after it to make it the longest prompt of the three"]


@pytest.fixture(scope="module")
def paged_build(tiny_llama_dir, tmp_path_factory):
    """The float cache with blocks of 16 tokens, as the compile stage builds it: (config, the stage's metrics)."""
    cfg = parse_config({"base_model": {"source": "local", "path": str(tiny_llama_dir)},
                        "engine": {"dir": str(tmp_path_factory.mktemp("paged") / "engine"), "threads": 1, "kv_block_size": 16,
                                   "kv_cache": "float"}})
    return cfg, compile_profile_engines(cfg)


@pytest.fixture(scope="module")
def release(paged_build, tiny_llama_dir, tmp_path_factory):
    """An adapter's LoRA inputs."""
    cfg, _ = paged_build
    adapter_dir = make_adapter(tiny_llama_dir, tmp_path_factory.mktemp("adapter"), r=4)
    return load_adapter(adapter_dir, read_interface(cfg.layout.serving_engine_dir))


def opened(engine_dir, lora) -> OrtEngine:
    engine = OrtEngine(engine_dir, threads=1)
    engine.set_adapter(lora)
    return engine


def test_the_compile_stage_builds_a_paged_serving_engine_with_stacked_adapters(paged_build):
    cfg, metrics = paged_build
    serving = cfg.layout.serving_engine_dir
    iface = read_interface(serving)

    assert serving == cfg.layout.engine_dir / "paged16-stacked"
    assert iface.version == LOGIT_POSITIONS_INTERFACE_VERSION == 8 and iface.logit_positions
    assert iface.stacked and iface.kv_block_size == 16 and iface.kv_pages is None
    assert BLOCK_TABLE in iface.input_names and "pool_key.0" in iface.input_names
    assert not any(name.startswith("past_") for name in iface.input_names)
    # Releases bind to the float engine's interface, paged or not
    assert iface.float_interface_hash == read_interface(cfg.layout.engine_dir).float_interface_hash
    assert metrics["serving_engine"] == {"dir": str(serving), "kv_block_size": 16, "mixed_adapters": True,
                                         "engine_builds": 1, "interface_hash": iface.interface_hash}
    assert metrics["engine_builds"] == 2  # float, and its paged form with stacked adapters
    assert json.loads((serving / "cache_key.json").read_text())["kv_block_size"] == 16


def test_a_rerun_builds_nothing_and_another_block_size_is_built_beside_it(paged_build, monkeypatch):
    import tasks.stages.compile as compile_stage

    cfg, first = paged_build
    again = compile_profile_engines(cfg)
    assert again["engine_builds"] == 0 and again["serving_engine"]["interface_hash"] == first["serving_engine"]["interface_hash"]

    wider = with_settings(cfg, {"engine.kv_block_size": 32}, "test")
    metrics = compile_profile_engines(wider)

    assert metrics["engine_builds"] == 1 and metrics["serving_engine"]["dir"] == str(cfg.layout.engine_dir / "paged32-stacked")
    assert read_interface(wider.layout.serving_engine_dir).kv_block_size == 32
    assert read_interface(cfg.layout.serving_engine_dir).kv_block_size == 16  # the other block size's engine stays
    monkeypatch.setattr(compile_stage, "export_backbone", lambda *a, **k: pytest.fail("a cached engine was exported"))
    assert compile_profile_engines(cfg)["engine_builds"] == 0


def test_the_evaluate_checks_run_on_the_paged_engine_as_on_the_padded_one(paged_build, release, tiny_llama_dir):
    cfg, _ = paged_build
    paged = opened(cfg.layout.serving_engine_dir, release)
    padded = opened(cfg.layout.engine_dir, release)
    tokenizer = load_tokenizer(tiny_llama_dir)

    # The same logits, prefill and decode steps across a block boundary
    ids = np.asarray([tokenizer(PROMPTS[2])["input_ids"]], dtype=np.int64)  # (1, 85)
    got, _ = engine_run(paged, ids, split=ids.shape[1] - 20)
    want, _ = engine_run(padded, ids, split=ids.shape[1] - 20)
    np.testing.assert_allclose(got, want, atol=1e-5)

    # Greedy answers in left-padded batches, decoding across block boundaries
    answers = generate_text(paged, tokenizer, PROMPTS, max_new_tokens=20, batch_size=2)
    assert answers == generate_text(padded, tokenizer, PROMPTS, max_new_tokens=20, batch_size=2)
    assert any(answer.strip() for answer in answers)

    assert engine_perplexity(paged, tokenizer, PROMPTS) == pytest.approx(engine_perplexity(padded, tokenizer, PROMPTS),
                                                                         rel=1e-5)
    summary, samples = decode_latency(paged, padded, tokenizer, PROMPTS[:2], steps=18)
    lengths = [len(tokenizer(p)["input_ids"]) for p in PROMPTS[:2]]
    assert [(i, past) for i, past, _ in samples] == [(i, lengths[i] + s) for i in range(2) for s in range(18)]
    assert summary["steps"] == 36 and summary["p95_ms"] > 0
    assert paged.pool.used_blocks == 0  # every cache the checks dropped gave its blocks back


def test_the_weight_quantized_copy_of_a_paged_engine_decodes_as_the_padded_copy(paged_build, release, tiny_llama_dir):
    cfg, _ = paged_build
    int8 = with_settings(cfg, {"engine.weights": "int8"}, "test")
    padded_int8 = with_settings(int8, {"engine.kv_block_size": 0}, "test")

    metrics = compile_profile_engines(int8)
    compile_profile_engines(padded_int8)

    serving = int8.layout.serving_engine_dir
    assert serving == cfg.layout.engine_dir / "paged16-stacked-int8" and metrics["weights_builds"] == 1
    iface = read_interface(serving)
    assert iface.kv_block_size == 16 and iface.weights["precision"] == "int8"
    ids = np.asarray([load_tokenizer(tiny_llama_dir)(PROMPTS[1])["input_ids"]], dtype=np.int64)  # (1, T)
    got, _ = engine_run(opened(serving, release), ids, split=ids.shape[1] - 18)
    want, _ = engine_run(opened(padded_int8.layout.serving_engine_dir, release), ids, split=ids.shape[1] - 18)
    np.testing.assert_allclose(got, want, atol=1e-4)


def test_activation_statistics_read_a_paged_float_engine_as_its_padded_one(paged_build, tiny_llama_dir, tmp_path):
    cfg, _ = paged_build
    paged_dir = cfg.layout.serving_engine_dir
    ids = [[1, 5, 9, 2, 40], [7, 3]]

    got = calibrate_activations(paged_dir / "model.onnx", ids)
    want = calibrate_activations(cfg.layout.engine_dir / "model.onnx", ids)

    # The two exports name their tensors apart; the statistics are the same projections' inputs.
    assert len(got) == len(want) == 2 * 4 + 1  # 2 layers x (qkv, o, gate_up, down) + the LM head
    for a, b in zip(sorted(got.values(), key=list), sorted(want.values(), key=list), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5)
    quantize_engine_dir(paged_dir, tmp_path / "paged-int4", "int4", act_sq=got)
    quantize_engine_dir(cfg.layout.engine_dir, tmp_path / "padded-int4", "int4", act_sq=want)
    batch = np.asarray([[1, 5, 9, 2, 40, 7, 3, 11]], dtype=np.int64)
    got_logits, _ = engine_run(opened(tmp_path / "paged-int4", None), batch, split=4)
    want_logits, _ = engine_run(opened(tmp_path / "padded-int4", None), batch, split=4)
    np.testing.assert_allclose(got_logits, want_logits, atol=1e-4)
