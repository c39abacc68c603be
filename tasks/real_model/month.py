"""The real-model profile's month: a classification task from the Unicode database, as chats.

A real task that nobody here wrote, from text every machine has offline: Python's ``unicodedata``
(the Unicode Character Database). Each row asks which kind of character a Unicode name denotes,
``U+00E0 LATIN SMALL LETTER A WITH GRAVE`` -> ``lowercase``, among six classes that group the general
categories: uppercase (Lu), lowercase (Ll), digit (Nd), punctuation (P*), symbol (S*) and mark (M*).
An instruct model gets part of it from the words of the name (SMALL, CAPITAL, DIGIT) and misses the
rest (a symbol from a mark, punctuation from a symbol), which a LoRA adapter learns. Splits hold
disjoint characters, the same number of each class. The held-out text for perplexity is real prose:
paragraphs of the Python reference's topics (``pydoc_data.topics``), not task rows. The rehearsal text
(``train.rehearsal_share``) is real prose too: the reference's topics of ``tasks.real_model.text``'s calib split,
every topic that holds a held-out paragraph left out.

    python -m tasks.real_model.month --out real-models/unicode/2026-11    # make real-model
"""

from __future__ import annotations

import argparse
import random
import re
import sys
import unicodedata
from collections.abc import Callable
from pathlib import Path
from typing import Any

from runtime.engine.tokenizer import ChatPrompt
from tasks.artifacts import atomic_output_dir
from tasks.real_model.text import real_documents
from tasks.records import HELDOUT_TEXT, REHEARSAL_TEXT, Example, heldout_overlaps, write_jsonl

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


def chat_example(system: str, user: str, label: str) -> Example:
    """A chat row of a classification task: the system and user turns, the label as the answer and the rule."""
    messages = ({"role": "system", "content": system}, {"role": "user", "content": user})
    return Example(ChatPrompt(messages), label, rule=label)


def chat_row(cp: int, name: str, label: str) -> Example:
    return chat_example(SYSTEM, f"U+{cp:04X} {name}", label)


def balanced_splits(rng: random.Random, items_by_class: dict[str, list], per_class: dict[str, int],
                    row: Callable[[Any, str], Example]) -> dict[str, list[Example]]:
    """Each split's rows: per class, a draw of distinct items, split after split (``per_class[split]`` of
    every class in each split, in ``per_class``'s order), then each split shuffled; ``row(item, label)``
    makes a row. A class with fewer items than the splits take is refused, naming it."""
    splits: dict[str, list[Example]] = {split: [] for split in per_class}
    for label, items in items_by_class.items():
        if len(items) < sum(per_class.values()):
            raise ValueError(f"class {label!r} has {len(items)} items, the splits take {sum(per_class.values())}")
        drawn = rng.sample(items, sum(per_class.values()))
        for split, count in per_class.items():
            splits[split] += [row(item, label) for item in drawn[:count]]
            drawn = drawn[count:]
    for rows in splits.values():
        rng.shuffle(rows)
    return splits


def split_rows(seed: int) -> dict[str, list[Example]]:
    """Each split's rows: per class, a seeded draw of distinct characters, split after split."""
    return balanced_splits(random.Random(f"unicode:{seed}"), characters_by_class(), PER_CLASS,
                           lambda char, label: chat_row(*char, label))


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


def rehearsal_documents(heldout: list[str]) -> list[str]:
    """General text to rehearse (``data.rehearsal_text``), one topic per line: the Python reference's topics of
    ``tasks.real_model.text``'s calib split, leaving out each that holds a ``heldout`` paragraph (the finetune stage
    refuses such a document). Prose only: a document is one line, and code with its newlines and indentation
    collapsed is not text a model reads."""
    topics = [" ".join(text.split()) for name, text in real_documents("calib", min_chars=0) if name.startswith("topic:")]
    holding = {i for i, _ in heldout_overlaps(topics, heldout)}
    return [text for i, text in enumerate(topics) if i not in holding]


def write_month(out_dir: Path, seed: int = 0) -> Path:
    """Write train/val/calib/test.jsonl (chat rows), heldout.txt and rehearsal.txt into ``out_dir``, all or nothing."""
    return write_chat_month(out_dir, split_rows(seed))


def write_chat_month(out_dir: Path, splits: dict[str, list[Example]]) -> Path:
    """Write each split's rows (``<split>.jsonl``), heldout.txt (``heldout_paragraphs``) and rehearsal.txt
    (``rehearsal_documents``) into ``out_dir``, all or nothing."""
    heldout = heldout_paragraphs()
    with atomic_output_dir(Path(out_dir)) as tmp:
        for split, rows in splits.items():
            write_jsonl(tmp / f"{split}.jsonl", rows)
        (tmp / HELDOUT_TEXT).write_text("\n".join(heldout) + "\n")
        (tmp / REHEARSAL_TEXT).write_text("\n".join(rehearsal_documents(heldout)) + "\n")
    return Path(out_dir)


def month_main(argv: list[str] | None, description: str, default_out: Path,
               write: Callable[[Path, int], Path]) -> int:
    """A month writer's command line: ``--out`` (default ``default_out``) and ``--seed``, then ``write(out, seed)``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", type=Path, default=default_out, help=f"output directory (default: {default_out})")
    parser.add_argument("--seed", type=int, default=0, help="seeds which items each split draws")
    args = parser.parse_args(argv)
    print(f"month written to {write(args.out, args.seed)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return month_main(argv, "Write the real-model profile's month: Unicode character classification as chat rows, "
                            "and prose for perplexity.", DEFAULT_OUT, write_month)


if __name__ == "__main__":
    sys.exit(main())
