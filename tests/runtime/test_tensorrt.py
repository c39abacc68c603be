"""TensorRT backend: GPU tests skip with a reason on CPU machines; the profile logic runs anywhere."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from runtime.interface import read_interface

HAS_TRT = importlib.util.find_spec("tensorrt") is not None
needs_gpu = pytest.mark.skipif(
    not (HAS_TRT and torch.cuda.is_available()),
    reason="TensorRT tests need an NVIDIA GPU and pip install '.[tensorrt]'; run bench/gpu_check.py there",
)


def test_importing_the_backend_needs_neither_tensorrt_nor_cuda():
    import runtime.backends.tensorrt as backend

    assert backend.PLAN_FILE == "model.plan"


def test_optimization_profile_covers_prefill_and_decode(tiny_engine):
    from runtime.backends.tensorrt import profile_shapes

    shapes = profile_shapes(read_interface(tiny_engine), max_batch=8, max_seq=1024, max_past=2048, opt=(1, 1, 512))

    assert shapes["past_key.0"] == ((1, 2, 0, 16), (1, 2, 512, 16), (8, 2, 2048, 16))  # past 0 = prefill
    assert shapes["input_ids"] == ((1, 1), (1, 1), (8, 1024))
    assert shapes["attention_mask"] == ((1, 1), (1, 513), (8, 3072))
    assert not any(name.startswith("lora_") for name in shapes)  # fixed shapes, no profile needed


@pytest.mark.skipif(HAS_TRT and torch.cuda.is_available(), reason="checks the CPU-machine error path")
def test_tensorrt_engine_refuses_clearly_without_gpu(tiny_engine):
    from runtime.backends.tensorrt import TensorRTEngine, TensorRTUnavailable

    with pytest.raises(TensorRTUnavailable, match="tensorrt is not installed|no CUDA device"):
        TensorRTEngine(tiny_engine)


@needs_gpu
def test_tensorrt_plan_matches_onnx_runtime(tiny_engine, qwen_adapter):
    from runtime.adapter import load_adapter
    from runtime.backends.onnxruntime import OrtEngine
    from runtime.backends.tensorrt import TensorRTEngine, build_plan

    build_plan(tiny_engine, max_batch=4, max_seq=64, max_past=128, opt=(1, 1, 32))
    ort_engine, trt_engine = OrtEngine(tiny_engine), TensorRTEngine(tiny_engine)
    lora = load_adapter(qwen_adapter, ort_engine.interface)
    ort_engine.set_adapter(lora)
    trt_engine.set_adapter(lora)
    ids = np.random.default_rng(0).integers(0, 96, (2, 9))
    pos, mask = np.broadcast_to(np.arange(9), (2, 9)), np.ones((2, 9), np.int64)

    want, _ = ort_engine.forward(ids, pos, mask, None)
    got, _ = trt_engine.forward(ids, pos, mask, None)

    assert np.abs(got - want).max() <= 1e-3
