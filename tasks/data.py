"""The month's data: the embedded inspection-rule generator and the JSONL reader.

The embedded default models an automated optical inspection (AOI) line: each record is
a board on which the AOI flagged one defect type with its measurement (plus identifiers
and the reflow temperature, which no rule reads), and the verdict follows the month's rule
book. A rule (one per defect type) compares the measurement with a threshold and gives one
verdict below it and another at or above.
Every month the rule book changes a few rules and keeps the rest, so the base model,
trained on an earlier month, gets the changed rules wrong while the unchanged ones form a
regression set.

Users can bring their own month instead: a folder with the same four JSONL splits, each
row ``{"prompt": ..., "completion": ...}`` or, the OpenAI fine-tuning format as TRL reads it,
``{"messages": [{"role": "system" | "user" | "assistant", "content": ...}, ...]}`` ending with the
assistant's answer (one format per file). A chat row's prompt is every message before that answer,
rendered by the base model's chat template (``runtime.engine.tokenizer.ChatPrompt``); evaluation scores the
last assistant turn, training learns every assistant turn. ``data.prompt_format`` decides whether
prompt/completion rows are chats too (one user turn): the data stage writes them as chat rows.
An optional ``rule`` field enables the per-rule
table; an optional ``changed`` field (on every row or on none) splits accuracy into the rules
changed this month and the regression set, which the gates then read instead of overall accuracy.
"""

from __future__ import annotations

import json
import random
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from runtime.engine.tokenizer import ChatPrompt, DeviceTokenizer, TokenizerError
from tasks.artifacts import atomic_output_dir, write_json
from tasks.cli import stage_main
from tasks.config import DataConfig, ReleaseConfig, StageError

SPLITS = ("train", "val", "calib", "test")
HELDOUT_TEXT = "heldout.txt"
RULEBOOK = "rulebook.json"
CHAT_ROLES = ("system", "user", "assistant")
# Each AOI defect type comes with the one measurement its rule reads (0-99 in its unit).
MEASUREMENT_OF = {
    "cosmetic": "mark_mm2",
    "bridge": "solder_pct",
    "tombstone": "tilt_deg",
    "shift": "offset_um",
    "void": "void_pct",
    "scratch": "depth_um",
    "crack": "crack_um",
    "lifted": "lift_um",
}
DEFECTS = tuple(MEASUREMENT_OF)
THRESHOLDS = tuple(range(20, 90, 10))
# The rule book history starts here; every later month is this book plus monthly edits.
EPOCH_MONTH = "2026-01"


class DataError(StageError, ValueError):
    """Bad input data; the message names the file and line."""


@dataclass(frozen=True)
class Rule:
    defect: str
    threshold: int
    below: str
    at_or_above: str

    def verdict(self, measurement: int) -> str:
        return self.at_or_above if measurement >= self.threshold else self.below


@dataclass(frozen=True)
class Example:
    prompt: str | ChatPrompt
    completion: str  # a chat row's: the content of its last assistant turn
    rule: str | None = None
    changed: bool | None = None

    @property
    def text(self) -> str:
        """The row as plain text (perplexity without a held-out text, the embedded tokenizer's corpus)."""
        if isinstance(self.prompt, ChatPrompt):
            return "\n".join([m["content"] for m in self.prompt.messages] + [self.completion])
        return self.prompt + self.completion

    def as_chat(self) -> Example:
        """A prompt/completion row as a chat of one user turn; its answer without the leading space
        that separates a raw completion from its prompt."""
        if isinstance(self.prompt, ChatPrompt):
            return self
        return Example(ChatPrompt(({"role": "user", "content": self.prompt},)), self.completion.strip(),
                       self.rule, self.changed)

    def to_json(self) -> dict:
        if isinstance(self.prompt, ChatPrompt):
            row: dict = {"messages": [*self.prompt.messages, {"role": "assistant", "content": self.completion}]}
        else:
            row = {"prompt": self.prompt, "completion": self.completion}
        if self.rule is not None:
            row["rule"] = self.rule
        if self.changed is not None:
            row["changed"] = self.changed
        return row


def _verdicts(defect: str) -> tuple[str, ...]:
    return ("PASS", "REWORK", "HOLD", f"FAIL:{defect}")


def _month_index(month: str) -> int:
    year, mon = (int(p) for p in month.split("-"))
    return year * 12 + mon - 1


def _month_name(index: int) -> str:
    return f"{index // 12:04d}-{index % 12 + 1:02d}"


def _epoch_rulebook(seed: int) -> dict[str, Rule]:
    rng = random.Random(f"rulebook:{seed}")
    book = {}
    for defect in DEFECTS:
        below, above = rng.sample(_verdicts(defect), 2)
        book[defect] = Rule(defect, rng.choice(THRESHOLDS), below, above)
    return book


