"""Pages of preempted rows on local storage: the spill file.

When a request cannot be admitted within the KV budget, the scheduler may preempt running rows
(``runtime.serve.batcher``): their pages are written here, their blocks go back to the pool, and they are read
back into fresh blocks when the pool has room again, byte for byte, so a resumed row decodes what it would have.

The file is the process's own: created with mode 0600 and removed from its directory at once (``O_TMPFILE`` where
the filesystem has it, else a fresh name unlinked right after it is made), so nothing else opens it, and it is gone
whenever the process ends, killed or not. A named leftover of a process killed between the two steps is removed at
the next start (``STALE_GLOB``). Space: at most ``budget_bytes``, each row's pages in one extent of their exact bytes
(a float page is ~13 sealed ones at the 0.5B shape: slots of one size would waste most of the file); each page's
blake2b digest is kept in memory and checked on reading, so a page that does not read back intact raises
``SpillCorrupted`` (the row fails; it never decodes from wrong K/V).
"""

from __future__ import annotations

import hashlib
import os
import secrets
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SPILL_PREFIX = "adapter-kv-swap-"
STALE_GLOB = f"{SPILL_PREFIX}*.spill"
DIGEST_BYTES = 16


class SwapFull(Exception):
    """The spill file's budget holds no more pages."""


class SpillCorrupted(RuntimeError):
    """A spilled page did not read back as written."""


@dataclass(frozen=True)
class SpilledRow:
    """A row's pages in the spill file: one extent from ``offset``, its pages' sizes and digests in order (blocks of
    each of the pool's ``block_pools`` in turn, ``counts`` of each), and the row's length."""
    counts: tuple[int, ...]
    offset: int
    sizes: tuple[int, ...]
    digests: tuple[bytes, ...]
    length: int

    @property
    def nbytes(self) -> int:
        return sum(self.sizes)


class SpillFile:
    """Rows' pages in one private, unnamed file under ``directory``, at most ``budget_bytes``: each row one extent of
    its exact bytes, placed first fit among the free ranges (adjacent ranges merge when freed)."""

    def __init__(self, directory: str | Path, budget_bytes: int):
        directory = Path(directory)
        if not directory.is_dir():
            raise FileNotFoundError(f"kv swap directory {directory} does not exist")
        if budget_bytes < 1:
            raise ValueError(f"a kv swap budget of {budget_bytes} bytes holds nothing")
        self.directory, self.budget_bytes = directory, budget_bytes
        for stale in directory.glob(STALE_GLOB):  # only this module's names: a leftover of a killed process
            stale.unlink(missing_ok=True)
        self.fd = self._open_private(directory)
        self._free = [(0, budget_bytes)]  # (offset, length), by offset
        self._lock = threading.Lock()

    @staticmethod
    def _open_private(directory: Path) -> int:
        if hasattr(os, "O_TMPFILE"):
            try:
                return os.open(directory, os.O_TMPFILE | os.O_RDWR, 0o600)
            except OSError:  # a filesystem without unnamed files
                pass
        path = directory / f"{SPILL_PREFIX}{os.getpid()}-{secrets.token_hex(4)}.spill"
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        os.unlink(path)
        return fd

    @property
    def used_bytes(self) -> int:
        return self.budget_bytes - sum(length for _, length in self._free)

    def holds(self, extents: list[int]) -> bool:
        """Whether extents of these sizes, placed one after another, fit beside what the file holds now."""
        free = list(self._free)
        for size in extents:
            i = next((i for i, (_, length) in enumerate(free) if length >= size), None)
            if i is None:
                return False
            offset, length = free[i]
            free[i] = (offset + size, length - size)
        return True

    def write(self, pages: list[bytes], counts: tuple[int, ...], length: int) -> SpilledRow:
        """A row's ``pages`` into one extent (``SwapFull`` before anything is written when no free range holds it)."""
        size = sum(map(len, pages))
        with self._lock:
            i = next((i for i, (_, free) in enumerate(self._free) if free >= size), None)
            if i is None:
                raise SwapFull(f"a row of {size} bytes of KV pages: no free range of the spill file holds it "
                               f"({self.used_bytes} of {self.budget_bytes} bytes used)")
            offset, free = self._free[i]
            self._free[i : i + 1] = [(offset + size, free - size)] if free > size else []
        os.pwrite(self.fd, b"".join(pages), offset)
        return SpilledRow(counts, offset, tuple(map(len, pages)),
                          tuple(hashlib.blake2b(p, digest_size=DIGEST_BYTES).digest() for p in pages), length)

    def read(self, row: SpilledRow) -> list[bytes]:
        """The row's pages, each checked against its digest: ``SpillCorrupted`` naming the first that is not."""
        data = os.pread(self.fd, row.nbytes, row.offset)
        pages, start = [], 0
        for n, (size, digest) in enumerate(zip(row.sizes, row.digests)):
            page = data[start : start + size]
            if len(page) != size or hashlib.blake2b(page, digest_size=DIGEST_BYTES).digest() != digest:
                raise SpillCorrupted(f"KV page {n} of a preempted row (spill file bytes {row.offset + start}-"
                                     f"{row.offset + start + size}) did not read back as written")
            pages.append(page)
            start += size
        return pages

    def release(self, row: SpilledRow) -> None:
        """The row's extent is free again (merged with free neighbours)."""
        with self._lock:
            free = sorted(self._free + [(row.offset, row.nbytes)])
            merged = [free[0]]
            for offset, length in free[1:]:
                last_offset, last_length = merged[-1]
                if last_offset + last_length == offset:
                    merged[-1] = (last_offset, last_length + length)
                else:
                    merged.append((offset, length))
            self._free = merged

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def row_pages(cache, row: int) -> tuple[list[bytes], tuple[int, ...]]:
    """Row ``row`` of a paged cache as bytes, one page per block (every layer's tensors of it), and how many blocks of
    each of the pool's ``block_pools``."""
    pool = cache.pool
    blocks = cache.row_blocks(row)
    with pool.lock:
        pages = [b"".join(array[block].tobytes() for array in owner.arrays.values())
                 for owner, held in zip(pool.block_pools, blocks) for block in held]
    return pages, tuple(map(len, blocks))


def spill_row(cache, row: int, spill: SpillFile) -> SpilledRow:
    """Row ``row`` of a paged cache into ``spill`` (its blocks stay the cache's: the caller drops the row after)."""
    pages, counts = row_pages(cache, row)
    return spill.write(pages, counts, int(cache.lengths[row]))


def read_back(engine, spilled: SpilledRow, spill: SpillFile):
    """A one-row cache of ``engine``'s pool holding ``spilled``'s pages in fresh blocks; its extent freed. Every page
    is read and checked before a block is taken: ``SpillCorrupted`` leaves the pool as it was."""
    pool = engine.pool
    try:
        pages = iter(spill.read(spilled))
    finally:
        spill.release(spilled)
    with pool.lock:
        blocks = pool.take_blocks(list(spilled.counts))
        for owner, held in zip(pool.block_pools, blocks):
            for block in held:
                page, offset = next(pages), 0
                for array in owner.arrays.values():
                    slab = array[block]
                    array[block] = np.frombuffer(page, dtype=array.dtype, count=slab.size, offset=offset).reshape(slab.shape)
                    offset += slab.nbytes
    return engine.cache_of_blocks([blocks], np.array([spilled.length], dtype=np.int64))
