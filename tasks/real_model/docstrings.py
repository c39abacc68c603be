"""A second real-model month: which standard-library package a docstring comes from, as chats.

A real task that nobody here wrote, from text every machine with Python has offline: the docstrings of
the standard library's own source (PSF-licensed), read with ``ast`` (nothing is imported). Each row gives
the summary of one function's, method's or class's docstring (its first paragraph, whitespace collapsed)
and asks which of six packages defines it: ``asyncio``, ``email``, ``logging``, ``tkinter``, ``unittest`` or
``xml`` (every ``*.py`` under the package, its ``test`` folders left out): ``Delegate a log call to the
underlying logger, after adding contextual information from this adapter instance.`` -> ``logging``. The rows are real English sentences of 8 to 33 words
(9-46 tokens of SmolLM2's tokenizer, median 13; 56-93 with the system turn, the answer and its eos, so
every row fits the profile's ``train.max_seq_len`` of 96 whole). An instruct model gets the rows that
name their domain (a handler, a MIME header, a widget, a test case) and misses those that could come
from anywhere (``Return the value of the option.``), which a LoRA adapter learns from the package's
vocabulary and style.

Kept: summaries that read as prose (``is_prose``); a summary written in two packages is left out, so no
text has two labels. On CPython 3.11.7 that leaves 102 (unittest) to 401 (tkinter) per package. Splits
hold distinct summaries, the same number of each package (train 480, val 24, calib 24, test 48 rows),
drawn with the seed. The rows depend on the interpreter's standard library, as the Unicode month's
depend on its ``unicodedata``. The held-out text for perplexity (heldout.txt) and the rehearsal text
(rehearsal.txt) are the Unicode month's, written by the same ``tasks.real_model.month.write_chat_month``:
16 paragraphs of the Python language reference's prose (``heldout_paragraphs``: ``pydoc_data.topics``,
not the ``eval`` documents of ``tasks.real_model.text``, whose standard-library code holds these very
docstrings) and other topics of it (``rehearsal_documents``); no row is part of either.

    python -m tasks.real_model.docstrings --out real-models/docstrings/2026-12    # make real-model
"""

from __future__ import annotations

import ast
import random
import re
import sys
import sysconfig
from collections import Counter
from pathlib import Path

from tasks.real_model.month import balanced_splits, chat_example, month_main, write_chat_month
from tasks.records import Example

DEFAULT_OUT = Path("real-models/docstrings/2026-12")
PACKAGES = ("asyncio", "email", "logging", "tkinter", "unittest", "xml")
SYSTEM = ("Name the package of the Python standard library this docstring comes from. Answer with one word: "
          "asyncio, email, logging, tkinter, unittest or xml.")
# Rows per package in each split, as the Unicode month's but for a larger test split (unittest and xml have about
# 100 summaries that qualify, so 96 each is what the data allows).
PER_CLASS = {"train": 80, "val": 4, "calib": 4, "test": 8}
MIN_WORDS = 8
MAX_CHARS = 180  # keeps a row within the profile's 96 tokens (system turn 45, summary up to ~50, answer and eos)
TEST_DIRS = {"test", "tests", "idle_test"}


def summary(docstring: str) -> str:
    """A docstring's first paragraph, its whitespace collapsed to single spaces."""
    return " ".join(re.split(r"\n\s*\n", docstring.strip())[0].split())


def is_prose(text: str) -> bool:
    """Sentences, not code: MIN_WORDS words or more, most of them words, no examples (``>>>``, quoted
    literals, lists of numbers such as ``move_row(2, 4, 1)``), at most MAX_CHARS characters."""
    words = text.split()
    return (len(words) >= MIN_WORDS and len(text) <= MAX_CHARS and text[0].isupper()
            and sum(w.strip(".,;:()'").isalpha() for w in words) >= 0.7 * len(words)
            and ">>>" not in text and '"' not in text and not re.search(r"\d[,)]", text))


def package_summaries(package: str, stdlib: Path | None = None) -> set[str]:
    """The summaries of every docstring of a function, method or class under the package (tests left out)."""
    root = Path(stdlib or sysconfig.get_paths()["stdlib"])
    found = set()
    for path in sorted((root / package).rglob("*.py")):
        if TEST_DIRS & set(path.relative_to(root).parts):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and ast.get_docstring(node):
                found.add(summary(ast.get_docstring(node)))
    return found


def summaries_by_package(stdlib: Path | None = None) -> dict[str, list[str]]:
    """Each package's summaries that read as prose and are written in no other of PACKAGES, sorted."""
    found = {package: package_summaries(package, stdlib) for package in PACKAGES}
    written = Counter(text for texts in found.values() for text in texts)
    return {package: sorted(t for t in texts if written[t] == 1 and is_prose(t)) for package, texts in found.items()}


def split_rows(seed: int) -> dict[str, list[Example]]:
    """Each split's rows: per package, a seeded draw of distinct summaries, split after split."""
    return balanced_splits(random.Random(f"docstrings:{seed}"), summaries_by_package(), PER_CLASS,
                           lambda text, package: chat_example(SYSTEM, text, package))


def write_month(out_dir: Path, seed: int = 0) -> Path:
    """Write train/val/calib/test.jsonl (chat rows), heldout.txt and rehearsal.txt into ``out_dir``, all or nothing."""
    return write_chat_month(out_dir, split_rows(seed))


def main(argv: list[str] | None = None) -> int:
    return month_main(argv, "Write the second real-model month: which standard-library package a docstring comes "
                            "from, as chat rows, and prose for perplexity.", DEFAULT_OUT, write_month)


if __name__ == "__main__":
    sys.exit(main())