def _edit_rule(rule: Rule, rng: random.Random) -> Rule:
    # The new verdicts are the two the old rule never gave, so every record the rule
    # governs changes its answer: a model that learned the old book is wrong on all of them.
    unused = [v for v in _verdicts(rule.defect) if v not in (rule.below, rule.at_or_above)]
    below, above = rng.sample(unused, 2)
    return Rule(rule.defect, rng.choice(THRESHOLDS), below, above)


def rulebook(month: str, seed: int, rules_changed_per_month: int) -> dict[str, Rule]:
    """The rule book in force in ``month``: the epoch book with every monthly edit applied."""
    book = _epoch_rulebook(seed)
    start = _month_index(EPOCH_MONTH)
    end = _month_index(month)
    if end < start:
        raise DataError(f"month {month} is before the first rule book ({EPOCH_MONTH})")
    for index in range(start + 1, end + 1):
        rng = random.Random(f"edits:{seed}:{_month_name(index)}")
        for defect in rng.sample(DEFECTS, rules_changed_per_month):
            book[defect] = _edit_rule(book[defect], rng)
    return book


def changed_rules(month: str, since: str, seed: int, rules_changed_per_month: int) -> list[str]:
    """Defect types whose rule differs between the book of ``since`` and that of ``month``."""
    new = rulebook(month, seed, rules_changed_per_month)
    old = rulebook(since, seed, rules_changed_per_month)
    return sorted(d for d in DEFECTS if new[d] != old[d])


def render_prompt(board: str, line: str, part: str, temp_c: int, defect: str, measurement: int) -> str:
    return (
        f"inspect board={board} line={line} part={part} temp_c={temp_c} "
        f"defect={defect} {MEASUREMENT_OF[defect]}={measurement} verdict:"
    )


def sample_examples(
    book: dict[str, Rule], n: int, rng: random.Random, changed: set[str] | None = None
) -> list[Example]:
    examples = []
    for i in range(n):
        # Cycle through the defect types so every rule is equally represented in every split.
        defect = DEFECTS[i % len(DEFECTS)]
        measurement = rng.randrange(100)
        prompt = render_prompt(
            board=f"PCB-{rng.randrange(10000):04d}",
            line=f"L{rng.randrange(1, 5)}",
            part=f"{rng.choice('RCUQJ')}{rng.randrange(1, 100)}",
            temp_c=rng.randrange(180, 260),
            defect=defect,
            measurement=measurement,
        )
        examples.append(
            Example(
                prompt=prompt,
                completion=" " + book[defect].verdict(measurement),
                rule=defect,
                changed=None if changed is None else defect in changed,
            )
        )
    rng.shuffle(examples)
    return examples


def split_sizes(cfg: DataConfig) -> dict[str, int]:
    return {"train": cfg.train_size, "val": cfg.val_size, "calib": cfg.calib_size, "test": cfg.test_size}


def write_jsonl(path: Path, examples: list[Example]) -> None:
    with open(path, "w") as fh:
        for ex in examples:
            fh.write(json.dumps(ex.to_json(), sort_keys=True) + "\n")


def generate_month(cfg: DataConfig, base_month: str, out_dir: Path, chat: bool = False) -> Path:
    """Write the four splits, a held-out text and the rule book of ``cfg.month``; with ``chat`` the
    rows are chats of one user turn.

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
    return out_dir


def parse_row(path: Path, lineno: int, line: str) -> Example:
    where = f"{path}:{lineno}"
    try:
        row = json.loads(line)
    except json.JSONDecodeError as err:
        raise DataError(f"{where}: not valid JSON ({err.msg})") from None
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
    if "messages" in row:
        if "prompt" in row or "completion" in row:
            raise DataError(f"{where}: a row has either 'messages' or 'prompt' and 'completion', not both")
        prompt, completion = _parse_messages(where, row["messages"])
    else:
        for key in ("prompt", "completion"):
            if key not in row:
                raise DataError(f"{where}: missing field {key!r} (or give the row as 'messages')")
            if not isinstance(row[key], str) or not row[key].strip():
                raise DataError(f"{where}: field {key!r} must be a non-empty string")
        prompt, completion = row["prompt"], row["completion"]
    rule = row.get("rule")
    if rule is not None and not isinstance(rule, str):
        raise DataError(f"{where}: field 'rule' must be a string")
    changed = row.get("changed")
    if changed is not None and not isinstance(changed, bool):
        raise DataError(f"{where}: field 'changed' must be true or false")
    return Example(prompt, completion, rule, changed)


def _parse_messages(where: str, messages) -> tuple[ChatPrompt, str]:
    """(the prompt, the answer) of a chat row: every message before the last, which is the assistant's."""
    if not isinstance(messages, list) or len(messages) < 2:
        raise DataError(f"{where}: field 'messages' must be a list of at least two messages (a prompt and its answer)")
    for i, message in enumerate(messages):
        if not (isinstance(message, dict) and set(message) == {"role", "content"}):
            raise DataError(f"{where}: messages[{i}] must be an object with exactly 'role' and 'content'")
        if message["role"] not in CHAT_ROLES:
            raise DataError(f"{where}: messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, got {message['role']!r}")
        if not isinstance(message["content"], str) or not message["content"].strip():
            raise DataError(f"{where}: messages[{i}].content must be a non-empty string")
    if messages[-1]["role"] != "assistant":
        raise DataError(f"{where}: the last message must be the assistant's answer, got role {messages[-1]['role']!r}")
    if all(m["role"] == "assistant" for m in messages):
        raise DataError(f"{where}: messages hold no system or user turn to answer")
    return ChatPrompt(tuple(dict(m) for m in messages[:-1])), messages[-1]["content"]


