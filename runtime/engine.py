"""The Engine protocol every backend implements, and the one way to open an engine.

The cache (past K/V) is opaque to callers: each backend keeps it in its own memory
(torch tensors, ORT values, device buffers) so a decode step never copies it through numpy.
Logits always come back as a float32 numpy array (B, T, V).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Protocol, runtime_checkable

import numpy as np

from runtime.interface import EngineInterface

Cache = Any  # backend-specific list of 2 * num_layers K/V buffers, layout from the interface


@runtime_checkable
class Engine(Protocol):
    interface: EngineInterface

    def set_adapter(self, lora: Mapping[str, np.ndarray] | None) -> None:
        """Bind LoRA inputs (``runtime.adapter.load_adapter`` output); None = base model."""

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
