"""A real checkpoint (the real-model profile's ``base_model.path``) as the real-model benchmarks measure it: real
text this machine has offline, split into calib and eval documents, the KV statistics of the base on the calib
documents, and the served quantized-KV engine with scales made from them."""

from __future__ import annotations

from pathlib import Path

from tasks.kv_stats import collect_kv_stats, kv_scales_from_stats

CALIB_WINDOW, CALIB_WINDOWS = 512, 16  # calib documents cut into this many windows of this many tokens


def real_documents(split: str) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(prose, code) documents of ``split``, [(name, text)]: ``tasks.real_model.text``'s, the same text and
    calib/eval split the KV gate's held-out file and ``bench.quality.kv_real_text`` read."""
    from tasks.real_model import text as real_text

    docs = real_text.real_documents(split)
    return [d for d in docs if d[0].startswith("topic:")], [d for d in docs if d[0].startswith("stdlib:")]


def calib_batches(tokenizer, windows: int = CALIB_WINDOWS, length: int = CALIB_WINDOW) -> list:
    """[(ids (1, length), mask)] cut from the calib documents, prose and code alternating."""
    import torch

    prose, code = real_documents("calib")
    out = []
    for (_, a), (_, b) in zip(prose, code):
        for text in (a, b):
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            for i in range(0, len(ids) - length + 1, length):
                if len(out) < windows:
                    out.append((torch.tensor([ids[i : i + length]]), torch.ones(1, length, dtype=torch.long)))
    return out


def calibration_stats(backbone, tokenizer, cfg) -> dict:
    """K/V statistics of the base model on the calib documents, as the calibrate stage collects them for a release."""
    return collect_kv_stats(backbone, calib_batches(tokenizer), cfg.kv.spec().pre_rope_keys, cfg.kv.clip_percentile,
                            progress=False)


def served_engine(engine_dir: Path, stats: dict, spec, threads: int):
    """A quantized-KV engine (the compile stage's, or a weight-quantized copy) with scales for ``spec`` bound."""
    from runtime.engine.backends.onnxruntime import OrtEngine

    engine = OrtEngine(engine_dir, threads=threads)
    engine.set_adapter(None, kv_scales=kv_scales_from_stats(stats, spec, {"base_model_hash": engine.interface.backbone_hash}))
    return engine

