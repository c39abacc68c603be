"""Real prose and code that every machine has offline, for KV-cache perplexity on real weights.

Prose: the topics of Python's own reference manual (``pydoc_data.topics``: what ``help("if")``
prints). Code: this interpreter's standard-library ``*.py`` sources. Neither is task data, and
neither was written for this project, so a quantized cache is scored on the kind of text a
pretrained checkpoint reads, at the context lengths (1,024+ tokens) where its errors add up.

Documents are split by a hash of their name into ``calib`` and ``eval`` (stable across machines),
so scales are never set on the text that scores them.

``write_heldout_text(path)`` writes the ``eval`` documents one per line (``tasks.records.read_text_corpus``
reads one document per line; inner whitespace is collapsed to single spaces): the file a profile's
``data.heldout_text`` names.

    python -m tasks.real_model.text --out heldout.txt
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import sysconfig
from pathlib import Path

SPLITS = ("calib", "eval")


def _split_of(name: str) -> str:
    return "calib" if int(hashlib.sha256(name.encode()).hexdigest(), 16) % 4 == 0 else "eval"


def real_documents(split: str, min_chars: int = 6000) -> list[tuple[str, str]]:
    """[(name, text)] of one split, prose first then code, each at least ``min_chars`` long
    (about 1,500 tokens of a 49k BPE), in a stable order."""
    import pydoc_data.topics

    if split not in SPLITS:
        raise ValueError(f"split={split!r}: one of {SPLITS}")
    prose = [(f"topic:{name}", text) for name, text in sorted(pydoc_data.topics.topics.items())]
    root = Path(sysconfig.get_paths()["stdlib"])
    code = [(f"stdlib:{p.name}", p.read_text(errors="replace")) for p in sorted(root.glob("*.py"))]
    return [(name, text) for name, text in prose + code if len(text) >= min_chars and _split_of(name) == split]


def calibration_windows(model_dir: Path, tokens: int, window: int) -> list[list[int]]:
    """About ``tokens`` token ids of the calib split under ``model_dir``'s tokenizer, as windows of ``window`` tokens
    (at most the model's max_position_embeddings), cut from the documents in turn: the text GPTQ
    (``tasks.stages.compile.weight_calibration_ids``) and the pages' per-layer widths (``tasks.checks.page_widths``) read."""
    from runtime.engine.model import read_hf_config
    from tasks.config import StageError
    from tasks.models import load_tokenizer

    window = min(window, int(read_hf_config(model_dir).get("max_position_embeddings", window)))
    tokenizer = load_tokenizer(Path(model_dir))
    docs = [tokenizer(text)["input_ids"] for _, text in real_documents("calib")]
    windows, depth = [], 0
    while sum(map(len, windows)) < tokens:
        cut = [ids[depth:depth + window] for ids in docs if len(ids) >= depth + window]
        if not cut:
            raise StageError(f"the calibration text holds fewer than {tokens} tokens in windows of {window}")
        windows += cut
        depth += window
    return windows[: -(-tokens // window)]


def write_heldout_text(path: Path, documents: int = 24, min_chars: int = 6000) -> Path:
    """The ``eval`` split as a text corpus: half prose, half code, one document per line."""
    docs = real_documents("eval", min_chars)
    prose = [t for n, t in docs if n.startswith("topic:")][: documents // 2]
    code = [t for n, t in docs if n.startswith("stdlib:")][: documents - len(prose)]
    lines = [" ".join(t.split()) for t in prose + code]
    Path(path).write_text("\n".join(lines) + "\n")
    return Path(path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Write real prose and code (offline) as a held-out text corpus.")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--documents", type=int, default=24)
    args = ap.parse_args(argv)
    print(write_heldout_text(args.out, args.documents))
    return 0


if __name__ == "__main__":
    sys.exit(main())
