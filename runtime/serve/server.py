"""The device's releases and generation: verify and swap releases into one engine without a restart.

The engine (one ONNX Runtime session) is opened once. Each verified release becomes an
immutable ``ActiveRelease``: its own engine handle (``OrtEngine.fork``) with the release's LoRA
inputs bound, plus its manifest. Several stay resident at once (``runtime.serve.residents``:
the ``champion``, a ``candidate``, and standby releases up to ``max_resident``, least recently used
unloaded first). A generation gets its release once, when it starts (``AdapterServer.start_generation``),
and runs every step, prefill to last token, on that release's handle: in the release's batch
(``runtime.serve.batcher``) or on its own fork of the handle (``runtime.serve.generation``); a
load, promotion or unload only changes which releases new requests can get (under a lock, after
verification and binding are done), while requests in flight finish on theirs. A release that fails
verification raises its ``PackageError`` (``reason``, ``exit_code``); the resident ones keep serving.

With a state directory (``gates``, one per product: ``runtime.serve.health``), a load is also checked against
its product's high-water mark, a release is copied there, and a new champion is health-checked, then
committed or reverted.

A device serves the products it is configured for (``products``, the first its default: what requests
without ``model`` get); each release is of the product its signed manifest names, and holds a channel of
that product only (``runtime.serve.residents``).

Watch mode polls a directory for release directories or tarballs and loads as champion any verified
one newer than the champion (never a rollback, nor a release reverted here). Publish into it atomically (write elsewhere,
then rename), or a half-copied release is refused until its next change.
The update channel's watch (``runtime.serve.channel_watch``) loads what the signed channel names the same way.

The HTTP side is ``runtime.serve.http_app`` (routes) and ``runtime.serve.http_server`` (uvicorn).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from runtime.engine.generate import decode_steps
from runtime.engine.kv_swap import SpillFile
from runtime.release.contract import DEFAULT_PRODUCT, MANIFEST, manifest_product
from runtime.release.verify import (
    DEFAULT_MAX_PACKAGE_BYTES,
    PackageError,
    RollbackRefused,
    bind_release,
    unpacked_release,
    verify_release,
)
from runtime.serve.active_release import ActiveRelease
from runtime.serve.batcher import DEFAULT_PREFILL_CHUNK, KV_WAIT_S, BatchedGeneration, Batcher, worst_case_kv_bytes
from runtime.serve.generation import ForkedGeneration, Generation, StopText
from runtime.serve.metrics import ServerMetrics
from runtime.serve.residents import CANDIDATE, CHAMPION, DEFAULT_MAX_RESIDENT, ResidencyError, ResidentSet

if TYPE_CHECKING:
    # The project's one two-way link, and type-only: a ReleaseGate (runtime.serve.health, above this module)
    # drives the server and registers itself in ``gates``, and ``load`` calls back into it (floor, admit, begin)
    # in the middle of a load. A Protocol here would only repeat the gate's hooks.
    from runtime.serve.health import ReleaseGate

log = logging.getLogger(__name__)


class UpdateChannelStatus(Protocol):
    """What the server asks of the update channel it follows (``runtime.serve.channel_watch.ChannelWatcher``,
    which sets itself as ``AdapterServer.channel``): its state, for ``/healthz`` and ``/ready``."""

    def summary(self) -> dict: ...


def claimed_product(release_dir: Path) -> str:
    """The product a release's manifest names, read before it is verified: it picks the product whose champion
    and high-water mark the release is checked against, and ``verify_release`` then refuses the release unless
    its signed manifest names the same (``product_mismatch``)."""
    try:
        return manifest_product(json.loads((Path(release_dir) / MANIFEST).read_bytes()))
    except (OSError, ValueError, AttributeError):  # no manifest, or not an object: verify_release says which
        return DEFAULT_PRODUCT


class AdapterServer:
    """The engine, the tokenizer, the trusted keys and the resident releases; thread-safe."""

    def __init__(self, engine, tokenizer, trusted_keys: dict, max_bytes: int = DEFAULT_MAX_PACKAGE_BYTES,
                 max_resident: int = DEFAULT_MAX_RESIDENT, products: tuple[str, ...] = (DEFAULT_PRODUCT,),
                 kv_wait_s: float = KV_WAIT_S, prefill_chunk: int | None = DEFAULT_PREFILL_CHUNK,
                 share_prefixes: bool = True, kv_swap_dir: str | Path | None = None, kv_swap_bytes: int = 0):
        """``kv_wait_s``: on a paged engine with a KV budget, how long a batched request waits for blocks;
        ``prefill_chunk``: the most prompt tokens a batched prefill runs per forward (None: the whole prompt);
        ``share_prefixes``: prompts on one release share their full KV pages (``runtime.engine.kv_prefix``);
        ``kv_swap_dir``: with a KV budget, running rows are preempted into a private spill file there, at most
        ``kv_swap_bytes``, instead of a request waiting for blocks (``runtime.engine.kv_swap``)."""
        if not hasattr(engine, "fork"):
            raise ValueError(f"{type(engine).__name__} cannot be shared between requests; serve runs the onnxruntime backend")
        self.engine, self.tokenizer, self.trusted_keys, self.max_bytes = engine, tokenizer, trusted_keys, max_bytes
        self.residents = ResidentSet(max_resident, products)
        self.metrics = ServerMetrics(self.residents.listing)
        self._loads = 0
        self._load_lock = threading.Lock()
        pool = getattr(engine, "pool", None)
        if kv_swap_dir is not None and (pool is None or not pool.fixed):
            raise ValueError("a KV swap directory needs a paged engine with a KV budget")
        spill = SpillFile(kv_swap_dir, kv_swap_bytes) if kv_swap_dir is not None else None
        # One scheduler for every release's batch; None where the backend cannot merge caches (``merges_caches``).
        self.batcher = (Batcher(tokenizer.stop_ids, tokenizer.pad_id, self.metrics, pool=pool,
                                kv_wait_s=kv_wait_s, stacked=engine.interface.stacked, prefill_chunk=prefill_chunk,
                                share_prefixes=share_prefixes, spill=spill)
                        if getattr(engine, "merges_caches", False) else None)
        # set by runtime.serve.health.ReleaseGate: per product, the state directory and its trials
        self.gates: dict[str, ReleaseGate] = {}
        self.channel: UpdateChannelStatus | None = None  # set by runtime.serve.channel_watch.ChannelWatcher

    @property
    def gate(self) -> ReleaseGate | None:
        """The default product's gate (None without a state directory)."""
        return self.gates.get(self.residents.default_product)

    @property
    def active(self) -> ActiveRelease | None:
        """The default product's champion: what a request that names no model gets."""
        return self.residents.champion

    def load(self, path: str | Path, allow_rollback: bool = False, channel: str = CHAMPION, trial: bool = True,
             month: str | None = None, product: str | None = None) -> dict:
        """Verify the release at ``path`` (of ``month`` and ``product`` when it was fetched by those names), bind
        it to a new handle, make it resident on ``channel`` of its product
        (never older than that product's champion, nor than its high-water mark, unless ``allow_rollback``);
        raise PackageError or ResidencyError. With a state directory (``gates``) a new champion starts its
        health trial unless ``trial`` is False (the device's own resume and revert), and a candidate is recorded."""
        start = time.perf_counter()
        try:
            with unpacked_release(path, self.max_bytes) as d:
                product = product or claimed_product(d)
                gate, champion = self.gates.get(product), self.residents.holder(CHAMPION, product)
                verified = verify_release(
                    d, self.trusted_keys, self.engine.interface,
                    active_release=gate.floor(champion) if gate else champion and champion.release_id,
                    allow_rollback=allow_rollback, max_bytes=self.max_bytes, tokenizer_sha256=self.tokenizer.sha256,
                    stop_token_ids=self.tokenizer.stop_ids, month=month, product=product,
                )
                if product not in self.residents.products:
                    raise ResidencyError("unknown_product", f"{path}: release {verified.release_id} is of product "
                                         f"{product}, which this device does not serve (products: "
                                         f"{', '.join(self.residents.products)}; --product)")
                if gate is not None:
                    gate.admit(d, verified)
            handle = self.engine.fork()
            bind_release(handle, verified)  # the arrays are copied into ORT values: the files may go
            flip = time.perf_counter()
            with self._load_lock:
                previous = self.residents.holder(channel, product)
                release = ActiveRelease(verified.release_id, self._loads + 1, verified.manifest, handle, time.time())
                try:  # the order is checked again: another load may have won while this one verified
                    unloaded = self.residents.add(release, channel, allow_rollback)
                except RollbackRefused as err:
                    raise RollbackRefused(f"{path}: {err}") from None
                self._loads += 1
                done = time.perf_counter()
            self.metrics.loaded(done - start)
            self.metrics.unloads.labels("lru").inc(len(unloaded))
            self._resident_changed()
        except PackageError as err:
            self.metrics.refusals.labels(err.reason).inc()
            raise
        if gate is not None and channel == CHAMPION and trial:
            gate.begin(release)
        elif gate is not None and channel == CANDIDATE:
            gate.record_candidate()
        swap_ms, activate_ms = (done - start) * 1e3, (done - flip) * 1e3
        log.info("%s %s of %s (activation %d) in %.1f ms", channel, verified.release_id, product, release.activation,
                 swap_ms)
        return {"release_id": verified.release_id, "product": product, "channel": channel, "activation": release.activation,
                "previous": previous.release_id if previous else None, "unloaded": [r.release_id for r in unloaded],
                "resident": self.resident_summary(),
                "swap_ms": round(swap_ms, 3), "activate_ms": round(activate_ms, 4), "checks": verified.checks}

    def promote(self, product: str | None = None) -> dict:
        """``product``'s (default: the device's default product) candidate becomes its champion; the champion
        stays resident on standby. Raise ResidencyError without a candidate."""
        champion, previous = self.residents.promote(product)
        self.metrics.promotions.inc()
        if champion.product in self.gates:
            self.gates[champion.product].begin(champion)
        log.info("promoted %s to champion of %s (was %s)", champion.release_id, champion.product, previous.release_id)
        return {"champion": champion.release_id, "product": champion.product, "previous": previous.release_id,
                "resident": self.resident_summary()}

    def unload(self, model: str) -> dict:
        """Forget the resident release ``model`` names (not a champion); requests running on it finish."""
        release = self.residents.remove(model)
        self.metrics.unloads.labels("admin").inc()
        self._resident_changed()
        if release.product in self.gates:
            self.gates[release.product].record_candidate()
        log.info("unloaded %s", release.release_id)
        return {"unloaded": release.release_id, "resident": self.resident_summary()}

    def _resident_changed(self) -> None:
        """Releases left the device: their metrics and their shared KV pages go."""
        resident = [r for r, _ in self.residents.listing()]
        self.metrics.sweep_releases(r.release_id for r in resident)
        if self.batcher is not None:
            self.batcher.forget_releases(resident)

    def resident_summary(self) -> list[dict]:
        return [{"release_id": r.release_id, "product": r.product, "channel": channel}
                for r, channel in self.residents.listing()]

    def start_generation(self, release: ActiveRelease, prompts: list[list[int]], max_tokens: int, sample,
                         stops: list[str], decode: str = "batched") -> Generation:
        """A generation of ``prompts`` (token ids) on ``release`` (read once from ``active`` when the
        request started), for every step of it; a swap cannot reach it. ``decode="batched"``: decoded
        with the other requests on ``release`` (``runtime.serve.batcher``) when the engine's cache can be
        merged, else, and with ``"fork"``, alone on a fork of the release's handle. Raises
        ``runtime.engine.kv_blocks.KVBudgetExceeded`` for a request whose worst case the KV budget never holds."""
        worst_case_kv_bytes(getattr(self.engine, "pool", None), prompts, max_tokens)  # refused before it is counted
        self.metrics.by_release.labels(release.release_id, self.residents.channel_of(release), release.product).inc()
        texts = [StopText(self.tokenizer, stops) for _ in prompts]
        if decode == "batched" and self.batcher is not None:
            return BatchedGeneration(self.batcher, release, prompts, sample, texts, max_tokens)
        steps = decode_steps(release.handle.fork(), prompts, max_tokens, self.tokenizer.stop_ids,
                             self.tokenizer.pad_id, sample)
        return ForkedGeneration(release, steps, texts, max_tokens)

    def health(self) -> dict:
        """The default product's champion (id, activation, month, expiry) at the top level, its candidate's the
        same under ``candidate`` (None without one), the number of resident releases, and under ``products``
        each product's champion, candidate and (with a state directory) device state."""
        champion, candidate = self.residents.champion, self.residents.candidate
        return {"status": "ok" if champion else "no_release", **release_card(champion),
                "candidate": release_card(candidate) if candidate else None,
                "resident": len(self.residents.listing()), "weights": self.engine.interface.weight_precision,
                "products": {p: self.product_health(p) for p in self.residents.products}} | \
            ({"device_state": self.gate.summary()} if self.gate else {}) | \
            ({"update_channel": self.channel.summary()} if self.channel else {})

    def product_health(self, product: str) -> dict:
        champion, candidate = self.residents.holder(CHAMPION, product), self.residents.holder(CANDIDATE, product)
        return {"champion": release_card(champion) if champion else None,
                "candidate": release_card(candidate) if candidate else None} | \
            ({"device_state": self.gates[product].summary()} if product in self.gates else {})


def release_card(release: ActiveRelease | None) -> dict:
    """What health checks say of a release: the fields of ``release_id``, ``activation``, ``month``, ``expires_at``."""
    if release is None:
        return {"release_id": None, "activation": 0, "month": None, "expires_at": None}
    return {"release_id": release.release_id, "activation": release.activation, "month": release.manifest["month"],
            "expires_at": release.manifest["expires_at"]}


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
            except (PackageError, ResidencyError) as err:  # a release of a product this device does not serve
                log.warning("watch: refused %s: %s", path, err)
                results.append({"path": str(path), "refused": err.reason if isinstance(err, PackageError) else err.code,
                                "error": str(err)})
        return results

    def run(self):
        while not self.stop.wait(self.interval):
            self.poll_once()
