"""The OpenAI wire format the device speaks: request models, response and chunk bodies, the error object.

The request models mirror OpenAI's ``/v1/completions`` and ``/v1/chat/completions`` field for field,
for the fields the device honours; any other field is an error (400 naming it), never silently
ignored, so a client asking for ``n: 2`` or ``logprobs`` learns it does not get them. Defaults are
OpenAI's: ``max_tokens`` 16 for completions, ``temperature`` 1 and ``top_p`` 1 (sampling;
``temperature: 0`` is greedy). Values are checked here, before a request reaches the engine, so a
value the sampler or the decode loop cannot take is the client's 400, never a 500 counted against
the release: numbers and booleans are strict (``"16"``, ``true`` or ``16.5`` for ``max_tokens`` are
errors, not coerced), ``seed`` is 0 to 2**63 - 1 (the non-negative part of OpenAI's int64 range:
numpy's generator takes no negative seed), and a stop sequence is at most ``MAX_STOP_CHARS``
characters (each decode step tests every prefix of every stop sequence against the text's end).
"""

from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError, field_validator

OWNED_BY = "adapter-release"
MAX_STOP_SEQUENCES = 4  # OpenAI's limit
MAX_STOP_CHARS = 256  # per stop sequence: a step's cost grows with its square (runtime.serve.generation.ChoiceText)
MAX_SEED = 2**63 - 1
MAX_PROMPTS = 16  # prompts of one request: decoded as one batch, in one generation slot


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    include_usage: StrictBool = False


class OpenAIRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    # a product, <product>:candidate, a release id, a month or a channel name; none: the champion or the canary
    model: StrictStr | None = None
    max_tokens: StrictInt | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2, strict=True)  # strict: an int is a float still, a bool or str is not
    top_p: float = Field(1.0, gt=0, le=1, strict=True)
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: StrictInt = Field(1, ge=1, le=1)  # one choice per prompt
    user: StrictStr | None = None

    @field_validator("seed")
    @classmethod
    def _seed_in_range(cls, value):
        if value is not None and not 0 <= value <= MAX_SEED:
            raise ValueError(f"seed must be an integer from 0 to {MAX_SEED}, got {value}")
        return value

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value):
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > MAX_STOP_SEQUENCES or any(not 0 < len(s) <= MAX_STOP_CHARS for s in stops):
            raise ValueError(f"up to {MAX_STOP_SEQUENCES} stop sequences of 1 to {MAX_STOP_CHARS} characters")
        return stops

    @property
    def stops(self) -> list[str]:
        return list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(OpenAIRequest):
    prompt: StrictStr | list[StrictStr]
    max_tokens: StrictInt | None = Field(16, ge=1)

    @field_validator("prompt")
    @classmethod
    def _prompts_not_empty(cls, value):
        prompts = [value] if isinstance(value, str) else value
        if not prompts or len(prompts) > MAX_PROMPTS or any(not p for p in prompts):
            raise ValueError(f"one non-empty string or a list of 1 to {MAX_PROMPTS} of them")
        return value

    @property
    def prompts(self) -> list[str]:
        return [self.prompt] if isinstance(self.prompt, str) else list(self.prompt)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: StrictStr
    name: StrictStr | None = None


class ChatCompletionRequest(OpenAIRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)  # OpenAI's newer name for max_tokens

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class APIError(Exception):
    """An answer other than 2xx, as OpenAI's error object."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def parse_request(model: type[BaseModel], data) -> BaseModel:
    """The request model of ``data``, or APIError(400) naming the first bad field (all of them in the message)."""
    try:
        return model.model_validate(data)
    except ValidationError as err:
        problems = err.errors()
        first = ".".join(str(p) for p in problems[0]["loc"]) or None
        message = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in problems)
        raise APIError(400, message, param=first, code="invalid_value") from None


def new_id(kind: str) -> str:
    return f"{kind}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_body(request_id: str, model: str, choices: list[dict], use: dict, chat: bool) -> dict:
    """A whole response. ``choices``: {"index", "text", "finish_reason"} per prompt."""
    if chat:
        choices = [{"index": c["index"], "message": {"role": "assistant", "content": c["text"]},
                    "finish_reason": c["finish_reason"], "logprobs": None} for c in choices]
    else:
        choices = [c | {"logprobs": None} for c in choices]
    return {"id": request_id, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": choices, "usage": use}


def chunk_body(request_id: str, model: str, index: int, text: str, finish_reason: str | None, chat: bool,
               first: bool = False) -> dict:
    """One server-sent event's data: a piece of one choice's text, its finish_reason on its last chunk."""
    if chat:
        delta = ({"role": "assistant"} if first else {}) | ({"content": text} if text or not finish_reason else {})
        choice = {"index": index, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
    else:
        choice = {"index": index, "text": text, "finish_reason": finish_reason, "logprobs": None}
    return {"id": request_id, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": [choice]}


def usage_chunk(request_id: str, model: str, use: dict, chat: bool) -> dict:
    """The last chunk when ``stream_options.include_usage``: no choices, the request's usage."""
    return {"id": request_id, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": [], "usage": use}


def model_card(release_id: str, month: str, created: int) -> dict:
    return {"id": release_id, "object": "model", "created": created, "owned_by": OWNED_BY, "month": month}
