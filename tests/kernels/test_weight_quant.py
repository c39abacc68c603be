"""Numerics of kernels/weight_quant.py: round-to-nearest groups, their error, the clip search, MatMulNBits packing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels.weight_quant import (
    bits_per_weight,
    dequantize_groups,
    fake_quantize,
    gptq_groups,
    mixed_precision_plan,
    pack_codes,
    quantize_groups,
    row_output_error,
)
from runtime.engine.model import rms_norm


def test_norm_fold_is_exact_in_float():
    # Given an RMSNorm scale g far from 1 and a projection W (out, in)
    torch.manual_seed(0)
    x, g, w = torch.randn(5, 64, dtype=torch.float64), torch.rand(64, dtype=torch.float64) * 3, torch.randn(32, 64, dtype=torch.float64)
    # When g is folded into W
    folded = rms_norm(x, torch.ones(64, dtype=torch.float64), 1e-6) @ (w * g[None, :]).t()
    # Then the product is unchanged (to float64 rounding)
    assert torch.allclose(rms_norm(x, g, 1e-6) @ w.t(), folded, atol=1e-12, rtol=0)


@pytest.mark.parametrize("bits", [4, 8])
def test_packing_matches_onnxruntime_own_quantizer_bit_for_bit(bits):
    from onnxruntime.capi._pybind_state import quantize_matmul_4bits, quantize_matmul_8bits

    # Given a random (K, N) weight, quantized by ORT's C++ helper (the MatMulNBits reference layout)
    K, N, block = 128, 48, 32
    w = np.random.default_rng(bits).normal(size=(K, N)).astype(np.float32)
    packed = np.zeros((N, K // block, block * bits // 8), np.uint8)
    zp = np.zeros((N, (K // block * bits + 7) // 8), np.uint8)
    scale = np.zeros((N, K // block), np.float32)
    (quantize_matmul_4bits if bits == 4 else quantize_matmul_8bits)(packed, w, scale, zp, block, N, K, False)
    # When ours quantizes the same weight
    q, s, z = quantize_groups(torch.from_numpy(w.T.copy()), bits, block)
    # Then codes, scales and zero points are identical
    assert np.array_equal(pack_codes(q.numpy(), bits), packed)
    assert np.array_equal(s.numpy(), scale)
    assert np.array_equal(pack_codes(z.numpy(), bits), zp)


def test_rtn_error_is_bounded_by_half_a_step():
    w = torch.randn(16, 96)
    q, scale, zp = quantize_groups(w, 4, 32)
    err = (fake_quantize(w, 4, 32) - w).abs().view(16, 3, 32)
    assert (err <= scale[..., None] / 2 + 1e-6).all()
    assert pack_codes(np.array([[1, 2, 15, 4]], np.uint8), 4).tolist() == [[0x21, 0x4F]]  # low nibble first


def test_calibrated_clip_search_never_increases_the_expected_output_error():
    # Given a weight with outliers and activations whose channels differ in energy
    torch.manual_seed(0)
    w = torch.randn(32, 128) * torch.where(torch.rand(32, 128) < 0.02, 8.0, 1.0)
    act_sq = torch.rand(128) * 4

    def expected_error(q, scale, zp):
        deq = dequantize_groups(q, scale, zp, 128)
        return float((((deq - w) ** 2) * act_sq).sum())

    # When groups may shrink their range (the ratio 1.0, plain RTN, is among the candidates)
    rtn = expected_error(*quantize_groups(w, 4, 32))
    clipped = expected_error(*quantize_groups(w, 4, 32, act_sq=act_sq))
    # Then the activation-weighted error does not grow, and here it shrinks
    assert clipped < rtn


def _correlated_inputs(tokens: int, K: int, seed: int = 0) -> torch.Tensor:
    """Activations whose channels are correlated and differ in energy, as a layer's inputs are."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(K, K, generator=g) / K**0.5 + torch.eye(K)
    return torch.randn(tokens, K, generator=g) @ mix * (torch.rand(K, generator=g) * 3)


def test_gptq_cuts_the_output_error_of_round_to_nearest_by_a_third_on_correlated_inputs():
    # Given a weight and calibration inputs, and other inputs drawn the same way to score on
    K, N = 256, 96
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(1)) * 0.05
    inputs = _correlated_inputs(6144, K)
    calib, held_out = inputs[:4096], inputs[4096:]
    hessian = calib.T.double() @ calib.double() / len(calib)

    def output_error(codes):
        return float(((held_out @ (dequantize_groups(*codes, K) - w).T) ** 2).mean())

    # When the same weight is quantized at 4 bits in groups of 64 by each method
    rtn = output_error(quantize_groups(w, 4, 64))
    clip = output_error(quantize_groups(w, 4, 64, act_sq=torch.diagonal(hessian)))
    gptq = output_error(gptq_groups(w, hessian, 4, 64))
    # Then GPTQ's output error on inputs it was not calibrated on is under 0.7x round to nearest's (measured 0.59x),
    # and below the clip search's (which weighs each channel's error alone)
    assert gptq < 0.7 * rtn and gptq < clip < rtn


