"""Bit packing of quantization codes, in plain PyTorch ops that export to ONNX: what a sealed page stores
(``kernels.page_quant``; the device packs the same bytes in numpy, ``runtime.engine.kv_pages``).

Along the last axis (or ``dim``), values form a little-endian bit stream, value j occupying bits [j b, (j + 1) b).
Every 8 values fill exactly b bytes, so a (..., d) row costs ceil(d / 8) * b bytes (``kernels.kv_spec.packed_size``).
At 4 bits: two values per byte, low nibble first; at 2 bits: four per byte, lowest bits first; at 3 bits 8 values
straddle 3 bytes; at 8 bits one byte per value.
"""

from __future__ import annotations

import torch
import torch.nn as nn


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
    """Inverse of ``pack_bits``: (..., ceil(n/8) * b) uint8 -> (..., n) uint8. The reference's unpacking (the graph
    reads packed codes through ``unpack_parts_u8`` or ``prefix_parts_u8`` instead, never interleaving them back)."""
    if bits == 8:
        return packed[..., :n]
    p = packed.to(torch.int64)
    planes = torch.remainder(torch.div(p.unsqueeze(-1), _bit_weights(8), rounding_mode="trunc"), 2)  # (..., nbytes, 8)
    stream = planes.flatten(-2).unflatten(-1, (-1, bits))  # (..., n8, b)
    return (stream * _bit_weights(bits)).sum(-1)[..., :n].to(torch.uint8)  # (..., n)


# Widths that divide 8 (2 and 4 bits) never straddle a byte: byte k holds values k*per .. k*per + per - 1,
# lowest bits first, the same stream as above, packed with float32 multiplies by powers of two (exact below 256).

def _powers(per: int, bits: int, sign: int) -> torch.Tensor:
    return torch.tensor([2.0 ** (sign * j * bits) for j in range(per)], dtype=torch.float32)  # (per,)


def _pack_aligned(u: torch.Tensor, bits: int) -> torch.Tensor:
    per, n = 8 // bits, u.shape[-1]
    x = u.to(torch.float32)
    if n % 8:
        x = nn.functional.pad(x, (0, 8 - n % 8))  # same byte count as the general path
    x = x.unflatten(-1, (-1, per))  # (..., nbytes, per)
    return (x * _powers(per, bits, 1)).sum(-1).to(torch.uint8)  # (..., nbytes): sum of u_j 2^(j b) < 256


def pack_token_runs(u: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes u (..., n, w) uint8 at a width dividing 8 (2, 4 bits), n a multiple of per = 8 / bits -> (..., n / per, w)
    uint8, packed across the second-last axis in runs: byte (t, c) holds u[t + j n / per, c] in bits [j b, (j + 1) b),
    j = 0 .. per - 1 (``kernels.kv_spec.key_token_rows``: a page's keys, one channel of per tokens a byte).
    ``prefix_parts_u8`` reads it as it reads any byte, run j being value j."""
    per = 8 // bits
    runs = u.to(torch.float32).unflatten(-2, (per, -1))  # (..., per, n / per, w)
    return (runs * _powers(per, bits, 1)[:, None, None]).sum(-3).to(torch.uint8)  # sum of u_j 2^(j b) < 256


def _word_parts_f32(packed: torch.Tensor, bits: int, dim: int = -1) -> list[torch.Tensor]:
    """A width that straddles bytes, 3 bits: each 8 values fill ``bits`` bytes (along ``dim``), read as one
    little-endian integer below 2^24 (exact in float32), then peeled ``bits`` at a time as ``unpack_parts_f32`` peels
    a byte: the integers of ``unpack_bits``'s int64 bit planes, in float ops (int64 Div/Mod on 8 bit planes cost ~70 ms
    per decode step in the ORT engine at past 512, tiny backbone; these a few percent of that).
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


def prefix_parts_u8(packed: torch.Tensor, bits: int) -> list[torch.Tensor]:
    """Packed values of a width dividing 8 (2, 4 bits; every byte whole), bytes along the last axis -> per part j
    (value j of every byte) the bytes times 2^(b (per - 1 - j)), uint8: multiplying wraps modulo 256, so the values
    above j fall off the top, value j lands in the top b bits and the values before it stay below. Read with weight
    2^(8 - b), part j is u_j + sum over i < j of 2^(-b (j - i)) u_i, which ``unmix_prefix_parts`` takes out on the
    other side of any linear map (a dequantization whose scale the byte's values share, a product with weights).
    The last part is the byte as it is. Instead of ``unpack_parts_u8``'s masks: ONNX Runtime's uint8 BitwiseAnd took
    6x the time of its uint8 Mul or Sub (44.8 against 7.4 and 5.7 us on 131,072 bytes, 2 threads, ORT 1.32)."""
    per = 8 // bits
    return [packed * 2 ** (bits * (per - 1 - j)) for j in range(per - 1)] + [packed]


def unmix_prefix_parts(mixed: list[torch.Tensor], bits: int) -> list[torch.Tensor]:
    """``prefix_parts_u8``'s parts (or a linear map of each, the same map) -> the values': part j less 2^-b times
    part j - 1 (which holds the values before j at the weights one place further down), exact but for one rounding."""
    return [mixed[0]] + [mixed[j] - mixed[j - 1] * 2.0**-bits for j in range(1, len(mixed))]

