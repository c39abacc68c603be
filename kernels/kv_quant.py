"""KV-cache quantization: quantize, dequantize and bit-pack, in plain PyTorch ops that export to ONNX.

One convention for every width b in 2..8: a value is stored as an unsigned integer
u in [0, 2^b - 1] and read back as ``x = (u - zero) * scale``.

* symmetric:  zero = 2^(b-1) (a constant, not stored), scale = amax / (2^(b-1) - 1).
  At 4 bits this is exactly ONNX Runtime's ``GroupQueryAttention`` int4 layout
  ("offset by 8"); at 8 bits ``u - 128`` is the op's int8 (flip the top bit).
* asymmetric: scale = (hi - lo) / (2^b - 1), zero = round(-lo / scale) (integer valued,
  may fall outside [0, 2^b - 1] when the range does not contain 0, so it is kept as a float:
  fp32 for static per-channel zeros, fp16 for online per-token ones, exact up to 2048).

The scheme (widths, granularity, symmetry, keys before or after RoPE, fp16 sink and window) is a
``kernels.kv_spec.KVQuantSpec``; its docstring says what each choice means and measured. Keys
quantized before RoPE: the backbone in ``runtime/engine/model.py`` hands out post-RoPE keys; the reference
cache below un-rotates them exactly (RoPE is orthogonal) before quantizing and re-rotates them at
every read.

Bit packing (``pack_bits``): along the last axis, values form a little-endian bit stream,
value j occupying bits [j b, (j + 1) b). Every 8 values fill exactly b bytes, so a (…, d) row
costs ceil(d / 8) * b bytes. At 4 bits: two values per byte, low nibble first (the GQA op's
layout); at 2 bits: four per byte, lowest bits first; at 8 bits: one byte per value.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from kernels.kv_spec import CHANNEL_SCALE_BYTES, KVQuantSpec
from kernels.rope import rope_rotate

_TINY = 2.0**-14  # floor of a scale: the smallest normal fp16, so an all-zero token quantizes to 0, not 0/0


# ---------------------------------------------------------------- quantize / dequantize

def scale_zero_from_range(lo: torch.Tensor, hi: torch.Tensor, bits: int, symmetric: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, zero) covering [lo, hi]; symmetric covers [-amax, amax] with zero = 2^(b-1)."""
    if symmetric:
        amax = torch.maximum(lo.abs(), hi.abs())
        scale = amax / (2 ** (bits - 1) - 1)
        return scale, torch.full_like(scale, 2.0 ** (bits - 1))
    scale = (hi - lo) / (2**bits - 1)
    zero = torch.round(-lo / scale.clamp_min(_TINY))
    return scale, zero


