"""Full KV pages shared between requests: a prompt's pages, found again by the tokens that made them.

A page's K/V depend on every token up to its last slot and on the weights that computed them, so a full page is
known by a key chained over the tokens (``page_keys``: the key of page i hashes page i-1's key and page i's own
tokens) and started from a scope, the release bound (``release_scope``: its id and activation, so a reloaded or
another release never reads these pages; an engine's KV scheme is fixed with its pool, which is per engine). A
request that starts with the tokens of pages already held reuses the longest such chain and prefills only the rest
(vLLM's automatic prefix caching, by block hashes; its ``hash(prefix tokens, block tokens)``).

What is shared is only what no row writes again: full pages. On quantized pages (``runtime.engine.kv_pages``) that is
the sink (a full float page) and sealed pages, whose codes depend only on their own K/V; the open page of a row is
never full, so never shared. The suffix's prefill reads the shared prefix through its pages, as a later prefill
chunk reads the earlier ones (``runtime.engine.generate.prefill``).

Pages are counted: a page held by rows stays; one held by none is idle, kept in the pool and given back, least
recently used first, only when the pool needs its block (``BlockPool.take``, ``PagePool.take``). ``drop_scopes``
forgets a release's pages when it leaves the device (held ones go back when their rows finish). Every method runs
under the pool's lock.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

KEY_BYTES = 16


class BlockOwner(Protocol):
    """What the index needs of a pool (``runtime.engine.kv_blocks.BlockPool``, which imports this module)."""

    block_bytes: int

    def give_back(self, blocks: list[int]) -> None: ...


Page = tuple[BlockOwner, int]  # where a page lies: its pool, its block


def release_scope(release_id: str, activation: int) -> str:
    """The scope of a loaded release's pages: its id and the activation that loaded it (a reload is another)."""
    return f"{release_id}#{activation}"


def page_keys(scope: str, tokens: Sequence[int], block_size: int) -> list[bytes]:
    """The keys of the full pages of ``tokens`` under ``scope``, page 0 first: each hashes the previous key and the
    page's own token ids (int64 little-endian), so a key names every token up to its page's end."""
    ids = np.asarray(tokens, dtype="<i8")
    key = hashlib.blake2b(scope.encode(), digest_size=KEY_BYTES).digest()
    keys = []
    for start in range(0, len(ids) - block_size + 1, block_size):
        key = hashlib.blake2b(key + ids[start : start + block_size].tobytes(), digest_size=KEY_BYTES).digest()
        keys.append(key)
    return keys


@dataclass
class PrefixCounters:
    """What sharing did since the pool was made (the server's Prometheus counters read the differences)."""
    hit_tokens: int = 0  # prompt tokens read from shared pages
    miss_tokens: int = 0  # prompt tokens prefilled
    pages_shared: int = 0  # pages a row took from the index instead of computing them


