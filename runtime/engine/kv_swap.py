"""Pages of preempted rows on local storage: the spill file.

When a request cannot be admitted within the KV budget, the scheduler may preempt running rows
(``runtime.serve.batcher``): their pages are written here, their blocks go back to the pool, and they are read
back into fresh blocks when the pool has room again, byte for byte, so a resumed row decodes what it would have.

The file is the process's own: created with mode 0600 and removed from its directory at once (``O_TMPFILE`` where
the filesystem has it, else a fresh name unlinked right after it is made), so nothing else opens it, and it is gone
whenever the process ends, killed or not. A named leftover of a process killed between the two steps is removed at
the next start (``STALE_GLOB``). Space: fixed slots of one page each (the largest page kind's bytes), at most
``budget_bytes``; a slot's blake2b digest is kept in memory and checked on reading, so a page that does not read
back intact raises ``SpillCorrupted`` (the row fails; it never decodes from wrong K/V).
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


class SpillFile:
    """Fixed-size page slots in one private, unnamed file under ``directory``, at most ``budget_bytes`` of them."""

    def __init__(self, directory: str | Path, budget_bytes: int, slot_bytes: int):
        directory = Path(directory)
        if not directory.is_dir():
            raise FileNotFoundError(f"kv swap directory {directory} does not exist")
        self.directory, self.slot_bytes = directory, slot_bytes
        self.capacity = budget_bytes // slot_bytes
        if self.capacity < 1:
            raise ValueError(f"a kv swap budget of {budget_bytes} bytes holds no page of {slot_bytes} bytes")
        for stale in directory.glob(STALE_GLOB):  # only this module's names: a leftover of a killed process
            stale.unlink(missing_ok=True)
        self.fd = self._open_private(directory)
        self._free = list(range(self.capacity - 1, -1, -1))
        self._digests: dict[int, bytes] = {}
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
    def free_slots(self) -> int:
        return len(self._free)

    @property
    def used_bytes(self) -> int:
        return (self.capacity - len(self._free)) * self.slot_bytes

    def write(self, pages: list[bytes]) -> list[int]:
        """Each page into a slot of its own (``SwapFull`` before anything is written when they do not all fit)."""
        with self._lock:
            if len(pages) > len(self._free):
                raise SwapFull(f"{len(pages)} pages to spill, {len(self._free)} of {self.capacity} slots free")
            slots = [self._free.pop() for _ in pages]
        for slot, page in zip(slots, pages):
            if len(page) > self.slot_bytes:
                raise ValueError(f"a page of {len(page)} bytes is larger than a slot ({self.slot_bytes})")
            os.pwrite(self.fd, page, slot * self.slot_bytes)
            self._digests[slot] = hashlib.blake2b(page, digest_size=DIGEST_BYTES).digest()
        return slots

    def read(self, slot: int, size: int) -> bytes:
        """The page in ``slot`` (``size`` bytes); ``SpillCorrupted`` when it is not what was written."""
        page = os.pread(self.fd, size, slot * self.slot_bytes)
        if len(page) != size or hashlib.blake2b(page, digest_size=DIGEST_BYTES).digest() != self._digests.get(slot):
            raise SpillCorrupted(f"KV page in spill slot {slot} did not read back as written ({len(page)} of {size} "
                                 "bytes, digest differs)")
        return page

    def release(self, slots: list[int]) -> None:
        with self._lock:
            for slot in slots:
                self._digests.pop(slot, None)
                self._free.append(slot)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


@dataclass(frozen=True)
class SpilledRow:
    """A row's pages in the spill file: how many blocks of each of the pool's ``block_pools``, their slots in order,
    and its length."""
    counts: tuple[int, ...]
    slots: tuple[int, ...]
    length: int


def spill_row(cache, row: int, spill: SpillFile) -> SpilledRow:
    """Row ``row`` of a paged cache into ``spill`` (its blocks stay the cache's: the caller drops the row after)."""
    pool = cache.pool
    blocks = cache.row_blocks(row)
    with pool.lock:
        pages = [b"".join(array[block].tobytes() for array in owner.arrays.values())
                 for owner, held in zip(pool.block_pools, blocks) for block in held]
    return SpilledRow(tuple(map(len, blocks)), tuple(spill.write(pages)), int(cache.lengths[row]))


def read_back(engine, spilled: SpilledRow, spill: SpillFile):
    """A one-row cache of ``engine``'s pool holding ``spilled``'s pages in fresh blocks; its slots freed. Every page is
    read and checked before a block is taken: ``SpillCorrupted`` leaves the pool as it was (and frees the slots)."""
    pool = engine.pool
    sizes = [owner.block_bytes for owner, count in zip(pool.block_pools, spilled.counts) for _ in range(count)]
    try:
        pages = iter([spill.read(slot, size) for slot, size in zip(spilled.slots, sizes)])
    finally:
        spill.release(list(spilled.slots))
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
