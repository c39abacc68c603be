"""The Engine protocol every backend implements, and the one way to open an engine.

The cache (past K/V) is opaque to callers: each backend keeps it in its own memory
(torch tensors, ORT values, device buffers) so a decode step never copies it through numpy.
Logits always come back as a float32 numpy array (B, T, V).

A backend that serves continuous batching (``runtime.serve.batcher``; onnxruntime) also merges and splits
caches along the batch axis: ``merges_caches`` (whether it can), ``concat_caches(caches)`` (rows in
order, each left-padded along the past axis to the longest, the padding masked by the caller) and
``take_cache_rows(cache, rows, drop)`` (some rows, without their first ``drop`` past slots). A paged
engine's cache (``runtime.engine.kv_blocks.PagedCache``) is never padded: both move its rows' blocks and
consume the caches given, and a step extends the cache it is given. It also says what a cache costs:
``cache_bytes(cache)`` (every slot, padding included) and ``kv_bytes_per_token`` (one row's slot), which the
server's KV gauges report (``runtime.serve.metrics``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Protocol, runtime_checkable

import numpy as np

from runtime.engine.interface import EngineInterface

Cache = Any  # backend-specific list of 2 * num_layers K/V buffers, layout from the interface


@runtime_checkable
class Engine(Protocol):
    interface: EngineInterface

    def set_adapter(self, lora: Mapping[str, np.ndarray] | None) -> None:
        """Bind LoRA inputs (``runtime.engine.adapter.load_adapter`` output); None = base model."""

    def forward(
        self, input_ids: np.ndarray, position_ids: np.ndarray, attention_mask: np.ndarray, past: Cache | None,
        logit_positions: np.ndarray | None = None,
    ) -> tuple[np.ndarray, Cache]:
        """(B, T) ids and positions, (B, P + T) mask, cache of P tokens or None -> (logits (B, T, V), cache);
        with ``logit_positions`` (B, K) int64 the logits of those new tokens, (B, K, V), on an engine that
        selects them (interface version 8; an older one returns all T)."""

    def cache_to_numpy(self, cache: Cache) -> list[np.ndarray]:
        """The cache as numpy arrays, for tests and debugging only."""


def open_engine(engine_dir: str | Path, backend: str = "onnxruntime", threads: int = 2, **options) -> Engine:
    """Open a compiled engine directory with the named backend ("onnxruntime", "torch", "tensorrt")."""
    engine_dir = Path(engine_dir)
    if backend == "onnxruntime":
        from runtime.engine.backends.onnxruntime import OrtEngine

        return OrtEngine(engine_dir, threads=threads, **options)
    if backend == "torch":
        from runtime.engine.backends.torch_eager import TorchEngine

        return TorchEngine.from_engine_dir(engine_dir, threads=threads, **options)
    if backend == "tensorrt":
        from runtime.engine.backends.tensorrt import TensorRTEngine

        return TensorRTEngine(engine_dir, **options)
    raise ValueError(f"unknown backend {backend!r}; expected onnxruntime, torch or tensorrt")
