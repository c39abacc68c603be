"""TensorRT backend: a serialized ``.plan`` built once from the same ONNX graph, run on an NVIDIA GPU.

Default builder: the TensorRT Python API (``OnnxParser`` -> strongly typed network, one
optimization profile over the dynamic batch/seq/past axes, a persistent timing cache).
Second builder: torch-tensorrt (``torch_tensorrt.dynamo.convert_exported_program_to_serialized_trt_engine``)
on the exported program of the same forward. Both need the optional extra
(``pip install .[tensorrt]``); ``tensorrt``, ``torch_tensorrt`` and CUDA are imported lazily,
so importing this module on a CPU machine costs nothing and fails nowhere.

The plan is built on first use where it runs (``ensure_plan``; a plan belongs to one GPU and
TensorRT version) and rebuilt when ``plan_key.json`` shows another graph, TensorRT or GPU.

Execution: ``execute_async_v3`` on a CUDA stream with device buffers owned by torch. LoRA
inputs are copied to the GPU once per adapter and their addresses bound once; a step sets
the input shapes, the ids/positions/mask/cache addresses, and reads the logits back.

Precision follows the graph ("strong typing"): a float32 ONNX gives a float32 engine.
The weight-only int8/int4 copies (``tasks.weights.graph``, format ``qdq_fp16``) run their
projections in fp16, the rest in fp32; an all-fp16 engine would need an fp16 export, not produced yet.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Mapping

import numpy as np

from runtime.engine.adapter import check_lora_inputs, zero_lora_inputs
from runtime.engine.atomic_files import atomic_write
from runtime.engine.hashing import sha256_file
from runtime.engine.interface import CACHE_KEY_FILE, ENGINE_ONNX, LOGIT_POSITIONS, EngineInterface, read_interface

PLAN_FILE = "model.plan"
PLAN_KEY_FILE = "plan_key.json"  # which graph, TensorRT version and GPU the plan was built for
TIMING_CACHE_FILE = "timing.cache"
TORCH_TRT_PLAN_FILE = "model.torch_trt.plan"


class TensorRTUnavailable(RuntimeError):
    """No CUDA device or no tensorrt package: the message says which, and how to get it."""


def require_tensorrt():
    try:
        import tensorrt as trt
    except ImportError as err:
        raise TensorRTUnavailable(f"tensorrt is not installed ({err}); pip install '.[tensorrt]'") from None
    import torch

    if not torch.cuda.is_available():
        raise TensorRTUnavailable("no CUDA device visible: TensorRT engines run on NVIDIA GPUs only")
    return trt


def profile_shapes(iface: EngineInterface, max_batch: int, max_seq: int, max_past: int, opt: tuple[int, int, int]):
    """(min, opt, max) per dynamic input: the optimization profile for batch, seq, past and total."""
    opt_b, opt_t, opt_p = opt
    dims = {
        "batch": (1, opt_b, max_batch),
        "seq": (1, opt_t, max_seq),
        "past": (0, opt_p, max_past),
        "total": (1, opt_p + opt_t, max_past + max_seq),
        "positions": (1, opt_t, max_seq),  # logit positions (version 8): at most one per new token
    }
    shapes = {}
    for spec in iface.inputs:
        if any(isinstance(d, str) for d in spec.shape):
            shapes[spec.name] = tuple(
                tuple(dims[d][k] if isinstance(d, str) else d for d in spec.shape) for k in range(3)
            )
    return shapes


def build_plan(
    engine_dir: str | Path,
    max_batch: int = 8,
    max_seq: int = 1024,
    max_past: int = 2048,
    opt: tuple[int, int, int] = (1, 1, 512),
    workspace_gib: float = 4.0,
    tf32: bool = False,
) -> Path:
    """Parse ``model.onnx`` and write ``model.plan``, reusing and updating ``timing.cache``."""
    trt = require_tensorrt()
    engine_dir = Path(engine_dir)
    iface = read_interface(engine_dir)
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    # TensorRT 10 offers STRONGLY_TYPED as a flag; TensorRT 11 networks are strongly typed only.
    flag = getattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED", None)
    network = builder.create_network(0 if flag is None else 1 << int(flag))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(engine_dir / ENGINE_ONNX)):  # resolves external data beside it
        errors = [str(parser.get_error(i)) for i in range(parser.num_errors)]
        raise RuntimeError("TensorRT could not parse model.onnx:\n  " + "\n  ".join(errors))

    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace_gib * (1 << 30)))
    if not tf32 and hasattr(trt.BuilderFlag, "TF32"):
        config.clear_flag(trt.BuilderFlag.TF32)  # exact fp32 matmuls, so parity with ORT holds at 1e-3
    cache_path = engine_dir / TIMING_CACHE_FILE
    cache = config.create_timing_cache(cache_path.read_bytes() if cache_path.exists() else b"")
    config.set_timing_cache(cache, ignore_mismatch=False)
    profile = builder.create_optimization_profile()
    for name, (lo, mid, hi) in profile_shapes(iface, max_batch, max_seq, max_past, opt).items():
        profile.set_shape(name, lo, mid, hi)
    config.add_optimization_profile(profile)

    t0 = time.perf_counter()
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise RuntimeError("TensorRT build failed; see the logger output above")
    atomic_write(engine_dir / PLAN_FILE, bytes(plan))
    atomic_write(cache_path, bytes(config.get_timing_cache().serialize()))
    record = plan_key(engine_dir, trt.__version__, _device_name()) | {
        "profile": {"max_batch": max_batch, "max_seq": max_seq, "max_past": max_past, "opt": list(opt)}}
    atomic_write(engine_dir / PLAN_KEY_FILE, json.dumps(record, indent=2, sort_keys=True).encode())
    print(f"tensorrt: built {engine_dir / PLAN_FILE} in {time.perf_counter() - t0:.1f}s")
    return engine_dir / PLAN_FILE


def plan_key(engine_dir: str | Path, tensorrt_version: str, device: str) -> dict:
    """What a plan is valid for: the graph it was parsed from (the engine's cache key, which covers
    backbone, interface, KV scheme and weight format; else the hash of model.onnx), the TensorRT
    version and the GPU. A plan from another of any of these must be rebuilt, never run."""
    engine_dir = Path(engine_dir)
    key_file = engine_dir / CACHE_KEY_FILE
    graph = json.loads(key_file.read_text())["key"] if key_file.exists() else sha256_file(engine_dir / ENGINE_ONNX)
    return {"graph": graph, "tensorrt": tensorrt_version, "device": device}


def plan_is_current(engine_dir: str | Path, tensorrt_version: str, device: str) -> bool:
    engine_dir = Path(engine_dir)
    record = engine_dir / PLAN_KEY_FILE
    if not (engine_dir / PLAN_FILE).exists() or not record.exists():
        return False
    stored = json.loads(record.read_text())
    return all(stored.get(k) == v for k, v in plan_key(engine_dir, tensorrt_version, device).items())


def ensure_plan(engine_dir: str | Path, **build_options) -> bool:
    """Build ``model.plan`` unless the one there was built from this graph, TensorRT and GPU; True if built.
    The compile stage writes the ONNX anywhere; the plan is built where it runs (it is GPU-specific)."""
    trt = require_tensorrt()
    if plan_is_current(engine_dir, trt.__version__, _device_name()):
        return False
    build_plan(engine_dir, **build_options)
    return True


def _device_name() -> str:
    import torch

    return torch.cuda.get_device_name()


def build_plan_torch_tensorrt(
    model_dir: str | Path, engine_dir: str | Path, max_batch: int = 8, max_seq: int = 1024, max_past: int = 2048
) -> Path:
    """Second builder: torch.export of the same forward -> torch-tensorrt -> raw TensorRT plan."""
    require_tensorrt()
    import torch_tensorrt

    engine_dir = Path(engine_dir)
    iface = read_interface(engine_dir)
    program, example = export_flat_program(model_dir, iface, device="cuda")
    shapes = profile_shapes(iface, max_batch, max_seq, max_past, (1, 1, 512))
    inputs = []
    for spec, value in zip(iface.inputs, example):
        if spec.name in shapes:
            lo, mid, hi = shapes[spec.name]
            inputs.append(torch_tensorrt.Input(min_shape=lo, opt_shape=mid, max_shape=hi, dtype=value.dtype))
        else:
            inputs.append(torch_tensorrt.Input(shape=tuple(value.shape), dtype=value.dtype))
    plan = torch_tensorrt.dynamo.convert_exported_program_to_serialized_trt_engine(program, arg_inputs=inputs)
    atomic_write(engine_dir / TORCH_TRT_PLAN_FILE, bytes(plan))
    return engine_dir / TORCH_TRT_PLAN_FILE


def export_flat_program(model_dir, iface: EngineInterface, device: str = "cpu"):
    """torch.export of the backbone behind a flat positional signature in interface order."""
    import torch

    from runtime.engine.model import load_backbone
    from runtime.engine.tracing import MAX_BATCH, MAX_PAST, MAX_SEQ, TRACE_BATCH, TRACE_PAST, TRACE_SEQ, example_inputs

    model = load_backbone(model_dir, iface.target_modules).to(device)
    n_kv = 2 * iface.num_layers

    class Flat(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, *flat):
            n_lora = len(iface.lora_names)
            lora, positions = flat[3 + n_kv : 3 + n_kv + n_lora], flat[3 + n_kv + n_lora :]  # positions: version 8
            logits, present = self.inner(flat[0], flat[1], flat[2], flat[3 : 3 + n_kv], lora, *positions)
            return (logits, *present)

    ids, pos, mask, kv, lora, *positions = example_inputs(model, iface, TRACE_BATCH, TRACE_SEQ, TRACE_PAST)
    example = tuple(t.to(device) for t in (ids, pos, mask, *kv, *lora, *positions))
    Dim = torch.export.Dim
    batch, seq, past = Dim("batch", min=1, max=MAX_BATCH), Dim("seq", min=1, max=MAX_SEQ), Dim("past", min=0, max=MAX_PAST)
    dynamic = [{0: batch, 1: seq}, {0: batch, 1: seq}, {0: batch, 1: Dim.AUTO}]
    dynamic += [{0: batch, 2: past}] * n_kv + [None] * len(lora)
    dynamic += [{0: batch, 1: Dim("positions", min=1, max=MAX_SEQ)}] * len(positions)
    with torch.no_grad():
        # Deferred asserts: guards such as T * min(16, 32 T) == 16 T hold for every T >= 1 but
        # cannot be proven symbolically; the ONNX exporter defers them the same way.
        program = torch.export.export(
            Flat(), example, dynamic_shapes=(tuple(dynamic),), prefer_deferred_runtime_asserts_over_guards=True
        )
    return program, example


class TensorRTEngine:
    """Engine protocol on a TensorRT plan. Cache buffers live on the GPU as torch tensors."""

    def __init__(self, engine_dir: str | Path, plan_file: str = PLAN_FILE):
        trt = require_tensorrt()
        import torch

        self._torch = torch
        engine_dir = Path(engine_dir)
        self.interface = read_interface(engine_dir)
        if self.interface.paged:
            raise ValueError(f"{engine_dir}: paged KV cache; only the onnxruntime backend runs it so far")
        if plan_file == PLAN_FILE:
            ensure_plan(engine_dir)  # first use on this GPU, or the graph / TensorRT changed since
        self._logger = trt.Logger(trt.Logger.WARNING)
        self._runtime = trt.Runtime(self._logger)
        self._engine = self._runtime.deserialize_cuda_engine((engine_dir / plan_file).read_bytes())
        if self._engine is None:
            raise RuntimeError(f"{engine_dir / plan_file}: TensorRT could not deserialize the plan (other TensorRT version or GPU?)")
        names = [self._engine.get_tensor_name(i) for i in range(self._engine.num_io_tensors)]
        expected = self.interface.input_names + self.interface.output_names
        if sorted(names) != sorted(expected):
            raise ValueError(f"{plan_file}: plan I/O differs from interface.json")
        self._context = self._engine.create_execution_context()
        self._stream = torch.cuda.Stream()
        self._kv_in = [n for n in self.interface.input_names if n.startswith("past_")]
        self._kv_out = [n for n in self.interface.output_names if n.startswith("present_")]
        self._lora: dict[str, "torch.Tensor"] = {}
        self.set_adapter(None)

    def set_adapter(self, lora: Mapping[str, np.ndarray] | None) -> None:
        if lora is None:
            lora = zero_lora_inputs(self.interface)
        check_lora_inputs(self.interface, lora)
        torch = self._torch
        self._lora = {n: torch.from_numpy(np.ascontiguousarray(v, dtype=np.float32)).cuda() for n, v in lora.items()}
        for name, value in self._lora.items():  # bound once: a swap is a copy, never a rebuild
            self._context.set_input_shape(name, tuple(value.shape))
            self._context.set_tensor_address(name, value.data_ptr())

    def forward(self, input_ids, position_ids, attention_mask, past=None, logit_positions=None):
        torch, ctx, i = self._torch, self._context, self.interface
        B, T = input_ids.shape
        if past is None:
            past = [torch.zeros(B, i.num_kv_heads, 0, i.head_dim, device="cuda") for _ in self._kv_in]
        feeds = {
            "input_ids": torch.as_tensor(np.asarray(input_ids, dtype=np.int64)).cuda(),
            "position_ids": torch.as_tensor(np.asarray(position_ids, dtype=np.int64)).cuda(),
            "attention_mask": torch.as_tensor(np.asarray(attention_mask, dtype=np.int64)).cuda(),
        }
        if i.logit_positions:  # None = every position, as the ONNX Runtime backend
            every = np.broadcast_to(np.arange(T, dtype=np.int64), (B, T))
            feeds[LOGIT_POSITIONS] = torch.as_tensor(np.ascontiguousarray(
                every if logit_positions is None else logit_positions, dtype=np.int64)).cuda()
        feeds.update(zip(self._kv_in, past))
        for name, value in feeds.items():
            ctx.set_input_shape(name, tuple(value.shape))
            # TensorRT rejects a null address, which an empty (past = 0) tensor may have.
            ctx.set_tensor_address(name, value.data_ptr() if value.numel() else self._dummy().data_ptr())
        outputs = {}
        for name in i.output_names:
            shape = tuple(ctx.get_tensor_shape(name))
            outputs[name] = torch.empty(shape, dtype=torch.float32, device="cuda")
            ctx.set_tensor_address(name, outputs[name].data_ptr())
        self._stream.wait_stream(torch.cuda.current_stream())
        if not ctx.execute_async_v3(self._stream.cuda_stream):
            raise RuntimeError("TensorRT execute_async_v3 failed")
        self._stream.synchronize()
        return outputs["logits"].cpu().numpy(), [outputs[n] for n in self._kv_out]

    def _dummy(self):
        if not hasattr(self, "_dummy_buf"):
            self._dummy_buf = self._torch.zeros(1, device="cuda")
        return self._dummy_buf

    def cache_to_numpy(self, cache) -> list[np.ndarray]:
        return [t.cpu().numpy() for t in cache]
