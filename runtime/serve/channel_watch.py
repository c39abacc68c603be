"""A serving device that follows the update channel through python-tuf's ngclient (``serve --tuf-url``).

Every ``interval`` seconds (``--tuf-interval``, device config ``tuf_interval``; 300 by default) a poll,
on a thread of its own while requests are served:

1. refreshes the TUF metadata from the device's trusted root (``runtime.release.tuf_pull.refreshed``: the root
   chain, then timestamp, snapshot and targets, with their signatures, thresholds, versions, lengths,
   hashes and expiry checked; nothing older than what ``--metadata-dir`` saw before);
2. reads the signed ``channels.json`` (``signed_channels``);
3. when it names a champion newer than the one serving here (by its target's signed custom field
   ``release_id``), not reverted on this device and not below the state's high-water mark, downloads
   its tarball (length and sha256 as signed) and loads it as champion with ``AdapterServer.load``, the
   path of the directory watch and the admin API: ``verify_release`` unchanged (told the month the target
   was named by, which the signed manifest must say: ``month_mismatch``), the rollback rules,
   and with ``--state-dir`` the health-gated commit of ``runtime.serve.health`` (probes, window, revert);
4. likewise loads as candidate the month ``candidate`` names when it is newer than the champion and
   than the candidate resident here (the publish step names the newest month published there). A
   candidate gets the requests that name it and the canary share; it becomes champion when the
   channel names it so (or through the admin API).

A champion the channel names that is older than what this device runs, or than its high-water mark,
is never installed: a rollback is a local act (``python -m runtime rollback``), never one the
network can ask for.

**Freshness.** The outcome of the last poll is the channel's state, shown in ``/healthz`` and ``/ready``
(``update_channel``: ``state``, ``reason``, ``detail``, ``last_success``, ``url``, ...), in ``/metrics``
(``adapter_update_channel_fresh``, ``adapter_update_channel_last_success_timestamp_seconds``,
``adapter_update_channel_refusals_total{reason}``) and, once per change of state or reason, in a JSON
log line (``"event": "update_channel"``; a warning unless fresh):

- ``fresh``: the metadata was refreshed, and the device runs (or has just loaded) what it names;
- ``stale``: no fresh metadata: ngclient refused the refresh (``stale_metadata``: an expired
  timestamp, a frozen channel; ``unreachable``; ``untrusted_metadata``: a wrong or revoked key;
  ``metadata_rollback``; ``too_large``; ``hash_mismatch``: metadata of another snapshot; see
  ``runtime.release.tuf_pull.EXIT_CODES``), or no poll has finished yet (``not_checked``);
- ``refused``: the metadata is fresh, but what it names was refused: the target's bytes
  (``hash_mismatch``, ``too_large``), the release itself (a ``runtime.release.verify`` reason), a release
  this device ``reverted``, or one older than it runs (``rollback``).

Nothing is installed from metadata ngclient did not verify as fresh: a stale channel leaves every
resident release serving as it was. ``/ready`` stays 200 while a champion serves, whatever the
channel's state: the device still answers correctly with the release it verified, and a load
balancer that took it out would turn an update outage into a serving outage. Alert on
``adapter_update_channel_fresh`` and on the age of its last success instead.

**Products.** The device follows the channels of every product it serves (``--product``, device config
``products``): one refresh of the metadata per poll, then each product's signed ``channels.json``
(``products/<product>/channels.json``, the default product's at the top) and its releases, loaded on that
product's channels and checked against that product's champion and high-water mark. A refusal in one
product never stops the others from being followed; the poll's outcome is the first refusal, else fresh.

A release ``verify_release`` refused is remembered by its target's path and sha256 and not downloaded
again (the last ``MAX_REJECTED`` of them: a channel that names ever new refused targets cannot grow the
device's memory); a download ngclient refused is tried again at the next poll (a mirror may be repaired).
"""

from __future__ import annotations

