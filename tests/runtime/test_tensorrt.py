"""TensorRT backend: GPU tests skip with a reason on CPU machines; the profile logic runs anywhere."""

from __future__ import annotations

import hashlib
import importlib.util

import numpy as np
import pytest
import torch

from runtime.engine.interface import read_interface

HAS_TRT = importlib.util.find_spec("tensorrt") is not None
needs_gpu = pytest.mark.skipif(
    not (HAS_TRT and torch.cuda.is_available()),
    reason="TensorRT tests need an NVIDIA GPU and pip install '.[tensorrt]'; run bench/engine/gpu_check.py there",
)


def test_importing_the_backend_needs_neither_tensorrt_nor_cuda():
    import runtime.engine.backends.tensorrt as backend

    assert backend.PLAN_FILE == "model.plan"


def test_optimization_profile_covers_prefill_and_decode(tiny_engine):
    from runtime.engine.backends.tensorrt import profile_shapes

    shapes = profile_shapes(read_interface(tiny_engine), max_batch=8, max_seq=1024, max_past=2048, opt=(1, 1, 512))

    assert shapes["past_key.0"] == ((1, 2, 0, 16), (1, 2, 512, 16), (8, 2, 2048, 16))  # past 0 = prefill
    assert shapes["input_ids"] == ((1, 1), (1, 1), (8, 1024))
    assert shapes["attention_mask"] == ((1, 1), (1, 513), (8, 3072))
    assert not any(name.startswith("lora_") for name in shapes)  # fixed shapes, no profile needed


@pytest.mark.skipif(HAS_TRT and torch.cuda.is_available(), reason="checks the CPU-machine error path")
def test_tensorrt_engine_refuses_clearly_without_gpu(tiny_engine):
    from runtime.engine.backends.tensorrt import TensorRTEngine, TensorRTUnavailable

    with pytest.raises(TensorRTUnavailable, match="tensorrt is not installed|no CUDA device"):
        TensorRTEngine(tiny_engine)


def _plan_and_onnx_runtime_logits(engine_dir, adapter_dir):
    """Build the plan of ``engine_dir``, then prefill logits of TensorRT and of ONNX Runtime on the same graph."""
    from runtime.engine.adapter import load_adapter
    from runtime.engine.backends.tensorrt import TensorRTEngine, build_plan
    from tasks.weights.engines import open_on_cpu

    build_plan(engine_dir, max_batch=4, max_seq=64, max_past=128, opt=(1, 1, 32))
    ort_engine, trt_engine = open_on_cpu(engine_dir), TensorRTEngine(engine_dir)
    lora = load_adapter(adapter_dir, ort_engine.interface)
    ort_engine.set_adapter(lora)
    trt_engine.set_adapter(lora)
    ids = np.random.default_rng(0).integers(0, 96, (2, 9))
    pos, mask = np.broadcast_to(np.arange(9), (2, 9)), np.ones((2, 9), np.int64)
    return ort_engine.forward(ids, pos, mask, None)[0], trt_engine.forward(ids, pos, mask, None)[0]


@needs_gpu
def test_tensorrt_plan_matches_onnx_runtime(tiny_engine, qwen_adapter):
    want, got = _plan_and_onnx_runtime_logits(tiny_engine, qwen_adapter)

    assert np.abs(got - want).max() <= 1e-3


@needs_gpu
def test_tensorrt_weight_only_int4_plan_matches_onnx_runtime_on_the_same_graph(tiny_engine, qwen_adapter, tmp_path):
    from tasks.weights.engines import quantize_engine_dir

    # Given the int4 weights in TensorRT's weight-only form (symmetric blocked DequantizeLinear, fp16 GEMMs)
    quantize_engine_dir(tiny_engine, tmp_path / "int4", "int4", 32, fmt="qdq_fp16")
    want, got = _plan_and_onnx_runtime_logits(tmp_path / "int4", qwen_adapter)

    # Then both compute the same codes in fp16: equal within fp16 rounding
    assert np.abs(got - want).max() <= 1e-2 * np.abs(want).max()


def test_a_plan_is_stale_once_its_graph_tensorrt_or_gpu_changes(tmp_path):
    import json

    from runtime.engine.backends.tensorrt import PLAN_FILE, PLAN_KEY_FILE, plan_is_current, plan_key

    # Given an engine directory whose plan was built for its cache key on one TensorRT and GPU
    (tmp_path / "cache_key.json").write_text(json.dumps({"key": "abc"}))
    assert not plan_is_current(tmp_path, "11.0", "H200")  # no plan yet
    (tmp_path / PLAN_FILE).write_bytes(b"plan")
    assert not plan_is_current(tmp_path, "11.0", "H200")  # a plan nobody recorded is not trusted
    (tmp_path / PLAN_KEY_FILE).write_text(json.dumps(plan_key(tmp_path, "11.0", "H200") | {"profile": {"max_batch": 8}}))
    # Then it is reused as it is, and rebuilt for another TensorRT, another GPU or another graph
    assert plan_is_current(tmp_path, "11.0", "H200")
    assert not plan_is_current(tmp_path, "11.1", "H200")
    assert not plan_is_current(tmp_path, "11.0", "Orin")
    (tmp_path / "cache_key.json").write_text(json.dumps({"key": "int4 copy"}))
    assert not plan_is_current(tmp_path, "11.0", "H200")
    # An engine directory without a cache key is identified by the bytes of its graph
    (tmp_path / "cache_key.json").unlink()
    (tmp_path / "model.onnx").write_bytes(b"graph")
    assert plan_key(tmp_path, "11.0", "H200")["graph"] == hashlib.sha256(b"graph").hexdigest()
