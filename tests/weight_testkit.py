"""Weight-quantization test kit: running an engine the way the weight tests compare it, and an engine
whose graph keeps its weights in a data file, as the compile stage writes a large one."""

from __future__ import annotations

import numpy as np
import onnx


def prefill_and_decode(engine, ids):
    """Logits of a prefill of all but the last token, then one decode step with the cache."""
    B, T = ids.shape
    pos, mask = np.arange(T)[None].repeat(B, 0), np.ones((B, T), np.int64)
    first, cache = engine.forward(ids[:, :-1], pos[:, :-1], mask[:, :-1], None)
    last, _ = engine.forward(ids[:, -1:], pos[:, -1:], mask, cache)
    return np.concatenate([first, last], axis=1)  # (B, T, V)


def external_copy(engine_dir, out_dir):
    """The engine with its graph's weights in model.onnx.data, as the compile stage writes a large one."""
    import shutil

    out_dir.mkdir()
    for name in ("interface.json", "cache_key.json"):
        shutil.copy(engine_dir / name, out_dir / name)
    onnx.save(onnx.load(str(engine_dir / "model.onnx")), str(out_dir / "model.onnx"), save_as_external_data=True,
              location="model.onnx.data")
    return out_dir