def test_gptq_with_uncorrelated_equal_inputs_is_round_to_nearest():
    # Given a Hessian with nothing to spread an error onto (identity: no two channels correlated)
    w = torch.randn(24, 128, generator=torch.Generator().manual_seed(3))
    # When GPTQ quantizes without the clip search
    got = gptq_groups(w, torch.eye(128, dtype=torch.float64), 4, 32, clip_search=False)
    # Then it writes round to nearest's codes, scales and zero points, in its layout
    for a, b in zip(got, quantize_groups(w, 4, 32)):
        assert torch.equal(a, b)


def test_gptq_quantizes_a_channel_the_calibration_never_moved():
    # Given a Hessian whose last channels are zero (inputs the calibration text never activated) and K not a
    # whole number of groups
    w = torch.randn(8, 80, generator=torch.Generator().manual_seed(4))
    x = _correlated_inputs(512, 80)
    x[:, 70:] = 0
    q, scale, zp = gptq_groups(w, x.T.double() @ x.double(), 4, 32)
    # Then every code is finite and on the grid, and the dead channels keep their weights (rounded, never zeroed:
    # a user's input may move them)
    deq = dequantize_groups(q, scale, zp, 80)
    assert q.shape == (8, 3, 32) and torch.isfinite(deq).all() and int(q.max()) <= 15
    assert torch.corrcoef(torch.stack([deq[:, 70:].flatten(), w[:, 70:].flatten()]))[0, 1] > 0.9


def test_bits_per_weight_counts_codes_scales_zero_points_and_padding():
    assert [round(bits_per_weight(b, bs, 1536), 4) for b, bs in ((4, 128), (4, 64), (4, 32), (8, 128))] == [4.2812, 4.5625, 5.125, 8.3125]
    assert bits_per_weight(4, 32, 1536, symmetric=True) == 5.0
    # 576 channels (SmolLM2's width) are 4.5 blocks of 128: the padded half block makes 128 dearer than 64
    assert round(bits_per_weight(4, 128, 576), 4) == 4.7639 > round(bits_per_weight(4, 64, 576), 4) == 4.5694


def test_mixed_plan_spends_the_budget_where_loss_falls_most_per_bit():
    # given a small sensitive part (v), a large insensitive one (up) and a large sensitive one (down)
    int4, int4_b32, int8 = (4, 128), (4, 32), (8, 128)
    losses = {"v": {int4: 10.0, int4_b32: 4.0, int8: 0.1},
              "up": {int4: 1.0, int4_b32: 0.6, int8: 0.01},
              "down": {int4: 8.0, int4_b32: 3.0, int8: 0.1}}
    sizes = {"v": 1000, "up": 10000, "down": 10000}
    costs = {p: {o: bits_per_weight(*o, 1024) * n for o in losses[p]} for p, n in sizes.items()}
    base = bits_per_weight(*int4, 1024)
    # when the budget allows about int8 for the small part and smaller blocks for one large one
    plan = mixed_precision_plan(losses, costs, sizes, budget_bits=base + 0.6)
    # then the small sensitive part is int8 and the spare bits go to the large sensitive part's smaller blocks
    assert plan == {"v": int8, "up": int4, "down": int4_b32}
    assert sum(costs[p][plan[p]] for p in plan) / sum(sizes.values()) <= base + 0.6
    # the cheapest budget is uniform int4; a lower one is refused
    assert set(mixed_precision_plan(losses, costs, sizes, base).values()) == {int4}
    with pytest.raises(ValueError, match="below the cheapest"):
        mixed_precision_plan(losses, costs, sizes, 4.0)


def test_row_output_error_is_the_output_error_on_the_calibration_inputs():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(256, 64, generator=gen, dtype=torch.float64)
    w = torch.randn(8, 64, generator=gen, dtype=torch.float64)
    wq = dequantize_groups(*quantize_groups(w.float(), 4, 32), K=64).double()
    direct = ((x @ wq.T - x @ w.T) ** 2).sum(0)
    assert torch.allclose(row_output_error(w, wq, x.T @ x), direct, rtol=1e-9)