def quantize(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    """u = clamp(round(x / scale) + zero, 0, 2^b - 1) as uint8; scale/zero broadcast against x."""
    u = torch.round(x / scale) + zero
    return u.clamp(0, 2**bits - 1).to(torch.uint8)


def dequantize(u: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """x = (u - zero) * scale, float32."""
    return (u.to(torch.float32) - zero) * scale


def quantize_per_channel(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                         bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (B, nkv, T, d) with static scale/zero (nkv, d) -> (u (B, nkv, T, d), scale (nkv, 1, d), zero (nkv, 1, d)),
    scale and zero as they broadcast against x. zero None = symmetric."""
    scale = scale[:, None, :]  # (nkv, 1, d) broadcasts over B and T
    zero = torch.full_like(scale, 2.0 ** (bits - 1)) if zero is None else zero[:, None, :]
    return quantize(x, scale, zero, bits), scale, zero


def quantize_per_token(x: torch.Tensor, bits: int, symmetric: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (..., d) -> (u (..., d), scale (..., 1), zero (..., 1)), one online (scale, zero) per row.

    Scale and zero point are rounded to fp16 before use, because fp16 is what the cache stores
    (a zero point is an integer, exact in fp16 up to 2048 = 128 ranges of offset at 4 bits).
    """
    lo = x.amin(dim=-1, keepdim=True)  # (..., 1)
    hi = x.amax(dim=-1, keepdim=True)
    scale, zero = scale_zero_from_range(lo, hi, bits, symmetric)
    scale = scale.to(torch.float16).to(torch.float32).clamp_min(_TINY)
    if not symmetric:  # recompute the zero point for the rounded scale; it is stored as fp16 too
        zero = torch.round(-lo / scale).to(torch.float16).to(torch.float32)
    return quantize(x, scale, zero, bits), scale, zero


# ---------------------------------------------------------------- rotation

# A cache may hold K R and V R for an orthogonal R (d, d) instead of K and V: attention is unchanged
# when queries turn with the keys, (q R)(k R)^T = q k^T, and the value mix turns back after it,
# (a (v R)) R^T = a v. A Hadamard R spreads a few outlier channels over all d, so per-channel scales
# no longer spend their levels on them (QuaRot, Ashkboos et al. 2024, sec. 4; llama.cpp's rotated KV
# cache). Calibration chooses R per layer (tasks/kv_stats.py ``choose_rotation``).

def hadamard_matrix(d: int) -> torch.Tensor:
    """Normalized Walsh-Hadamard matrix (d, d), d a power of two (Sylvester's construction).

    Symmetric and orthogonal (H H = I); every entry is +-1/sqrt(d), exact in float32 when d is
    an even power of two (64: +-1/8), so x @ H is a sum of exactly scaled terms."""
    if d < 1 or d & (d - 1):
        raise ValueError(f"head_dim={d}: a Walsh-Hadamard rotation needs a power of two")
    h = torch.ones(1, 1)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(d)


# ---------------------------------------------------------------- bit packing

def _bit_weights(n: int) -> torch.Tensor:
    return torch.tensor([2**j for j in range(n)], dtype=torch.int64)  # (n,): 1, 2, 4, ...


def pack_bits(u: torch.Tensor, bits: int) -> torch.Tensor:
    """u (..., n) uint8 values < 2^b -> (..., ceil(n/8) * b) uint8, little-endian bit stream.

    Goes through bit planes (values 0/1) rather than shifting machine words: the ONNX exporter
    lowers integer division to float Div + Floor and ONNX BitShift takes unsigned types only,
    while every intermediate here stays below 256 and is exact in float32.
    """
    if bits == 8:
        return u.to(torch.uint8)
    n = u.shape[-1]
    if 8 % bits == 0:
        return _pack_aligned(u, bits)
    x = u.to(torch.int64)
    if n % 8:
        x = nn.functional.pad(x, (0, 8 - n % 8))  # 8 values fill exactly `bits` bytes
    planes = torch.remainder(torch.div(x.unsqueeze(-1), _bit_weights(bits), rounding_mode="trunc"), 2)  # (..., n8, b)
    stream = planes.flatten(-2).unflatten(-1, (-1, 8))  # (..., n8 b / 8, 8): value j owns bits [j b, (j+1) b)
    return (stream * _bit_weights(8)).sum(-1).to(torch.uint8)  # (..., n8 b / 8)


def unpack_bits(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of ``pack_bits``: (..., ceil(n/8) * b) uint8 -> (..., n) uint8."""
    if bits == 8:
        return packed[..., :n]
    if 8 % bits == 0:
        return unpack_bits_f32(packed, bits, n).to(torch.uint8)
    p = packed.to(torch.int64)
    planes = torch.remainder(torch.div(p.unsqueeze(-1), _bit_weights(8), rounding_mode="trunc"), 2)  # (..., nbytes, 8)
    stream = planes.flatten(-2).unflatten(-1, (-1, bits))  # (..., n8, b)
    return (stream * _bit_weights(bits)).sum(-1)[..., :n].to(torch.uint8)  # (..., n)


# Widths that divide 8 (2 and 4 bits) never straddle a byte: byte k holds values k*per .. k*per + per - 1,
# lowest bits first, the same stream as above. These go through float32 multiplies by powers of two
# and Floor (exact below 256) instead of int64 bit planes: measured in the ORT engine at past 512
# (tiny backbone), the bit-plane unpack cost ~70 ms per decode step (int64 Div/Mod/Sign on 8 planes),
# the float form a few percent of that.

def _powers(per: int, bits: int, sign: int) -> torch.Tensor:
    return torch.tensor([2.0 ** (sign * j * bits) for j in range(per)], dtype=torch.float32)  # (per,)


def _pack_aligned(u: torch.Tensor, bits: int) -> torch.Tensor:
    per, n = 8 // bits, u.shape[-1]
    x = u.to(torch.float32)
    if n % 8:
        x = nn.functional.pad(x, (0, 8 - n % 8))  # same byte count as the general path
    x = x.unflatten(-1, (-1, per))  # (..., nbytes, per)
    return (x * _powers(per, bits, 1)).sum(-1).to(torch.uint8)  # (..., nbytes): sum of u_j 2^(j b) < 256


def unpack_bits_f32(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """``unpack_bits`` as float32 (exact integers), for a dequantize that follows: no uint8 round trip."""
    if bits == 8:
        return packed[..., :n].to(torch.float32)
    if bits == 3:
        return _unpack_words_f32(packed, bits)[..., :n]
    if 8 % bits:
        return unpack_bits(packed, bits, n).to(torch.float32)
    return torch.stack(unpack_parts_f32(packed, bits), dim=-1).flatten(-2)[..., :n]  # (..., n): low bits first


def _unpack_words_f32(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """A width that straddles bytes, 3 bits: the values of ``_word_parts_f32`` back in order, (..., n8 * 8)."""
    return torch.stack(_word_parts_f32(packed, bits), dim=-1).flatten(-2)  # low bits first


def _word_parts_f32(packed: torch.Tensor, bits: int, dim: int = -1) -> list[torch.Tensor]:
    """A width that straddles bytes, 3 bits: each 8 values fill ``bits`` bytes (along ``dim``), read as one
    little-endian integer below 2^24 (exact in float32), then peeled ``bits`` at a time as ``unpack_parts_f32`` peels
    a byte: the integers of ``unpack_bits``'s int64 bit planes, in the float ops the aligned widths use (see below).
    8 float32 tensors, ``dim`` of n8 = nbytes / bits: part j holds value j of every 8."""
    dim = dim % packed.dim()
    words = packed.to(torch.float32).unflatten(dim, (-1, bits))  # (..., n8, bits, ...)
    weights = torch.tensor([256.0**j for j in range(bits)]).reshape(bits, *[1] * (packed.dim() - dim - 1))
    word = (words * weights).sum(dim + 1)  # (..., n8, ...): below 2^(8 bits) = 2^24
    parts = []
    for _ in range(7):
        high = torch.floor(word * 2.0**-bits)
        parts.append(word - high * 2.0**bits)  # value j of each 8: the lowest bits left
        word = high
    return parts + [word]


def unpack_parts_f32(packed: torch.Tensor, bits: int) -> list[torch.Tensor]:
    """Packed (..., nbytes) at a width dividing 8 -> 8 // bits float32 tensors (..., nbytes) of exact
    integers: part j holds value j of every byte (values j, j + 8 // bits, ... of the row).

    Peels one value per step with scalar multiplies (p >> b is floor(p / 2^b), exact below 256):
    a broadcast against a (per,) vector of powers was ~10x slower in ONNX Runtime (a 2-wide inner loop).
    """
    rest = packed.to(torch.float32)  # (..., nbytes)
    parts = []
    for _ in range(8 // bits - 1):
        high = torch.floor(rest * 2.0**-bits)
        parts.append(rest - high * 2.0**bits)  # the lowest b bits
        rest = high
    return parts + [rest]


def unpack_parts_u8(packed: torch.Tensor, bits: int, dim: int = -1) -> list[tuple[torch.Tensor, float]]:
    """Packed values, their bytes along ``dim``, at any width -> the values as uint8 parts, for a dequantization
    that reads bytes (ONNX's DequantizeLinear, ``kernels.page_quant``): per part, (codes, weight), the codes holding
    the part's values times ``weight``. At a width dividing 8, per = 8 // bits parts of the packed shape, part j the
    values j, j + per, ... of the row (value j of every byte) with their bits left in place: weight 2^(b j), exact
    under any scale (a power of two). At 3 bits 8 parts of weight 1, ``dim`` of nbytes / 3, part j holding value j
    of every 8 (``_word_parts_f32``). Never interleaved back.

    The aligned widths mask each byte: a BitwiseAnd, and a Sub for the rest of the byte (a shift would need a
    BitShift, which the exporter writes as a signed-shift emulation of seven ops, or a float round trip)."""
    if bits == 8:
        return [(packed, 1.0)]
    if 8 % bits:
        return [(part.to(torch.uint8), 1.0) for part in _word_parts_f32(packed, bits, dim)]
    rest, parts = packed, []  # byte by byte: ``dim`` is any
    for j in range(8 // bits - 1):
        part = rest & ((2**bits - 1) << (bits * j))  # value j, times 2^(b j)
        parts.append((part, 2.0 ** (bits * j)))
        rest = rest - part
    return parts + [(rest, 2.0 ** (8 - bits))]


# ---------------------------------------------------------------- reference cache

class _Quantized:
    """One tensor stream (K or V of one layer) of quantized tokens: packed bytes + scales."""

    def __init__(self):
        self.packed: list[torch.Tensor] = []  # (B, nkv, t, packed_size(d))
        self.scales: list[torch.Tensor] = []  # (B, nkv, t, 1) per-token fp16 scales (empty for per-channel)
        self.zeros: list[torch.Tensor] = []
        self.decoded: list[torch.Tensor] = []  # decoded from the packed bytes once, reused on every read


class QuantizedKVCache:
    """Reference quantized KV cache for all layers of ``runtime.engine.model.Backbone``.

    ``append(layer, k, v, positions)`` takes the post-RoPE k and v (B, nkv, T, d) that the
    backbone returns and the positions (B, T) of those tokens; ``get(layer)`` returns the
    dequantized post-RoPE (k, v) (B, nkv, S, d) float32 to feed back as ``past_kv``.
    Per-channel scales ``k_scale``/``v_scale`` (L, nkv, d) come from a calibration; their
    zero points are None when symmetric. ``rotation`` (L, d, d), post-RoPE keys only: per layer the
    orthogonal R the cache stores K R and V R with (see ``hadamard_matrix``; the engine's
    ``kv_rotation`` input), turned back at every read; None = none.
    """

    def __init__(
        self,
        spec: KVQuantSpec,
        num_layers: int,
        head_dim: int,
        inv_freq: torch.Tensor | None = None,
        k_scale: torch.Tensor | None = None,
        k_zero: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
        v_zero: torch.Tensor | None = None,
        rotation: torch.Tensor | None = None,
    ):
        if spec.k_granularity == "channel" and k_scale is None:
            raise ValueError("per-channel keys need calibrated k_scale (layers, kv heads, head_dim)")
        if spec.v_granularity == "channel" and v_scale is None:
            raise ValueError("per-channel values need calibrated v_scale (layers, kv heads, head_dim)")
        if spec.pre_rope_keys and inv_freq is None:
            raise ValueError("pre-RoPE keys need the backbone's inv_freq to undo and redo RoPE")
        if spec.pre_rope_keys and rotation is not None:
            raise ValueError("a KV rotation turns post-RoPE keys; this spec caches keys before RoPE")
        self.spec, self.num_layers, self.head_dim, self.inv_freq = spec, num_layers, head_dim, inv_freq
        self.rotation = rotation
        self.static = {"k": (k_scale, k_zero), "v": (v_scale, v_zero)}
        self.layers = [self._empty() for _ in range(num_layers)]

    @staticmethod
    def _empty() -> dict:
        return {"sink_k": [], "sink_v": [], "win_k": [], "win_v": [], "win_pos": [],
                "k": _Quantized(), "v": _Quantized(), "q_pos": [], "sink_len": 0}

    def __len__(self) -> int:
        st = self.layers[0]
        return st["sink_len"] + sum(t.shape[2] for t in st["win_k"]) + sum(t.shape[2] for t in st["k"].packed)

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        st, spec = self.layers[layer], self.spec
        if self.rotation is not None:  # turned in float32, then rounded to fp16: the engine's order
            k, v = k @ self.rotation[layer], v @ self.rotation[layer]
        take = min(spec.sink_tokens - st["sink_len"], k.shape[2])
        if take > 0:  # the first tokens go to the fp16 sink
            st["sink_k"].append(k[:, :, :take].half())
            st["sink_v"].append(v[:, :, :take].half())
            st["sink_len"] += take
            k, v, positions = k[:, :, take:], v[:, :, take:], positions[:, take:]
        if k.shape[2] == 0:
            return
        st["win_k"].append(k.half()), st["win_v"].append(v.half()), st["win_pos"].append(positions)
        wk, wv, wpos = torch.cat(st["win_k"], 2), torch.cat(st["win_v"], 2), torch.cat(st["win_pos"], 1)
        leave = wk.shape[2] - spec.window_tokens
        if leave > 0:  # the oldest tokens leave the window and are quantized
            # From their fp16 values even when they pass straight through a short window: the
            # codes then do not depend on how tokens were chunked (prefill vs one by one).
            self._quantize(layer, wk[:, :, :leave].float(), wv[:, :, :leave].float(), wpos[:, :leave])
            wk, wv, wpos = wk[:, :, leave:], wv[:, :, leave:], wpos[:, leave:]
        st["win_k"], st["win_v"], st["win_pos"] = [wk], [wv], [wpos]

    def _quantize(self, layer: int, k_full: torch.Tensor, v_full: torch.Tensor, pos: torch.Tensor) -> None:
        st, spec = self.layers[layer], self.spec
        if spec.pre_rope_keys:
            k_full = rope_rotate(k_full, pos, self.inv_freq, inverse=True)  # exact up to fp32 rounding
        for kind, x, bits, gran, sym in (("k", k_full, spec.k_bits, spec.k_granularity, spec.k_symmetric),
                                         ("v", v_full, spec.v_bits, spec.v_granularity, spec.v_symmetric)):
            q: _Quantized = st[kind]
            if gran == "channel":
                scale, zero = self.static[kind]
                u, s, z = quantize_per_channel(x, scale[layer], None if zero is None else zero[layer], bits)  # s, z (nkv, 1, d)
            else:
                u, s, z = quantize_per_token(x, bits, sym)  # s, z (B, nkv, t, 1)
                q.scales.append(s.half()), q.zeros.append(z.half())
            packed = pack_bits(u, bits)
            q.packed.append(packed)
            q.decoded.append(dequantize(unpack_bits(packed, bits, self.head_dim), s, z))  # from the bytes
        st["q_pos"].append(pos)

    def get(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized (k, v), each (B, nkv, S, d) float32, slots in append order."""
        st = self.layers[layer]
        ks = [t.float() for t in st["sink_k"]]
        vs = [t.float() for t in st["sink_v"]]
        if st["k"].decoded:
            k_body = torch.cat(st["k"].decoded, 2)
            if self.spec.pre_rope_keys:
                k_body = rope_rotate(k_body, torch.cat(st["q_pos"], 1), self.inv_freq)
            ks.append(k_body), vs.append(torch.cat(st["v"].decoded, 2))
        ks += [t.float() for t in st["win_k"]]
        vs += [t.float() for t in st["win_v"]]
        k, v = torch.cat(ks, 2), torch.cat(vs, 2)
        if self.rotation is not None:
            r_t = self.rotation[layer].transpose(0, 1)
            k, v = k @ r_t, v @ r_t
        return k, v

    def past(self) -> tuple[torch.Tensor, ...]:
        """Flat (k.0, v.0, k.1, ...) as ``Backbone.forward`` takes it."""
        return tuple(t for i in range(self.num_layers) for t in self.get(i))

    def stored_bytes(self) -> int:
        """Bytes this cache actually holds (packed values, per-token scales, fp16 tokens) plus the
        static per-channel scales and zero points it was given: the check of ``bytes_per_token``."""
        total = 0
        for st in self.layers:
            for name in ("sink_k", "sink_v", "win_k", "win_v"):
                total += sum(t.numel() * t.element_size() for t in st[name])
            for kind in ("k", "v"):
                q = st[kind]
                total += sum(t.numel() for t in q.packed)
                total += sum(t.numel() * t.element_size() for t in q.scales)
                total += sum(t.numel() * t.element_size() for t in q.zeros if not self._symmetric(kind))
        for kind in ("k", "v"):
            scale, zero = self.static[kind]
            gran = self.spec.k_granularity if kind == "k" else self.spec.v_granularity
            if gran == "channel":
                total += scale.numel() * CHANNEL_SCALE_BYTES
                total += 0 if self._symmetric(kind) else zero.numel() * CHANNEL_SCALE_BYTES
        return total

    def _symmetric(self, kind: str) -> bool:
        return self.spec.k_symmetric if kind == "k" else self.spec.v_symmetric
