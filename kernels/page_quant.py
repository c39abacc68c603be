"""Quantized pages (``kernels.kv_spec.PageQuantSpec``) in PyTorch: the reference sealer, and the read the graph runs.

Sealing a page of ``bs`` tokens (one block of the paged cache):
  keys    (bs, d): per channel c, over the page's tokens: lo_c = min_t k[t, c], hi_c = max_t k[t, c];
  values  (bs, d): per token t and group of G channels: lo, hi over the group's channels;
  then, per (lo, hi): scale = fp16((hi - lo) / (2^b - 1)) (at least ``kernels.kv_spec.MIN_PAGE_SCALE``), minimum = fp16(lo),
  u = clamp(round((x - minimum) / scale), 0, 2^b - 1), read back as x' = u scale + minimum (KIVI's form).

Every step is one IEEE operation on float32 (subtract, divide, round half to even) or a cast to fp16 (round to
nearest even), so numpy computes the same integers and the same fp16 scales bit for bit: the device seals in
numpy (``runtime.engine.kv_pages``, no torch on the serving path) and ``tests/kernels/test_page_quant.py`` compares
the two code for code. The minimum is kept as a float (fp16), not rounded to an integer zero point: an integer
zero point moves every value of the group by up to half a step on top of its rounding.

The read (``dequantize_key_pages``, ``dequantize_value_pages``) is what the exported graph runs on the codes it
gathers through a block table: unpack (``kernels.kv_quant.unpack_bits_f32``), multiply, add, in standard ONNX ops.
"""

from __future__ import annotations

import torch

from kernels.kv_quant import pack_bits, unpack_bits_f32
from kernels.kv_spec import MIN_PAGE_SCALE, PageQuantSpec


def _scale_minimum(lo: torch.Tensor, hi: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp16 (scale, minimum) covering [lo, hi] at ``bits``."""
    scale = ((hi - lo) / (2**bits - 1)).to(torch.float16).clamp_min(MIN_PAGE_SCALE)
    return scale, lo.to(torch.float16)


def _codes(x: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, bits: int) -> torch.Tensor:
    """u = clamp(round((x - minimum) / scale), 0, 2^b - 1) as uint8; scale and minimum fp16, broadcast against x."""
    u = torch.round((x - minimum.to(torch.float32)) / scale.to(torch.float32))
    return u.clamp(0, 2**bits - 1).to(torch.uint8)


def seal_keys(k: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Full pages of keys k (..., bs, d) float32 -> (codes (..., bs, d) uint8, scale (..., 1, d) fp16,
    minimum (..., 1, d) fp16): one (scale, minimum) per channel over the page's tokens."""
    scale, minimum = _scale_minimum(k.amin(dim=-2, keepdim=True), k.amax(dim=-2, keepdim=True), bits)
    return _codes(k, scale, minimum, bits), scale, minimum


def seal_values(v: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Values v (..., d) float32 -> (codes (..., d) uint8, scale (..., d / group) fp16, minimum (..., d / group)
    fp16): one (scale, minimum) per token and group of ``group`` channels."""
    grouped = v.unflatten(-1, (v.shape[-1] // group, group))  # (..., d / G, G)
    scale, minimum = _scale_minimum(grouped.amin(dim=-1), grouped.amax(dim=-1), bits)  # (..., d / G)
    return _codes(grouped, scale[..., None], minimum[..., None], bits).flatten(-2), scale, minimum


def seal_packed(k: torch.Tensor, v: torch.Tensor, spec: PageQuantSpec) -> dict[str, torch.Tensor]:
    """Full pages k, v (S, nkv, bs, d) float32 -> what the page pool stores, by role: ``key_codes`` and
    ``value_codes`` bit-packed (``kernels.kv_quant.pack_bits``), the fp16 scales and minima as they are."""
    k_codes, k_scale, k_min = seal_keys(k, spec.k_bits)
    v_codes, v_scale, v_min = seal_values(v, spec.v_bits, spec.v_group_size)
    return {"key_codes": pack_bits(k_codes, spec.k_bits), "key_scale": k_scale, "key_min": k_min,
            "value_codes": pack_bits(v_codes, spec.v_bits), "value_scale": v_scale, "value_min": v_min}


def dequantize_key_pages(codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, bits: int,
                         block_size: int) -> torch.Tensor:
    """Sealed keys as the graph gathers them: codes (B, nkv, M bs, packed d) uint8, scale and minimum (B, nkv, M, d)
    fp16 -> keys (B, nkv, M bs, d) float32, each page's tokens read with its channels' scales."""
    B, nkv, M, d = scale.shape
    u = unpack_bits_f32(codes, bits, d).reshape(B, nkv, M, block_size, d)
    k = u * scale.to(torch.float32)[:, :, :, None] + minimum.to(torch.float32)[:, :, :, None]
    return k.reshape(B, nkv, M * block_size, d)


def dequantize_value_pages(codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, bits: int,
                           head_dim: int) -> torch.Tensor:
    """Sealed values as the graph gathers them: codes (B, nkv, S, packed d) uint8, scale and minimum (B, nkv, S, d / G)
    fp16 -> values (B, nkv, S, d) float32."""
    B, nkv, S, groups = scale.shape
    u = unpack_bits_f32(codes, bits, head_dim).reshape(B, nkv, S, groups, head_dim // groups)  # (B, nkv, S, d / G, G)
    v = u * scale.to(torch.float32)[..., None] + minimum.to(torch.float32)[..., None]
    return v.reshape(B, nkv, S, head_dim)


def read_back(k: torch.Tensor, v: torch.Tensor, spec: PageQuantSpec, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference cache: a row's K and V (nkv, n, d) float32, positions 0..n-1, as the scheme reads them back.
    The first page and the open page (a last page not yet full) as they are; every other page sealed (its codes,
    never packed) and dequantized. The engine's graph reads the same values from packed pools, in another order."""
    bs, n = block_size, k.shape[1]
    sealed = max(n // bs - 1, 0)  # pages 1 .. n // bs - 1 are full and not the first
    if not sealed:
        return k, v
    span = slice(bs, bs * (1 + sealed))
    nkv, d = k.shape[0], k.shape[2]
    k_pages = k[:, span].reshape(nkv, sealed, bs, d)
    k_codes, k_scale, k_min = seal_keys(k_pages, spec.k_bits)
    v_codes, v_scale, v_min = seal_values(v[:, span], spec.v_bits, spec.v_group_size)
    groups = d // spec.v_group_size
    k_read = (k_codes.float() * k_scale.float() + k_min.float()).reshape(nkv, sealed * bs, d)
    v_read = (v_codes.float().unflatten(-1, (groups, spec.v_group_size)) * v_scale.float()[..., None]
              + v_min.float()[..., None]).flatten(-2)
    return (torch.cat([k[:, :bs], k_read, k[:, span.stop:]], dim=1), torch.cat([v[:, :bs], v_read, v[:, span.stop:]], dim=1))
