"""A real checkpoint (the real-model profile's ``base_model.path``) as the real-model benchmarks measure it: real
text this machine has offline, split into calib and eval documents, and the served engine with quantized pages."""

from __future__ import annotations

from pathlib import Path


def real_documents(split: str) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(prose, code) documents of ``split``, [(name, text)]: ``tasks.real_model.text``'s, the same text and
    calib/eval split the KV gate's held-out file reads."""
    from tasks.real_model import text as real_text

    docs = real_text.real_documents(split)
    return [d for d in docs if d[0].startswith("topic:")], [d for d in docs if d[0].startswith("stdlib:")]


def served_engine(engine_dir: Path, threads: int):
    """An engine with quantized pages (the compile stage's serving engine, or a weight-quantized copy) on no adapter:
    each page takes its scales from its own K/V when it seals, so there is nothing else to bind."""
    from runtime.engine.backends.onnxruntime import OrtEngine

    engine = OrtEngine(engine_dir, threads=threads)
    engine.set_adapter(None)
    return engine
