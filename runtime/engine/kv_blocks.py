"""The paged KV cache's memory: a pool of fixed-size blocks per cache tensor and layer, and each row's blocks.

A version-6 engine (``runtime.engine.interface.paged_kv_tensors``) reads its past through a block table, so a
row holds ceil(length / block_size) blocks wherever they lie in the pool, takes one more when it crosses a
block boundary, and gives them all back when it leaves: no row is padded to the longest (vLLM's
PagedAttention, Kwon et al. 2023, sec. 4.1). ``BlockPool`` owns the numpy pools, shared with the backend as
its own values (``wrap``: ONNX Runtime's ``ortvalue_from_numpy``, same memory, so a write is seen by the next
step without a copy); ``PagedCache`` is the rows of one batch. Neither torch nor ONNX Runtime is imported here:
the serving path's command and HTTP layer read the budget's errors without loading an engine.

Capacity: a pool with a budget (``BlockPool.for_budget``) has a fixed number of blocks and refuses, with
``KVBudgetExceeded``, an allocation past them; the scheduler admits a request only when its worst case
fits (``runtime.serve.batcher``). Without one the pool doubles when it runs out (evaluation, tests).
Every pool is zero-filled: a slot no row has written is masked, and a masked slot must still be finite
(0 x NaN is NaN in the attention's weighted sum).
"""

from __future__ import annotations

import mmap
import os
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from runtime.engine.errors import RefusedInput
from runtime.engine.kv_prefix import Page, PrefixPages

INITIAL_BLOCKS = 64  # a pool without a budget starts this big, then doubles
# serve's default budget: a quarter of the available memory leaves the rest to the weights (int4 0.5B: ~0.4 GB),
# ORT's per-step transients (one layer's gathered past at a time) and the other processes of the device
DEFAULT_BUDGET_SHARE = 0.25


def small_paged_zeros(shape: tuple[int, ...], dtype: str) -> np.ndarray:
    """A zero-filled array in memory of its own (an anonymous map), in 4 KiB pages, never 2 MiB huge ones.

    numpy asks the kernel for huge pages on every array of 4 MiB or more (madvise MADV_HUGEPAGE); a pool is
    budget-sized (a quarter of the machine) and filled from its first block on, so a huge page made resident
    2 MiB of each pool for the first few KB a row wrote: measured, 48 pools (the 0.5B shape) holding 51.9 MB of
    blocks were 88.7 MB resident, 48.1 MB in small pages. The pages stay zero pages until first written."""
    nbytes = max(int(np.prod(shape)) * np.dtype(dtype).itemsize, 1)
    # private and anonymous (mmap's default is shared: memory a forked child would write into), zero-filled;
    # unmapped when the last array over it goes
    memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):  # Linux; elsewhere the system's default pages
        memory.madvise(mmap.MADV_NOHUGEPAGE)
    return np.frombuffer(memory, dtype=dtype, count=int(np.prod(shape))).reshape(shape)


class KVBudgetExceeded(RefusedInput):
    """More KV blocks than the device's budget holds: now (wait and retry) or ever (``never`` True)."""

    def __init__(self, message: str, never: bool = False):
        super().__init__(message)
        self.never = never


@dataclass(frozen=True)
class PoolTensor:
    name: str  # the engine input, ``pool_*.i``
    shape: tuple[int, int, int]  # (nkv, block_size, width) of one block
    dtype: str

    @property
    def block_bytes(self) -> int:
        return int(np.prod(self.shape)) * np.dtype(self.dtype).itemsize


