"""Quantized pages (``kernels.kv_spec.PageQuantSpec``) in PyTorch: the reference sealer, and the read the graph runs.

Sealing a page of ``bs`` tokens (one block of the paged cache), every range asymmetric, nothing clipped:
  values  (bs, d): per token t and group of G channels: lo, hi over the group's channels;
          scale = fp16((hi - lo) / (2^b - 1)) (at least ``kernels.kv_spec.MIN_PAGE_SCALE``), minimum = fp16(lo);
  keys    (bs, d): per channel c, over the page's tokens: lo_c = min_t k[t, c], hi_c = max_t k[t, c]; the d minima
          and d scales of a (page, head) are themselves stored in 8 bits (double quantization, QLoRA's term), on
          grids of the page's own ``key_base`` (fp16: scale unit, minimum origin, minimum unit):
            origin = fp16(min_c lo_c), min_unit = fp16((max_c lo_c - origin) / 255),
            minimum_c = origin + floor((lo_c - origin) / min_unit) min_unit  (at or below lo_c: the range still holds),
            s_c = (hi_c - minimum_c) / (2^b - 1), scale_unit = fp16(max_c s_c / 254) (fp16 rounds by at most
            2^-11, so the widest channel needs at most 255 units), scale_c = ceil(s_c / scale_unit) scale_unit (at or
            above s_c: the top code still reaches hi_c);
          fp16 pairs per channel would cost 32 bits per 16 tokens, 2 bits per key; these cost 1 bit, and measured on
          SmolLM2 (bench/quality/real_model_quality.py's text, K4/V4 g64) KL 4.72e-3 against fp16 pairs' 4.78e-3;
  then u = clamp(round((x - minimum) / scale), 0, 2^b - 1), read back as x' = u scale + minimum (KIVI's form).

Every step is one IEEE operation on float32 (subtract, multiply, divide, floor, ceil, round half to even) or a cast to
fp16 (round to nearest even), so numpy computes the same integers and the same fp16 scales bit for bit: the device
seals in numpy (``runtime.engine.kv_pages``, no torch on the serving path) and ``tests/kernels/test_page_quant.py``
compares the two code for code. Minima are kept as floats (fp16, or on their 8-bit grid), not rounded to an integer
zero point: an integer zero point moves every value of the group by up to half a step on top of its rounding.

Keys at 2 and 4 bits are packed across a page's tokens (``kernels.kv_spec.key_token_rows``: a byte holds one channel
of tokens t, t + r, ...), values and the other key widths across channels (``kernels.bit_packing.pack_bits``).

The read (``sealed_key_scores``, ``sealed_value_mix``; materialized for the tests by ``dequantize_key_pages``,
``dequantize_value_pages``) is what the exported graph runs on the codes it gathers through a block table: bytes
taken apart (``kernels.bit_packing.prefix_parts_u8`` at 2 and 4 bits, by a uint8 multiply; ``unpack_parts_u8``
otherwise), multiplied by their scales as they become floats, in standard ONNX ops. The keys' multiply is a blocked
DequantizeLinear (a scale per channel over a page's tokens), which needs opset ``READ_OPSET``: ``onnx_translations``
tells the exporter how to write it.
"""

from __future__ import annotations

import torch
import torch.ao.quantization.fx._decomposed  # noqa: F401  registers torch.ops.quantized_decomposed (DequantizeLinear)

from kernels.bit_packing import (
    pack_bits,
    pack_token_runs,
    prefix_parts_u8,
    unmix_prefix_parts,
    unpack_parts_u8,
)
from kernels.kv_spec import KEY_GRID_STEPS, MIN_PAGE_SCALE, PageQuantSpec, key_code_shape, key_token_rows


