"""Weight-only quantization numerics: round-to-nearest groups along the input channels, their
dequantization, and the byte packing ONNX Runtime's ``com.microsoft.MatMulNBits`` reads.

Each output column is quantized in groups of ``block_size`` input channels (round to nearest,
asymmetric min/max with a zero point, or symmetric with the zero point fixed at 2^(bits-1)). The
layout is MatMulNBits': B ``(N, K/block, block*bits/8)`` uint8, scales ``(N, K/block)``, zero points
packed the same way. ``tasks/weights/graph.py`` writes these codes into an engine's graph;
``tests/weight_reference.py`` loads their dequantized weights into the PyTorch backbone.
"""

from __future__ import annotations

import math

import numpy as np
import torch

# Range shrink factors tried per group by the calibrated scheme (AWQ/GPTQ-style clip search:
# a slightly clipped range rounds the many small weights more finely than it hurts the few large ones).
CLIP_GRID = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7)


def _rtn(w, bits: int, symmetric: bool, ratio=1.0):
    """Codes, scale, zero point of (N, kb, block) groups whose min/max range is scaled by ``ratio``."""
    qmax = (1 << bits) - 1
    if symmetric:
        # Zero point fixed at 2^(bits-1) (MatMulNBits' default when none is given).
        zp = torch.full(w.shape[:-1], 1 << (bits - 1), dtype=torch.float32)
        scale = w.abs().amax(-1) * ratio / ((1 << (bits - 1)) - 1)  # (N, kb)
    else:
        # The range always contains 0 so that zero padding and exact zeros stay exact.
        lo, hi = w.amin(-1).clamp(max=0.0) * ratio, w.amax(-1).clamp(min=0.0) * ratio  # (N, kb)
        scale = (hi - lo) / qmax
        zp = torch.round(-lo / torch.where(scale > 0, scale, 1.0)).clamp(0, qmax)
    safe = torch.where(scale > 0, scale, 1.0)
    q = torch.round(w / safe[..., None] + zp[..., None]).clamp(0, qmax)  # (N, kb, block)
    return q, scale, zp


def quantize_groups(w_nk, bits: int, block_size: int, symmetric: bool = False, act_sq=None):
    """Round-to-nearest groups along K for each of N rows.

    w_nk: (N, K) float tensor, the layout of a torch Linear weight (out, in) = MatMulNBits' B.
    act_sq: optional (K,) mean squared activation of each input channel (from the calib split):
    then each group's range is shrunk by the factor of ``CLIP_GRID`` that minimizes the
    activation-weighted error sum_k E[x_k^2] (w_k - dq(w_k))^2, i.e. the expected output error.
    Returns q (N, kb, block) uint8 codes, scale (N, kb) float32, zero point (N, kb) uint8,
    with kb = ceil(K / block); K is zero-padded to a whole number of blocks.
    """
    w = torch.as_tensor(w_nk, dtype=torch.float32)
    N, K = w.shape
    kb = math.ceil(K / block_size)
    w = torch.nn.functional.pad(w, (0, kb * block_size - K)).view(N, kb, block_size)  # (N, kb, block)
    q, scale, zp = _rtn(w, bits, symmetric)
    if act_sq is not None:
        a = torch.nn.functional.pad(torch.as_tensor(act_sq, dtype=torch.float32), (0, kb * block_size - K))
        a = a.view(1, kb, block_size)  # (1, kb, block)
        best = (((q - zp[..., None]) * scale[..., None] - w) ** 2 * a).sum(-1)  # (N, kb)
        for ratio in CLIP_GRID[1:]:
            q2, s2, z2 = _rtn(w, bits, symmetric, ratio)
            err = (((q2 - z2[..., None]) * s2[..., None] - w) ** 2 * a).sum(-1)
            better = err < best
            q, scale, zp = torch.where(better[..., None], q2, q), torch.where(better, s2, scale), torch.where(better, z2, zp)
            best = torch.minimum(err, best)
    return q.to(torch.uint8), scale.float(), zp.to(torch.uint8)


def dequantize_groups(q, scale, zp, K: int):
    """(N, kb, block) codes -> (N, K) float32 weights: (q - zp) * scale, padding dropped."""
    w = (q.float() - zp.float()[..., None]) * scale[..., None]  # (N, kb, block)
    return w.reshape(w.shape[0], -1)[:, :K]


def fake_quantize(w_nk, bits: int, block_size: int, symmetric: bool = False, norm_scale=None):
    """The weight the quantized engine effectively multiplies by, as (N, K) float32.

    With ``norm_scale`` g (K,) the quantized matrix is W diag(g) and the engine feeds it the
    unscaled normalized activations, so the effective weight of the scaled ones is Q(W diag(g)) / g.
    """
    w = torch.as_tensor(w_nk, dtype=torch.float32)
    if norm_scale is not None:
        w = w * norm_scale[None, :]
    out = dequantize_groups(*quantize_groups(w, bits, block_size, symmetric), K=w.shape[1])
    return out / norm_scale[None, :] if norm_scale is not None else out


def pack_codes(q: np.ndarray, bits: int) -> np.ndarray:
    """(..., n) uint8 codes -> (..., n * bits / 8) bytes; 4-bit: element 2j in the low nibble."""
    if bits == 8:
        return np.ascontiguousarray(q, dtype=np.uint8)
    if q.shape[-1] % 2:
        q = np.concatenate([q, np.zeros(q.shape[:-1] + (1,), np.uint8)], axis=-1)
    return np.ascontiguousarray(q[..., 0::2] | (q[..., 1::2] << 4), dtype=np.uint8)
