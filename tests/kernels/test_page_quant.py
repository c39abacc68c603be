"""Quantized pages: the device's numpy sealer (``runtime.engine.kv_pages``) against the PyTorch reference
(``kernels.page_quant``), the graph's read of the packed pools, and what a page stores."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels.kv_quant import pack_bits
from kernels.kv_spec import PAGE_BITS, PageQuantSpec
from kernels.page_quant import (
    dequantize_key_pages,
    dequantize_value_pages,
    read_back,
    seal_keys,
    seal_packed,
    seal_values,
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

    keys = dequantize_key_pages(row(stored["key_codes"]), row(stored["key_scale"]), row(stored["key_min"]), k_bits, 16)
    values = dequantize_value_pages(row(stored["value_codes"]), row(stored["value_scale"]), row(stored["value_min"]),
                                    v_bits, 64)
    # the reference: a row of 8 pages (sink, the 6, an open page of 3 tokens) read back
    sink, tail = torch.randn(2, 16, 64), torch.randn(2, 3, 64)
    ref_k, ref_v = read_back(torch.cat([sink, row(k)[0], tail], 1), torch.cat([sink, row(v)[0], tail], 1), spec, 16)

    assert torch.equal(keys[0], ref_k[:, 16:-3]) and torch.equal(values[0], ref_v[:, 16:-3])
    assert torch.equal(ref_k[:, :16], sink) and torch.equal(ref_k[:, -3:], tail)  # the float pages read as they are


@pytest.mark.parametrize("bits", PAGE_BITS)
def test_a_sealed_value_is_within_half_a_step_plus_the_fp16_rounding_of_its_scale_and_minimum(bits):
    k, v = (torch.from_numpy(x) for x in pages_of_real_shape(1))
    for x, (u, scale, minimum), reduce in ((k, seal_keys(k, bits), -2), (v, seal_values(v, bits, 32), None)):
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


def test_a_constant_group_codes_to_zero_and_reads_back_its_value():
    x = torch.full((1, 1, 16, 8), -2.5)
    u, scale, minimum = seal_keys(x, 4)
    assert (u == 0).all() and torch.equal(u.float() * scale.float() + minimum.float(), x)
    device = seal_pages(x.numpy(), x.numpy(), PageQuantSpec(k_bits=4, v_bits=4, v_group_size=8))
    assert (device["key_codes"] == 0).all() and device["key_scale"].min() == np.float16(2.0**-14)


def test_the_stored_bits_count_codes_scales_and_the_float_pages():
    spec = PageQuantSpec()  # K4/V4, values in groups of 32
    # one head of d = 64 in pages of 16, per page: keys 16 x 32 code bytes + 64 (scale, minimum) pairs of fp16 = 768,
    # values 16 x 32 + 16 tokens x 2 groups x 2 x fp16 = 640
    assert spec.sealed_page_bytes(64, 16) == 768 + 640
    # 2,048 tokens: the sink page float (K and V, 16 x 64 fp32 each: 8,192 bytes), 127 pages sealed, no open page
    assert spec.stored_bits_per_value(64, 16, 2048) == pytest.approx(8 * (8192 + 127 * 1408) / (2 * 2048 * 64))  # 5.71
    # 2,050 tokens: an open page of 2 tokens, allocated whole, float
    assert spec.stored_bits_per_value(64, 16, 2050) == pytest.approx(8 * (2 * 8192 + 127 * 1408) / (2 * 2050 * 64))
    assert PageQuantSpec(k_bits=3, v_bits=3).sealed_page_bytes(64, 16) == (16 * 24 + 256) + (16 * 24 + 128)


def test_a_scheme_is_refused_with_every_problem_named():
    with pytest.raises(ValueError, match=r"k_bits=5 is not one of \(2, 3, 4, 8\); v_group_size=0"):
        PageQuantSpec(k_bits=5, v_group_size=0)
    with pytest.raises(ValueError, match=r"unknown fields \['rotation'\]"):
        PageQuantSpec.from_dict({"k_bits": 4, "v_bits": 4, "v_group_size": 32, "rotation": "hadamard"})
    assert PageQuantSpec(v_group_size=48).problems(64) == ["v_group_size=48 does not divide head_dim=64"]
    assert PageQuantSpec(v_group_size=4).problems(12) == ["head_dim=12 (codes pack 8 channels at a time: needs a multiple of 8)"]
