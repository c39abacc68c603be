"""Quantized pages: the device's numpy sealer (``runtime.engine.kv_pages``) against the PyTorch reference
(``kernels.page_quant``), the graph's read of the packed pools, and what a page stores."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from kernels.bit_packing import pack_bits, prefix_parts_u8, unmix_prefix_parts, unpack_bits, unpack_parts_u8
from kernels.kv_spec import MIN_PAGE_SCALE, PAGE_BITS, PageQuantSpec, key_code_shape
from kernels.page_quant import (
    dequantize_key_pages,
    dequantize_value_pages,
    key_scale_minimum,
    read_back,
    seal_keys,
    seal_packed,
    seal_values,
    sealed_key_scores,
    sealed_value_mix,
)
from runtime.engine.kv_pages import pack_codes, seal_pages

WIDTHS = [(8, 8), (4, 4), (3, 3), (2, 2), (4, 2), (2, 8)]


def pages_of_real_shape(seed: int) -> tuple[np.ndarray, np.ndarray]:
    """K and V of 6 pages (S, nkv, bs, d) = (6, 2, 16, 64) as real checkpoints make them hard to quantize: a few
    key channels 20x wider and off-centre, a token whose values are 30x the rest (a massive activation), a constant
    channel (hi == lo), negatives only, and values that land on rounding ties."""
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((6, 2, 16, 64)).astype(np.float32)
    k[..., [3, 40]] = k[..., [3, 40]] * 20 + 7
    k[:, :, :, 9] = 1.25  # constant over the page
    k[1] = -np.abs(k[1]) - 3
    v = rng.standard_normal((6, 2, 16, 64)).astype(np.float32)
    v[2, :, 5] *= 30
    v[3] = np.round(v[3] * 4) / 4  # multiples of 1/4: many values exactly half a step from two codes
    return k, v


@pytest.mark.parametrize("k_bits,v_bits", WIDTHS)
@pytest.mark.parametrize("group", [32, 8, 64])
def test_the_device_seals_the_same_codes_and_scales_as_the_pytorch_reference(k_bits, v_bits, group):
    spec = PageQuantSpec(k_bits=k_bits, v_bits=v_bits, v_group_size=group)
    for seed in range(3):
        k, v = pages_of_real_shape(seed)

        device = seal_pages(k, v, spec)
        reference = {role: t.numpy() for role, t in seal_packed(torch.from_numpy(k), torch.from_numpy(v), spec).items()}

        assert device.keys() == reference.keys()
        for role, stored in reference.items():
            # Identical integers, and identical fp16 scales and minima, not merely close: both sides run the same
            # correctly rounded float32 ops (subtract, divide, round half to even) and the same casts to fp16.
            assert device[role].dtype == stored.dtype and device[role].shape == stored.shape, role
            assert np.array_equal(device[role], stored), (role, seed)


@pytest.mark.parametrize("bits", PAGE_BITS)
def test_the_device_packs_codes_as_the_kernels_pack_them(bits):
    u = np.random.default_rng(bits).integers(0, 2**bits, (3, 2, 5, 64), dtype=np.uint8)
    assert np.array_equal(pack_codes(u, bits), pack_bits(torch.from_numpy(u), bits).numpy())
    assert pack_codes(u, bits).shape[-1] == 64 // 8 * bits  # 3 bits packed densely: 24 bytes per 64 codes, not 32


@pytest.mark.parametrize("k_bits,v_bits", WIDTHS)
def test_the_graphs_read_of_packed_pages_is_the_references_read_back(k_bits, v_bits):
    spec = PageQuantSpec(k_bits=k_bits, v_bits=v_bits, v_group_size=32)
    k, v = (torch.from_numpy(x) for x in pages_of_real_shape(0))  # 6 pages (S, nkv, bs, d)
    stored = seal_packed(k, v, spec)

    # the graph gathers one row's pages end to end: (B, nkv, M bs, ·) with the pages as M; here B = 1, M = 6
    def row(t):
        return t.transpose(0, 1).reshape(1, 2, -1, t.shape[-1])

    scale, minimum = key_scale_minimum(*(row(stored[role]) for role in ("key_scale", "key_min", "key_base")))
    keys = dequantize_key_pages(row(stored["key_codes"]), scale, minimum, k_bits, 16)
    values = dequantize_value_pages(row(stored["value_codes"]), row(stored["value_scale"]), row(stored["value_min"]),
                                    v_bits, 64)
    # the reference: a row of 8 pages (sink, the 6, an open page of 3 tokens) read back
    sink, tail = torch.randn(2, 16, 64), torch.randn(2, 3, 64)
    ref_k, ref_v = read_back(torch.cat([sink, row(k)[0], tail], 1), torch.cat([sink, row(v)[0], tail], 1), spec, 16)

    assert torch.equal(keys[0], ref_k[:, 16:-3]) and torch.equal(values[0], ref_v[:, 16:-3])
    assert torch.equal(ref_k[:, :16], sink) and torch.equal(ref_k[:, -3:], tail)  # the float pages read as they are


@pytest.mark.parametrize("block_size", [16, 6, 5])
@pytest.mark.parametrize("bits", PAGE_BITS)
def test_keys_of_any_page_size_are_read_back_from_their_layout_and_scored_as_the_read_back_keys(bits, block_size):
    """Pages of 16 and 6 tokens pack 4-bit keys across tokens (8 and 3 rows), 2-bit ones across tokens at 16 and across
    channels at 6 (no multiple of 4); pages of 5 pack every width across channels. Whatever the layout, the device packs
    what the reference packs, the read gives the keys read back, and the graph's scores are their products with q."""
    spec = PageQuantSpec(k_bits=bits, v_bits=4, v_group_size=16)
    k = torch.randn(4, 2, block_size, 64, generator=torch.Generator().manual_seed(bits)) * 3  # 4 pages (S, nkv, bs, d)
    stored = seal_packed(k, k, spec)
    assert tuple(stored["key_codes"].shape[-2:]) == key_code_shape(bits, block_size, 64)
    assert np.array_equal(seal_pages(k.numpy(), k.numpy(), spec)["key_codes"], stored["key_codes"].numpy())

    codes, *grid = seal_keys(k, bits)
    k_scale, k_min = key_scale_minimum(*grid)  # (S, nkv, 1, d)
    read_back_keys = (codes.float() * k_scale + k_min).transpose(0, 1).flatten(1, 2)  # (nkv, S bs, d)

    def row(t):  # a row's pages as the graph gathers them: (1, nkv, S, ., .)
        return t.transpose(0, 1)[None]

    scale, minimum = row(k_scale), row(k_min)  # (1, nkv, S, 1, d)
    keys = dequantize_key_pages(row(stored["key_codes"]).flatten(2, 3), scale.squeeze(3), minimum.squeeze(3), bits,
                                block_size)
    assert torch.equal(keys[0], read_back_keys)
    q = torch.randn(1, 2, 7, 64, generator=torch.Generator().manual_seed(1))
    scores = sealed_key_scores(q, row(stored["key_codes"]), scale, minimum, bits, block_size)
    want = q @ keys.transpose(-1, -2)
    assert (scores - want).abs().max() <= 2e-6 * want.abs().max()


