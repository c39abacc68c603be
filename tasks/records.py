"""The row format every split shares, and its JSONL and text readers.

A row is ``{"prompt": ..., "completion": ...}`` or, the OpenAI fine-tuning format as TRL reads it,
``{"messages": [{"role": "system" | "user" | "assistant", "content": ...}, ...]}`` ending with the
assistant's answer (one format per file). A chat row's prompt is every message before that answer,
rendered by the base model's chat template (``runtime.engine.tokenizer.ChatPrompt``). An optional
``rule`` field enables the per-rule table; an optional ``changed`` field says whether the row's rule
changed this month. Every reader names the file and line of what it refuses.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from runtime.engine.tokenizer import ChatPrompt
from tasks.config import StageError

SPLITS = ("train", "val", "calib", "test")


HELDOUT_TEXT = "heldout.txt"
REHEARSAL_TEXT = "rehearsal.txt"  # the data stage's copy of data.rehearsal_text


CHAT_ROLES = ("system", "user", "assistant")


class DataError(StageError, ValueError):
    """Bad input data; the message names the file and line."""


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


def write_jsonl(path: Path, examples: list[Example]) -> None:
    with open(path, "w") as fh:
        for ex in examples:
            fh.write(json.dumps(ex.to_json(), sort_keys=True) + "\n")


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


def read_numbered_rows(path: Path) -> list[tuple[int, Example]]:
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
    return [ex for _, ex in read_numbered_rows(path)]


def read_numbered_text(path: Path) -> list[tuple[int, str]]:
    """A plain-text corpus: (line number, document) for each non-empty line, stripped."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"{path}: text corpus not found")
    lines = [(n, ln.strip()) for n, ln in enumerate(path.read_text().splitlines(), start=1) if ln.strip()]
    if not lines:
        raise DataError(f"{path}: text corpus is empty")
    return lines


def read_text_corpus(path: Path) -> list[str]:
    """Plain text for perplexity: one document per non-empty line."""
    return [text for _, text in read_numbered_text(path)]


def heldout_corpus(data_dir: Path) -> tuple[Path, list[str]]:
    """The file held-out perplexity is scored on (the evaluate stage's, the forgetting gate's) and its documents:
    the month's ``heldout.txt``, or without one the val rows as text."""
    heldout = Path(data_dir) / HELDOUT_TEXT
    if heldout.exists():
        return heldout, read_text_corpus(heldout)
    val = Path(data_dir) / "val.jsonl"
    return val, [ex.text for ex in read_jsonl(val)]


def heldout_overlaps(documents: list[str], heldout: list[str]) -> list[tuple[int, str]]:
    """(index of a document, held-out text) for each held-out text found whole inside a document, runs of
    whitespace read as one space: what must never be trained on."""
    held = [" ".join(text.split()) for text in heldout]
    flat = (" ".join(doc.split()) for doc in documents)
    return [(i, text) for i, doc in enumerate(flat) for text in held if text in doc]
