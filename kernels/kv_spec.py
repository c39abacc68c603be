"""The served KV cache's quantization scheme, quantized pages (``PageQuantSpec``), and what it stores; torch-free.

The one definition of the scheme and of its defaults: ``tasks.config.KVConfig`` (the ``kv:`` section of
``params.yaml``) takes its defaults from here, the engine interface records ``to_dict()`` (``kv_pages``), the
device seals pages by it (``runtime.engine.kv_pages``) and the PyTorch reference and the graph's read live in
``kernels.page_quant``. No torch here, so the config, the Prefect form and the ONNX Runtime serving path can read the
scheme without loading it.

No calibrated scales at all: each full page of the paged cache gets scales of its own when its last slot is
written, and each row's first and newest page stay float (KIVI, Liu et al. 2024; the attention sink, StreamingLLM,
Xiao et al. 2024). ``PageQuantSpec.stored_bits_per_value`` counts what they store. (The static per-channel scheme
this module once defined, scales calibrated offline per release, was removed: +39.6% perplexity at 4 bits on
SmolLM2, docs/kv-cache-real-weights.md.)
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass


def packed_size(n: int, bits: int) -> int:
    """Bytes of ``n`` values packed at ``bits`` each (groups of 8 values fill ``bits`` bytes)."""
    return n if bits == 8 else math.ceil(n / 8) * bits



def key_token_rows(bits: int, block_size: int) -> bool:
    """Whether a sealed page packs its key codes across tokens (``key_code_shape``): at 2 and 4 bits, when the page's
    tokens split into 8 / bits runs. Then a byte holds one channel of tokens t, t + r, t + 2r, ... (r = block_size
    bits / 8), which share the channel's scale, so the graph reads each byte whole under that scale and takes the
    tokens apart after the product with q (``kernels.page_quant.sealed_key_scores``), where the scores are few;
    packed across channels, each byte's codes would need masking first (ONNX Runtime's uint8 BitwiseAnd: 6x the
    time of a uint8 Mul). Otherwise (3 and 8 bits, odd page sizes) codes pack across channels, as values do."""
    return bits < 8 and 8 % bits == 0 and block_size % (8 // bits) == 0


def key_code_shape(bits: int, block_size: int, head_dim: int) -> tuple[int, int]:
    """The (rows, bytes per row) of one sealed page's key codes, per head: (block_size bits / 8, head_dim) packed
    across tokens (``key_token_rows``), else (block_size, head_dim packed): the same bytes either way."""
    if key_token_rows(bits, block_size):
        return block_size * bits // 8, head_dim
    return block_size, packed_size(head_dim, bits)


# Widths a quantized page stores: 2, 4 and 8 bits pack whole values into bytes; 3 bits are packed densely too
# (8 values in 3 bytes, ``kernels.bit_packing.pack_bits``), so a 3-bit page stores 3 bits per code, not 4.
PAGE_BITS = (2, 3, 4, 8)
PAGE_SCALE_BYTES = 2  # each value scale and minimum of a sealed page is fp16, and so is each number of a key_base
# Keys' scales and minima are stored in 8 bits on a grid of their page (``kernels.page_quant.key_grid``): per (page,
# head) a key_base of three fp16 numbers (scale unit, minimum origin, minimum unit), per channel two codes in 0..255.
KEY_GRID_STEPS = 255
KEY_BASE_WIDTH = 3
FLOAT_PAGE_BYTES = 4  # a float page (the sink, the open page) holds fp32 K and V, as the float paged cache does
# The smallest scale a page stores: the smallest normal fp16, so a constant group (hi == lo) codes to 0 and reads
# back as its minimum instead of dividing by zero.
MIN_PAGE_SCALE = 2.0**-14


@dataclass(frozen=True, kw_only=True)
class PageQuantSpec:
    """Quantized pages: a paged cache whose full pages are quantized with scales of their own (KIVI, Liu et al.
    2024, sec. 3), computed when the page is sealed instead of calibrated offline.

    A page is one block of the paged cache (``engine.kv_block_size`` tokens). It is sealed when its last slot is
    written: keys get a scale and a minimum per (page, kv head, channel) over the page's tokens (stored in 8 bits on
    the page's own grid), values per (token, kv head, group of ``v_group_size`` channels); asymmetric, the whole
    range, no clipping. Each row's first
    page (the attention sink) and its open page (the newest tokens, KIVI's residual) stay float. Codes, scales and
    minima live in the page pool; ``runtime.engine.kv_pages`` seals (numpy), ``kernels.page_quant`` is the
    PyTorch reference and the graph's read."""

    k_bits: int = 4
    v_bits: int = 4
    # Channels per value scale. 64, a whole head of SmolLM2 and Qwen2-0.5B, is what brings K4/V4 to 4.99 stored bits
    # per value at 2,048 tokens (32: 5.24); measured on SmolLM2 (K4/V4, keys on their 8-bit grid): KL to the float
    # cache 4.72e-3 at 64, 4.01e-3 at 32 (keys in fp16), Δppl +0.10% and +0.28% (bench/quality/real_model_quality.py's text).
    v_group_size: int = 64
    # Per layer (k_bits, v_bits), where calibration widened some layers (``tasks.checks.page_widths``); empty: every layer
    # at k_bits/v_bits. The widths shape the page pools and the graph's read, so they are compiled into the engine.
    layer_bits: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_bits", tuple(tuple(int(b) for b in pair) for pair in self.layer_bits))
        problems = [f"{name}={getattr(self, name)} is not one of {PAGE_BITS}" for name in ("k_bits", "v_bits")
                    if getattr(self, name) not in PAGE_BITS]
        problems += [f"layer_bits[{i}]={list(pair)} is not a (k_bits, v_bits) pair of {PAGE_BITS}"
                     for i, pair in enumerate(self.layer_bits) if len(pair) != 2 or not set(pair) <= set(PAGE_BITS)]
        if self.v_group_size < 1:
            problems.append(f"v_group_size={self.v_group_size} is not a positive number of channels")
        if problems:
            raise ValueError("invalid PageQuantSpec: " + "; ".join(problems))

    @property
    def name(self) -> str:
        """Short label for tables: K4/V4 pages g32; with per-layer widths, how many layers are wider."""
        name = f"K{self.k_bits}/V{self.v_bits} pages g{self.v_group_size}"
        wider = sum(pair != (self.k_bits, self.v_bits) for pair in self.layer_bits)
        return f"{name}, {wider} of {len(self.layer_bits)} layers wider" if self.layer_bits else name

    def layer(self, i: int) -> "PageQuantSpec":
        """The pages of layer ``i``: this scheme at that layer's widths, with no per-layer table."""
        k_bits, v_bits = self.layer_bits[i] if self.layer_bits else (self.k_bits, self.v_bits)
        return PageQuantSpec(k_bits=k_bits, v_bits=v_bits, v_group_size=self.v_group_size)

    def with_layer_bits(self, layer_bits) -> "PageQuantSpec":
        """This scheme with per-layer widths ``layer_bits`` ((k_bits, v_bits) per layer); none wider: no table."""
        layer_bits = tuple(tuple(pair) for pair in layer_bits)
        uniform = all(pair == (self.k_bits, self.v_bits) for pair in layer_bits)
        return PageQuantSpec(k_bits=self.k_bits, v_bits=self.v_bits, v_group_size=self.v_group_size,
                             layer_bits=() if uniform else layer_bits)

    def problems(self, head_dim: int) -> list[str]:
        """Why pages of this scheme cannot hold a head of ``head_dim`` channels (empty: they can)."""
        problems = [] if head_dim % 8 == 0 else [f"head_dim={head_dim} (codes pack 8 channels at a time: needs a multiple of 8)"]
        if head_dim % self.v_group_size:
            problems.append(f"v_group_size={self.v_group_size} does not divide head_dim={head_dim}")
        return problems

    def to_dict(self) -> dict:
        """JSON-ready; ``layer_bits`` only where a layer differs, so a uniform scheme's dict (and the interface hash
        of an engine compiled before per-layer widths) is what it always was."""
        d = asdict(self)
        d["layer_bits"] = [list(pair) for pair in self.layer_bits]
        return d if self.layer_bits else {k: v for k, v in d.items() if k != "layer_bits"}

    @classmethod
    def from_dict(cls, d: dict) -> "PageQuantSpec":
        unknown = sorted(set(d) - {f for f in cls.__dataclass_fields__})
        if unknown:
            raise ValueError(f"invalid PageQuantSpec: unknown fields {unknown}")
        return cls(**d)

    def layer_problems(self, num_layers: int) -> list[str]:
        """Why this scheme cannot be a backbone of ``num_layers`` layers (empty: it can)."""
        if self.layer_bits and len(self.layer_bits) != num_layers:
            return [f"layer_bits names {len(self.layer_bits)} layers, the backbone has {num_layers}"]
        return []

    def sealed_page_bytes(self, head_dim: int, block_size: int) -> int:
        """Bytes of one sealed page of one kv head and layer, K and V: codes, then the keys' grid (two 8-bit codes
        per channel and the page's key_base) and the values' fp16 scales and minima (one pair per token and group).
        One layer's: a scheme with per-layer widths asks ``layer(i)``."""
        if self.layer_bits:
            raise ValueError(f"{self.name}: a page's bytes depend on its layer; ask layer(i).sealed_page_bytes")
        d, bs = head_dim, block_size
        keys = bs * packed_size(d, self.k_bits) + 2 * d + KEY_BASE_WIDTH * PAGE_SCALE_BYTES
        values = bs * packed_size(d, self.v_bits) + 2 * bs * (d // self.v_group_size) * PAGE_SCALE_BYTES
        return keys + values

    def stored_bits_per_value(self, head_dim: int, block_size: int, context_len: int) -> float:
        """Bits a row of ``context_len`` tokens stores per K or V value, everything counted: whole pages as they
        are allocated (the open page's empty slots too), codes, scales, minima, and the float sink and open pages."""
        if self.layer_bits:  # every layer the same length of cache: the mean of theirs
            layers = [self.layer(i) for i in range(len(self.layer_bits))]
            return sum(s.stored_bits_per_value(head_dim, block_size, context_len) for s in layers) / len(layers)
        d, bs, n = head_dim, block_size, context_len
        pages = -(-n // bs)
        open_page = n % bs != 0 and pages > 1
        float_pages = min(pages, 1) + open_page
        sealed = pages - float_pages
        float_bytes = float_pages * 2 * bs * d * FLOAT_PAGE_BYTES
        return 8 * (float_bytes + sealed * self.sealed_page_bytes(d, bs)) / (2 * n * d)
