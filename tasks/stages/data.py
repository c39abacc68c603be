"""The data stage: the month's four splits, generated for the embedded default or imported from the user's.

The embedded default's month is generated from its rule book (``tasks.inspection``): the rows whose
rule changed since the base model's month are what the adapter must learn, and the rest form a
regression set. Users can bring their own month instead: a folder with the same four JSONL splits
(``train``, ``val``, ``calib``, ``test``) in the row format of ``tasks.records``, one format per file.
``data.prompt_format`` decides whether prompt/completion rows are chats too (one user turn): the stage
writes them as chat rows. A month is validated whole (every row, and ``changed`` on every row or on
none) before anything is copied.
"""

from __future__ import annotations

import random
import shutil
import sys
from pathlib import Path

from runtime.engine.tokenizer import DeviceTokenizer, TokenizerError
from tasks.artifacts import atomic_output_dir, write_json
from tasks.cli import stage_main
from tasks.config import DataConfig, ReleaseConfig
from tasks.inspection import RULEBOOK, changed_rules, rulebook, sample_examples
from tasks.records import (
    HELDOUT_TEXT,
    REHEARSAL_TEXT,
    SPLITS,
    DataError,
    is_chat,
    read_jsonl,
    read_numbered_rows,
    read_text_corpus,
    write_jsonl,
)


def split_sizes(cfg: DataConfig) -> dict[str, int]:
    return {"train": cfg.train_size, "val": cfg.val_size, "calib": cfg.calib_size, "test": cfg.test_size}


def generate_month(cfg: DataConfig, base_month: str, out_dir: Path, chat: bool = False,
                   rehearsal_text: Path | None = None) -> Path:
    """Write the four splits, a held-out text and the rule book of ``cfg.month``; with ``chat`` the
    rows are chats of one user turn. A ``rehearsal_text`` is copied beside them.

    ``changed`` on each row is relative to ``base_month``, the last month the base model
    was trained on: those rows are what the adapter must learn.
    """
    book = rulebook(cfg.month, cfg.seed, cfg.rules_changed_per_month)
    changed = set(changed_rules(cfg.month, base_month, cfg.seed, cfg.rules_changed_per_month))
    with atomic_output_dir(out_dir) as tmp:
        for split, size in split_sizes(cfg).items():
            rng = random.Random(f"{cfg.seed}:{cfg.month}:{split}")
            rows = sample_examples(book, size, rng, changed)
            write_jsonl(tmp / f"{split}.jsonl", [ex.as_chat() for ex in rows] if chat else rows)
        rng = random.Random(f"{cfg.seed}:{cfg.month}:heldout")
        lines = [ex.text for ex in sample_examples(book, cfg.heldout_lines, rng)]
        (tmp / HELDOUT_TEXT).write_text("\n".join(lines) + "\n")
        write_json(
            tmp / RULEBOOK,
            {
                "month": cfg.month,
                "base_month": base_month,
                "changed_since_base": sorted(changed),
                "rules": {d: vars(r) for d, r in book.items()},
            },
        )
        copy_texts(tmp, {REHEARSAL_TEXT: rehearsal_text})
    return out_dir


def copy_texts(out_dir: Path, texts: dict[str, Path | None]) -> None:
    """Copy each given text corpus (checked first: it exists and holds a document) as ``out_dir``/its name."""
    for name, path in texts.items():
        if path is not None:
            read_text_corpus(path)
            shutil.copyfile(path, Path(out_dir) / name)


def check_month(src_dir: Path, chat_template: bool = True) -> None:
    """Validate every split of a user's month, and that rows are labelled all or none.

    ``changed`` decides what the gates read (accuracy on changed and unchanged rules, or overall
    accuracy): a month where only some rows say whether their rule changed has no meaning for either.
    Chat rows need a tokenizer with a chat template (``chat_template``) to render them.
    """
    first: tuple[Path, int, bool] | None = None
    for split in SPLITS:
        path = Path(src_dir) / f"{split}.jsonl"
        for lineno, ex in read_numbered_rows(path):
            if is_chat(ex) and not chat_template:
                raise DataError(f"{path}:{lineno}: a 'messages' row, but the base model's tokenizer has no chat "
                                "template to render it; give prompt/completion rows or a model with a template")
            labelled = ex.changed is not None
            if first is None:
                first = (path, lineno, labelled)
            elif labelled != first[2]:
                has = "has a 'changed' field" if labelled else "has no 'changed' field"
                other = "has one" if first[2] else "has none"
                raise DataError(f"{path}:{lineno}: row {has} but {first[0]}:{first[1]} {other}: "
                                "label every row with 'changed' or none")


def import_month(src_dir: Path, out_dir: Path, heldout_text: Path | None = None, chat: bool = False,
                 chat_template: bool = True, rehearsal_text: Path | None = None) -> Path:
    """Validate a user's month folder and copy it into place; nothing is copied on error. With
    ``chat``, prompt/completion rows are written as chats of one user turn; other files (the held-out
    and the rehearsal text) are copied byte for byte."""
    src_dir = Path(src_dir)
    check_month(src_dir, chat_template)
    with atomic_output_dir(out_dir) as tmp:
        for split in SPLITS:
            rows = read_jsonl(src_dir / f"{split}.jsonl")
            if chat and not is_chat(rows[0]):
                write_jsonl(tmp / f"{split}.jsonl", [ex.as_chat() for ex in rows])
            else:
                shutil.copyfile(src_dir / f"{split}.jsonl", tmp / f"{split}.jsonl")
        copy_texts(tmp, {HELDOUT_TEXT: heldout_text, REHEARSAL_TEXT: rehearsal_text})
    return out_dir


def has_chat_template(source: str, path: str) -> bool:
    """Whether the base model's tokenizer has a chat template (the device's reading of it); the
    embedded default's has none."""
    if source != "local":
        return False
    try:
        return DeviceTokenizer(path).chat_template is not None
    except TokenizerError as err:
        raise DataError(f"base_model.path: {err}") from None


def prepare_data(cfg: DataConfig, base_month: str, out_dir: Path, chat_template: bool = False) -> Path:
    """The data stage: generate the embedded month or import the user's. ``data.prompt_format``
    (default: chat when the tokenizer has a ``chat_template``) decides whether prompt/completion rows
    become chats."""
    if cfg.prompt_format == "chat" and not chat_template:
        raise DataError("data.prompt_format: chat needs a base model whose tokenizer has a chat template; "
                        "this one has none (set raw, or leave it unset)")
    chat = chat_template if cfg.prompt_format is None else cfg.prompt_format == "chat"
    rehearsal = Path(cfg.rehearsal_text) if cfg.rehearsal_text else None
    if cfg.jsonl_dir is None:
        return generate_month(cfg, base_month, out_dir, chat, rehearsal)
    heldout = Path(cfg.heldout_text) if cfg.heldout_text else None
    return import_month(Path(cfg.jsonl_dir), out_dir, heldout, chat, chat_template, rehearsal)


def run_stage(cfg: ReleaseConfig) -> str:
    template = has_chat_template(cfg.base_model.source, cfg.base_model.path)
    out = prepare_data(cfg.data, cfg.base_model.trained_through, cfg.layout.data_dir, template)
    return f"data for {cfg.data.month} written to {out}"


def main(argv: list[str] | None = None) -> int:
    return stage_main("Write the month's data splits.", run_stage, argv)


if __name__ == "__main__":
    sys.exit(main())