import datetime as dt
import logging
import tempfile
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from runtime.release.contract import DEFAULT_TUF_INTERVAL_S, format_time, release_order, release_target_path
from runtime.release.tuf_pull import (
    EXIT_CODES,
    UpdateRefused,
    channel_month,
    refreshed,
    release_tarball,
    signed_channels,
    target_info,
)
from runtime.release.verify import PackageError
from runtime.serve.metrics import ChannelMetrics
from runtime.serve.residents import CANDIDATE, CHAMPION, ResidencyError
from runtime.serve.server import AdapterServer

log = logging.getLogger(__name__)
FRESH, STALE, REFUSED = "fresh", "stale", "refused"
NOT_CHECKED = "not_checked"
MAX_REJECTED = 32  # refused signed targets remembered; each holds its refusal's message


@dataclass(frozen=True)
class Outcome:
    """What one poll ended in: a state, and for stale or refused the reason and its message."""

    state: str
    reason: str | None = None
    detail: str | None = None


class ChannelWatcher(threading.Thread):
    """Polls the update channel at ``url`` for ``app`` (``start`` it; ``stop.set()`` ends it)."""

    def __init__(self, app: AdapterServer, url: str, trusted_root: str | Path, metadata_dir: str | Path,
                 interval: float = DEFAULT_TUF_INTERVAL_S):
        if interval <= 0:
            raise ValueError(f"update channel poll interval {interval}: seconds, more than 0")
        super().__init__(daemon=True, name="channel-watcher")
        self.app, self.url, self.interval = app, url, interval
        self.trusted_root, self.metadata_dir = Path(trusted_root), Path(metadata_dir)
        self.stop = threading.Event()
        self.metrics = ChannelMetrics(app.metrics.registry, EXIT_CODES)
        self.outcome = Outcome(STALE, NOT_CHECKED, "no poll of the update channel has finished yet")
        self.polls = 0
        self.last_poll: float | None = None
        self.last_success: float | None = None
        self.named: dict[str, dict[str, str]] = {}  # product -> channel -> month, as its last fresh channels.json said
        self._rejected: OrderedDict[tuple[str, str], PackageError] = OrderedDict()  # (target path, sha256) -> refusal
        self.max_rejected = MAX_REJECTED
        self._lock = threading.Lock()  # one poll at a time: the thread's, or a test's poll_once
        app.channel = self

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                self.poll_once()
            except Exception:  # a bug in one poll must not end the watch: the next poll runs
                log.exception("update channel poll failed", extra={"fields": {"event": "update_channel_error"}})
            self.stop.wait(self.interval)

    def poll_once(self) -> Outcome:
        with self._lock, tempfile.TemporaryDirectory(prefix="tuf-watch-") as tmp:
            started = time.time()
            outcome = self._poll(Path(tmp))
            self._report(outcome, started)
            return outcome

    def _poll(self, workdir: Path) -> Outcome:
        try:
            updater = refreshed(self.url, self.trusted_root, self.metadata_dir)
        except UpdateRefused as err:
            return Outcome(STALE, err.reason, str(err))
        self.last_success = time.time()
        refusals = [self._follow_product(updater, product, workdir) for product in self.app.residents.products]
        return next((outcome for outcome in refusals if outcome is not None), Outcome(FRESH))

    def _follow_product(self, updater, product: str, workdir: Path) -> Outcome | None:
        """Follow ``product``'s channels; an Outcome when something it names was refused."""
        try:
            channels = signed_channels(updater, self.url, workdir, product)
            self.named[product] = {c: channels[c] for c in (CHAMPION, CANDIDATE) if c in channels}
            for channel in (CHAMPION, CANDIDATE):
                if channel == CHAMPION or channel in channels:
                    refused = self._follow(updater, product, channel, channel_month(channels, self.url, channel),
                                           workdir)
                    if refused is not None:
                        return refused
        except (UpdateRefused, PackageError) as err:
            return Outcome(REFUSED, err.reason, str(err))
        except ResidencyError as err:  # the resident set changed under this poll (an admin call)
            return Outcome(REFUSED, err.code, str(err))
        return None

    def _follow(self, updater, product: str, channel: str, month: str, workdir: Path) -> Outcome | None:
        """Load what ``channel`` of ``product`` names if this device should; an Outcome when it refuses it without
        a download."""
        info = target_info(updater, self.url, release_target_path(month, product), self.app.max_bytes)
        release_id = (info.custom or {}).get("release_id")
        try:
            order = release_order(release_id)
        except ValueError:
            raise UpdateRefused("repository", f"update channel {self.url}: target {info.path} has no signed custom "
                                f"release_id (got {release_id!r:.80})") from None
        residents, gate = self.app.residents, self.app.gates.get(product)
        champion = residents.holder(CHAMPION, product)
        held = residents.holder(channel, product)
        if held is not None and held.release_id == release_id:
            return None  # serving it already
        if channel == CANDIDATE and (champion is None or order <= release_order(champion.release_id)
                                     or (held is not None and order < release_order(held.release_id))):
            return None  # nothing newer to compare with the champion
        reverted = gate.state.reverted(release_id) if gate is not None else None
        if reverted is not None:
            return Outcome(REFUSED, "reverted", f"update channel {self.url}: {channel} {release_id} was reverted on "
                           f"this device at {reverted['at']} ({reverted['reason']}); it is never installed again")
        floor = gate.floor(champion) if gate is not None else champion and champion.release_id
        if floor is not None and order < release_order(floor):
            return Outcome(REFUSED, "rollback", f"update channel {self.url}: {channel} {release_id} is older than "
                           f"{floor}, which this device runs or committed; a rollback is a local act")
        rejected = self._rejected.get((info.path, info.hashes["sha256"]))
        if rejected is not None:
            return Outcome(REFUSED, rejected.reason, str(rejected))
        tarball = release_tarball(updater, self.url, info, workdir)
        try:
            # the month and product it was named by: a mislabel is refused
            self.app.load(tarball, channel=channel, month=month, product=product)
        except PackageError as err:  # these signed bytes will never pass: not downloaded again
            self._rejected[(info.path, info.hashes["sha256"])] = err
            while len(self._rejected) > self.max_rejected:
                self._rejected.popitem(last=False)  # the oldest: named again, it is downloaded and refused again
            raise
        return None

    def _report(self, outcome: Outcome, started: float) -> None:
        previous, self.outcome = self.outcome, outcome
        self.polls += 1
        self.last_poll = started
        self.metrics.fresh.set(0 if outcome.state == STALE else 1)
        if self.last_success is not None:
            self.metrics.last_success.set(self.last_success)
        if outcome.state != FRESH:
            self.metrics.refusals.labels(outcome.reason).inc()
        if (outcome.state, outcome.reason) == (previous.state, previous.reason):
            return
        fields = {"event": "update_channel", "state": outcome.state, "reason": outcome.reason, "url": self.url,
                  "detail": outcome.detail, "last_success": _time(self.last_success)}
        if outcome.state == FRESH:
            log.info("update channel fresh", extra={"fields": fields})
        else:
            log.warning(f"update channel {outcome.state}: {outcome.reason}; the resident releases keep serving",
                        extra={"fields": fields})

    def summary(self) -> dict:
        """What ``/healthz`` and ``/ready`` say of the update channel."""
        o = self.outcome
        return {"state": o.state, "reason": o.reason, "detail": o.detail, "url": self.url,
                "last_success": _time(self.last_success), "last_poll": _time(self.last_poll), "polls": self.polls,
                "interval_s": self.interval, "channels": dict(self.named.get(self.app.residents.default_product, {})),
                "products": {product: dict(channels) for product, channels in self.named.items()}}


def _time(t: float | None) -> str | None:
    return None if t is None else format_time(dt.datetime.fromtimestamp(t, dt.timezone.utc))
