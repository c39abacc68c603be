"""Health-gated commit of a new champion, and the device's own revert (Mender's ArtifactCommit and
ArtifactRollback, without a reboot).

With a state directory (``runtime.release.device_state``), every new champion starts on trial:

1. its signed probes (``runtime.release.verify.release_probes``) run on it, greedy, through
   ``AdapterServer.start_generation`` in the server's decode mode, the path clients get (batched with their
   requests, or alone on a fork); each answer must equal the expected one (whitespace-trimmed);
2. then, for ``window_s`` seconds, any request on it that fails with 500 (``adapter_generation_errors_total``)
   fails the check (0: commit as soon as the probes pass);
3. passed: the release is committed (the state's high-water mark rises to it); failed: the device
   makes the previous release (the last committed one, resident on standby or reloaded from its copy
   in the state directory) the champion again, unloads the failed one, and records it as reverted
   with the reason. Requests already running on the failed release finish on it; new ones get the
   previous release from the moment of the swap, so clients see no failed request.

A new champion loaded during a trial ends that trial (the new one starts its own, and the revert
target stays the last committed release). A trial interrupted by a restart runs again at the next
start. The candidate channel's release is recorded too (every write of the state names the candidate
resident then) and resumed on that channel at the next start; a candidate is never on trial. With
nothing to revert to (the first release of a device), a failed check leaves the release serving, with
status ``failed`` in ``/healthz``.

Each product a device serves has a gate of its own (``product``), on that product's state
(``runtime.release.device_state.DeviceState.for_product``): its champion's trial, its revert target, its
high-water mark. Products never revert or block one another.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import threading
import time

from runtime.engine.sampling import greedy
from runtime.release.contract import format_time, release_order
from runtime.release.device_state import CHAMPION_STATES, COMMITTED, FAILED, TRIAL, DeviceState, StateError, newer
from runtime.release.verify import RevertedRelease, release_probes
from runtime.serve.active_release import ActiveRelease
from runtime.serve.residents import CANDIDATE, CHAMPION, ResidencyError
from runtime.serve.server import AdapterServer

log = logging.getLogger(__name__)
DEFAULT_HEALTH_WINDOW_S = 30.0
POLL_S = 0.05  # how often the window looks at the error counter: a failing release is reverted within this


class ReleaseGate:
    """The trial of each new champion on ``server``, recorded in ``state``."""

    def __init__(self, server: AdapterServer, state: DeviceState, window_s: float = DEFAULT_HEALTH_WINDOW_S,
                 decode: str = "batched", product: str | None = None):
        if window_s < 0:
            raise ValueError(f"health window {window_s}: seconds, 0 or more")
        self.server, self.state, self.window_s = server, state, window_s
        self.product = product or server.residents.default_product  # ``state`` is this product's
        self.decode = decode  # the serve's --decode: probes decode as its clients' requests do
        self._lock = threading.RLock()
        self._cancel = threading.Event()
        self._thread: threading.Thread | None = None
        server.gates[self.product] = self
        self._show()

    # ------------------------------------------------------------------ hooks of AdapterServer.load

    def floor(self, champion: ActiveRelease | None) -> str | None:
        """What a new release may not be older than: the champion or the high-water mark, the later."""
        return newer(champion.release_id if champion else None, self.state.floor())

    def admit(self, release_dir, verified) -> None:
        """Refuse a release this device reverted; keep a verified copy of any other in the state directory."""
        record = self.state.reverted(verified.release_id)
        if record is not None:
            raise RevertedRelease(f"release {verified.release_id} was reverted on this device at {record['at']} "
                                  f"({record['reason']}: {record.get('detail', '')}); it is never installed "
                                  "again: a fixed release is a new build")
        self.state.keep(release_dir, verified.release_id, self.server.trusted_keys, self.server.max_bytes)

    def begin(self, release: ActiveRelease) -> None:
        """``release`` has just become the champion: record it and start its trial."""
        with self._lock:
            record = self.state.record
            if release.release_id == record.active and record.status == COMMITTED:
                self.record_candidate()  # the committed release loaded again: nothing to check
                return
            previous = record.active if record.status == COMMITTED else record.previous
            self._write(active=release.release_id, status=TRIAL, previous=previous)
            self._start(release)

    def record_candidate(self) -> None:
        """The candidate channel changed (a load, an unload): record the release it holds now."""
        with self._lock:
            if self.state.record.candidate != self._candidate_id():
                self._write()

    # ------------------------------------------------------------------ start of serve

    def resume(self) -> None:
        """Load the state's active release from its copy (and the previous one, on standby, when the active
        one's trial was cut by a restart, which then runs again), then its candidate on that channel: no
        network and no --package needed."""
        record = self.state.record
        if record.active is None:
            return
        if record.high_water is not None and release_order(record.active) < release_order(record.high_water):
            raise StateError(f"{self.state.path}: active release {record.active} is older than the high-water mark "
                             f"{record.high_water}; the state was altered")
        if record.status == TRIAL and record.previous is not None:
            self.server.load(self.state.copy_path(record.previous), allow_rollback=True, trial=False, product=self.product)
        self.server.load(self.state.copy_path(record.active), allow_rollback=True, trial=False, product=self.product)
        if record.candidate is not None:  # before the trial starts: its commit writes the candidate resident then
            self.server.load(self.state.copy_path(record.candidate), allow_rollback=True, channel=CANDIDATE,
                             product=self.product)
        if record.status == TRIAL:
            with self._lock:
                self._start(self._champion())
        self._show()

    # ------------------------------------------------------------------ the trial

    def _start(self, release: ActiveRelease) -> None:
        self._cancel.set()  # a trial still running is over: its release is no longer the champion
        self._cancel = cancel = threading.Event()
        self._show()
        self._thread = threading.Thread(target=self._trial, args=(release, cancel), daemon=True,
                                        name=f"health-{release.release_id}")
        self._thread.start()

    def wait(self, timeout: float | None = None) -> None:
        """Until the current trial has ended (tests, benchmarks)."""
        if self._thread is not None:
            self._thread.join(timeout)

    def stop(self) -> None:
        """End the trial running, if any; its release stays on trial in the state, and the next start runs it again."""
        self._cancel.set()
        self.wait()

    def _trial(self, release: ActiveRelease, cancel: threading.Event) -> None:
        def errors() -> float:
            return self.server.metrics.value("adapter_generation_errors_total", release_id=release.release_id,
                                             product=release.product)

        errors_before = errors()
        started = time.monotonic()
        try:
            failure = self._probe(release)
        except Exception as err:  # a probe that cannot run is a failed check, not a crash of the device
            log.exception("probe failed to run on %s", release.release_id)
            failure = ("probe_error", f"{type(err).__name__}: {err}")
        deadline = time.monotonic() + self.window_s
        while failure is None:
            failed = errors() - errors_before
            if failed:
                failure = ("generation_errors", f"{int(failed)} request(s) failed (500) on it within the "
                           f"{self.window_s:g} s window")
            elif time.monotonic() >= deadline:
                break
            elif cancel.wait(min(POLL_S, max(deadline - time.monotonic(), 0))):
                return
        with self._lock:
            if cancel.is_set() or self._champion() is not release:
                return  # superseded by a newer champion, which runs its own trial
            seconds = time.monotonic() - started
            if failure is None:
                self._commit(release, seconds)
            else:
                self._revert(release, *failure, seconds)

    def _probe(self, release: ActiveRelease) -> tuple[str, str] | None:
        """(reason, detail) of the first probe that answers otherwise, or None when every one passes."""
        for i, probe in enumerate(release_probes(release.manifest)):
            generation = self.server.start_generation(release, [probe.encode(self.server.tokenizer)],
                                                      probe.max_tokens, greedy, [], self.decode)
            text = asyncio.run(_decoded(generation))  # this thread's own loop, as a request's is the server's
            if text.strip() != probe.expected.strip():
                return "probe_mismatch", f"probe {i} ({probe.shown[:60]!r}): expected {probe.expected!r}, got {text!r}"
        return None

    def _commit(self, release: ActiveRelease, seconds: float) -> None:
        record = self.state.record
        check = self._check(release, COMMITTED, None, f"{len(release_probes(release.manifest))} probe(s) passed, no "
                            f"failed request in {self.window_s:g} s")
        self._write(status=COMMITTED, high_water=newer(record.high_water, release.release_id), last_check=check)
        self.server.metrics.commits.inc()
        self._show()
        log.info("release committed", extra={"fields": {"event": "release_committed", "release_id": release.release_id,
                                                         "seconds": round(seconds, 3)}})

    def _revert(self, release: ActiveRelease, reason: str, detail: str, seconds: float) -> None:
        record = self.state.record
        if record.previous is None:
            self._write(status=FAILED, last_check=self._check(release, FAILED, reason, detail))
            self._show()
            log.error("release failed its health check, nothing to revert to", extra={"fields": {
                "event": "release_check_failed", "release_id": release.release_id, "reason": reason, "detail": detail}})
            return
        previous = self.server.residents.find(record.previous)
        if previous is not None and previous.release_id == record.previous:
            self.server.residents.add(previous, CHAMPION, allow_rollback=True)  # resident on standby: a channel flip
        else:  # unloaded meanwhile: from its verified copy
            self.server.load(self.state.copy_path(record.previous), allow_rollback=True, trial=False, product=self.product)
        try:
            self.server.residents.remove(release.release_id)  # requests running on it finish on it
        except ResidencyError:
            pass  # already unloaded
        check = self._check(release, "reverted", reason, detail)
        self._write(active=record.previous, status=COMMITTED, previous=None, last_check=check,
                    reverted=record.reverted | {release.release_id: {k: check[k] for k in ("reason", "detail", "at")}})
        self.server.metrics.reverts.labels(reason).inc()
        self._show()
        log.warning("release reverted", extra={"fields": {
            "event": "release_reverted", "release_id": release.release_id, "reverted_to": record.previous,
            "reason": reason, "detail": detail, "seconds": round(seconds, 3)}})

    # ------------------------------------------------------------------ reporting

    def _check(self, release: ActiveRelease, result: str, reason: str | None, detail: str) -> dict:
        return {"release_id": release.release_id, "result": result, "reason": reason, "detail": detail,
                "at": format_time(dt.datetime.now(dt.timezone.utc))}

    def _write(self, **changes) -> None:
        """Write ``changes`` to the state with the candidate resident now, keeping every resident release's copy."""
        self.state.write(candidate=self._candidate_id(), keep={r.release_id for r, _ in self.server.residents.listing()},
                         **changes)

    def _champion(self) -> ActiveRelease | None:
        return self.server.residents.holder(CHAMPION, self.product)

    def _candidate_id(self) -> str | None:
        candidate = self.server.residents.holder(CANDIDATE, self.product)
        return candidate.release_id if candidate else None

    def _show(self) -> None:
        status = self.state.record.status or "none"
        for state in CHAMPION_STATES:
            self.server.metrics.champion_state.labels(state, self.product).set(1 if state == status else 0)

    def summary(self) -> dict:
        """What ``/healthz`` says of the product's device state."""
        record = self.state.record
        return {"product": self.product, "state": record.status or "none", "release_id": record.active,
                "previous": record.previous,
                "candidate": record.candidate,
                "high_water": record.high_water, "health_window_s": self.window_s, "last_check": record.last_check,
                "reverted": sorted(record.reverted), "state_dir": str(self.state.directory)}


async def _decoded(generation) -> str:
    """The whole text of a one-prompt generation, decoded as a request's is (batched with the others on its
    release, or on its own fork)."""
    try:
        while await generation.next_choices() is not None:
            pass
    finally:
        generation.close()
    return generation.texts[0].text
