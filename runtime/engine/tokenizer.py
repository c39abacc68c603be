"""The device's tokenizer: the base model's ``tokenizer.json`` through ``tokenizers`` alone.

The serving path stays free of torch and transformers. One special-token policy holds everywhere
(training, PyTorch evaluation, the compiled engine, the device server): a prompt is encoded with
the tokenizer's own special tokens, i.e. what the ``tokenizer.json`` post-processor adds (a Llama
BOS, nothing for the embedded default); a completion is encoded without them and ends with eos.
``DeviceTokenizer.encode`` is that prompt encoding on the device, ``encode_prompt`` the same on a
transformers tokenizer (``tasks.models.load_tokenizer`` refuses a directory where they differ).

A chat is rendered with the tokenizer's own chat template (``chat_template`` of
``tokenizer_config.json``, or ``chat_template.jinja`` beside it), as transformers renders it: a
sandboxed jinja2 environment, the generation prompt added; the rendered text holds its special
tokens already, so it is encoded without the post-processor's. ``DeviceTokenizer.encode_chat`` is the
one rendering: the device's ``/v1/chat/completions`` calls it, and so do training and evaluation
(``encode_prompt`` of a ``ChatPrompt`` on a tokenizer from ``tasks.models.load_tokenizer``), so the
device answers the token ids evaluation scored.

Generation stops at any of ``stop_ids``: ``eos_token`` of ``tokenizer_config.json``, then every
``eos_token_id`` of ``generation_config.json`` (Llama 3 lists several), all beside ``tokenizer.json``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from runtime.engine.errors import RefusedInput
from runtime.engine.hashing import sha256_file

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
GENERATION_CONFIG = "generation_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"


class TokenizerError(RefusedInput):
    """A tokenizer the device cannot use; the message names the file."""


class NoChatTemplate(TokenizerError):
    """A chat asked of a tokenizer that has no chat template."""


def _token_text(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


@dataclass(frozen=True)
class ChatPrompt:
    """The messages before the answer of a chat row: ``({"role": ..., "content": ...}, ...)``."""

    messages: tuple[dict, ...]


def encode_prompt(tokenizer, prompt: str | ChatPrompt) -> list[int]:
    """A prompt's ids from a transformers tokenizer: a text with its special tokens, what
    ``DeviceTokenizer.encode`` gives; a chat through the device's own ``encode_chat``, which
    ``tasks.models.load_tokenizer`` attaches as ``tokenizer.device_tokenizer``."""
    if isinstance(prompt, ChatPrompt):
        return tokenizer.device_tokenizer.encode_chat(list(prompt.messages))
    return list(tokenizer(prompt, add_special_tokens=True)["input_ids"])


def _read_json(file: Path) -> dict:
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise TokenizerError(f"{file}: not valid JSON ({err.msg})") from None


def until_stop(ids: list[int], stop_ids) -> list[int]:
    """``ids`` up to, not including, the first stop id: what ``runtime.engine.generate.greedy_generate`` returns."""
    stop = set(stop_ids)
    return ids[: next((i for i, t in enumerate(ids) if t in stop), len(ids))]


def _generation_eos_ids(file: Path, vocab_size: int) -> list[int]:
    """``eos_token_id`` of generation_config.json (an int or a list of ints); [] without the file or key."""
    if not file.is_file():
        return []
    value = _read_json(file).get("eos_token_id")
    ids = [] if value is None else value if isinstance(value, list) else [value]
    bad = [i for i in ids if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < vocab_size]
    if bad:
        raise TokenizerError(f"{file}: eos_token_id {value!r} is not a token id (an int, or a list of ints, "
                             f"below the vocabulary size {vocab_size})")
    return ids


def _chat_template(config: dict, jinja_file: Path) -> str | None:
    """The default chat template: a string, or the entry named "default" of a list of named ones."""
    value = config.get("chat_template")
    if isinstance(value, list):
        value = next((t.get("template") for t in value if isinstance(t, dict) and t.get("name") == "default"), None)
    if value is None and jinja_file.is_file():
        value = jinja_file.read_text()
    return value if isinstance(value, str) and value else None


class DeviceTokenizer:
    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer

        path = Path(path)
        file = path / TOKENIZER_FILE if path.is_dir() else path
        if not file.is_file():
            raise TokenizerError(f"{file}: no tokenizer.json; pass --tokenizer with the base model's directory")
        self.file = file
        try:
            self._tok = Tokenizer.from_file(str(file))
        except Exception as err:  # tokenizers raises a bare Exception for any unreadable file
            raise TokenizerError(f"{file}: not a tokenizers file ({err})") from None
        config_file = file.with_name(TOKENIZER_CONFIG)
        config = _read_json(config_file) if config_file.is_file() else {}
        eos = _token_text(config.get("eos_token"))
        self.eos_id = self._tok.token_to_id(eos) if eos else None
        if self.eos_id is None:
            problem = f"eos_token {eos!r} is not a token of {file.name}" if eos else "no eos_token"
            raise TokenizerError(f"{config_file}: {problem}; generation could never stop")
        extra = _generation_eos_ids(file.with_name(GENERATION_CONFIG), self._tok.get_vocab_size(with_added_tokens=True))
        self.stop_ids = tuple(dict.fromkeys([self.eos_id, *extra]))  # the tokenizer's eos first, no repeats
        pad = _token_text(config.get("pad_token"))
        pad_id = self._tok.token_to_id(pad) if pad else None
        self.pad_id = self.eos_id if pad_id is None else pad_id
        self.special_tokens = {key: _token_text(config.get(key)) for key in ("bos_token", "eos_token")}
        self.chat_template = _chat_template(config, file.with_name(CHAT_TEMPLATE_FILE))

    @property
    def sha256(self) -> str:
        return sha256_file(self.file)

    def encode(self, text: str) -> list[int]:
        """A prompt's ids, the post-processor's special tokens included (see the module docstring)."""
        return self._tok.encode(text).ids

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """A chat's ids: the chat template rendered with the generation prompt, then encoded as is."""
        if self.chat_template is None:
            raise NoChatTemplate(f"{self.file.parent}: the tokenizer has no chat template "
                                 f"(chat_template in {TOKENIZER_CONFIG} or {CHAT_TEMPLATE_FILE}); use /v1/completions")
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment  # as transformers renders templates

        def raise_exception(message):
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = raise_exception
        text = env.from_string(self.chat_template).render(messages=messages, add_generation_prompt=True,
                                                         **self.special_tokens)
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)
