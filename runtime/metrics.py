"""The server's Prometheus metrics, in a registry of its own (several apps may live in one process).

Every value is a counter, a gauge or a fixed-bucket histogram: memory stays bounded however long
the device runs. Labels are bounded too: endpoints and statuses are the server's own, refusal
reasons are ``runtime.package.EXIT_CODES``'s, and ``release_id`` grows by one per release served.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from runtime.contract import parse_time

PREFIX = "adapter"
# Seconds. A request is a prefill plus up to max_tokens decode steps of a few ms each on CPU.
REQUEST_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
FIRST_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
# A swap is verify (hash every file) + bind: tens of ms for the embedded default's 250 kB release.
SWAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class ServerMetrics:
    def __init__(self):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(f"{PREFIX}_requests", "HTTP requests answered", ["endpoint", "status"], registry=r)
        self.request_seconds = Histogram(f"{PREFIX}_request_duration_seconds", "Request duration, first byte in to "
                                         "last byte out", ["endpoint"], buckets=REQUEST_BUCKETS, registry=r)
        self.first_token_seconds = Histogram(f"{PREFIX}_time_to_first_token_seconds", "Request start to its first "
                                             "generated token, queueing included", buckets=FIRST_TOKEN_BUCKETS, registry=r)
        self.tokens = Counter(f"{PREFIX}_generated_tokens", "Tokens generated", registry=r)
        self.by_release = Counter(f"{PREFIX}_release_requests", "Generation requests per release they ran on",
                                  ["release_id"], registry=r)
        self.in_flight = Gauge(f"{PREFIX}_generations_in_flight", "Generations running now", registry=r)
        self.queue_depth = Gauge(f"{PREFIX}_generation_queue_depth", "Generations waiting for a slot", registry=r)
        self.swaps = Counter(f"{PREFIX}_swaps", "Releases verified, bound and activated", registry=r)
        self.swap_seconds = Histogram(f"{PREFIX}_swap_duration_seconds", "Verify + bind + activate of an accepted "
                                      "release", buckets=SWAP_BUCKETS, registry=r)
        self.refusals = Counter(f"{PREFIX}_refusals", "Releases refused, by reason", ["reason"], registry=r)
        self.release_info = Gauge(f"{PREFIX}_release_info", "The active release (value 1)", ["release_id", "month"],
                                  registry=r)
        self.expires_in = Gauge(f"{PREFIX}_release_expires_in_seconds", "Seconds until the active release's "
                                "manifest expires_at (negative: expired; NaN before a release is active)",
                                registry=r)
        self._expires_at: float | None = None
        self.expires_in.set_function(self._seconds_to_expiry)

    def _seconds_to_expiry(self) -> float:
        return float("nan") if self._expires_at is None else self._expires_at - time.time()

    def activated(self, release_id: str, month: str, expires_at: str, previous: tuple[str, str] | None,
                  seconds: float) -> None:
        self.swaps.inc()
        self.swap_seconds.observe(seconds)
        if previous is not None:
            self.release_info.remove(*previous)
        self.release_info.labels(release_id, month).set(1)
        self._expires_at = parse_time(expires_at).timestamp()

    def exposition(self) -> tuple[bytes, str]:
        """The text format a Prometheus scrape reads, and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def value(self, name: str, **labels) -> float:
        """One sample's value (0 when absent), e.g. ``value("adapter_swaps_total")``: for benchmarks and reports."""
        return self.registry.get_sample_value(name, labels) or 0.0

    def requests_by_release(self) -> dict[str, int]:
        return {s.labels["release_id"]: int(s.value) for m in self.registry.collect() if m.name == f"{PREFIX}_release_requests"
                for s in m.samples if s.name.endswith("_total")}
