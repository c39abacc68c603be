"""Continuous batching: one scheduler thread decodes every running request, one step at a time, batched per release.

A request picked its release (``runtime.serve.active_release.ActiveRelease``) once, when it started; its rows (one
per prompt) run every step on that release's batch, and rows of two releases are never in one
batch. Each turn of the loop:

1. admits the requests that arrived (a free ``Admission`` slot submitted them), as many as fit the
   release's batch of at most ``max_rows`` rows (the rest wait, in order): the arrivals of one
   release are prefilled together (each alone if the engine refuses them together, so a request
   that cannot be prefilled fails alone), left-padded as ``runtime.engine.generate`` pads prompts, their first
   tokens sampled, and their rows merged into the release's running batch (``concat_caches``:
   every cache left-padded along the past axis to the longest, the padding masked);
2. runs one decode step of each release's batch in turn (the releases take turns on the session's
   threads instead of contending for them), samples each request's rows with the request's own
   sampler (so a seeded request draws what it would in any company), and hands every request the
   choices that changed through ``loop.call_soon_threadsafe``: no thread hop per token, and at most
   one wake-up of the event loop in flight (each writes to the loop's self-pipe: one per request and
   step took 60% of the scheduler thread's time at 8 requests on the tiny engine); what later steps
   produce before the loop has run it joins the same hand-over;
3. drops the rows that finished or whose client left (``close``), and the leading past slots that
   are then masked in every remaining row (``take_cache_rows``);
4. sets the KV gauges (``adapter_kv_cache_bytes``: what the caches hold, padding included;
   ``adapter_kv_cache_needed_bytes``: the rows' real tokens), 0 once no batch runs.

Every row's real slots are the last ``lengths[b]`` of the batch's past, so the past is as long as
the longest row and a row's next position is its length: it decodes as it would alone, up to float
rounding. On a paged engine (``runtime.engine.kv_blocks``) no row is padded: each holds the blocks its
own length needs, and the pool of blocks, which every release's batch shares, is bounded by the device's
KV budget, counted in bytes (an engine with quantized pages, ``runtime.engine.kv_pages``, holds float and sealed
pages of two sizes). A request is admitted only when the worst case of every admitted row (prompt + max_tokens - 1
tokens each) fits the pool together with its own, so no row ever runs out of blocks mid-decode
(TensorRT-LLM's ``GUARANTEED_NO_EVICT`` policy; vLLM instead preempts and recomputes). A request that
does not fit waits, first come first served, at most ``kv_wait_s``; then, or at once if it could never
fit, it fails with ``KVBudgetExceeded`` (the HTTP API answers 503 with ``Retry-After``). With a spill file
(``runtime.engine.kv_swap``) it first preempts the newest running rows whose worst cases make room: their pages go
to the file, byte for byte, and come back into fresh blocks when the budget has room again, first preempted first
and before any new request, so a preempted row decodes what it would have. A prompt that starts with the full pages
of an earlier one on the same release reuses them (``runtime.engine.kv_prefix``), and the budget counts each such
page once (``Batcher._promised_bytes``).

The thread runs while there is work and ends once there has been none for ``IDLE_S``; the next request
starts another. An engine whose caches cannot be merged (a backend without ``concat_caches``: TensorRT, eager) is
served per request instead (``runtime.serve.generation.ForkedGeneration``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
import time
from dataclasses import dataclass

import numpy as np

from runtime.engine.generate import left_padded, prefill, prefill_by_position
from runtime.engine.kv_blocks import BlockPool, KVBudgetExceeded
from runtime.engine.kv_pages import PagePool
from runtime.engine.kv_prefix import PrefixCounters, release_scope
from runtime.engine.kv_swap import SpillCorrupted, SpilledRow, SpillFile, read_back, spill_row
from runtime.engine.sampling import greedy
from runtime.engine.tracing import MAX_BATCH
from runtime.serve.generation import Choice, Generation, StopText

# Prompt tokens a batched prefill runs per forward (``runtime.engine.generate.prefill``). Measured at the 0.5B shape
# (int4, 4-bit KV, 8 clients x 2,048 tokens, docs/measuring.md): the server's peak resident set 1.55 GB whole,
# 0.99 GB in chunks of 256, and a 2 x 1,024-token prefill no slower (15.1 s against 19.7 s whole, one noisy
# interleaved run on 2 shared cores): a chunk's attention scores are (heads, chunk, past + chunk), not (heads, T, T).
# 128 once a decode step's transient fell below a 256-token chunk's (14 x 256 x 2,048 fp32 scores, 29 MB a layer):
# 0.636 -> 0.615 GB (two runs of 128 at 0.615), the load's wall time the same (96.9 s both); 64: 0.615 GB.
# 64 since the 4-bit quantized pages serve (a chunk also reads the row's sealed pages back per layer), measured
# 2026-12-07 with ``bench.serving.device_memory_bench --shape 0.5b --servers ours --kv-cache quantized_pages``,
# one after the other, load ~2: 8 x 2,048 peak 0.67 GB at 128 (two runs), 0.62 GB at 64 (two), 0.60 GB at 32, at
# 12.9-13.5 / 13.2-13.9 / 11.6 tokens/s; 1 x 8,192 peak 0.90 -> 0.71 GB, its wall time 37 -> 39 s. A shared prefix
# on quantized pages is a multiple of the chunk, so 64 also shares in finer steps.
DEFAULT_PREFILL_CHUNK = 64

log = logging.getLogger(__name__)
# The scheduler thread waits this long for a request once it has no work, then ends (the next request
# starts another): a client's next request, sent when its answer ended, finds it running. Starting a
# thread took 0.2-0.8 ms on the 2 shared cores, paid by every request at 1 client.
IDLE_S = 0.5
KV_WAIT_S = 30.0  # a request waits at most this long for KV blocks, then gets 503 with Retry-After


def worst_case_kv_bytes(pool: BlockPool | PagePool | None, prompts: list[list[int]], max_tokens: int) -> list[int]:
    """Per row, the bytes of KV blocks it may come to hold (its last sampled token is never fed back; with quantized
    pages, its float and sealed pages at their worst, ``PagePool.row_bytes``); zeros without a budget.
    ``KVBudgetExceeded`` (never) when the whole pool cannot hold the request."""
    if pool is None or not pool.fixed:
        return [0] * len(prompts)
    rows = [pool.row_bytes(len(p) + max_tokens - 1) for p in prompts]
    need = sum(rows)
    if need > pool.capacity_bytes:
        raise KVBudgetExceeded(
            f"{len(prompts)} prompt(s) of up to {max(map(len, prompts))} tokens plus max_tokens {max_tokens} need "
            f"{need} bytes of KV cache; this device's budget holds {pool.capacity_bytes}", never=True)
    return rows


class BatchedGeneration(Generation):
    """A request decoded by the ``Batcher``: submitted when its consumer first asks for choices (it
    holds an admission slot by then); the scheduler thread hands it each step's choices.
    A consumer slower than the decode gets what queued up meanwhile as one list: each choice's new
    text joined (one streamed chunk for several tokens instead of a backlog of one per token)."""

    def __init__(self, batcher: "Batcher", release, prompts: list[list[int]], sample, texts: list[StopText],
                 max_tokens: int):
        super().__init__(release, texts, max_tokens)
        self.batcher, self.prompts, self.sample = batcher, prompts, sample
        self.row_kv_bytes = worst_case_kv_bytes(batcher.pool, prompts, max_tokens)  # per row (0: no budget)
        self.submitted = 0.0  # time.monotonic() when submitted: how long it has waited for KV blocks
        self.cancelled = False  # set by the event loop (the client left), read by the scheduler thread
        self.shared: list[list] | None = None  # per prompt, the shared pages it holds from admission to its prefill
        self.loop: asyncio.AbstractEventLoop | None = None
        # Each step's choices, None once every choice has finished, or the error that ended the decode:
        # what the scheduler handed over and the consumer has not taken yet. A list and a future, not an
        # asyncio.Queue: its get and put call get_running_loop(), a getpid syscall each on Python 3.11.
        self._items: list = []
        self._waiter: asyncio.Future | None = None
        self._ended = False

    def put(self, item) -> None:
        """On the event loop: one hand-over item; wakes the consumer."""
        self._items.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def next_choices(self) -> list[Choice] | None:
        if self.loop is None:
            self.loop = asyncio.get_running_loop()
            self.batcher.submit(self)
        if self._ended:
            return None
        if not self._items:
            self._waiter = self.loop.create_future()
            await self._waiter
        items, self._items = self._items, []
        if len(items) == 1 and isinstance(items[0], list):  # the consumer kept up: one step's choices
            return items[0]
        merged: dict[int, Choice] = {}
        for item in items:
            if isinstance(item, BaseException):
                raise item
            if item is None:
                self._ended = True
                break
            for c in item:
                before = merged.get(c.index)
                merged[c.index] = c if before is None else Choice(c.index, before.text + c.text, c.finish_reason)
        return list(merged.values()) if merged or not self._ended else None

    def close(self) -> None:
        self.cancelled = True  # its rows leave the batch before the next step


@dataclass
class Row:
    generation: BatchedGeneration
    index: int  # its choice index in the request
    admitted: int = 0  # the scheduler's count of rows admitted when this one was: the newest is preempted first

    @property
    def kv_bytes(self) -> int:
        return self.generation.row_kv_bytes[self.index]


@dataclass
class SwappedRow:
    """A preempted row: its pages in the spill file, and what its next decode step needs."""
    row: Row
    spilled: SpilledRow
    token: int  # its last sampled token, the next step's input


class ReleaseBatch:
    """The running rows of one release (or, on a stacked engine, of every release), their cache, and per row its
    real length, last token and slot."""

    def __init__(self, release, stacked: bool = False):
        self.key = None if stacked else release  # what its arrivals share: one release, or (stacked) none
        self.engine = release.handle.fork()  # the scheduler's own handle: only its thread runs it
        self.releases = [release]  # per slot of a stacked engine, the release bound there (on fork: the first)
        self.rows: list[Row] = []
        self.cache = None
        self.lengths = np.zeros(0, dtype=np.int64)  # (B,) real tokens per row = its next token's position
        self.tokens = np.zeros(0, dtype=np.int64)  # (B,) each row's last sampled token: the next step's input
        self.slots = np.zeros(0, dtype=np.int64)  # (B,) the slot of each row's release

    @property
    def stacked(self) -> bool:
        return self.key is None

    def bind(self, arriving: list) -> np.ndarray:
        """Stacked: give each release of ``arriving`` (one per new row) a slot; the slots (one per row). The
        slots are the releases that still have rows, in their order, then the new ones: a release that left
        the resident set keeps its slot until its last row finishes, and rebinding copies each running row's
        release into its new slot, so no running row changes weights (``OrtEngine.bind_slots``)."""
        if not self.stacked:
            return np.zeros(len(arriving), dtype=np.int64)
        running = {id(self.releases[s]) for s in self.slots.tolist()}
        wanted = [r for r in self.releases if id(r) in running]
        for r in arriving:  # by identity: a release is its loaded instance (ActiveRelease holds a dict)
            if all(w is not r for w in wanted):
                wanted.append(r)
        if [id(r) for r in wanted] != [id(r) for r in self.releases]:
            self.engine.bind_slots([r.handle for r in wanted])
            new_index = {id(r): i for i, r in enumerate(wanted)}
            self.slots = np.array([new_index[id(self.releases[s])] for s in self.slots.tolist()], dtype=np.int64)
            self.releases = wanted
        index = {id(r): i for i, r in enumerate(self.releases)}
        return np.array([index[id(r)] for r in arriving], dtype=np.int64)


class Batcher:
    """The scheduler of one ``AdapterServer``: ``submit`` a generation, its thread does the rest."""

    def __init__(self, stop_ids, pad_id: int, metrics, max_rows: int = MAX_BATCH, pool: BlockPool | PagePool | None = None,
                 kv_wait_s: float = KV_WAIT_S, stacked: bool = False, prefill_chunk: int | None = DEFAULT_PREFILL_CHUNK,
                 share_prefixes: bool = True, spill: SpillFile | None = None):
        """``max_rows``: rows one release's batch decodes at most (the engine was exported for batches up
        to ``MAX_BATCH``); arrivals beyond it wait, in order, for rows to leave. ``pool``: a paged engine's
        KV blocks, which every release's batch shares; with a budget, arrivals also wait (at most
        ``kv_wait_s``) for their worst case to fit. ``stacked``: the engine takes rows of several releases in
        one forward (interface version 7): one batch for every release, each row on its release's slot.
        ``prefill_chunk``: prompts are prefilled at most this many tokens per forward
        (``runtime.engine.generate.prefill``; None: whole). ``share_prefixes``: on a paged engine, the full pages of
        every prompt are indexed and a prompt that starts with them reuses them (``runtime.engine.kv_prefix``).
        ``spill``: with a KV budget, a request that does not fit preempts the newest running rows into this file
        instead of waiting (``runtime.engine.kv_swap``); they resume, first preempted first, when the budget has room."""
        self.stop_ids, self.pad_id, self.metrics = frozenset(int(t) for t in stop_ids), pad_id, metrics
        self.max_rows, self.pool, self.kv_wait_s, self.stacked = max_rows, pool, kv_wait_s, stacked
        self.prefill_chunk = prefill_chunk
        self.prefix = pool.share_prefixes() if share_prefixes and pool is not None else None
        # Pages a shared prefix is a multiple of. Quantized pages: whole prefill chunks, so the suffix reads the
        # prefix as the unshared prompt's later chunks read it (sealed), not as its own chunk (float): the same answers.
        self.share_unit = (math.lcm(pool.block_size, prefill_chunk) // pool.block_size
                           if isinstance(pool, PagePool) and prefill_chunk else 1)
        self._counted = PrefixCounters()  # the prefix counters as the metrics last read them
        self.spill = spill if pool is not None and pool.fixed else None
        self._swapped: list[SwappedRow] = []  # the scheduler thread's alone, first preempted first
        self._admitting: list[BatchedGeneration] = []  # the scheduler thread's alone: this turn's admissions
        self._admitted = 0  # rows admitted so far
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)  # notified when a request arrives for a waiting thread
        self._arrivals: list[BatchedGeneration] = []
        self._thread: threading.Thread | None = None
        self._batches: list[ReleaseBatch] = []  # the scheduler thread's alone
        self._outbox: list[tuple[BatchedGeneration, object]] = []  # (generation, hand-over item) of this step
        self._handover_lock = threading.Lock()
        self._handed: dict[asyncio.AbstractEventLoop, list] = {}  # items an event loop has yet to take

    def submit(self, generation: BatchedGeneration) -> None:
        generation.submitted = time.monotonic()
        with self._lock:
            self._arrivals.append(generation)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="batcher", daemon=True)
                self._thread.start()
            else:
                self._work.notify()

    def _run(self) -> None:
        try:
            while self._turn():
                pass
        except Exception as err:  # a bug here must fail the requests, not leave them waiting forever
            log.exception("the batch scheduler failed")
            failed = ([r.generation for b in self._batches for r in b.rows] + [s.row.generation for s in self._swapped]
                      + self._admitting)
            self._batches, self._swapped, self._admitting = [], [], []
            self._count_kv()
            with self._lock:  # the next submit starts a fresh thread once this one has handed over
                failed, self._arrivals = failed + self._arrivals, []
                for g in dict.fromkeys(failed):
                    self._deliver(g, err)
                self._hand_over()
                self._thread = None

    def _turn(self) -> bool:
        """Admit the arrivals, then one decode step per release; False (the thread ends) when there has
        been no work for ``IDLE_S``."""
        with self._lock:
            if (not self._arrivals and not self._batches and not self._swapped
                    and not self._work.wait_for(lambda: self._arrivals, IDLE_S)):
                self._thread = None
                return False
            arrivals, self._arrivals, resume, preempt = self._fitting(self._arrivals)
        self._admitting = arrivals  # taken from the arrivals, not yet in a batch: a bug now must fail them too
        self._preempt(preempt)
        self._resume(resume)
        self._admit(arrivals)
        self._admitting = []
        self._hand_over()
        for batch in list(self._batches):
            self._step(batch)
            self._hand_over()
        self._count_kv()
        return True

    def _count_kv(self) -> None:
        """The KV gauges: bytes the batches' caches hold (every slot; on a paged engine the blocks held, a shared page
        once) and bytes their rows' real tokens need."""
        held = (self.pool.used_bytes if self.pool is not None and self._batches
                else sum(b.engine.cache_bytes(b.cache) for b in self._batches))
        needed = sum(int(b.lengths.sum()) * b.engine.kv_bytes_per_token for b in self._batches)
        self.metrics.kv_cache_bytes.set(held)
        self.metrics.kv_cache_needed_bytes.set(needed)
        if self.spill is not None:
            self.metrics.swap_bytes.set(self.spill.used_bytes)
        if self.prefix is not None:
            now, before, m = self.prefix.counters, self._counted, self.metrics
            m.prefix_hit_tokens.inc(now.hit_tokens - before.hit_tokens)
            m.prefix_miss_tokens.inc(now.miss_tokens - before.miss_tokens)
            m.prefix_pages_shared.inc(now.pages_shared - before.pages_shared)
            m.prefix_cached_pages.set(self.prefix.cached_pages)
            self._counted = PrefixCounters(now.hit_tokens, now.miss_tokens, now.pages_shared)

    def forget_releases(self, resident: list) -> None:
        """Only the shared pages of ``resident`` releases stay indexed (called when releases leave the device)."""
        if self.prefix is not None:
            with self.pool.lock:
                self.prefix.drop_scopes({release_scope(r.release_id, r.activation) for r in resident})

    def _fitting(self, arrivals: list[BatchedGeneration]) -> tuple[list, list, list[SwappedRow], list]:
        """(the arrivals whose rows fit their release's batch and whose KV worst case fits the pool, in order;
        those that wait; the swapped rows that resume now; the running (batch, row) pairs to preempt now). Once one
        request of a release waits for rows, the later ones of that release wait too, and once one waits for KV
        blocks, every later one does: first come, first served. A request that waited ``kv_wait_s`` for blocks fails
        with ``KVBudgetExceeded``; a cancelled one is dropped. With a spill file, swapped rows resume first, first
        preempted first, as their worst cases fit; an arrival that does not fit preempts the newest running rows whose
        worst cases make room for it, when the spill file holds their pages (``_victims``): a request waits, and gets
        its 503, only past both budgets."""
        if not arrivals and not self._swapped:  # most turns: nothing to count (the promise walks every row's pages)
            return [], [], [], []
        with self.pool.lock if self.pool is not None else contextlib.nullcontext():  # shared pages counted, then held
            return self._fitting_locked(arrivals)

    def _fitting_locked(self, arrivals: list[BatchedGeneration]) -> tuple[list, list, list[SwappedRow], list]:
        rows = {id(b.key): len(b.rows) for b in self._batches}
        free = self.pool.capacity_bytes - self._promised_bytes() \
            if self.pool is not None and self.pool.fixed else None  # bytes no admitted row may come to need
        resume, waiting = [], []
        for swapped in self._swapped:
            g = swapped.row.generation
            key = id(self._key(g.release))
            if g.cancelled:
                self.spill.release(swapped.spilled)
            elif waiting or swapped.row.kv_bytes > free or rows.get(key, 0) >= self.max_rows:
                waiting.append(swapped)
            else:
                resume.append(swapped)
                free -= swapped.row.kv_bytes
                rows[key] = rows.get(key, 0) + 1
        self._swapped = waiting
        admit, wait, full, kv_full, preempt = [], [], set(), False, []
        now = time.monotonic()
        for g in arrivals:
            if g.cancelled:
                continue
            key, need = id(self._key(g.release)), self._arrival_bytes(g)
            if self.spill is not None and not kv_full and need > free:
                victims = self._victims(need - free, preempt)
                preempt += victims
                for batch, row in victims:
                    free += self._reserved_bytes(batch, row, alone=True)
                    rows[id(batch.key)] -= 1
            taken = rows.get(key, 0)
            if kv_full or (free is not None and need > free):
                if now - g.submitted >= self.kv_wait_s:
                    self._deliver(g, KVBudgetExceeded(
                        f"waited {now - g.submitted:.1f} s for {need} bytes of KV cache; {free} of "
                        f"{self.pool.capacity_bytes} are not promised to running requests"))
                    continue
                kv_full = True
                wait.append(g)
            elif key in full or (taken and taken + len(g.prompts) > self.max_rows):
                full.add(key)
                wait.append(g)
            else:  # an empty batch takes any request (its prompts are capped far below MAX_BATCH)
                rows[key] = taken + len(g.prompts)
                free = None if free is None else free - need
                if free is not None and self.prefix is not None:
                    g.shared = self._lookup(g)
                admit.append(g)
        return admit, wait, resume, preempt

    # What the budget has promised. A shared page counts once, however many rows hold it: each running row promises
    # its worst case less the indexed pages it holds (``_reserved_bytes``), and the indexed pages rows hold count once
    # (``PrefixPages.held_bytes``). So the pages rows hold, each once, plus what every row may still take never exceed
    # the budget, and rows that share a prefix are admitted beside each other where their whole worst cases would not
    # be. A page that leaves the index (its release left the device) counts again in each row's whole worst case.

    def _promised_bytes(self) -> int:
        """Bytes the running rows hold or may come to take (the pool's lock held when pages are shared)."""
        rows = sum(self._reserved_bytes(b, r) for b in self._batches for r in b.rows)
        return rows + (self.prefix.held_bytes() if self.prefix is not None else 0)

    def _reserved_bytes(self, batch: ReleaseBatch, row: Row, alone: bool = False) -> int:
        """A running row's worst case less the indexed pages it holds (counted once, by ``_promised_bytes``). With
        ``alone``, less only those another row holds too: what preempting it surely frees (a page it alone holds goes
        idle, and an idle page is the pool's to take)."""
        if self.prefix is None:
            return row.kv_bytes
        blocks = batch.cache.row_blocks(batch.rows.index(row))
        shared = sum(pool.block_bytes for pool, held in zip(batch.cache.pool.block_pools, blocks) for block in held
                     if self.prefix.indexed(pool, block) and not (alone and self.prefix.holders(pool, block) == 1))
        return row.kv_bytes - shared

    def _arrival_bytes(self, g: BatchedGeneration) -> int:
        """What admitting ``g`` promises: each row's worst case less the indexed pages its prompt starts with, plus
        those of them no row holds (idle: they count once held)."""
        if self.prefix is None or not self.pool.fixed:
            return sum(g.row_kv_bytes)
        need = 0
        for scope, prompt, worst in zip(self._scopes([g]), g.prompts, g.row_kv_bytes):
            pages = self.prefix.peek(scope, prompt, self.share_unit)
            need += worst - sum(pool.block_bytes for pool, block in pages if not self.prefix.is_idle(pool, block))
        return need

    def _lookup(self, g: BatchedGeneration) -> list[list]:
        """Per prompt of ``g``, the shared pages it starts with, now held by its row (the pool's lock held)."""
        return [self.prefix.lookup(scope, prompt, self.share_unit) for scope, prompt in zip(self._scopes([g]), g.prompts)]

    @staticmethod
    def _scopes(gens: list[BatchedGeneration]) -> list[str]:
        """The prefix scope of each row of ``gens`` (their release as loaded)."""
        return [release_scope(g.release.release_id, g.release.activation) for g in gens for _ in g.prompts]

    def _victims(self, need: int, chosen: list) -> list:
        """The newest running rows not in ``chosen`` whose worst cases add up to ``need`` bytes and whose pages the
        spill file holds after ``chosen``'s, as (batch, row) pairs; none when they cannot."""
        taken = {id(row) for _, row in chosen}
        running = sorted(((b, r) for b in self._batches for r in b.rows if id(r) not in taken),
                         key=lambda pair: pair[1].admitted, reverse=True)
        victims, freed = [], 0
        for batch, row in running:
            if freed >= need:
                break
            victims.append((batch, row))
            freed += self._reserved_bytes(batch, row, alone=True)
        extents = [self._held_bytes(b, r) for b, r in chosen + victims]
        return victims if freed >= need and self.spill.holds(extents) else []

    @staticmethod
    def _held_bytes(batch: ReleaseBatch, row: Row) -> int:
        """The bytes of the blocks a running row holds now (its extent in the spill file)."""
        pools = batch.cache.pool.block_pools
        return sum(len(held) * p.block_bytes for p, held in zip(pools, batch.cache.row_blocks(batch.rows.index(row))))

    def _preempt(self, victims: list) -> None:
        """Write each victim row's pages to the spill file and take it out of its batch; it waits in ``_swapped``."""
        for batch in {id(b): b for b, _ in victims}.values():
            leaving = {id(r) for b, r in victims if b is batch}
            for i, row in enumerate(batch.rows):
                if id(row) in leaving:
                    spilled = spill_row(batch.cache, i, self.spill)
                    self._swapped.append(SwappedRow(row, spilled, int(batch.tokens[i])))
                    self.metrics.preemptions.inc()
                    self.metrics.pages_swapped_out.inc(len(spilled.sizes))
            self._keep(batch, [id(r) not in leaving for r in batch.rows])
        if victims:
            log.info("preempted %d row(s) to the KV spill file (%d bytes used)", len(victims), self.spill.used_bytes)

    def _resume(self, resuming: list[SwappedRow]) -> None:
        """Read each row back into fresh blocks and join it to its release's batch; a row whose pages do not read
        back intact fails its request (500), never decodes on."""
        for swapped in resuming:
            g = swapped.row.generation
            key = self._key(g.release)
            batch = next((b for b in self._batches if b.key is key), None)
            if batch is None:
                batch = ReleaseBatch(g.release, self.stacked)
                self._batches.append(batch)
            try:
                cache = read_back(batch.engine, swapped.spilled, self.spill)
            except SpillCorrupted as err:
                log.error("request %s failed: %s", id(g), err)
                self._deliver(g, err)
                g.cancelled = True  # its other rows leave at the next step
                if not batch.rows:
                    self._drop(batch)
                continue
            self.metrics.pages_swapped_in.inc(len(swapped.spilled.sizes))
            slot = batch.bind([g.release])
            batch.cache = cache if batch.cache is None else batch.engine.concat_caches([batch.cache, cache])
            batch.rows.append(swapped.row)
            batch.lengths = np.append(batch.lengths, swapped.spilled.length)
            batch.tokens = np.append(batch.tokens, swapped.token)
            batch.slots = np.append(batch.slots, slot)

    def _key(self, release):
        """The batch a release's rows join: its own, or on a stacked engine the one batch (key None)."""
        return None if self.stacked else release

    def _deliver(self, generation: BatchedGeneration, item) -> None:
        self._outbox.append((generation, item))

    def _hand_over(self) -> None:
        """Hand what this step produced to the requests' event loops, waking each one not already woken."""
        with self._handover_lock:
            wake = [g.loop for g, _ in self._outbox if g.loop not in self._handed]
            for g, item in self._outbox:
                self._handed.setdefault(g.loop, []).append((g, item))
        self._outbox = []
        for loop in dict.fromkeys(wake):
            try:
                loop.call_soon_threadsafe(self._take, loop)
            except RuntimeError:  # that event loop has closed: nobody reads these rows any more
                for g, _ in self._take_items(loop):
                    g.cancelled = True

    def _take(self, loop) -> None:
        """On ``loop``: every item handed to it since it was woken, to its request."""
        for g, item in self._take_items(loop):
            g.put(item)

    def _take_items(self, loop) -> list:
        with self._handover_lock:
            return self._handed.pop(loop, [])

    # ------------------------------------------------------------------ admission

    def _admit(self, arrivals: list[BatchedGeneration]) -> None:
        groups: list[tuple[object, list[BatchedGeneration]]] = []
        for g in arrivals:
            key = self._key(g.release)
            group = next((gens for k, gens in groups if k is key), None)
            if group is None:
                groups.append((key, [g]))
            else:
                group.append(g)
        for key, gens in groups:
            batch = next((b for b in self._batches if b.key is key), None)
            if batch is None:
                batch = ReleaseBatch(gens[0].release, self.stacked)
                self._batches.append(batch)
            self._prefill(batch, gens)
            if not batch.rows:
                self._drop(batch)

    def _prefill(self, batch: ReleaseBatch, gens: list[BatchedGeneration]) -> None:
        """Prefill ``gens`` together and join their rows to ``batch``. When the engine refuses them
        together (it cannot allocate the padded batch, say), each is prefilled alone: only a request
        that fails alone fails, not the ones that arrived with it; the batch runs on. An engine that pairs its rows
        (``serve --batch-invariant``) prefills each request apart: ONNX Runtime's fp32 matmuls give a row other floats
        in a product of other row counts (the LoRA's, tens of rows and more), and a prefill's rows are its chunks'
        tokens, which a request's company would change; a decode step has a row per request."""
        if len(gens) > 1 and getattr(batch.engine, "paired_rows", False):
            for g in gens:
                self._prefill(batch, [g])
            return
        try:
            prompts = [p for g in gens for p in g.prompts]
            slots = batch.bind([g.release for g in gens for _ in g.prompts])  # (n,)
            if self.pool is None:  # a padded cache: left-padded, the padding's slots dropped when rows leave
                ids, pos, mask = left_padded(prompts, self.pad_id)  # (n, L) each
                logits, cache = prefill(batch.engine, ids, pos, mask, self.prefill_chunk,
                                        **self._slots(batch, slots))  # (n, 1, V)
                width = ids.shape[1]
            else:  # paged: each row in its own positions' chunks, after the shared pages it starts with
                scopes = self._scopes(gens)
                start, shared = self._shared_pages(batch, gens, scopes)  # (n,) tokens each row reads from shared pages
                logits, cache = prefill_by_position(batch.engine, prompts, shared,
                                                    self.prefill_chunk or max(map(len, prompts)), start,
                                                    **self._slots(batch, slots))  # (n, 1, V)
                self._index_pages(cache, prompts, scopes)
                width = None
        except Exception as err:
            if len(gens) > 1:
                log.warning("prefill of %d requests together failed (%s: %s); prefilling each alone",
                            len(gens), type(err).__name__, err)
                for g in gens:
                    self._prefill(batch, [g])
                return
            log.exception("prefill failed")
            self._unshare(gens[0])
            self._deliver(gens[0], err)
            return
        try:
            self._join(batch, gens, np.array([len(p) for p in prompts]), width, logits, cache, slots)
        except Exception as err:  # a bug past the engine: these requests fail, the batch runs on
            log.exception("joining the prefilled rows failed")
            for g in gens:
                self._deliver(g, err)

    def _shared_pages(self, batch: ReleaseBatch, gens: list[BatchedGeneration], scopes: list[str]):
        """(a cache whose rows start with the longest chain of shared pages each prompt of ``gens`` begins with, or
        None without sharing; (n,) the tokens those pages hold). The pages a request was admitted with (``shared``,
        held since) pass to the cache; a request prefilled again after a failed batch looks them up again."""
        if self.prefix is None:
            return None, np.zeros(sum(len(g.prompts) for g in gens), dtype=np.int64)
        with self.pool.lock:
            pages = []
            for g in gens:
                held, g.shared = g.shared, None
                pages += held or self._lookup(g)
            start = batch.engine.cache_with_pages(pages)
        return start, start.lengths.copy()

    def _unshare(self, g: BatchedGeneration) -> None:
        """Let go of the shared pages ``g`` was admitted with when it fails before its prefill took them."""
        held, g.shared = g.shared, None
        if held is None:
            return
        for pool, block in (page for pages in held for page in pages):
            pool.release([[block]])

    def _index_pages(self, cache, prompts: list[list[int]], scopes: list[str]) -> None:
        """Index the full pages of each prefilled prompt (row b of ``cache`` holds ``prompts[b]``) for the next."""
        if self.prefix is not None:
            with self.pool.lock:
                for row, (scope, prompt) in enumerate(zip(scopes, prompts)):
                    self.prefix.add(scope, prompt, cache.full_pages(row))

    @staticmethod
    def _slots(batch: ReleaseBatch, slots: np.ndarray) -> dict:
        """forward's ``slots`` argument: only a stacked batch passes one (other engines take none)."""
        return {"slots": slots} if batch.stacked else {}

    def _join(self, batch: ReleaseBatch, gens: list[BatchedGeneration], lengths, width, logits, cache, slots) -> None:
        """Sample the first tokens of the prefilled ``gens`` (``lengths`` (n,): their prompts' tokens; ``width``: a
        padded cache's past, None for a paged one) and merge their rows into ``batch``."""
        rows = [Row(g, i, self._admitted + n) for n, (g, i) in enumerate((g, i) for g in gens for i in range(len(g.prompts)))]
        self._admitted += len(rows)
        tokens, decoding = self._emit(rows, logits[:, -1])
        if not any(decoding):
            return
        keep = np.array(decoding)
        drop = 0 if width is None else width - int(lengths[keep].max())
        if drop or not keep.all():
            cache = batch.engine.take_cache_rows(cache, np.flatnonzero(keep), drop)
        batch.cache = cache if batch.cache is None else batch.engine.concat_caches([batch.cache, cache])
        batch.rows += [r for r, k in zip(rows, keep) if k]
        batch.lengths = np.concatenate([batch.lengths, lengths[keep]])
        batch.tokens = np.concatenate([batch.tokens, tokens[keep]])
        batch.slots = np.concatenate([batch.slots, slots[keep]])

    # ------------------------------------------------------------------ decode

    def _step(self, batch: ReleaseBatch) -> None:
        self._keep(batch, [not r.generation.cancelled for r in batch.rows])
        if not batch.rows:
            return
        B, W = len(batch.rows), int(batch.lengths.max())
        lengths = batch.lengths + 1
        mask = (np.arange(W + 1)[None, :] >= (W + 1 - lengths)[:, None]).astype(np.int64)  # (B, W + 1)
        try:
            logits, batch.cache = batch.engine.forward(batch.tokens[:, None], batch.lengths[:, None], mask, batch.cache,
                                                       **self._slots(batch, batch.slots))
        except Exception as err:
            log.exception("decode step failed")
            for g in {id(r.generation): r.generation for r in batch.rows}.values():
                self._deliver(g, err)
            self._drop(batch)
            return
        self.metrics.batch_rows.observe(B)
        self.metrics.batch_releases.observe(len({id(r.generation.release) for r in batch.rows}))
        batch.lengths = lengths
        batch.tokens, keep = self._emit(batch.rows, logits[:, -1])
        self._keep(batch, keep)

    def _emit(self, rows: list[Row], logits: np.ndarray) -> tuple[np.ndarray, list[bool]]:
        """Sample every row's next token from ``logits`` (B, V), each request's rows with its own
        sampler, hand each request its choices; (tokens (B,), per row whether it decodes on)."""
        tokens = np.zeros(len(rows), dtype=np.int64)
        by_request: dict[int, list[int]] = {}
        for b, r in enumerate(rows):
            by_request.setdefault(id(r.generation), []).append(b)
        argmax = None  # the greedy rows': one argmax over the batch, which is each row's own argmax
        for positions in by_request.values():
            g = rows[positions[0]].generation
            if g.cancelled:
                continue
            if g.sample is greedy:
                argmax = logits.argmax(-1) if argmax is None else argmax
                sampled = argmax[positions]
            else:
                sampled = g.sample(logits[positions])  # (n,): the request's draws do not depend on the batch
            tokens[positions] = sampled
            choices = g.accept({rows[b].index: None if t in self.stop_ids else t
                                for b, t in zip(positions, sampled.tolist())})
            if choices:
                self._deliver(g, choices)
            if all(g.finished):
                self._deliver(g, None)
        return tokens, [not (r.generation.cancelled or r.generation.finished[r.index]) for r in rows]

    def _drop(self, batch: ReleaseBatch) -> None:
        """The batch leaves, its cache now: a paged one's blocks are free before its last choices are handed over."""
        batch.cache = None
        self._batches.remove(batch)

    def _keep(self, batch: ReleaseBatch, keep: list[bool]) -> None:
        """Only the rows where ``keep`` (one bool per row); the past slots masked in all of them are dropped."""
        if all(keep):  # a Python list: most steps keep every row, and numpy's all() on it costs more
            return
        if not any(keep):
            self._drop(batch)
            return
        keep = np.array(keep)
        drop = int(batch.lengths.max() - batch.lengths[keep].max())
        batch.cache = batch.engine.take_cache_rows(batch.cache, np.flatnonzero(keep), drop)
        batch.rows = [r for r, k in zip(batch.rows, keep) if k]
        batch.lengths, batch.tokens, batch.slots = batch.lengths[keep], batch.tokens[keep], batch.slots[keep]
