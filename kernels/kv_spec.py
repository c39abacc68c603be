"""The KV-cache quantization scheme (``KVQuantSpec``) and what it costs in memory; torch-free.

The one definition of a scheme and of its defaults: ``tasks.config.KVConfig`` (the ``kv:`` section
of ``params.yaml``) takes its defaults from here, the engine interface records ``to_dict()``, and
the numerics that run a scheme live in ``kernels.kv_quant``. No torch here, so the config, the Prefect
form and the ONNX Runtime serving path can read a scheme without loading it.

Granularity (shapes: B batch, nkv kv heads, T tokens, d head dim):
* per channel: one (scale, zero) per (layer, kv head, channel), shape (nkv, d), calibrated
  offline for a release (``tasks/stages/calibrate.py``). Used for keys: a few key channels carry
  much larger values than the rest, and a per-token scale would be set by them and crush
  the small channels of the same token (KIVI, Liu et al. 2024, sec. 3; KVQuant, Hooper et
  al. 2024, sec. 3.1).
* per token: one (scale, zero) per (token, kv head), shape (B, nkv, T, 1), computed online
  when the token is appended. Used for values (outliers there are per token, not per channel)
  and, as the naive baseline, for keys.

Keys before or after RoPE: ``pre_rope_keys=True`` quantizes keys *before* the rotary embedding.
RoPE rotates channel pairs (i, i + d/2) by a position-dependent angle, so a large channel leaks
into its partner with a varying sign and the per-channel statistics that static scales rely on
are smeared across positions; before RoPE a channel's range is the same at every position
(KVQuant, sec. 3.2). The price: the cache holds pre-RoPE keys, so RoPE is re-applied to the
dequantized keys at every read (the cache stores no extra data: a slot's position is known).
Measured (bench/quality/kv_schemes.py, K4/V4, two-pass): pre- vs post-RoPE per-channel keys give KL to
the float cache 0.00089 vs 0.00138 on stdlib text (scales at the 99.9th percentile).

Full-precision tokens: the first ``sink_tokens`` (the attention sink, StreamingLLM, Xiao et al.
2024) and the most recent ``window_tokens`` (KIVI's residual, sec. 3.3) stay in fp16; a token
is quantized when it leaves the window.

The defaults are the scheme the release ships: the one ONNX Runtime's ``GroupQueryAttention``
reads (``kernels/gqa_attention.py``; ``gqa_problems(KVQuantSpec()) == []``). That op caches post-RoPE
keys with symmetric per-channel K and V scales and no sink; with scales at the 99th percentile it
measured -0.08% perplexity on stdlib text and -0.02% on the default month, computed exactly as that
engine computes it. ``PRE_ROPE_SCHEME`` is the best quality on the reference cache, which only the
standard-ops engine runs.

Quantized pages (``PageQuantSpec``, issue 39) are the other kind of scheme: no calibrated scales at all; each full
page of the paged cache gets scales of its own when its last slot is written, and each row's first and newest page
stay float. ``PageQuantSpec.stored_bits_per_value`` counts what they store.

Stored sizes assumed by ``bytes_per_token``: fp16 sink/window tokens, packed integers, fp16
per-token scales and zero points, fp32 per-channel scales and zero points (static per release,
amortized over the context).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Literal

Granularity = Literal["channel", "token"]
BITS = range(2, 9)
FP16_BYTES, TOKEN_SCALE_BYTES, CHANNEL_SCALE_BYTES = 2, 2, 4


@dataclass(frozen=True, kw_only=True)
class KVQuantSpec:
    k_bits: int = 4  # the GQA op reads 4-bit K and V only
    v_bits: int = 4
    k_granularity: Granularity = "channel"  # static calibrated scales per (layer, kv head, channel)
    v_granularity: Granularity = "channel"  # the GQA op's PER_CHANNEL values; "token" = online per (token, kv head)
    k_symmetric: bool = True  # the op's "offset by 8"; pre-RoPE key channels are off-centre: a zero point buys a bit
    v_symmetric: bool = True  # measured per token: asymmetric V4 was no better on stdlib text (KL 0.00097
    # vs 0.00104) and worse on the default month (KL 0.0120 vs 0.0104), and its zero point costs
    # 2 bytes per token and head
    sink_tokens: int = 0  # first tokens kept in fp16 (attention sink); the op has none
    window_tokens: int = 0  # most recent tokens kept in fp16 before they are quantized (reference cache only)
    pre_rope_keys: bool = False  # the op caches keys after RoPE (see the module docstring)

    def __post_init__(self) -> None:
        problems = []
        for name in ("k_bits", "v_bits"):
            if getattr(self, name) not in BITS:
                problems.append(f"{name}={getattr(self, name)} is not a width in 2..8")
        for name in ("k_granularity", "v_granularity"):
            if getattr(self, name) not in ("channel", "token"):
                problems.append(f"{name}={getattr(self, name)!r} is not 'channel' or 'token'")
        for name in ("sink_tokens", "window_tokens"):
            if getattr(self, name) < 0:
                problems.append(f"{name}={getattr(self, name)} is negative")
        if problems:
            raise ValueError("invalid KVQuantSpec: " + "; ".join(problems))

    @property
    def name(self) -> str:
        """Short label for tables: K4c-a/V4t-a pre s1 w0."""
        def part(kind, bits, gran, sym):
            return f"{kind}{bits}{gran[0]}{'s' if sym else 'a'}"

        k = part("K", self.k_bits, self.k_granularity, self.k_symmetric)
        v = part("V", self.v_bits, self.v_granularity, self.v_symmetric)
        rope = "pre" if self.pre_rope_keys else "post"
        return f"{k}/{v} {rope} s{self.sink_tokens} w{self.window_tokens}"

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "KVQuantSpec":
        return cls(**d)


# K4 per-channel asymmetric keys quantized before RoPE, V4 per-token symmetric values, one fp16
# sink token: the lowest error measured on the reference cache (bench/quality/kv_schemes.py "K4/V4 chosen"),
# the scheme the standard-ops engine was built for; GroupQueryAttention cannot run it.
PRE_ROPE_SCHEME = KVQuantSpec(k_granularity="channel", v_granularity="token", k_symmetric=False, v_symmetric=True,
                              sink_tokens=1, pre_rope_keys=True)


def packed_size(n: int, bits: int) -> int:
    """Bytes of ``n`` values packed at ``bits`` each (groups of 8 values fill ``bits`` bytes)."""
    return n if bits == 8 else math.ceil(n / 8) * bits


def bytes_per_token(spec: KVQuantSpec | None, num_layers: int, num_kv_heads: int, head_dim: int, context_len: int) -> float:
    """KV bytes per token at ``context_len`` tokens, everything counted: packed values, per-token
    scales and zero points, static per-channel scales and zero points (amortized), and the fp16
    sink and window tokens. ``spec=None`` is the fp16 cache."""
    L, nkv, d, T = num_layers, num_kv_heads, head_dim, context_len
    fp16_token = 2 * nkv * d * FP16_BYTES  # K and V of one token in one layer
    if spec is None:
        return float(L * fp16_token)
    full = min(T, spec.sink_tokens + spec.window_tokens)
    per_token, static = 0.0, 0.0
    for bits, gran, sym in ((spec.k_bits, spec.k_granularity, spec.k_symmetric),
                            (spec.v_bits, spec.v_granularity, spec.v_symmetric)):
        params = 1 if sym else 2  # scale, plus a zero point when asymmetric
        per_token += nkv * packed_size(d, bits)
        if gran == "token":
            per_token += nkv * params * TOKEN_SCALE_BYTES
        else:
            static += nkv * d * params * CHANNEL_SCALE_BYTES
    total = L * (full * fp16_token + (T - full) * per_token + static)
    return total / T


# ---------------------------------------------------------------- quantized pages

# Widths a quantized page stores: 2, 4 and 8 bits pack whole values into bytes; 3 bits are packed densely too
# (8 values in 3 bytes, ``kernels.kv_quant.pack_bits``), so a 3-bit page stores 3 bits per code, not 4.
PAGE_BITS = (2, 3, 4, 8)
PAGE_SCALE_BYTES = 2  # each value scale and minimum of a sealed page is fp16, and so is each number of a key_base
# Keys' scales and minima are stored in 8 bits on a grid of their page (``kernels.page_quant.key_grid``): per (page,
# head) a key_base of three fp16 numbers (scale unit, minimum origin, minimum unit), per channel two codes in 0..255.
KEY_GRID_STEPS = 255
KEY_BASE_WIDTH = 3
FLOAT_PAGE_BYTES = 4  # a float page (the sink, the open page) holds fp32 K and V, as the float paged cache does
# The smallest scale a page stores: the smallest normal fp16, so a constant group (hi == lo) codes to 0 and reads
# back as its minimum instead of dividing by zero (kernels.kv_quant floors a per-token scale there too).
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

    def __post_init__(self) -> None:
        problems = [f"{name}={getattr(self, name)} is not one of {PAGE_BITS}" for name in ("k_bits", "v_bits")
                    if getattr(self, name) not in PAGE_BITS]
        if self.v_group_size < 1:
            problems.append(f"v_group_size={self.v_group_size} is not a positive number of channels")
        if problems:
            raise ValueError("invalid PageQuantSpec: " + "; ".join(problems))

    @property
    def name(self) -> str:
        """Short label for tables: K4/V4 pages g32."""
        return f"K{self.k_bits}/V{self.v_bits} pages g{self.v_group_size}"

    def problems(self, head_dim: int) -> list[str]:
        """Why pages of this scheme cannot hold a head of ``head_dim`` channels (empty: they can)."""
        problems = [] if head_dim % 8 == 0 else [f"head_dim={head_dim} (codes pack 8 channels at a time: needs a multiple of 8)"]
        if head_dim % self.v_group_size:
            problems.append(f"v_group_size={self.v_group_size} does not divide head_dim={head_dim}")
        return problems

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "PageQuantSpec":
        unknown = sorted(set(d) - {f for f in cls.__dataclass_fields__})
        if unknown:
            raise ValueError(f"invalid PageQuantSpec: unknown fields {unknown}")
        return cls(**d)

    def sealed_page_bytes(self, head_dim: int, block_size: int) -> int:
        """Bytes of one sealed page of one kv head and layer, K and V: codes, then the keys' grid (two 8-bit codes
        per channel and the page's key_base) and the values' fp16 scales and minima (one pair per token and group)."""
        d, bs = head_dim, block_size
        keys = bs * packed_size(d, self.k_bits) + 2 * d + KEY_BASE_WIDTH * PAGE_SCALE_BYTES
        values = bs * packed_size(d, self.v_bits) + 2 * bs * (d // self.v_group_size) * PAGE_SCALE_BYTES
        return keys + values

    def stored_bits_per_value(self, head_dim: int, block_size: int, context_len: int) -> float:
        """Bits a row of ``context_len`` tokens stores per K or V value, everything counted: whole pages as they
        are allocated (the open page's empty slots too), codes, scales, minima, and the float sink and open pages."""
        d, bs, n = head_dim, block_size, context_len
        pages = -(-n // bs)
        open_page = n % bs != 0 and pages > 1
        float_pages = min(pages, 1) + open_page
        sealed = pages - float_pages
        float_bytes = float_pages * 2 * bs * d * FLOAT_PAGE_BYTES
        return 8 * (float_bytes + sealed * self.sealed_page_bytes(d, bs)) / (2 * n * d)
