"""The Engine protocol every backend implements, and the one way to open an engine.

The cache (past K/V) is opaque to callers: each backend keeps it in its own memory
(torch tensors, ORT values, device buffers) so a decode step never copies it through numpy.
Logits always come back as a float32 numpy array (B, T, V).

A backend that serves continuous batching (``runtime.batcher``; onnxruntime) also merges and splits
caches along the batch axis: ``merges_caches`` (whether it can), ``concat_caches(caches)`` (rows in
order, each left-padded along the past axis to the longest, the padding masked by the caller) and
``take_cache_rows(cache, rows, drop)`` (some rows, without their first ``drop`` past slots).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Protocol, runtime_checkable

import numpy as np

from runtime.contract import KV_SCALE_KINDS, KVScales
from runtime.interface import KV_ROTATION_INPUT, EngineInterface

Cache = Any  # backend-specific list of 2 * num_layers K/V buffers, layout from the interface


@runtime_checkable
class Engine(Protocol):
    interface: EngineInterface

    def set_adapter(self, lora: Mapping[str, np.ndarray] | None) -> None:
        """Bind LoRA inputs (``runtime.adapter.load_adapter`` output); None = base model.
        Engines with a quantized KV cache (``interface.kv_spec``) also take ``kv_scales=``."""

    def forward(
        self, input_ids: np.ndarray, position_ids: np.ndarray, attention_mask: np.ndarray, past: Cache | None
    ) -> tuple[np.ndarray, Cache]:
        """(B, T) ids and positions, (B, P + T) mask, cache of P tokens or None -> (logits (B, T, V), cache)."""

    def cache_to_numpy(self, cache: Cache) -> list[np.ndarray]:
        """The cache as numpy arrays, for tests and debugging only."""


def check_lora_inputs(iface: EngineInterface, lora: Mapping[str, np.ndarray]) -> None:
    """Every LoRA input present, with the interface's shape and finite values, nothing extra."""
    expected = {t.name: tuple(t.shape) for t in iface.inputs if t.name.startswith("lora_")}
    problems = [f"missing {n}" for n in expected if n not in lora]
    problems += [f"unexpected {n}" for n in lora if n not in expected]
    for name, shape in expected.items():
        if name in lora:
            value = np.asarray(lora[name])
            if tuple(value.shape) != shape:
                problems.append(f"{name} has shape {tuple(value.shape)}, interface says {shape}")
            elif not np.isfinite(value).all():
                problems.append(f"{name} has non-finite values")
    if problems:
        raise ValueError("LoRA inputs do not match the engine interface: " + "; ".join(problems))


def kv_scale_inputs(iface: EngineInterface, kv_scales: KVScales) -> dict[str, np.ndarray]:
    """The static KV-scale inputs (``k_scale.{i}`` ... (nkv, d) float32) of a quantized-KV engine,
    from a release's scales (``runtime.contract.read_kv_scales``). Refuses another spec or backbone,
    missing, mis-shaped, non-finite or non-positive scales, every problem at once; nothing is defaulted."""
    from runtime.errors import RefusedInput

    problems = []
    if kv_scales.spec != iface.kv_spec:
        problems.append(f"scales were calibrated for KV spec {kv_scales.spec}, the engine implements {iface.kv_spec}")
    base = kv_scales.record.get("base_model_hash")
    if base is not None and base != iface.backbone_hash:
        problems.append(f"scales were calibrated on backbone {base[:12]}, the engine runs {iface.backbone_hash[:12]}")
    stacked_by_kind = kv_scales.stacked()
    wanted = [t for t in iface.inputs if t.name.split(".")[0] in KV_SCALE_KINDS]
    inputs = {}
    for t in wanted:
        field, layer = t.name.split(".")
        stacked = stacked_by_kind.get(field)
        if stacked is None:
            problems.append(f"{field} is missing")
            continue
        stacked = np.asarray(stacked, dtype=np.float32)
        if stacked.ndim != 3 or stacked.shape[0] != iface.num_layers or tuple(stacked.shape[1:]) != tuple(t.shape):
            problems.append(f"{field} has shape {stacked.shape}, the engine needs ({iface.num_layers}, *{tuple(t.shape)})")
            continue
        value = np.ascontiguousarray(stacked[int(layer)])
        if not np.isfinite(value).all():
            problems.append(f"{t.name} has non-finite values")
        elif field.endswith("scale") and not (value > 0).all():
            problems.append(f"{t.name} has zero or negative scales")
        inputs[t.name] = value
    rotations = [t for t in iface.inputs if t.name.split(".")[0] == KV_ROTATION_INPUT]
    if rotations:
        stacked = kv_scales.rotation_or_identity()
        for t in rotations:
            if tuple(stacked.shape[1:]) != tuple(t.shape):
                problems.append(f"the KV rotation is {stacked.shape[1:]}, the engine needs {tuple(t.shape)}")
                break
            inputs[t.name] = np.ascontiguousarray(stacked[int(t.name.split(".")[1])], dtype=np.float32)
    elif kv_scales.rotation is not None:
        problems.append("the scales come with a KV rotation and this engine has no rotation input "
                        f"(interface version {iface.version}); recompile the engine")
    if problems:
        raise RefusedInput("KV scales do not fit this engine: " + "; ".join(dict.fromkeys(problems)))
    return inputs


def open_engine(engine_dir: str | Path, backend: str = "onnxruntime", threads: int = 2, **options) -> Engine:
    """Open a compiled engine directory with the named backend ("onnxruntime", "torch", "tensorrt")."""
    engine_dir = Path(engine_dir)
    if backend == "onnxruntime":
        from runtime.backends.onnxruntime import OrtEngine

        return OrtEngine(engine_dir, threads=threads, **options)
    if backend == "torch":
        from runtime.backends.torch_eager import TorchEngine

        return TorchEngine.from_engine_dir(engine_dir, threads=threads, **options)
    if backend == "tensorrt":
        from runtime.backends.tensorrt import TensorRTEngine

        return TensorRTEngine(engine_dir, **options)
    raise ValueError(f"unknown backend {backend!r}; expected onnxruntime, torch or tensorrt")
