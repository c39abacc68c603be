"""The device's releases and generation: verify and swap releases into one engine without a restart.

The engine (one ONNX Runtime session) is opened once. Each verified release becomes an
immutable ``ActiveRelease``: its own engine handle (``OrtEngine.fork``) with the release's LoRA
inputs and KV scales bound, plus its manifest. Several stay resident at once (``runtime.residents``:
the ``champion``, a ``candidate``, and standby releases up to ``max_resident``, least recently used
unloaded first). A generation gets its release once, when it starts (``AdapterServer.start_generation``),
and forks that release's handle, so it runs every step, prefill to last token, on that release; a
load, promotion or unload only changes which releases new requests can get (under a lock, after
verification and binding are done), while requests in flight finish on theirs. A release that fails
verification raises its ``PackageError`` (``reason``, ``exit_code``); the resident ones keep serving.

Watch mode polls a directory for release directories or tarballs and loads as champion any verified
one newer than the champion (never a rollback). Publish into it atomically (write elsewhere,
then rename), or a half-copied release is refused until its next change.

The HTTP side is ``runtime.http_app`` (routes) and ``runtime.http_server`` (uvicorn).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from runtime.contract import MANIFEST
from runtime.generate import decode_steps
from runtime.metrics import ServerMetrics
from runtime.package import (
    DEFAULT_MAX_PACKAGE_BYTES,
    PackageError,
    RollbackRefused,
    bind_release,
    unpacked_release,
    verify_release,
)
from runtime.residents import CANDIDATE, CHAMPION, DEFAULT_MAX_RESIDENT, ResidentSet

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ActiveRelease:
    release_id: str
    activation: int  # 1 for the first release loaded, +1 per load (either channel)
    manifest: dict
    handle: object  # an engine handle with this release bound; forked per request, never rebound
    loaded_at: float


class AdapterServer:
    """The engine, the tokenizer, the trusted keys and the resident releases; thread-safe."""

    def __init__(self, engine, tokenizer, trusted_keys: dict, max_bytes: int = DEFAULT_MAX_PACKAGE_BYTES,
                 max_resident: int = DEFAULT_MAX_RESIDENT):
        if not hasattr(engine, "fork"):
            raise ValueError(f"{type(engine).__name__} cannot be shared between requests; serve runs the onnxruntime backend")
        self.engine, self.tokenizer, self.trusted_keys, self.max_bytes = engine, tokenizer, trusted_keys, max_bytes
        self.residents = ResidentSet(max_resident)
        self.metrics = ServerMetrics(self.residents.listing)
        self._loads = 0
        self._load_lock = threading.Lock()

    @property
    def active(self) -> ActiveRelease | None:
        """The champion: what a request that names no model gets."""
        return self.residents.champion

    def load(self, path: str | Path, allow_rollback: bool = False, channel: str = CHAMPION) -> dict:
        """Verify the release at ``path``, bind it to a new handle, make it resident on ``channel``
        (never older than the champion, unless ``allow_rollback``); raise PackageError or ResidencyError."""
        start = time.perf_counter()
        champion = self.residents.champion
        try:
            with unpacked_release(path, self.max_bytes) as d:
                verified = verify_release(
                    d, self.trusted_keys, self.engine.interface,
                    active_release=champion.release_id if champion else None, allow_rollback=allow_rollback,
                    max_bytes=self.max_bytes, tokenizer_sha256=self.tokenizer.sha256,
                    stop_token_ids=self.tokenizer.stop_ids,
                )
            handle = self.engine.fork()
            bind_release(handle, verified)  # the arrays are copied into ORT values: the files may go
            flip = time.perf_counter()
            with self._load_lock:
                previous = self.residents.candidate if channel == CANDIDATE else self.residents.champion
                release = ActiveRelease(verified.release_id, self._loads + 1, verified.manifest, handle, time.time())
                try:  # the order is checked again: another load may have won while this one verified
                    unloaded = self.residents.add(release, channel, allow_rollback)
                except RollbackRefused as err:
                    raise RollbackRefused(f"{path}: {err}") from None
                self._loads += 1
                done = time.perf_counter()
            self.metrics.loaded(done - start)
            self.metrics.unloads.labels("lru").inc(len(unloaded))
        except PackageError as err:
            self.metrics.refusals.labels(err.reason).inc()
            raise
        swap_ms, activate_ms = (done - start) * 1e3, (done - flip) * 1e3
        log.info("%s %s (activation %d) in %.1f ms", channel, verified.release_id, release.activation, swap_ms)
        return {"release_id": verified.release_id, "channel": channel, "activation": release.activation,
                "previous": previous.release_id if previous else None, "unloaded": [r.release_id for r in unloaded],
                "resident": self.resident_summary(),
                "swap_ms": round(swap_ms, 3), "activate_ms": round(activate_ms, 4), "checks": verified.checks}

    def promote(self) -> dict:
        """The candidate becomes the champion; the champion stays resident on standby. Raise ResidencyError
        without a candidate."""
        champion, previous = self.residents.promote()
        self.metrics.promotions.inc()
        log.info("promoted %s to champion (was %s)", champion.release_id, previous.release_id)
        return {"champion": champion.release_id, "previous": previous.release_id, "resident": self.resident_summary()}

    def unload(self, model: str) -> dict:
        """Forget the resident release ``model`` names (not the champion); requests running on it finish."""
        release = self.residents.remove(model)
        self.metrics.unloads.labels("admin").inc()
        log.info("unloaded %s", release.release_id)
        return {"unloaded": release.release_id, "resident": self.resident_summary()}

    def resident_summary(self) -> list[dict]:
        return [{"release_id": r.release_id, "channel": channel} for r, channel in self.residents.listing()]

    def start_generation(self, release: ActiveRelease, prompts: list[list[int]], max_tokens: int, sample,
                         stops: list[str]) -> "Generation":
        """A generation of ``prompts`` (token ids) on ``release`` (read once from ``active`` when the
        request started), for every step of it: its handle is forked here, so a swap cannot reach it."""
        self.metrics.by_release.labels(release.release_id, self.residents.channel_of(release)).inc()
        steps = decode_steps(release.handle.fork(), prompts, max_tokens, self.tokenizer.stop_ids,
                             self.tokenizer.pad_id, sample)
        return Generation(release, steps, [StopText(self.tokenizer, stops) for _ in prompts], max_tokens)

    def health(self) -> dict:
        """The champion (id, activation, month, expiry) at the top level, the candidate's the same under
        ``candidate`` (None without one), and the number of resident releases."""
        champion, candidate = self.residents.champion, self.residents.candidate
        return {"status": "ok" if champion else "no_release", **release_card(champion),
                "candidate": release_card(candidate) if candidate else None,
                "resident": len(self.residents.listing()), "weights": self.engine.interface.weight_precision}


def release_card(release: ActiveRelease | None) -> dict:
    """What health checks say of a release: the fields of ``release_id``, ``activation``, ``month``, ``expires_at``."""
    if release is None:
        return {"release_id": None, "activation": 0, "month": None, "expires_at": None}
    return {"release_id": release.release_id, "activation": release.activation, "month": release.manifest["month"],
            "expires_at": release.manifest["expires_at"]}


class StopText:
    """One choice's text as its tokens arrive: the part that may be sent now, and the stop sequences.

    Text that could still turn into a stop sequence (a suffix that is a prefix of one), or that ends
    in part of a UTF-8 character (decoded as U+FFFD), is held back until the next token decides it."""

    def __init__(self, tokenizer, stops: list[str]):
        self.tokenizer, self.stops = tokenizer, stops
        self.ids: list[int] = []
        self.text, self.sent, self.stopped = "", 0, False

    def push(self, token: int) -> str:
        self.ids.append(token)
        self.text = self.tokenizer.decode(self.ids)
        hits = [i for i in (self.text.find(s) for s in self.stops) if i >= 0]
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
    """A request's decode on its release, one step per ``step()`` call (blocking: run it in a worker
    thread). The decode loop is ``decode_steps``; a batching scheduler would drive the same choices."""

    def __init__(self, release: ActiveRelease, steps: Iterator[list[int | None]], texts: list[StopText], max_tokens: int):
        self.release, self.steps, self.texts, self.max_tokens = release, steps, texts, max_tokens
        self.finished = [False] * len(texts)
        self.completion_tokens = 0

    def step(self) -> list[Choice] | None:
        """The choices that changed in one decode step (maybe none: text held back); None once every
        choice has finished."""
        if all(self.finished):
            return None
        tokens = next(self.steps, None)
        out = []
        for i, text in enumerate(self.texts):
            if self.finished[i]:
                continue
            token = None if tokens is None else tokens[i]
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
        if all(self.finished):
            self.steps.close()  # a choice cut by a stop sequence ends the decode early
        return out

    def _finish(self, i: int, piece: str, reason: str) -> Choice:
        self.finished[i] = True
        return Choice(i, piece, reason)

    def close(self) -> None:
        self.steps.close()


class Watcher(threading.Thread):
    """Polls ``directory`` and loads as champion any verified release newer than the champion."""

    def __init__(self, app: AdapterServer, directory: Path, interval: float = 2.0):
        super().__init__(daemon=True, name="release-watcher")
        self.app, self.directory, self.interval = app, Path(directory), interval
        self.seen: dict[str, tuple] = {}  # path -> (mtime_ns, size) last tried
        self.stop = threading.Event()

    def candidates(self) -> list[Path]:
        if not self.directory.is_dir():
            return []
        out = []
        for entry in sorted(self.directory.iterdir()):
            if entry.name.startswith("."):
                continue  # being written (publish by rename)
            if (entry.is_dir() and (entry / MANIFEST).is_file()) or entry.name.endswith((".tar.gz", ".tgz")):
                st = entry.stat()
                key = (st.st_mtime_ns, st.st_size)
                if self.seen.get(str(entry)) != key:
                    out.append(entry)
                    self.seen[str(entry)] = key
        return out

    def poll_once(self) -> list[dict]:
        results = []
        for path in self.candidates():
            try:
                results.append(self.app.load(path, allow_rollback=False, channel=CHAMPION) | {"path": str(path)})
            except PackageError as err:
                log.warning("watch: refused %s: %s", path, err)
                results.append({"path": str(path), "refused": err.reason, "error": str(err)})
        return results

    def run(self):
        while not self.stop.wait(self.interval):
            self.poll_once()