@dataclass
class PrefixPages:
    """The index of shared pages over a pool's blocks (one or two ``BlockPool``s), with their holders counted."""

    block_size: int
    pages: dict[bytes, Page] = field(default_factory=dict)  # key -> where the page lies
    scopes: dict[str, set[bytes]] = field(default_factory=dict)  # scope -> its keys
    keys: dict[tuple[int, int], bytes] = field(default_factory=dict)  # (id(pool), block) -> key, indexed blocks
    held: dict[tuple[int, int], int] = field(default_factory=dict)  # rows holding each block indexed once
    idle: OrderedDict = field(default_factory=OrderedDict)  # (id(pool), block) -> Page: held by none, oldest first
    idle_counts: dict[int, int] = field(default_factory=dict)  # id(pool) -> its idle pages
    counters: PrefixCounters = field(default_factory=PrefixCounters)

    @property
    def cached_pages(self) -> int:
        return len(self.pages)

    def peek(self, scope: str, tokens: Sequence[int], unit: int = 1) -> list[Page]:
        """The longest chain of indexed pages, a multiple of ``unit`` pages, that starts ``tokens`` under ``scope``,
        leaving at least one token to prefill (its logits are the first answer); nothing changes."""
        found = []
        for key in page_keys(scope, tokens[: len(tokens) - 1], self.block_size):
            page = self.pages.get(key)
            if page is None:
                break
            found.append(page)
        del found[len(found) - len(found) % unit :]
        return found

    def lookup(self, scope: str, tokens: Sequence[int], unit: int = 1) -> list[Page]:
        """``peek``'s pages, each now held once more by the caller's row."""
        found = self.peek(scope, tokens, unit)
        for pool, block in found:
            slot = (id(pool), block)
            self.held[slot] += 1
            if slot in self.idle:
                self._wake(slot)
        self.counters.pages_shared += len(found)
        self.counters.hit_tokens += len(found) * self.block_size
        self.counters.miss_tokens += len(tokens) - len(found) * self.block_size
        return found

    def add(self, scope: str, tokens: Sequence[int], row_pages: list[Page]) -> None:
        """Index the full pages ``row_pages`` of a row that holds ``tokens`` (its prompt) from position 0; a page
        whose key is indexed already (the one this row shares, or a twin computed beside it) is left as it is."""
        for key, (pool, block) in zip(page_keys(scope, tokens, self.block_size), row_pages):
            slot = (id(pool), block)
            if key in self.pages or slot in self.keys:
                continue
            self.pages[key] = (pool, block)
            self.scopes.setdefault(scope, set()).add(key)
            self.keys[slot] = key
            self.held[slot] = self.held.get(slot, 0) + 1

    def indexed(self, pool: BlockOwner, block: int) -> bool:
        """Whether ``block`` of ``pool`` is an indexed page (a row holding it may share it with others)."""
        return (id(pool), block) in self.keys

    def is_idle(self, pool: BlockOwner, block: int) -> bool:
        return (id(pool), block) in self.idle

    def holders(self, pool: BlockOwner, block: int) -> int:
        """Rows holding ``block`` of ``pool``, an indexed page (0: idle)."""
        return self.held[(id(pool), block)]

    def held_bytes(self) -> int:
        """Bytes of the indexed pages rows hold, each once however many rows hold it."""
        return sum(pool.block_bytes for pool, block in self.pages.values() if self.held[(id(pool), block)])

    def released(self, pool: BlockOwner, blocks: Iterable[int]) -> list[int]:
        """A row gave back ``blocks`` of ``pool``: those now free (its own, or indexed pages it held last that are
        forgotten); an indexed page it held last becomes idle, most recently used."""
        free = []
        for block in blocks:
            slot = (id(pool), block)
            count = self.held.get(slot)
            if count is None:
                free.append(block)
            elif count > 1:
                self.held[slot] = count - 1
            elif slot in self.keys:
                self.held[slot] = 0
                self.idle[slot] = (pool, block)
                self.idle_counts[id(pool)] = self.idle_counts.get(id(pool), 0) + 1
            else:
                del self.held[slot]
                free.append(block)
        return free

    def evict(self, pool: BlockOwner | None, count: int) -> int:
        """Give back up to ``count`` idle pages, least recently used first (only ``pool``'s, or any pool's when None),
        to their pools' free lists; how many went."""
        victims = []
        for slot, (owner, _) in self.idle.items():
            if len(victims) == count:
                break
            if pool is None or owner is pool:
                victims.append(slot)
        for slot in victims:
            owner, block = self._wake(slot)
            self._forget(slot)
            del self.held[slot]
            owner.give_back([block])
        return len(victims)

    def idle_blocks(self, pool: BlockOwner) -> int:
        return self.idle_counts.get(id(pool), 0)

    def drop_scopes(self, keep: set[str]) -> None:
        """Forget every page of a scope not in ``keep`` (releases that left): idle ones go back to their pools now,
        held ones when their last row gives them back."""
        for scope in [s for s in self.scopes if s not in keep]:
            for key in self.scopes.pop(scope):
                pool, block = self.pages.pop(key)
                slot = (id(pool), block)
                del self.keys[slot]
                if slot in self.idle:
                    self._wake(slot)
                    del self.held[slot]
                    pool.give_back([block])

    def _wake(self, slot: tuple[int, int]) -> Page:
        """``slot`` is no longer idle (held again, or going back to its pool)."""
        pool, block = self.idle.pop(slot)
        self.idle_counts[id(pool)] -= 1
        return pool, block

    def _forget(self, slot: tuple[int, int]) -> None:
        key = self.keys.pop(slot)
        del self.pages[key]
        for scope_keys in self.scopes.values():
            scope_keys.discard(key)
