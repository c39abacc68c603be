"""Quantized pages on the device (interface version 9, ``kernels.kv_spec.PageQuantSpec``): sealing in numpy, the
float and sealed pools under one KV budget, and each row's pages.

A row of n tokens holds its first page (the attention sink) in a float block, its open page (the last n % bs tokens,
when that page is not the first) in another float block, and every page between them sealed: codes, fp16 scales and
fp16 minima in a block of the sealed pools. The graph reads the float pages through ``float_block_table``, the
sealed ones through ``block_table`` (``runtime.engine.paged_model.QuantizedPagesBackbone``), and returns the new
tokens' float K/V; ``PagesCache.append`` writes them into the float pages and seals every page whose last slot they
fill. Sealing reads only the page's own K/V, and pages are fixed by absolute position, so the same K/V give the same
codes however the tokens came in (one prefill, chunks, one by one, in any batch).

Sealing runs here, in numpy (no torch on the serving path), with the float32 and fp16 operations of the PyTorch
reference ``kernels.page_quant`` one for one: the same integers and the same fp16 scales
(``tests/kernels/test_page_quant.py``). Codes are packed as ``kernels.page_quant.seal_packed`` packs them: values as
``kernels.bit_packing.pack_bits`` does (3 bits densely, 8 codes in 3 bytes), keys at 2 and 4 bits across tokens
(``kernels.kv_spec.key_token_rows``).

Memory: two ``BlockPool``s, one per block shape, under one byte budget. With a budget both are mapped for the whole
budget (``small_paged_zeros``: a page nobody wrote costs nothing), and the budget counts the bytes of the blocks held,
so the resident pools stay within the budget plus the float blocks' high-water mark (two per running row).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import numpy as np

from kernels.kv_spec import KEY_GRID_STEPS, MIN_PAGE_SCALE, PageQuantSpec, key_token_rows
from runtime.engine.interface import SEALED_BLOCKS_AXIS, EngineInterface, InterfaceError, quantized_pages_tensors
from runtime.engine.kv_blocks import BlockPool, KVBudgetExceeded, PoolTensor
from runtime.engine.kv_prefix import Page, PrefixPages


def page_scheme(iface: EngineInterface) -> PageQuantSpec:
    """The quantized pages a version-9 engine records, as this runtime seals them. ``InterfaceError`` when this
    runtime cannot seal them, or when the sealed pools the interface lists are not the ones that scheme stores."""
    try:
        spec = PageQuantSpec.from_dict(iface.kv_pages)
    except (TypeError, ValueError) as err:
        raise InterfaceError(f"the engine's quantized pages {iface.kv_pages} are not a scheme this runtime seals "
                             f"({err}); update the runtime or recompile the engine") from None
    problems = spec.problems(iface.head_dim) + spec.layer_problems(iface.num_layers)
    want = quantized_pages_tensors(iface.num_layers, iface.num_kv_heads, iface.head_dim, iface.kv_block_size, iface.kv_pages)
    if not problems and [t for t in iface.inputs if SEALED_BLOCKS_AXIS in t.shape] != want:
        problems.append("its sealed pools are not the ones this scheme stores (an engine compiled before the keys' "
                        "8-bit grid or their codes packed across tokens: recompile it)")
    if problems:
        raise InterfaceError(f"the engine's quantized pages {spec.name}: " + "; ".join(problems))
    return spec


# ---------------------------------------------------------------- sealing


def _scale_minimum(lo: np.ndarray, hi: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """fp16 (scale, minimum) covering [lo, hi] at ``bits``: ``kernels.page_quant``'s, in numpy."""
    scale = np.maximum(((hi - lo) / np.float32(2**bits - 1)).astype(np.float16), np.float16(MIN_PAGE_SCALE))
    return scale, lo.astype(np.float16)


def _codes(x: np.ndarray, scale: np.ndarray, minimum: np.ndarray, bits: int) -> np.ndarray:
    """u = clip(round half to even((x - minimum) / scale), 0, 2^b - 1) as uint8, in float32."""
    u = np.rint((x - minimum.astype(np.float32)) / scale.astype(np.float32))
    return np.clip(u, 0, 2**bits - 1).astype(np.uint8)