def _scale_minimum(lo: torch.Tensor, hi: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp16 (scale, minimum) covering [lo, hi] at ``bits``."""
    scale = ((hi - lo) / (2**bits - 1)).to(torch.float16).clamp_min(MIN_PAGE_SCALE)
    return scale, lo.to(torch.float16)


def _codes(x: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, bits: int) -> torch.Tensor:
    """u = clamp(round((x - minimum) / scale), 0, 2^b - 1) as uint8; scale and minimum fp16 or float32, broadcast
    against x."""
    u = torch.round((x - minimum.to(torch.float32)) / scale.to(torch.float32))
    return u.clamp(0, 2**bits - 1).to(torch.uint8)


def key_scale_minimum(scale_codes: torch.Tensor, min_codes: torch.Tensor,
                      base: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A page's stored key grid, codes (..., d) uint8 and ``key_base`` (..., 3) fp16 (scale unit, minimum origin,
    minimum unit) -> the (scale, minimum) per channel (..., d) float32 its codes are read with."""
    unit, origin, min_unit = (base[..., i : i + 1].to(torch.float32) for i in range(3))
    return scale_codes.to(torch.float32) * unit, origin + min_codes.to(torch.float32) * min_unit


def key_grid(lo: torch.Tensor, hi: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-channel key ranges [lo, hi] (..., d) float32 -> (scale codes (..., d) uint8, minimum codes (..., d) uint8,
    ``key_base`` (..., 3) fp16): the double-quantized grid of the module's docstring."""
    origin = lo.amin(-1, keepdim=True).to(torch.float16)
    min_unit = ((lo.amax(-1, keepdim=True) - origin.to(torch.float32)) / KEY_GRID_STEPS).to(torch.float16)
    min_unit = min_unit.clamp_min(MIN_PAGE_SCALE)
    min_codes = torch.floor((lo - origin.to(torch.float32)) / min_unit.to(torch.float32)).clamp(0, KEY_GRID_STEPS)
    minimum = origin.to(torch.float32) + min_codes * min_unit.to(torch.float32)
    steps = (hi - minimum) / (2**bits - 1)
    unit = (steps.amax(-1, keepdim=True) / (KEY_GRID_STEPS - 1)).to(torch.float16).clamp_min(MIN_PAGE_SCALE)
    scale_codes = torch.ceil(steps / unit.to(torch.float32)).clamp(1, KEY_GRID_STEPS)
    return scale_codes.to(torch.uint8), min_codes.to(torch.uint8), torch.cat([unit, origin, min_unit], dim=-1)


def seal_keys(k: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Full pages of keys k (..., bs, d) float32 -> (codes (..., bs, d) uint8, scale codes (..., 1, d) uint8, minimum
    codes (..., 1, d) uint8, ``key_base`` (..., 1, 3) fp16): one (scale, minimum) per channel over the page's tokens,
    on the page's 8-bit grid (``key_grid``)."""
    scale_codes, min_codes, base = key_grid(k.amin(dim=-2, keepdim=True), k.amax(dim=-2, keepdim=True), bits)
    scale, minimum = key_scale_minimum(scale_codes, min_codes, base)
    return _codes(k, scale, minimum, bits), scale_codes, min_codes, base


def seal_values(v: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Values v (..., d) float32 -> (codes (..., d) uint8, scale (..., d / group) fp16, minimum (..., d / group)
    fp16): one (scale, minimum) per token and group of ``group`` channels."""
    grouped = v.unflatten(-1, (v.shape[-1] // group, group))  # (..., d / G, G)
    scale, minimum = _scale_minimum(grouped.amin(dim=-1), grouped.amax(dim=-1), bits)  # (..., d / G)
    return _codes(grouped, scale[..., None], minimum[..., None], bits).flatten(-2), scale, minimum


def seal_packed(k: torch.Tensor, v: torch.Tensor, spec: PageQuantSpec) -> dict[str, torch.Tensor]:
    """Full pages k, v (S, nkv, bs, d) float32 -> what the page pool stores, by role (``runtime.engine.interface.SEALED_ROLES``):
    ``key_codes`` bit-packed across tokens where ``kernels.kv_spec.key_token_rows`` (``pack_token_runs``), else across
    channels as ``value_codes`` are (``kernels.bit_packing.pack_bits``), the keys' 8-bit grid and its
    ``key_base``, the values' fp16 scales and minima, as they are."""
    k_codes, k_scale, k_min, k_base = seal_keys(k, spec.k_bits)
    v_codes, v_scale, v_min = seal_values(v, spec.v_bits, spec.v_group_size)
    rows = key_token_rows(spec.k_bits, k.shape[-2])
    k_packed = pack_token_runs(k_codes, spec.k_bits) if rows else pack_bits(k_codes, spec.k_bits)
    return {"key_codes": k_packed, "key_scale": k_scale, "key_min": k_min, "key_base": k_base,
            "value_codes": pack_bits(v_codes, spec.v_bits), "value_scale": v_scale, "value_min": v_min}


# ---------------------------------------------------------------- the read
# The graph reads a row's sealed pages as it gathers them, page by page (``runtime.engine.paged_model.gathered_blocks``):
# key codes (B, nkv, M, bs, packed d) uint8 with scale and minimum (B, nkv, M, 1, d) float32, read from their grid
# (``key_scale_minimum``); value codes (B, nkv, M, bs, packed d) with scale and minimum (B, nkv, M, bs, d / G) fp16. It never materializes them as float K/V plus minimum: the
# codes become floats already scaled (``dequantize_pages``, ``_dequantized``), and the minima fold into the small side, q and the weights.

def _dequantized(u: torch.Tensor, scale: torch.Tensor, run: int) -> torch.Tensor:
    """Codes u uint8 whose runs of ``run`` consecutive codes share a scale, scale float32 (one per run, in u's
    order) -> u scale as rows (u.numel() / run, run) float32: one per-axis DequantizeLinear
    (``quantized_decomposed.dequantize_per_channel`` exports as one), which reads the bytes and writes the floats
    in one pass. A Cast and a broadcast Mul take two, the Mul alone ~5x the DequantizeLinear's time (measured in
    ONNX Runtime, 2 threads, 1 M codes in rows of 16: 1.1-1.3 ms against 0.25 ms, the same floats)."""
    return torch.ops.quantized_decomposed.dequantize_per_channel(u.reshape(-1, run), scale.reshape(-1), None, 0, 0, 255,
                                                                 torch.uint8)


READ_OPSET = 21  # DequantizeLinear's block_size; the ops of an opset-18 export keep their meaning there


@torch.library.custom_op("page_quant::dequantize_pages", mutates_args=())
def dequantize_pages(u: torch.Tensor, scale: torch.Tensor, block_size: int) -> torch.Tensor:
    """Codes u (..., bs, w) uint8 and scale (..., 1, w) float32, a scale per channel over a page's ``bs`` tokens ->
    u scale (..., bs, w) float32. One op for the exporter to write as one blocked DequantizeLinear
    (``onnx_translations``), which reads the bytes and writes the floats in one pass: a Cast and a broadcast Mul take
    two; the keys transposed to rows of a page's channel (a per-row DequantizeLinear, as before) cost a Transpose of
    the codes and of the scales and a slower product (q times keys laid out channel by token, not token by channel).
    Measured at the 0.5B shape, int4, past 2,048, 2 threads, the two engines interleaved: a decode step at batch 8
    1.35x the float paged one's, against 1.80x with the transposed read; batch 1 the same (1.26x)."""
    return u.to(torch.float32) * scale


@dequantize_pages.register_fake
def _(u: torch.Tensor, scale: torch.Tensor, block_size: int) -> torch.Tensor:
    return torch.empty(u.shape, dtype=torch.float32)


def onnx_translations() -> dict:
    """``torch.onnx.export``'s ``custom_translation_table`` for this module's ops (export at ``READ_OPSET``)."""
    from onnxscript import opset21

    def dequantize_pages_onnx(u, scale, block_size: int):
        return opset21.DequantizeLinear(u, scale, axis=-2, block_size=block_size)

    return {torch.ops.page_quant.dequantize_pages.default: dequantize_pages_onnx}


def key_channels(codes: torch.Tensor, scale: torch.Tensor, bits: int) -> tuple[torch.Tensor, list[int] | None]:
    """Key pages packed across channels (3 and 8 bits, or a page size that ``kernels.kv_spec.key_token_rows`` leaves
    so), codes (B, nkv, M, bs, packed d) uint8 and scale (B, nkv, M, 1, d) float32 -> (the keys less their
    page's minimum, u s, as a row's tokens (B, nkv, M bs, d) float32 with the channels in part order, that order):
    the parts of ``kernels.bit_packing.unpack_parts_u8`` (part j: channels j::per) side by side, channels 0, per,
    2 per, ..., 1, per + 1, ..., so that q's channels taken in the same order multiply them in one product. None:
    one part (8 bits), the channels as they are.

    One blocked dequantization of the parts' bytes laid side by side (a Concat of bytes, a quarter of the floats' size),
    each part's weight folded into its channels' scales: not a product per part summed after, which holds per + 1
    (B, nkv, R, M bs) score tensors at once (a prefill chunk of 64 tokens at the Qwen2-0.5B shape, 2,048 tokens
    back: 6.7 MB each, the largest tensors of the forward) and an Add over them."""
    B, nkv, M, bs, _ = codes.shape
    d = scale.shape[-1]  # not -1 below: a row may have no sealed page yet (M = 0)
    parts = unpack_parts_u8(codes, bits)
    if len(parts) == 1:
        return dequantize_pages(codes, scale, bs).reshape(B, nkv, M * bs, d), None
    per = len(parts)
    order = [c for j in range(per) for c in range(j, d, per)]
    weights = torch.tensor([1.0 / weight for _, weight in parts for _ in range(d // per)])
    u = torch.cat([part for part, _ in parts], dim=-1)  # (B, nkv, M, bs, d)
    return dequantize_pages(u, scale[..., order] * weights, bs).reshape(B, nkv, M * bs, d), order


def value_parts(codes: torch.Tensor, scale: torch.Tensor, bits: int) -> tuple[list[torch.Tensor], int | None]:
    """Value pages, codes (B, nkv, M, bs, packed d) uint8 and scale (B, nkv, M, bs, d / G) fp16 -> per part j of the
    codes (channels j::per) the values less their group's minimum as floats, (B, nkv, M bs, d / per) float32, and the
    width to ``unmix_prefix_parts`` them with (None: each part holds its values alone).

    When each byte's channels share a group (per divides the group, at 2 and 4 bits), the parts are
    ``kernels.bit_packing.prefix_parts_u8``'s, read under their group's scale as they stand, and the caller unmixes
    them on the small side (``sealed_value_mix``: after the products with the weights). Otherwise the masked parts of
    ``unpack_parts_u8`` (3 bits: their words; a group narrower than a byte's channels: its scale per code). A part's
    codes of one group lie side by side (group / per of them: one DequantizeLinear row each). Not laid side by side
    in one tensor as 3-bit keys' parts are (``key_channels``): a group's parts would be copied in runs of group / per
    bytes (16 at K4/V4 g32), measured slower than a second DequantizeLinear and MatMul."""
    B, nkv, M, bs, _ = codes.shape
    groups = scale.shape[-1]
    # flat: ORT multiplies a (..., 1) tensor by a scalar on its slow broadcast path, ~35x a flat one's time
    # (8 x 2 x 127 x 16 x 1 floats: 207 against 6 us)
    s = scale.to(torch.float32).reshape(-1)
    per = 8 // bits if 8 % bits == 0 else 8
    d = per * codes.shape[-1] // (bits if 8 % bits else 1)
    run = d // groups // per  # a part's codes under one scale, side by side
    if bits < 8 and 8 % bits == 0 and (d // groups) % per == 0:
        weight = 2.0 ** (8 - bits)
        return [_dequantized(u, s * (1 / weight), run).reshape(B, nkv, M * bs, d // per)
                for u in prefix_parts_u8(codes, bits)], bits
    parts = unpack_parts_u8(codes, bits)
    if (d // groups) % per == 0:
        return [_dequantized(u, s if weight == 1 else s * (1 / weight), run).reshape(B, nkv, M * bs, d // per)
                for u, weight in parts], None
    per_channel = s.reshape(scale.shape).repeat_interleave(d // groups, dim=-1)  # (B, nkv, M, bs, d)
    return [_dequantized(u, per_channel[..., j::per] * (1 / weight), 1).reshape(B, nkv, M * bs, d // per)
            for j, (u, weight) in enumerate(parts)], None


def unmixed(parts: list[torch.Tensor], prefix_bits: int | None) -> list[torch.Tensor]:
    """``value_parts``' parts, or a linear map of each, as the values' own (``unmix_prefix_parts`` where they mix)."""
    return parts if prefix_bits is None else unmix_prefix_parts(parts, prefix_bits)


def sealed_key_scores(q: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor,
                      bits: int, block_size: int) -> torch.Tensor:
    """q (B, nkv, R, d) against the key pages, codes (B, nkv, M, ``kernels.kv_spec.key_code_shape``) uint8, scale and
    minimum (B, nkv, M, 1, d) float32 -> q . k (B, nkv, R, M bs), k = u s + m: q . (u s), plus q . m per page, one
    (R, d) x (d, M) product instead of an add over every key. The same sums as q . k, reassociated.

    Codes packed across tokens (``kernels.kv_spec.key_token_rows``) are read whole: ``prefix_parts_u8``'s parts of
    the bytes, laid in the page's token order, under the channel's scale (which every code of a byte shares) in one
    blocked dequantization; run j then holds its tokens' keys plus 2^-b times the runs before it, which
    ``unmix_prefix_parts`` takes out of the page's scores. Otherwise q's channels in the order of ``key_channels``."""
    B, nkv, M, rows, _ = codes.shape
    d, bs = scale.shape[-1], block_size  # not -1 in the reshapes: a row may have no sealed page yet (M = 0)
    if key_token_rows(bits, bs):
        u = torch.cat(prefix_parts_u8(codes, bits), dim=-2)  # (B, nkv, M, bs, d): each run mixed with those before
        keys = dequantize_pages(u, scale * 2.0 ** (bits - 8), bs).reshape(B, nkv, M * bs, d)
        mixed = (q @ keys.transpose(-1, -2)).unflatten(-1, (M, 8 // bits, rows))  # (B, nkv, R, M, per, rows)
        # Not a product with a constant (bs, bs) matrix: the weight quantizer would take it for a projection.
        scores = torch.stack(unmix_prefix_parts(list(mixed.unbind(-2)), bits), dim=-2).flatten(-2)
    else:
        keys, order = key_channels(codes, scale, bits)
        scores = ((q if order is None else q[..., order]) @ keys.transpose(-1, -2)).unflatten(-1, (M, bs))
    q_min = q @ minimum.squeeze(3).transpose(-1, -2)  # (B, nkv, R, M)
    return (scores + q_min[..., None]).flatten(-2)


def sealed_value_mix(a: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor,
                     bits: int) -> torch.Tensor:
    """Weights a (B, nkv, R, M bs) over the value pages (``value_parts``'s; minimum (B, nkv, M, bs, d / G) fp16) ->
    sum_t a_t v_t (B, nkv, R, d), v = u s + m: per part a . (u_j s_j), interleaved back on the small side, plus
    a . m per group, one (R, M bs) x (M bs, d / G) product instead of an add over every value."""
    B, nkv, M, bs, groups = scale.shape
    parts, prefix_bits = value_parts(codes, scale, bits)
    y = torch.stack(unmixed([a @ v for v in parts], prefix_bits), dim=-1).flatten(-2)  # (B, nkv, R, d)
    a_min = a @ minimum.to(torch.float32).reshape(B, nkv, M * bs, groups)  # (B, nkv, R, d / G)
    return (y.unflatten(-1, (groups, -1)) + a_min[..., None]).flatten(-2)


def dequantize_key_pages(codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, bits: int,
                         block_size: int) -> torch.Tensor:
    """A row's sealed keys end to end, codes (B, nkv, M rows, w) uint8 (``kernels.kv_spec.key_code_shape``), scale and
    minimum (B, nkv, M, d) float32 -> keys (B, nkv, M bs, d) float32, each page's tokens read with its channels'
    scales: the keys ``sealed_key_scores`` multiplies, materialized (the reference the tests hold it to). Runs across
    tokens are masked apart (``unpack_parts_u8``: exact, each under its weight's share of the scale)."""
    B, nkv, M, d = scale.shape
    bs = block_size
    rows = key_code_shape(bits, bs, d)[0]
    pages = codes.unflatten(2, (M, rows))  # (B, nkv, M, rows, w)
    s = scale[:, :, :, None]  # (B, nkv, M, 1, d)
    if key_token_rows(bits, bs):
        keys = torch.cat([dequantize_pages(u, s * (1.0 / weight), rows) for u, weight in unpack_parts_u8(pages, bits)],
                         dim=-2)  # (B, nkv, M, bs, d)
    else:
        keys, order = key_channels(pages, s, bits)
        if order is not None:  # back to channel order
            keys = keys[..., sorted(range(d), key=order.__getitem__)]
        keys = keys.unflatten(2, (M, bs))
    return (keys + minimum[:, :, :, None]).reshape(B, nkv, M * bs, d)


def dequantize_value_pages(codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, bits: int,
                           head_dim: int) -> torch.Tensor:
    """A row's sealed values end to end, codes (B, nkv, S, packed d) uint8, scale and minimum (B, nkv, S, d / G) fp16
    -> values (B, nkv, S, d) float32: the values ``sealed_value_mix`` weighs, materialized."""
    B, nkv, S, groups = scale.shape
    parts, prefix_bits = value_parts(codes[:, :, None], scale[:, :, None], bits)  # (B, nkv, S, d / per) each
    u_s = torch.stack(unmixed(parts, prefix_bits), dim=-1).reshape(B, nkv, S, groups, head_dim // groups)  # channel per k + j
    return (u_s + minimum.to(torch.float32)[..., None]).reshape(B, nkv, S, head_dim)


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
    k_codes, *k_grid = seal_keys(k_pages, spec.k_bits)
    k_scale, k_min = key_scale_minimum(*k_grid)
    v_codes, v_scale, v_min = seal_values(v[:, span], spec.v_bits, spec.v_group_size)
    groups = d // spec.v_group_size
    k_read = (k_codes.float() * k_scale + k_min).reshape(nkv, sealed * bs, d)
    v_read = (v_codes.float().unflatten(-1, (groups, spec.v_group_size)) * v_scale.float()[..., None]
              + v_min.float()[..., None]).flatten(-2)
    return (torch.cat([k[:, :bs], k_read, k[:, span.stop:]], dim=1), torch.cat([v[:, :bs], v_read, v[:, span.stop:]], dim=1))
