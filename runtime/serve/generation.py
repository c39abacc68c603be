"""One request's generation as the HTTP side reads it: each choice's text, its stops, its finish.

A request (one prompt or a list) is a ``Generation``: per step its rows' new tokens go in
(``accept``), the choices whose text changed come out. Two ways to drive it, picked by
``ServeSettings.decode``:

* ``ForkedGeneration`` (``fork``): the request decodes alone on its own fork of its release's
  engine handle, one ``runtime.engine.generate.decode_steps`` step per ``next_choices()``, each in a
  worker thread.
* ``runtime.serve.batcher.BatchedGeneration`` (``batched``): the device's scheduler thread decodes it
  together with every other request on the same release and hands it each step's choices.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import anyio.to_thread


class StopText:
    """One choice's text as its tokens arrive: the part that may be sent now, and the stop sequences.

    Text that could still turn into a stop sequence (a suffix that is a prefix of one), or that ends
    in part of a UTF-8 character (decoded as U+FFFD), is held back until the next token decides it.

    Decoding is incremental, as text-generation-inference's and vLLM's detokenizers do: each token
    decodes only the ids from ``_prefix`` on (those before ``_read`` are context, e.g. a SentencePiece
    word's leading space, and are decoded again to subtract their text); the new text is committed
    once it no longer ends in U+FFFD. Stop sequences are searched only where a new match can start.
    So the 1000th token costs what the first does, and ``text`` is what decoding every id at once gives."""

    def __init__(self, tokenizer, stops: list[str]):
        self.tokenizer, self.stops = tokenizer, stops
        self.longest_stop = max((len(s) for s in stops), default=0)
        self.ids: list[int] = []
        self.text, self.sent, self.stopped = "", 0, False
        self._committed = ""  # the text of ids[:_read]: no later token can change it
        self._prefix = self._read = 0

    def push(self, token: int) -> str:
        self.ids.append(token)
        searched = len(self._committed)  # the text before it was searched last time and has not changed
        window = self.tokenizer.decode(self.ids[self._prefix :])
        context = self.tokenizer.decode(self.ids[self._prefix : self._read]) if self._read > self._prefix else ""
        tail = window[len(context) :]
        if len(window) > len(context) and not window.endswith("\ufffd"):
            self._committed += tail
            self._prefix, self._read, tail = self._read, len(self.ids), ""
        self.text = self._committed + tail
        start = max(0, searched - self.longest_stop + 1)  # a new match ends in the new text
        hits = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        if hits:
            self.text, self.stopped = self.text[: min(hits)], True
            return self.finish()
        hold = max((k for s in self.stops for k in range(1, len(s)) if self.text.endswith(s[:k])), default=0)
        hold = max(hold, len(self.text) - len(self.text.rstrip("\ufffd")))
        return self._send_to(len(self.text) - hold)

    def finish(self) -> str:
        return self._send_to(len(self.text))

    def _send_to(self, end: int) -> str:
        piece, self.sent = self.text[self.sent : max(end, self.sent)], max(end, self.sent)
        return piece


@dataclass
class Choice:
    index: int
    text: str  # the new text of this step
    finish_reason: str | None  # "stop" (a stop token or sequence), "length" (max_tokens), None: not finished


class Generation:
    """A request's choices on its release (``release``: the ``runtime.serve.active_release.ActiveRelease`` it read
    once, when it started). ``next_choices()`` (async) gives the choices that changed in the next
    step, None once every choice has finished; ``close()`` ends the decode (a client that left)."""

    def __init__(self, release, texts: list[StopText], max_tokens: int):
        self.release, self.texts, self.max_tokens = release, texts, max_tokens
        self.finished = [False] * len(texts)
        self.completion_tokens = 0

    def accept(self, tokens: dict[int, int | None]) -> list[Choice]:
        """One step's new token per unfinished choice index (None: its stop token); the choices
        that changed (maybe none: text held back)."""
        out = []
        for i, token in tokens.items():
            text = self.texts[i]
            if token is None:  # its stop token (a row at max_tokens has finished already)
                out.append(self._finish(i, text.finish(), "stop"))
                continue
            self.completion_tokens += 1
            piece = text.push(token)
            if text.stopped:
                out.append(self._finish(i, piece, "stop"))
            elif len(text.ids) >= self.max_tokens:
                out.append(self._finish(i, piece + text.finish(), "length"))
            elif piece:
                out.append(Choice(i, piece, None))
        return out

    def _finish(self, i: int, piece: str, reason: str) -> Choice:
        self.finished[i] = True
        return Choice(i, piece, reason)

    async def next_choices(self) -> list[Choice] | None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class ForkedGeneration(Generation):
    """Decoded alone, on its own fork of the release's handle (``steps``: ``decode_steps`` on it);
    each step blocks, so ``next_choices`` runs it in a worker thread."""

    def __init__(self, release, steps: Iterator[list[int | None]], texts: list[StopText], max_tokens: int):
        super().__init__(release, texts, max_tokens)
        self.steps = steps

    def step(self) -> list[Choice] | None:
        if all(self.finished):
            return None
        tokens = next(self.steps, None)
        out = self.accept({i: None if tokens is None else tokens[i] for i, done in enumerate(self.finished) if not done})
        if all(self.finished):
            self.steps.close()  # a choice cut by a stop sequence ends the decode early
        return out

    async def next_choices(self) -> list[Choice] | None:
        return await anyio.to_thread.run_sync(self.step)

    def close(self) -> None:
        self.steps.close()