def _read_rows(path: Path) -> list[tuple[int, Example]]:
    path = Path(path)
    if not path.exists():
        raise DataError(f"{path}: split file not found")
    with open(path) as fh:
        rows = [(lineno, parse_row(path, lineno, line)) for lineno, line in enumerate(fh, start=1) if line.strip()]
    if not rows:
        raise DataError(f"{path}: split is empty")
    first_line, first = rows[0]
    for lineno, ex in rows:
        if is_chat(ex) != is_chat(first):
            raise DataError(f"{path}:{lineno}: a {_format_name(ex)} row in a file of {_format_name(first)} rows "
                            f"(line {first_line}); one format per file")
    return rows


def is_chat(ex: Example) -> bool:
    return isinstance(ex.prompt, ChatPrompt)


def _format_name(ex: Example) -> str:
    return "'messages'" if is_chat(ex) else "'prompt'/'completion'"


def read_jsonl(path: Path) -> list[Example]:
    """Read and validate one split; any problem names the file and line."""
    return [ex for _, ex in _read_rows(path)]


def check_month(src_dir: Path, chat_template: bool = True) -> None:
    """Validate every split of a user's month, and that rows are labelled all or none.

    ``changed`` decides what the gates read (accuracy on changed and unchanged rules, or overall
    accuracy): a month where only some rows say whether their rule changed has no meaning for either.
    Chat rows need a tokenizer with a chat template (``chat_template``) to render them.
    """
    first: tuple[Path, int, bool] | None = None
    for split in SPLITS:
        path = Path(src_dir) / f"{split}.jsonl"
        for lineno, ex in _read_rows(path):
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


def read_text_corpus(path: Path) -> list[str]:
    """Plain text for perplexity: one document per non-empty line."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"{path}: text corpus not found")
    lines = [ln.strip() for ln in path.read_text().splitlines() if ln.strip()]
    if not lines:
        raise DataError(f"{path}: text corpus is empty")
    return lines


def import_month(src_dir: Path, out_dir: Path, heldout_text: Path | None = None, chat: bool = False,
                 chat_template: bool = True) -> Path:
    """Validate a user's month folder and copy it into place; nothing is copied on error. With
    ``chat``, prompt/completion rows are written as chats of one user turn; other files are copied
    byte for byte."""
    src_dir = Path(src_dir)
    check_month(src_dir, chat_template)
    if heldout_text is not None:
        read_text_corpus(heldout_text)
    with atomic_output_dir(out_dir) as tmp:
        for split in SPLITS:
            rows = read_jsonl(src_dir / f"{split}.jsonl")
            if chat and not is_chat(rows[0]):
                write_jsonl(tmp / f"{split}.jsonl", [ex.as_chat() for ex in rows])
            else:
                shutil.copyfile(src_dir / f"{split}.jsonl", tmp / f"{split}.jsonl")
        if heldout_text is not None:
            shutil.copyfile(heldout_text, tmp / HELDOUT_TEXT)
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
    if cfg.jsonl_dir is None:
        return generate_month(cfg, base_month, out_dir, chat)
    heldout = Path(cfg.heldout_text) if cfg.heldout_text else None
    return import_month(Path(cfg.jsonl_dir), out_dir, heldout, chat, chat_template)


def run_stage(cfg: ReleaseConfig) -> str:
    template = has_chat_template(cfg.base_model.source, cfg.base_model.path)
    out = prepare_data(cfg.data, cfg.base_model.trained_through, cfg.layout.data_dir, template)
    return f"data for {cfg.data.month} written to {out}"


def main(argv: list[str] | None = None) -> int:
    return stage_main("Write the month's data splits.", run_stage, argv)


if __name__ == "__main__":
    sys.exit(main())