class BlockPool:
    """Blocks of every cache tensor of every layer; block b of each pool together hold one block of tokens."""

    def __init__(self, tensors: list[PoolTensor], capacity: int | None, block_size: int,
                 wrap: Callable[[np.ndarray], Any] = lambda a: a):
        """``capacity``: blocks, fixed; None: start at ``INITIAL_BLOCKS`` and double when full. ``wrap``: a
        pool array as the backend binds it, sharing its memory (``values``, made again when the pool grows)."""
        self.tensors, self.block_size, self.fixed, self.wrap = tensors, block_size, capacity is not None, wrap
        self.block_bytes = sum(t.block_bytes for t in tensors)
        # Allocation, freeing, writes and growth; ONNX Runtime only reads. Reentrant: a cache the garbage
        # collector finalizes while this thread holds the lock gives its blocks back under it.
        self.lock = threading.RLock()
        self._allocate(capacity if capacity is not None else INITIAL_BLOCKS)
        self._free = list(range(self.capacity - 1, -1, -1))  # a stack: block 0 first, freed blocks reused first
        self.prefix: PrefixPages | None = None  # pages shared between rows (``share_prefixes``), counted there

    @classmethod
    def for_budget(cls, tensors: list[PoolTensor], block_size: int, budget_bytes: int | None,
                   wrap: Callable[[np.ndarray], Any] = lambda a: a) -> "BlockPool":
        """A pool of as many blocks as ``budget_bytes`` holds (None: growing)."""
        if budget_bytes is None:
            return cls(tensors, None, block_size, wrap)
        block_bytes = sum(t.block_bytes for t in tensors)
        if budget_bytes < block_bytes:
            raise KVBudgetExceeded(f"a KV budget of {budget_bytes} bytes is less than one block of "
                                   f"{block_bytes} bytes ({block_size} tokens)", never=True)
        return cls(tensors, budget_bytes // block_bytes, block_size, wrap)

    def _allocate(self, blocks: int) -> None:
        old = getattr(self, "arrays", None)
        self.arrays = {t.name: small_paged_zeros((blocks, *t.shape), t.dtype) for t in self.tensors}  # (N, nkv, bs, w)
        if old is not None:
            for name, array in old.items():
                self.arrays[name][: len(array)] = array
        self.values = {name: self.wrap(a) for name, a in self.arrays.items()}
        self.capacity = blocks

    @property
    def block_pools(self) -> tuple["BlockPool", ...]:
        """The pools a row's blocks lie in (one here; a ``PagePool`` has two)."""
        return (self,)

    def take_blocks(self, counts: list[int]) -> list[list[int]]:
        """``counts[i]`` blocks of each of ``block_pools`` (caller holds ``lock``), within the budget."""
        return [self.take(counts[0])]

    def share_prefixes(self, prefix: PrefixPages | None = None) -> PrefixPages:
        """Full pages of rows' prompts are indexed and shared from now on (``runtime.engine.kv_prefix``), in
        ``prefix`` (the index a ``PagePool``'s two pools share) or an index of this pool's own."""
        self.prefix = prefix or PrefixPages(self.block_size)
        return self.prefix

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def idle_blocks(self) -> int:
        """Shared pages no row holds: kept for the next prompt that starts with them, taken back when needed."""
        return 0 if self.prefix is None else self.prefix.idle_blocks(self)

    @property
    def used_blocks(self) -> int:
        """Blocks rows hold (a shared page once)."""
        return self.capacity - len(self._free) - self.idle_blocks

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    @property
    def capacity_bytes(self) -> int:
        return self.capacity * self.block_bytes

    @property
    def used_bytes(self) -> int:
        """Bytes of the blocks rows hold (a shared page once)."""
        return self.used_blocks * self.block_bytes

    def row_bytes(self, tokens: int) -> int:
        """The most a row of up to ``tokens`` tokens holds: its blocks (the scheduler's worst case per row)."""
        return self.blocks_for(tokens) * self.block_bytes

    def take(self, count: int) -> list[int]:
        """``count`` free blocks (caller holds ``lock``), idle shared pages given back first when there are too few;
        then a pool without a budget grows, one with refuses."""
        if count > len(self._free) and self.prefix is not None:
            self.prefix.evict(self, count - len(self._free))
        if count > len(self._free):
            if self.fixed:
                raise KVBudgetExceeded(f"{count} KV blocks needed, {len(self._free)} of {self.capacity} free")
            grown = max(2 * self.capacity, self.capacity + count)
            self._free = list(range(grown - 1, self.capacity - 1, -1)) + self._free
            self._allocate(grown)
        taken, self._free = self._free[len(self._free) - count :], self._free[: len(self._free) - count]
        return taken[::-1]

    def release(self, rows: list[list[int]]) -> None:
        """Give back every block of ``rows`` and empty them (the rows left their batch); a shared page stays while
        another row holds it, and idle while its prompt may come again."""
        with self.lock:
            for blocks in rows:
                self.give_back(blocks if self.prefix is None else self.prefix.released(self, blocks))
                blocks.clear()

    def give_back(self, blocks: list[int]) -> None:
        """``blocks`` are free (caller holds ``lock``)."""
        self._free += blocks[::-1]


class PagedCache:
    """The rows of one batch: each row's blocks, in order, and its length (tokens written).

    A cache is consumed by ``concat`` and ``take_rows`` (its rows move to the result, or go back to the
    pool); rows still held when a cache is collected go back too (a generator closed mid-decode)."""

    def __init__(self, pool: BlockPool, blocks: list[list[int]], lengths: np.ndarray):
        self.pool, self.blocks, self.lengths = pool, blocks, lengths  # lengths (B,) int64
        weakref.finalize(self, pool.release, blocks)  # the same list object: emptied in place when rows move

    @classmethod
    def with_pages(cls, pool: BlockPool, rows: list[list[Page]]) -> "PagedCache":
        """Rows that start with the full pages ``rows`` (shared, already counted as held by them)."""
        return cls(pool, [[block for _, block in pages] for pages in rows],
                   np.array([len(pages) * pool.block_size for pages in rows], dtype=np.int64))

    def row_blocks(self, row: int) -> list[list[int]]:
        """Row ``row``'s blocks, per pool of ``pool.block_pools`` (one here): what a spill writes out."""
        return [list(self.blocks[row])]

    def full_pages(self, row: int) -> list[Page]:
        """Where row ``row``'s full pages lie, page 0 first."""
        return [(self.pool, block) for block in self.blocks[row][: int(self.lengths[row]) // self.pool.block_size]]

    @property
    def batch(self) -> int:
        return len(self.blocks)

    def _moved(self) -> list[list[int]]:
        rows = list(self.blocks)
        self.blocks.clear()
        return rows

    @staticmethod
    def concat(caches: list["PagedCache"]) -> "PagedCache":
        lengths = np.concatenate([c.lengths for c in caches])
        return PagedCache(caches[0].pool, [row for c in caches for row in c._moved()], lengths)

    def take_rows(self, rows: np.ndarray) -> "PagedCache":
        """The rows ``rows`` (indices, in order); the others' blocks go back to the pool."""
        lengths, moved = self.lengths[rows], self._moved()
        kept = set(int(r) for r in rows)
        self.pool.release([blocks for i, blocks in enumerate(moved) if i not in kept])
        return PagedCache(self.pool, [moved[int(r)] for r in rows], lengths)

    def block_table(self) -> np.ndarray:
        """(B, M) int64: each row's blocks that hold its past, M the most any row has; unused entries 0 (masked)."""
        return self._table([self.pool.blocks_for(int(n)) for n in self.lengths])

    def tables(self) -> list[np.ndarray]:
        """The engine's table inputs, in interface order: ``block_table``."""
        return [self.block_table()]

    def past_mask(self, tables: list[np.ndarray]) -> np.ndarray:
        """(B, M bs) bool: the slots of ``tables`` (``tables()``) each row has filled."""
        return np.arange(tables[0].shape[1] * self.pool.block_size)[None, :] < self.lengths[:, None]

    def _table(self, held: list[int]) -> np.ndarray:
        """(B, max(held)) int64: the first ``held[b]`` blocks of each row b, then zeros."""
        table = np.zeros((self.batch, max(held, default=0)), dtype=np.int64)
        for b, (blocks, n) in enumerate(zip(self.blocks, held)):
            table[b, :n] = blocks[:n]
        return table

    def append(self, outputs: dict[str, np.ndarray], real: np.ndarray) -> None:
        """Write the new tokens ``real`` marks (B, T) of ``outputs`` ({pool name: (B, nkv, T, w)}) after each
        row's last token, taking the blocks they need first; raises ``KVBudgetExceeded`` before any write."""
        pool, bs = self.pool, self.pool.block_size
        counts = real.sum(axis=1)
        rows, steps = np.nonzero(real)  # (K,) each: the row and step of every token written, row-major
        slot = self.lengths[rows] + (np.cumsum(real, axis=1) - 1)[rows, steps]  # its slot in its row
        with pool.lock:
            need = [pool.blocks_for(int(n + c)) - len(blocks) for blocks, n, c in zip(self.blocks, self.lengths, counts)]
            taken = pool.take(sum(max(n, 0) for n in need))
            for blocks, n in zip(self.blocks, need):
                if n > 0:
                    blocks += taken[:n]
                    taken = taken[n:]
            table = self._table([len(blocks) for blocks in self.blocks])  # every block held
            block, offset = table[rows, slot // bs], slot % bs  # (K,) each
            for name, new in outputs.items():
                pool.arrays[name][block, :, offset] = new[rows, :, steps]  # (K, nkv, w)
        self.lengths = self.lengths + counts

    def allocated_bytes(self) -> int:
        return sum(len(b) for b in self.blocks) * self.pool.block_bytes


def default_kv_budget_bytes(share: float = DEFAULT_BUDGET_SHARE) -> int:
    """``share`` of the memory the kernel says is available now (``MemAvailable`` of /proc/meminfo; where
    there is none, of the physical memory): serve's KV budget when none is configured. The pool's pages
    are zero pages until a block is first written, so an idle budget costs no resident memory."""
    try:
        with open("/proc/meminfo") as fh:
            available = next(int(line.split()[1]) * 1024 for line in fh if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        available = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return int(available * share)