def _key_grid(lo: np.ndarray, hi: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per-channel key ranges [lo, hi] (..., d) float32 -> ``kernels.page_quant.key_grid``'s scale codes, minimum codes
    and key_base, in numpy, and the float32 (scale, minimum) they read as."""
    f32, f16 = np.float32, np.float16
    origin = lo.min(axis=-1, keepdims=True).astype(f16)
    min_unit = np.maximum(((lo.max(axis=-1, keepdims=True) - origin.astype(f32)) / f32(KEY_GRID_STEPS)).astype(f16),
                          f16(MIN_PAGE_SCALE))
    min_codes = np.clip(np.floor((lo - origin.astype(f32)) / min_unit.astype(f32)), 0, KEY_GRID_STEPS)
    minimum = origin.astype(f32) + min_codes * min_unit.astype(f32)
    steps = (hi - minimum) / f32(2**bits - 1)
    unit = np.maximum((steps.max(axis=-1, keepdims=True) / f32(KEY_GRID_STEPS - 1)).astype(f16), f16(MIN_PAGE_SCALE))
    scale_codes = np.clip(np.ceil(steps / unit.astype(f32)), 1, KEY_GRID_STEPS)
    base = np.concatenate([unit, origin, min_unit], axis=-1)
    return scale_codes.astype(np.uint8), min_codes.astype(np.uint8), base, scale_codes * unit.astype(f32), minimum


def pack_codes(u: np.ndarray, bits: int) -> np.ndarray:
    """Codes u (..., n) uint8, n a multiple of 8 -> (..., n / 8 * bits) uint8: ``kernels.bit_packing.pack_bits``'s
    little-endian bit stream (code j in bits [j b, (j + 1) b)). Each 8 codes make one integer below 2^(8 b), whose
    low ``bits`` bytes are the stream's."""
    if bits == 8:
        return u
    *lead, n = u.shape
    shifts = (bits * np.arange(8)).astype(np.uint32)
    words = (u.reshape(*lead, n // 8, 8).astype(np.uint32) << shifts).sum(axis=-1, dtype=np.uint32)  # (..., n / 8)
    return words.astype("<u4").view(np.uint8).reshape(*lead, n // 8, 4)[..., :bits].reshape(*lead, n // 8 * bits)


def pack_token_runs(u: np.ndarray, bits: int) -> np.ndarray:
    """Codes u (..., n, w) uint8 -> (..., n / per, w), byte (t, c) holding u[t + j n / per, c] in bits [j b, (j + 1) b):
    ``kernels.bit_packing.pack_token_runs`` (a page's keys where ``kernels.kv_spec.key_token_rows``)."""
    per = 8 // bits
    runs = u.reshape(*u.shape[:-2], per, u.shape[-2] // per, u.shape[-1])  # (..., per, n / per, w)
    shifts = (bits * np.arange(per, dtype=np.uint8)).reshape(per, 1, 1)
    return (runs << shifts).sum(axis=-3, dtype=np.uint8)  # disjoint bits: the sum is their OR


def seal_pages(k: np.ndarray, v: np.ndarray, spec: PageQuantSpec) -> dict[str, np.ndarray]:
    """Full pages k, v (S, nkv, bs, d) float32 -> what the sealed pools store, by role (``runtime.engine.interface.SEALED_ROLES``):
    keys per (page, head, channel) over the page's tokens, on the page's 8-bit grid; values per (token, head, group of
    ``spec.v_group_size`` channels)."""
    k_scale_codes, k_min_codes, k_base, k_scale, k_min = _key_grid(k.min(axis=-2, keepdims=True),
                                                                    k.max(axis=-2, keepdims=True), spec.k_bits)
    *lead, d = v.shape
    grouped = v.reshape(*lead, d // spec.v_group_size, spec.v_group_size)  # (S, nkv, bs, d / G, G)
    v_scale, v_min = _scale_minimum(grouped.min(axis=-1), grouped.max(axis=-1), spec.v_bits)  # (S, nkv, bs, d / G)
    v_codes = _codes(grouped, v_scale[..., None], v_min[..., None], spec.v_bits).reshape(v.shape)
    k_codes = _codes(k, k_scale, k_min, spec.k_bits)
    k_packed = (pack_token_runs(k_codes, spec.k_bits) if key_token_rows(spec.k_bits, k.shape[-2])
                else pack_codes(k_codes, spec.k_bits))
    return {"key_codes": k_packed, "key_scale": k_scale_codes,
            "key_min": k_min_codes, "key_base": k_base, "value_codes": pack_codes(v_codes, spec.v_bits),
            "value_scale": v_scale, "value_min": v_min}


# ---------------------------------------------------------------- memory


class PagePool:
    """The float pools (``pool_key.i``, ``pool_value.i``: sinks and open pages) and the sealed pools of a version-9
    engine, every handle of a session sharing them; one lock, one byte budget over both."""

    def __init__(self, float_tensors: list[PoolTensor], sealed_tensors: list[PoolTensor], block_size: int,
                 budget_bytes: int | None, wrap: Callable[[np.ndarray], Any] = lambda a: a):
        """``budget_bytes``: the blocks held, float and sealed, at most this many bytes (None: both pools grow)."""
        self.block_size, self.budget_bytes, self.fixed = block_size, budget_bytes, budget_bytes is not None
        float_bytes, sealed_bytes = (sum(t.block_bytes for t in ts) for ts in (float_tensors, sealed_tensors))
        if budget_bytes is not None and budget_bytes < float_bytes:
            raise KVBudgetExceeded(f"a KV budget of {budget_bytes} bytes is less than one float page of {float_bytes} "
                                   f"bytes ({block_size} tokens)", never=True)
        capacity = (lambda b: None) if budget_bytes is None else (lambda b: budget_bytes // b)
        self.float = BlockPool(float_tensors, capacity(float_bytes), block_size, wrap)
        self.sealed = BlockPool(sealed_tensors, capacity(sealed_bytes), block_size, wrap)
        self.lock = self.sealed.lock = self.float.lock  # one lock: a row's pages move between the two

    @property
    def values(self) -> dict[str, Any]:
        return self.float.values | self.sealed.values

    @property
    def arrays(self) -> dict[str, np.ndarray]:
        return self.float.arrays | self.sealed.arrays

    @property
    def capacity(self) -> int:
        """Sealed pages the budget holds (the mapped sealed pools' blocks without one)."""
        return self.sealed.capacity

    @property
    def capacity_bytes(self) -> int:
        return self.budget_bytes if self.fixed else self.float.capacity_bytes + self.sealed.capacity_bytes

    @property
    def used_bytes(self) -> int:
        """Bytes of the blocks rows hold (a shared page once)."""
        return self.float.used_blocks * self.float.block_bytes + self.sealed.used_blocks * self.sealed.block_bytes

    @property
    def idle_bytes(self) -> int:
        """Bytes of shared pages no row holds (kept under the budget until it needs them)."""
        return self.float.idle_blocks * self.float.block_bytes + self.sealed.idle_blocks * self.sealed.block_bytes

    @property
    def prefix(self) -> PrefixPages | None:
        return self.float.prefix

    @property
    def block_pools(self) -> tuple[BlockPool, BlockPool]:
        """The pools a row's blocks lie in: float, then sealed."""
        return self.float, self.sealed

    def take_blocks(self, counts: list[int]) -> list[list[int]]:
        """``counts`` float and sealed blocks (caller holds ``lock``), within the budget."""
        return list(self.take(counts[0], counts[1], []))

    def share_prefixes(self) -> PrefixPages:
        """Full pages of rows' prompts are indexed and shared from now on, both pools in one index."""
        return self.sealed.share_prefixes(self.float.share_prefixes())

    def row_bytes(self, tokens: int) -> int:
        """The most a row of up to ``tokens`` tokens holds: one float page up to a page, else two (sink, open) and
        the pages between sealed (a sealed page is smaller than a float one, so an open page is the worst case)."""
        pages = -(-tokens // self.block_size)
        if pages <= 1:
            return pages * self.float.block_bytes
        return 2 * self.float.block_bytes + (pages - 2) * self.sealed.block_bytes

    def take(self, float_count: int, sealed_count: int, freed_float: list[int]) -> tuple[list[int], list[int]]:
        """Give back the float blocks ``freed_float``, then take ``float_count`` float and ``sealed_count`` sealed
        blocks (caller holds ``lock``); with a budget, ``KVBudgetExceeded`` before anything changes when they do not fit."""
        if self.fixed:
            need = ((float_count - len(freed_float)) * self.float.block_bytes + sealed_count * self.sealed.block_bytes)
            free = self.budget_bytes - self.used_bytes
            if need > free:
                raise KVBudgetExceeded(f"{need} bytes of KV pages needed, {free} of {self.budget_bytes} free")
            while self.prefix is not None and need > free - self.idle_bytes:  # idle shared pages make room, oldest first
                self.prefix.evict(None, 1)
        self.float.release([freed_float])
        return self.float.take(float_count), self.sealed.take(sealed_count)

    def release(self, float_rows: list[list[int]], sealed_rows: list[list[int]]) -> None:
        """Give back every block of the rows (each row's float and sealed lists) and empty them."""
        with self.lock:
            self.float.release(float_rows)
            self.sealed.release(sealed_rows)


class PagesCache:
    """The rows of one batch on a version-9 engine: each row's float blocks ([sink] or [sink, open page]), its sealed
    blocks (pages 1, 2, ... in order) and its length. Consumed by ``concat`` and ``take_rows`` like
    ``runtime.engine.kv_blocks.PagedCache``; rows still held when it is collected go back to the pool."""

    def __init__(self, pool: PagePool, spec: PageQuantSpec, float_blocks: list[list[int]], blocks: list[list[int]],
                 lengths: np.ndarray):
        self.pool, self.spec, self.float_blocks, self.blocks, self.lengths = pool, spec, float_blocks, blocks, lengths
        weakref.finalize(self, pool.release, float_blocks, blocks)  # the same lists: emptied in place when rows move

    @classmethod
    def empty(cls, pool: PagePool, spec: PageQuantSpec, batch: int) -> "PagesCache":
        return cls(pool, spec, [[] for _ in range(batch)], [[] for _ in range(batch)], np.zeros(batch, dtype=np.int64))

    @classmethod
    def with_pages(cls, pool: PagePool, spec: PageQuantSpec, rows: list[list[Page]]) -> "PagesCache":
        """Rows that start with the full pages ``rows`` (the sink, a float block, then sealed ones; shared, already
        counted as held by them)."""
        return cls(pool, spec, [[block for _, block in pages[:1]] for pages in rows],
                   [[block for _, block in pages[1:]] for pages in rows],
                   np.array([len(pages) * pool.block_size for pages in rows], dtype=np.int64))

    def row_blocks(self, row: int) -> list[list[int]]:
        """Row ``row``'s float blocks and sealed blocks (``pool.block_pools``' order): what a spill writes out."""
        return [list(self.float_blocks[row]), list(self.blocks[row])]

    def full_pages(self, row: int) -> list[Page]:
        """Where row ``row``'s full pages lie, page 0 (the sink, float) first, then the sealed ones."""
        full = int(self.lengths[row]) // self.pool.block_size
        sink = [(self.pool.float, block) for block in self.float_blocks[row][: min(full, 1)]]
        return sink + [(self.pool.sealed, block) for block in self.blocks[row][: max(full - 1, 0)]]

    @property
    def batch(self) -> int:
        return len(self.blocks)

    def _moved(self) -> tuple[list[list[int]], list[list[int]]]:
        rows = list(self.float_blocks), list(self.blocks)
        self.float_blocks.clear()
        self.blocks.clear()
        return rows

    @staticmethod
    def concat(caches: list["PagesCache"]) -> "PagesCache":
        moved = [c._moved() for c in caches]
        return PagesCache(caches[0].pool, caches[0].spec, [r for f, _ in moved for r in f], [r for _, s in moved for r in s],
                          np.concatenate([c.lengths for c in caches]))

    def take_rows(self, rows: np.ndarray) -> "PagesCache":
        """The rows ``rows`` (indices, in order); the others' blocks go back to the pool."""
        lengths, (floats, sealed) = self.lengths[rows], self._moved()
        kept = set(int(r) for r in rows)
        self.pool.release([f for i, f in enumerate(floats) if i not in kept], [s for i, s in enumerate(sealed) if i not in kept])
        return PagesCache(self.pool, self.spec, [floats[int(r)] for r in rows], [sealed[int(r)] for r in rows], lengths)

    @staticmethod
    def _table(rows: list[list[int]]) -> np.ndarray:
        """(B, longest row) int64: each row's blocks, then zeros (masked)."""
        table = np.zeros((len(rows), max(map(len, rows), default=0)), dtype=np.int64)
        for b, blocks in enumerate(rows):
            table[b, : len(blocks)] = blocks
        return table

    def tables(self) -> list[np.ndarray]:
        """The engine's table inputs, in interface order: ``block_table`` (sealed pages), ``float_block_table``."""
        return [self._table(self.blocks), self._table(self.float_blocks)]

    def past_mask(self, tables: list[np.ndarray]) -> np.ndarray:
        """(B, F bs + M bs) bool, the graph's past in order, float pages then sealed ones: the sink's filled slots, the
        open page's, every slot of a sealed page; nothing of the tables' padding."""
        bs, (sealed_table, float_table) = self.pool.block_size, tables
        sealed = np.array([len(b) for b in self.blocks], dtype=np.int64)  # (B,)
        fill = np.stack([np.minimum(self.lengths, bs), self.lengths - bs * (1 + sealed)], axis=1)  # (B, 2): sink, open
        fill[:, 1] *= [len(f) > 1 for f in self.float_blocks]
        float_slots = np.arange(bs)[None, None, :] < fill[:, : float_table.shape[1], None]  # (B, F, bs)
        sealed_slots = np.repeat(np.arange(sealed_table.shape[1])[None, :] < sealed[:, None], bs, axis=1)  # (B, M bs)
        return np.concatenate([float_slots.reshape(self.batch, -1), sealed_slots], axis=1)

    def append(self, outputs: dict[str, np.ndarray], real: np.ndarray) -> None:
        """Write the new tokens ``real`` marks (B, T) of ``outputs`` ({float pool name: (B, nkv, T, d)}) after each
        row's last token: into its sink or open page, or, for a page whose last slot they fill (not the first page),
        straight into its sealed block. Raises ``KVBudgetExceeded`` before any write."""
        pool, bs = self.pool, self.pool.block_size
        old, counts = self.lengths, real.sum(axis=1)
        new = old + counts
        rows, steps = np.nonzero(real)  # (K,) each: the row and step of every token written, row-major
        slot = old[rows] + (np.cumsum(real, axis=1) - 1)[rows, steps]
        page, offset = slot // bs, slot % bs
        sealed_old, sealed_new = np.maximum(old // bs - 1, 0), np.maximum(new // bs - 1, 0)  # pages sealed, per row
        to_seal = sealed_new - sealed_old  # pages 1 + sealed_old .. sealed_new fill now
        stage_start = np.cumsum(to_seal) - to_seal  # (B,) each row's first page in the staging
        open_old = (old % bs > 0) & (old >= bs)  # an open page that is not the sink
        open_sealed = open_old & (to_seal > 0)  # it fills now: staged (its first page there), its block freed
        open_new = (new % bs > 0) & (new >= bs)
        open_taken = open_new & ~(open_old & ~open_sealed)
        sink_taken = (old == 0) & (new > 0)
        staged = (page >= 1) & (page <= sealed_new[rows])  # each token: into a page sealed now, or a float page
        staged_rows, floats = rows[staged], ~staged
        stage_index = stage_start[staged_rows] + page[staged] - 1 - sealed_old[staged_rows]
        sealing = int(to_seal.sum())
        with pool.lock:
            freed = [self.float_blocks[r][1] for r in np.flatnonzero(open_sealed)]
            staging = {}
            for name, new_kv in outputs.items() if sealing else ():  # (S, nkv, bs, d): the pages sealed now
                staging[name] = np.empty((sealing, *pool.float.arrays[name].shape[1:]), dtype=np.float32)
                staging[name][stage_start[open_sealed]] = pool.float.arrays[name][freed]  # the old open slots first
                staging[name][stage_index, :, offset[staged]] = new_kv[staged_rows, :, steps[staged]]
            taken_float, taken_sealed = pool.take(int(sink_taken.sum() + open_taken.sum()), sealing, freed)
            for r in np.flatnonzero(open_sealed):
                del self.float_blocks[r][1:]
            for r in np.flatnonzero(sink_taken):
                self.float_blocks[r].append(taken_float.pop(0))
            for r in np.flatnonzero(open_taken):
                self.float_blocks[r].append(taken_float.pop(0))
            for r in np.flatnonzero(to_seal):
                self.blocks[r] += taken_sealed[stage_start[r] : stage_start[r] + to_seal[r]]
            float_rows, float_steps, float_offsets = rows[floats], steps[floats], offset[floats]
            block = np.array([self.float_blocks[r][0 if p == 0 else 1] for r, p in zip(float_rows, page[floats])],
                             dtype=np.int64)
            for name, new_kv in outputs.items():
                pool.float.arrays[name][block, :, float_offsets] = new_kv[float_rows, :, float_steps]  # (K, nkv, d)
            for layer in range(len(outputs) // 2 if sealing else 0):
                pages = seal_pages(staging[f"pool_key.{layer}"], staging[f"pool_value.{layer}"],
                                   self.spec.layer(layer))
                for role, stored in pages.items():
                    pool.sealed.arrays[f"pool_{role}.{layer}"][taken_sealed] = stored
        self.lengths = new

    def allocated_bytes(self) -> int:
        return (sum(map(len, self.float_blocks)) * self.pool.float.block_bytes
                + sum(map(len, self.blocks)) * self.pool.sealed.block_bytes)

    def to_numpy(self) -> dict[str, np.ndarray]:
        """Copies of every pool read through the rows' tables, {pool name: (B, nkv, blocks x slots, w)} (float pools:
        the float pages; sealed pools: the sealed ones), for tests and debugging."""
        sealed_table, float_table = self.tables()
        out = {}
        for name, array in self.pool.arrays.items():
            table = float_table if name in self.pool.float.arrays else sealed_table
            B, M, (_, nkv, slots, w) = table.shape[0], table.shape[1], array.shape
            out[name] = array[table].transpose(0, 2, 1, 3, 4).reshape(B, nkv, M * slots, w).copy()
        return out