@pytest.mark.parametrize("bits", PAGE_BITS)
def test_the_codes_unpack_into_byte_parts_that_are_the_codes_channels_by_part(bits):
    u = torch.randint(0, 2**bits, (3, 2, 5, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(bits))
    packed = pack_bits(u, bits)
    parts = unpack_parts_u8(packed, bits)
    per = len(parts)

    assert per == {8: 1, 4: 2, 3: 8, 2: 4}[bits] and all(p.dtype == torch.uint8 for p, _ in parts)
    values = [p.float() / weight for p, weight in parts]  # part j: value j of every byte (of every 8 at 3 bits)
    assert [weight for _, weight in parts] == ([1.0] * 8 if bits == 3 else [2.0 ** (bits * j) for j in range(per)])
    assert torch.equal(torch.stack(values, dim=-1).flatten(-2), unpack_bits(packed, bits, 64).float())
    assert all(torch.equal(v, u[..., j::per].float()) for j, v in enumerate(values))  # channels j::per
    along_2 = unpack_parts_u8(packed.movedim(-1, 2), bits, dim=2)  # the bytes along another axis: the same parts
    assert all(torch.equal(a.movedim(2, -1), p) for (a, _), (p, _) in zip(along_2, parts))


@pytest.mark.parametrize("bits", [4, 2])
def test_prefix_parts_multiply_bytes_without_masking_and_unmix_into_the_codes_channels_by_part(bits):
    u = torch.randint(0, 2**bits, (3, 2, 5, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(bits))
    parts = prefix_parts_u8(pack_bits(u, bits), bits)
    per = 8 // bits

    assert len(parts) == per and all(p.dtype == torch.uint8 for p in parts)
    mixed = [p.float() / 2 ** (8 - bits) for p in parts]  # part j: value j plus the ones before it, shifted down
    assert not torch.equal(mixed[1], u[..., 1::per].float())  # mixed before unmixing
    assert all(torch.equal(v, u[..., j::per].float()) for j, v in enumerate(unmix_prefix_parts(mixed, bits)))


@pytest.mark.parametrize("k_bits,v_bits", WIDTHS)
@pytest.mark.parametrize("group", [32, 8, 4])
def test_the_graphs_scores_and_mix_are_the_products_with_the_read_back_pages(k_bits, v_bits, group):
    """The graph never materializes the sealed pages: q . k and sum a v from the codes, the scales applied as the
    codes become floats and the minima folded into q and a. Equal to the products with the pages read back, up to
    float32 reassociation; group 4 is narrower than the 8 codes of a 3-bit word (a scale per code)."""
    spec = PageQuantSpec(k_bits=k_bits, v_bits=v_bits, v_group_size=group)
    k, v = (torch.from_numpy(x) for x in pages_of_real_shape(2))  # 6 pages (S, nkv, bs, d)
    stored = seal_packed(k, v, spec)
    pages = {role: t.transpose(0, 1)[None] for role, t in stored.items()}  # a row's pages as gathered: (1, nkv, 6, ·, ·)
    sink = torch.randn(2, 16, 64)
    ref_k, ref_v = (t[:, 16:][None] for t in read_back(torch.cat([sink, rows_of(k)], 1), torch.cat([sink, rows_of(v)], 1),
                                                       spec, 16))  # (1, nkv, 96, d): the 6 pages as read back
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 7, 64, generator=g)  # 7 query rows per kv head, as Qwen2-0.5B's heads fold
    a = torch.softmax(torch.randn(1, 2, 7, 96, generator=g) * 3, dim=-1)

    scores = sealed_key_scores(q, pages["key_codes"], *key_scale_minimum(pages["key_scale"], pages["key_min"],
                                                                         pages["key_base"]), k_bits, 16)
    mix = sealed_value_mix(a, pages["value_codes"], pages["value_scale"], pages["value_min"], v_bits)

    want_scores, want_mix = q @ ref_k.transpose(-1, -2), a @ ref_v
    # Measured at every width and group here: scores (up to ~130) within 8.4e-5, the mix (up to ~2.6) within 3.4e-6.
    # A code misread by one step moves a score by that key step times |q_c| (~1.6e-2 on a unit channel at 8 bits), and
    # the mix by the value step times the token's weight (~2e-4 at 8 bits, groups of 4, for the heaviest weights).
    assert (scores - want_scores).abs().max() <= 2e-6 * want_scores.abs().max()
    assert (mix - want_mix).abs().max() <= 1e-5


def rows_of(t: torch.Tensor) -> torch.Tensor:
    """Pages (S, nkv, bs, d) -> one row's tokens (nkv, S bs, d)."""
    return t.transpose(0, 1).reshape(t.shape[1], -1, t.shape[-1])


@pytest.mark.parametrize("bits", PAGE_BITS)
def test_a_sealed_value_is_within_half_a_step_plus_the_fp16_rounding_of_its_scale_and_minimum(bits):
    k, v = (torch.from_numpy(x) for x in pages_of_real_shape(1))
    k_codes, *k_grid = seal_keys(k, bits)
    for x, (u, scale, minimum), reduce in ((k, (k_codes, *key_scale_minimum(*k_grid)), -2),
                                           (v, seal_values(v, bits, 32), None)):
        if reduce is None:  # per token and group of 32: compare group by group
            x, u = x.unflatten(-1, (2, 32)), u.unflatten(-1, (2, 32))
            lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
            scale, minimum = scale[..., None], minimum[..., None]
        else:
            lo, hi = x.amin(reduce, keepdim=True), x.amax(reduce, keepdim=True)
        s, m = scale.float(), minimum.float()
        error = (u.float() * s + m - x).abs()
        # rounding: half a step; the fp16 minimum shifts the grid by |m - lo|; the fp16 scale stretches it by up to
        # (2^b - 1) |s - (hi - lo) / (2^b - 1)| at the top code; 1e-6 for float32 arithmetic on values up to ~80
        bound = 0.5 * s + (m - lo).abs() + (2**bits - 1) * (s - (hi - lo) / (2**bits - 1)).abs() + 1e-6 * hi.abs().clamp_min(1)
        assert (error <= bound).all()
        assert (u <= 2**bits - 1).all()


@pytest.mark.parametrize("bits", PAGE_BITS)
def test_a_keys_grid_reaches_below_each_channels_minimum_and_above_its_maximum(bits):
    """Keys' scales and minima are stored in 8 bits, and still nothing is clipped: each channel's stored minimum lies at
    or below its lowest key (within the fp16 rounding of the page's origin), less than one minimum unit below, and its
    top code reaches its highest key, with a step at most one scale unit coarser than the channel's own."""
    k, _ = (torch.from_numpy(x) for x in pages_of_real_shape(3))
    codes, *grid = seal_keys(k, bits)
    scale, minimum = key_scale_minimum(*grid)
    unit, origin, min_unit = (grid[2][..., i : i + 1].float() for i in range(3))
    lo, hi = k.amin(-2, keepdim=True), k.amax(-2, keepdim=True)
    origin_rounding = (origin - lo.amin(-1, keepdim=True)).clamp_min(0)  # fp16(origin) may land just above the lowest
    assert (minimum <= lo + origin_rounding).all() and (minimum > lo - min_unit - origin_rounding).all()
    top = minimum + (2**bits - 1) * scale
    assert (top >= hi - 1e-6 * hi.abs()).all()
    assert (scale <= (hi - minimum) / (2**bits - 1) + unit + 1e-7).all()
    assert grid[0].dtype == grid[1].dtype == torch.uint8 and grid[2].dtype == torch.float16 and grid[2].shape[-1] == 3


def test_a_constant_group_codes_to_zero_and_reads_back_its_value():
    x = torch.full((1, 1, 16, 8), -2.5)
    u, *grid = seal_keys(x, 4)
    scale, minimum = key_scale_minimum(*grid)
    assert (u == 0).all() and torch.equal(u.float() * scale + minimum, x)
    device = seal_pages(x.numpy(), x.numpy(), PageQuantSpec(k_bits=4, v_bits=4, v_group_size=8))
    assert (device["key_codes"] == 0).all() and (device["key_scale"] == 1).all()
    assert device["key_base"][..., 0].min() == np.float16(MIN_PAGE_SCALE)


def test_the_stored_bits_count_codes_scales_and_the_float_pages():
    spec = PageQuantSpec()  # K4/V4, values in groups of 64
    # one head of d = 64 in pages of 16, per page: keys 16 x 32 code bytes + 64 (scale, minimum) pairs of 8-bit codes
    # + the key_base's 3 fp16 = 646, values 16 x 32 + 16 tokens x 1 group x 2 x fp16 = 576
    assert spec.sealed_page_bytes(64, 16) == 646 + 576
    # 2,048 tokens: the sink page float (K and V, 16 x 64 fp32 each: 8,192 bytes), 127 pages sealed, no open page
    assert spec.stored_bits_per_value(64, 16, 2048) == pytest.approx(8 * (8192 + 127 * 1222) / (2 * 2048 * 64))  # 4.99
    assert spec.stored_bits_per_value(64, 16, 2048) <= 5.0  # issue 39's target (llama.cpp's q4_0 cache: 4.5)
    # 2,050 tokens: an open page of 2 tokens, allocated whole, float
    assert spec.stored_bits_per_value(64, 16, 2050) == pytest.approx(8 * (2 * 8192 + 127 * 1222) / (2 * 2050 * 64))
    assert PageQuantSpec(k_bits=3, v_bits=3, v_group_size=32).sealed_page_bytes(64, 16) == (16 * 24 + 134) + (16 * 24 + 128)


def test_a_scheme_is_refused_with_every_problem_named():
    with pytest.raises(ValueError, match=r"k_bits=5 is not one of \(2, 3, 4, 8\); v_group_size=0"):
        PageQuantSpec(k_bits=5, v_group_size=0)
    with pytest.raises(ValueError, match=r"unknown fields \['rotation'\]"):
        PageQuantSpec.from_dict({"k_bits": 4, "v_bits": 4, "v_group_size": 32, "rotation": "hadamard"})
    assert PageQuantSpec(v_group_size=48).problems(64) == ["v_group_size=48 does not divide head_dim=64"]
    assert PageQuantSpec(v_group_size=4).problems(12) == ["head_dim=12 (codes pack 8 channels at a time: needs a multiple of 8)"]


def test_per_layer_widths_give_each_layer_its_own_pages_and_count_their_mean():
    spec = PageQuantSpec(k_bits=2, v_bits=2).with_layer_bits([(2, 2), (4, 3), (2, 2)])
    assert [(s.k_bits, s.v_bits) for s in map(spec.layer, range(3))] == [(2, 2), (4, 3), (2, 2)]
    assert spec.name == "K2/V2 pages g64, 1 of 3 layers wider"
    # the table travels as JSON and reads back the same; a uniform scheme's dict has no table at all
    assert spec.to_dict()["layer_bits"] == [[2, 2], [4, 3], [2, 2]]
    assert PageQuantSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
    assert PageQuantSpec(k_bits=2, v_bits=2).with_layer_bits([(2, 2)] * 3) == PageQuantSpec(k_bits=2, v_bits=2)
    assert "layer_bits" not in PageQuantSpec().to_dict()
    # stored bits: the mean over layers, each at its own widths
    layers = [PageQuantSpec(k_bits=k, v_bits=v).stored_bits_per_value(64, 16, 2048) for k, v in [(2, 2), (4, 3), (2, 2)]]
    assert spec.stored_bits_per_value(64, 16, 2048) == pytest.approx(sum(layers) / 3)
    with pytest.raises(ValueError, match="a page's bytes depend on its layer"):
        spec.sealed_page_bytes(64, 16)
    assert spec.layer_problems(3) == [] and spec.layer_problems(30) == ["layer_bits names 3 layers, the backbone has 30"]
    with pytest.raises(ValueError, match=r"layer_bits\[1\]=\[4, 5\] is not a \(k_bits, v_bits\) pair"):
        PageQuantSpec(layer_bits=((4, 4), (4, 5)))
