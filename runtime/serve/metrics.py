"""The server's Prometheus metrics, in a registry of its own (several apps may live in one process).

Every value is a counter, a gauge or a fixed-bucket histogram: memory stays bounded however long
the device runs. Labels are bounded too: endpoints and statuses are the server's own, refusal
reasons are ``runtime.release.verify.EXIT_CODES``'s, channels ``runtime.serve.residents``'s, revert reasons and
champion states ``runtime.release.device_state``'s, the update channel's refusal reasons ``runtime.release.tuf_pull``'s
and ``runtime.release.verify``'s. What describes the resident releases (``release_info``, seconds to
expiry, the resident count) is read from the resident set at each scrape (``ResidentCollector``), so
an unloaded release leaves no series behind. The counters labelled by release (requests per release
and channel, generation errors) are swept at each load and unload (``sweep_releases``): a release's
series stay while it is resident and while it is one of the last ``RETAINED_UNLOADED`` releases to
leave, then are removed. Removing them at once would lose the requests counted between the last
scrape and the unload (a scrape after it would find no series); kept for the next few departures,
a scrape at any usual interval reads the final count, and a release loaded again later starts at 0
(a counter reset, which ``rate`` and ``increase`` handle).

Every series of a release or a champion carries its ``product`` label (``runtime.release.contract``): a
device serving several products tells their requests, errors, releases and health states apart.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import GaugeMetricFamily

from runtime.release.contract import parse_time
from runtime.release.device_state import REVERT_REASONS
from runtime.serve.residents import UNLOAD_REASONS

PREFIX = "adapter"
# Seconds. A request is a prefill plus up to max_tokens decode steps of a few ms each on CPU.
REQUEST_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
FIRST_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
# A swap is verify (hash every file) + bind: tens of ms for the embedded default's 250 kB release.
SWAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
# Rows (prompts) in one batched decode step: up to max_concurrent requests of up to 16 prompts each.
BATCH_ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# Unloaded releases whose per-release series are kept: a scrape a few unloads late still reads their final counts.
RETAINED_UNLOADED = 8


class ResidentCollector:
    """The resident releases as the scrape finds them: ``listing()`` gives (release, channel) pairs."""

    def __init__(self, listing: Callable[[], list]):
        self.listing = listing

    def collect(self):
        info = GaugeMetricFamily(f"{PREFIX}_release_info", "A resident release (value 1), by release id, month, "
                                 "channel and product", labels=["release_id", "month", "channel", "product"])
        expires = GaugeMetricFamily(f"{PREFIX}_release_expires_in_seconds", "Seconds until a resident release's "
                                    "manifest expires_at (negative: expired)", labels=["release_id", "channel", "product"])
        residents = self.listing()
        now = time.time()
        for release, channel in residents:
            info.add_metric([release.release_id, release.manifest["month"], channel, release.product], 1)
            expires.add_metric([release.release_id, channel, release.product],
                               parse_time(release.manifest["expires_at"]).timestamp() - now)
        yield info
        yield expires
        yield GaugeMetricFamily(f"{PREFIX}_resident_releases", "Releases resident now", value=len(residents))


class ChannelMetrics:
    """The update channel's state (``runtime.serve.channel_watch``), in the server's registry once serve watches one;
    ``reasons``: the refusal reasons whose counters start at 0."""

    def __init__(self, registry: CollectorRegistry, reasons):
        self.fresh = Gauge(f"{PREFIX}_update_channel_fresh", "1 when the last poll of the update channel got fresh, "
                           "verified metadata; 0 when it could not (stale)", registry=registry)
        self.last_success = Gauge(f"{PREFIX}_update_channel_last_success_timestamp_seconds", "Unix time of the last "
                                  "poll that got fresh metadata (0: none yet)", registry=registry)
        self.refusals = Counter(f"{PREFIX}_update_channel_refusals", "Polls of the update channel that ended stale "
                                "or refused, by reason", ["reason"], registry=registry)
        for reason in reasons:
            self.refusals.labels(reason)


class ServerMetrics:
    """``residents``: the (release, channel) pairs resident now (``ResidentSet.listing``); none by default,
    for a part tested without a server."""

    def __init__(self, residents: Callable[[], list] = list):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(f"{PREFIX}_requests", "HTTP requests answered", ["endpoint", "status"], registry=r)
        self.request_seconds = Histogram(f"{PREFIX}_request_duration_seconds", "Request duration, first byte in to "
                                         "last byte out", ["endpoint"], buckets=REQUEST_BUCKETS, registry=r)
        self.first_token_seconds = Histogram(f"{PREFIX}_time_to_first_token_seconds", "Request start to its first "
                                             "generated token, queueing included", buckets=FIRST_TOKEN_BUCKETS, registry=r)
        self.tokens = Counter(f"{PREFIX}_generated_tokens", "Tokens generated", registry=r)
        self.by_release = Counter(f"{PREFIX}_release_requests", "Generation requests per release they ran on, "
                                  "the channel it held and its product", ["release_id", "channel", "product"], registry=r)
        self.in_flight = Gauge(f"{PREFIX}_generations_in_flight", "Generations running now", registry=r)
        self.queue_depth = Gauge(f"{PREFIX}_generation_queue_depth", "Generations waiting for a slot", registry=r)
        self.swaps = Counter(f"{PREFIX}_swaps", "Releases verified, bound and made resident (either channel)", registry=r)
        self.swap_seconds = Histogram(f"{PREFIX}_swap_duration_seconds", "Verify + bind + activate of an accepted "
                                      "release", buckets=SWAP_BUCKETS, registry=r)
        self.promotions = Counter(f"{PREFIX}_promotions", "Candidates promoted to champion", registry=r)
        self.unloads = Counter(f"{PREFIX}_unloads", "Resident releases unloaded, by reason (lru: to make room; admin)",
                               ["reason"], registry=r)
        for reason in UNLOAD_REASONS:
            self.unloads.labels(reason)
        self.batch_rows = Histogram(f"{PREFIX}_decode_batch_rows", "Rows decoded together per batched decode step",
                                    buckets=BATCH_ROW_BUCKETS, registry=r)
        # Above 1 only on a stacked engine (interface version 7), where rows of several releases share a step.
        self.batch_releases = Histogram(f"{PREFIX}_decode_batch_releases", "Releases whose rows decoded together per "
                                        "batched decode step", buckets=BATCH_ROW_BUCKETS, registry=r)
        # Set by the batch scheduler after each turn (batched decode; a forked request's cache is its own).
        self.kv_cache_bytes = Gauge(f"{PREFIX}_kv_cache_bytes", "Bytes the KV caches of the running batches hold now, "
                                    "every slot allocated (padding included; on a paged engine the blocks rows hold, a shared prefix "
                                    "page once)", registry=r)
        self.kv_cache_needed_bytes = Gauge(f"{PREFIX}_kv_cache_needed_bytes", "Bytes the running rows' tokens need "
                                           "in the KV cache now: their real slots only", registry=r)
        self.prefix_hit_tokens = Counter(f"{PREFIX}_kv_prefix_hit_tokens", "Prompt tokens read from KV pages another "
                                         "request left (shared prefix pages, runtime.engine.kv_prefix)", registry=r)
        self.prefix_miss_tokens = Counter(f"{PREFIX}_kv_prefix_miss_tokens", "Prompt tokens prefilled while prefix "
                                          "sharing is on", registry=r)
        self.prefix_pages_shared = Counter(f"{PREFIX}_kv_prefix_pages_shared", "KV pages a request took from the "
                                           "prefix index instead of computing them", registry=r)
        self.prefix_cached_pages = Gauge(f"{PREFIX}_kv_prefix_cached_pages", "Prompt pages indexed for sharing now, "
                                         "held by rows or idle", registry=r)
        self.preemptions = Counter(f"{PREFIX}_kv_preemptions", "Running rows preempted to the KV spill file to admit "
                                   "a request (runtime.engine.kv_swap)", registry=r)
        self.pages_swapped_out = Counter(f"{PREFIX}_kv_pages_swapped_out", "KV pages written to the spill file",
                                         registry=r)
        self.pages_swapped_in = Counter(f"{PREFIX}_kv_pages_swapped_in", "KV pages read back from the spill file",
                                        registry=r)
        self.swap_bytes = Gauge(f"{PREFIX}_kv_swap_bytes", "Bytes of the spill file's slots in use now", registry=r)
        self.refusals = Counter(f"{PREFIX}_refusals", "Releases refused, by reason", ["reason"], registry=r)
        self.generation_errors = Counter(f"{PREFIX}_generation_errors", "Generation requests that failed (500), by "
                                         "the release they ran on and its product", ["release_id", "product"], registry=r)
        self.commits = Counter(f"{PREFIX}_release_commits", "New champions committed by their health check", registry=r)
        self.reverts = Counter(f"{PREFIX}_release_reverts", "New champions the device reverted, by reason", ["reason"],
                               registry=r)
        for reason in REVERT_REASONS:
            self.reverts.labels(reason)
        self.champion_state = Gauge(f"{PREFIX}_champion_state", "A product's champion's health state (1: this one): "
                                    "none, trial, committed, failed; absent without a state directory",
                                    ["state", "product"], registry=r)
        r.register(ResidentCollector(residents))
        self.per_release = (self.by_release, self.generation_errors)  # their first label is the release id
        self._left: OrderedDict[str, None] = OrderedDict()  # releases no longer resident, in the order seen gone
        self._sweep_lock = threading.Lock()

    def loaded(self, seconds: float) -> None:
        self.swaps.inc()
        self.swap_seconds.observe(seconds)

    def sweep_releases(self, resident: Iterable[str]) -> None:
        """Remove the per-release series of the releases not in ``resident`` (release ids), but the last
        ``RETAINED_UNLOADED`` of them to leave. Memory stays bounded however many releases come and go."""
        resident = set(resident)
        with self._sweep_lock:
            labelled = {(counter, tuple(s.labels.values())) for counter in self.per_release
                        for family in counter.collect() for s in family.samples}
            for release_id in sorted({labels[0] for _, labels in labelled} - resident - set(self._left)):
                self._left[release_id] = None
            for release_id in resident & set(self._left):  # loaded again
                del self._left[release_id]
            gone = set()
            while len(self._left) > RETAINED_UNLOADED:
                gone.add(self._left.popitem(last=False)[0])
            for counter, labels in labelled:
                if labels[0] in gone:
                    counter.remove(*labels)

    def exposition(self) -> tuple[bytes, str]:
        """The text format a Prometheus scrape reads, and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def value(self, name: str, **labels) -> float:
        """One sample's value (0 when absent), e.g. ``value("adapter_swaps_total")``: for benchmarks and reports."""
        return self.registry.get_sample_value(name, labels) or 0.0

    def requests_by_release(self) -> dict[str, int]:
        totals: dict[str, int] = {}
        samples = (s for m in self.registry.collect() if m.name == f"{PREFIX}_release_requests" for s in m.samples)
        for s in samples:
            if s.name.endswith("_total"):  # summed over the channels the release served in
                totals[s.labels["release_id"]] = totals.get(s.labels["release_id"], 0) + int(s.value)
        return totals
