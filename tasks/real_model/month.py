"""The real-model profile's month: a classification task from the Unicode database, as chats.

A real task that nobody here wrote, from text every machine has offline: Python's ``unicodedata``
(the Unicode Character Database). Each row asks which kind of character a Unicode name denotes,
``U+00E0 LATIN SMALL LETTER A WITH GRAVE`` -> ``lowercase``, among six classes that group the general
categories: uppercase (Lu), lowercase (Ll), digit (Nd), punctuation (P*), symbol (S*) and mark (M*).
An instruct model gets part of it from the words of the name (SMALL, CAPITAL, DIGIT) and misses the
rest (a symbol from a mark, punctuation from a symbol), which a LoRA adapter learns. Splits hold
disjoint characters, the same number of each class. The held-out text for perplexity is real prose:
paragraphs of the Python reference's topics (``pydoc_data.topics``), not task rows.

    python -m tasks.real_model.month --out real-models/unicode/2026-11    # make real-model
"""

from __future__ import annotations

import argparse
import random
import re
import sys
import unicodedata
from pathlib import Path

from runtime.engine.tokenizer import ChatPrompt
from tasks.artifacts import atomic_output_dir
from tasks.records import HELDOUT_TEXT, Example, write_jsonl

DEFAULT_OUT = Path("real-models/unicode/2026-11")
# The class of each general category kept; the others (other letters, other numbers, separators,
# controls) are left out: their names rarely say what they are (CJK UNIFIED IDEOGRAPH-4E00).
CLASS_OF_CATEGORY = {"Lu": "uppercase", "Ll": "lowercase", "Nd": "digit", "Mn": "mark", "Mc": "mark", "Me": "mark"}
CLASS_OF_MAJOR = {"P": "punctuation", "S": "symbol"}
CLASSES = ("uppercase", "lowercase", "digit", "punctuation", "symbol", "mark")
SYSTEM = ("Classify the Unicode character by its name. Answer with one word: "
          "uppercase, lowercase, digit, punctuation, symbol or mark.")
# Rows per class in each split (six classes), sized for the profile on 2 cores: evaluation decodes every
# test row six ways (base and adapter in PyTorch, the engine, parity, the float and the quantized KV cache).
PER_CLASS = {"train": 80, "val": 4, "calib": 4, "test": 6}
HELDOUT_LINES = 16
HELDOUT_WORDS = (40, 120)  # a paragraph kept for perplexity has this many words


def character_class(char: str) -> str | None:
    category = unicodedata.category(char)
    return CLASS_OF_CATEGORY.get(category) or CLASS_OF_MAJOR.get(category[0])


def characters_by_class() -> dict[str, list[tuple[int, str]]]:
    """(code point, name) of every named character of each class, in code point order."""
    by_class: dict[str, list[tuple[int, str]]] = {c: [] for c in CLASSES}
    for cp in range(0x110000):
        char = chr(cp)
        name = unicodedata.name(char, "")
        label = character_class(char) if name else None
        if label is not None:
            by_class[label].append((cp, name))
    return by_class


def chat_row(cp: int, name: str, label: str) -> Example:
    messages = ({"role": "system", "content": SYSTEM}, {"role": "user", "content": f"U+{cp:04X} {name}"})
    return Example(ChatPrompt(messages), label, rule=label)


def split_rows(seed: int) -> dict[str, list[Example]]:
    """Each split's rows: per class, a seeded draw of distinct characters, split after split."""
    rng = random.Random(f"unicode:{seed}")
    splits: dict[str, list[Example]] = {split: [] for split in PER_CLASS}
    for label, chars in characters_by_class().items():
        drawn = rng.sample(chars, sum(PER_CLASS.values()))
        for split, count in PER_CLASS.items():
            splits[split] += [chat_row(cp, name, label) for cp, name in drawn[:count]]
            drawn = drawn[count:]
    for rows in splits.values():
        rng.shuffle(rows)
    return splits


def heldout_paragraphs(lines: int = HELDOUT_LINES) -> list[str]:
    """Paragraphs of prose from the Python reference (``pydoc_data.topics``), one per line, topics in
    name order: the first ``lines`` whose word count lies in HELDOUT_WORDS."""
    from pydoc_data.topics import topics

    low, high = HELDOUT_WORDS
    kept = []
    for name in sorted(topics):
        for paragraph in re.split(r"\n\s*\n", topics[name]):
            words = paragraph.split()
            # prose, not code or tables: most words alphabetic, ending as a sentence
            if low <= len(words) <= high and paragraph.rstrip().endswith(".") and \
                    sum(w.isalpha() for w in words) >= 0.6 * len(words):
                kept.append(" ".join(words))
                if len(kept) == lines:
                    return kept
    return kept


def write_month(out_dir: Path, seed: int = 0) -> Path:
    """Write train/val/calib/test.jsonl (chat rows) and heldout.txt into ``out_dir``, all or nothing."""
    with atomic_output_dir(Path(out_dir)) as tmp:
        for split, rows in split_rows(seed).items():
            write_jsonl(tmp / f"{split}.jsonl", rows)
        (tmp / HELDOUT_TEXT).write_text("\n".join(heldout_paragraphs()) + "\n")
    return Path(out_dir)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write the real-model profile's month: Unicode character "
                                                 "classification as chat rows, and prose for perplexity.")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output directory (default: {DEFAULT_OUT})")
    parser.add_argument("--seed", type=int, default=0, help="seeds which characters each split draws")
    args = parser.parse_args(argv)
    print(f"month written to {write_month(args.out, args.seed)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
