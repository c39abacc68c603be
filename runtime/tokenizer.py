"""The device's tokenizer: the base model's ``tokenizer.json`` through ``tokenizers`` alone.

The serving path stays free of torch and transformers. Encoding applies the tokenizer's own
post-processor (special tokens included), exactly what ``AutoTokenizer(...)(text)`` does in
``tasks.evaluate``, so the engine sees the token ids the adapter was trained and evaluated on.
The stop token is ``eos_token`` of ``tokenizer_config.json`` beside it.
"""

from __future__ import annotations

import json
from pathlib import Path

from runtime.errors import RefusedInput

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"


class TokenizerError(RefusedInput):
    """A tokenizer the device cannot use; the message names the file."""


def _token_text(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


class DeviceTokenizer:
    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer

        path = Path(path)
        file = path / TOKENIZER_FILE if path.is_dir() else path
        if not file.is_file():
            raise TokenizerError(f"{file}: no tokenizer.json; pass --tokenizer with the base model's directory")
        self.file = file
        self._tok = Tokenizer.from_file(str(file))
        config_file = file.with_name(TOKENIZER_CONFIG)
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        eos = _token_text(config.get("eos_token"))
        self.eos_id = self._tok.token_to_id(eos) if eos else None
        if self.eos_id is None:
            raise TokenizerError(f"{config_file}: no eos_token known to {file.name}; generation could never stop")
        pad = _token_text(config.get("pad_token"))
        pad_id = self._tok.token_to_id(pad) if pad else None
        self.pad_id = self.eos_id if pad_id is None else pad_id

    @property
    def sha256(self) -> str:
        from runtime.package import sha256_file

        return sha256_file(self.file)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)
