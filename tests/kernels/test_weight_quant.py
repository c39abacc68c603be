"""Numerics of kernels/weight_quant.py: round-to-nearest groups, their error, the clip search, MatMulNBits packing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels.weight_quant import dequantize_groups, fake_quantize, pack_codes, quantize_groups
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
