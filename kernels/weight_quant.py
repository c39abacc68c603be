"""Weight-only quantization numerics: round-to-nearest groups along the input channels, their
dequantization, and the byte packing ONNX Runtime's ``com.microsoft.MatMulNBits`` reads.

Each output column is quantized in groups of ``block_size`` input channels (round to nearest,
asymmetric min/max with a zero point, or symmetric with the zero point fixed at 2^(bits-1)). The
layout is MatMulNBits': B ``(N, K/block, block*bits/8)`` uint8, scales ``(N, K/block)``, zero points
packed the same way. ``tasks/weights/graph.py`` writes these codes into an engine's graph;
``tests/weight_reference.py`` loads their dequantized weights into the PyTorch backbone.

``gptq_groups`` writes the same layout by GPTQ (Frantar et al., arXiv 2210.17323): columns are quantized one
at a time and each one's rounding error is spread over the columns not yet quantized, weighted by the inverse
of the calibration activations' second moments, so the layer's *output* error is what is minimized, not the
weights'. By default the columns go in order of falling input energy (act-order) and each group's scale and zero
point are fixed before the first column is quantized ("static groups": the layout has no reordering index).
"""

from __future__ import annotations

import math

import numpy as np
import torch

# Range shrink factors tried per group by the calibrated scheme (AWQ/GPTQ-style clip search:
# a slightly clipped range rounds the many small weights more finely than it hurts the few large ones).
CLIP_GRID = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7)
# GPTQ's dampening, a fraction of the Hessian's mean diagonal added to it. 0.1 rather than the paper's 0.01: on
# SmolLM2-135M's layers 3, 15 and 26 (int4, groups of 64, inputs of 8k tokens of real text, error on text GPTQ did
# not see) the output error against round to nearest was 0.446x at 0.1 and 0.475x at 0.01.
GPTQ_DAMP = 0.1
# Input channels per quantization group, per width, where ``engine.weight_block_size`` leaves it to the width
# (MatMulNBits' ``block_size``).
# int4: 128 instead of 32 (measured on 2 cores, 0.5B width, ORT 1.32, one interleaved run): decode at past 512
# 3.24 -> 2.59 ms, prefill of 128 107 -> 80 ms (fewer scales to read and apply); GPTQ and the mixed plan
# (``tasks.weights.mixed``, which also takes 64 and 32 where they pay) recover the quality.
# int8: 32. Its error is not the weights' but the activations': level 4 rounds them to int8 per block of the
# weight's block size. On SmolLM2 (4,096 tokens, docs/engine.md) block 32 costs +0.18% perplexity against
# +0.72-0.87% at 128, for 1.08-1.10x the decode time and 1.21x the prefill time at the 0.5B width (2026-12-07,
# ``python -m bench.engine.weight_quant_bench --configs 0.5b-width --variants int8,int8_b128``).
DEFAULT_BLOCK_SIZES = {"int8": 32, "int4": 128}


def _grid(w, bits: int, symmetric: bool, ratio=1.0):
    """Scale and zero point of (..., block) groups whose min/max range is scaled by ``ratio``."""
    qmax = (1 << bits) - 1
    if symmetric:
        # Zero point fixed at 2^(bits-1) (MatMulNBits' default when none is given).
        zp = torch.full(w.shape[:-1], 1 << (bits - 1), dtype=torch.float32)
        scale = w.abs().amax(-1) * ratio / ((1 << (bits - 1)) - 1)
    else:
        # The range always contains 0 so that zero padding and exact zeros stay exact.
        lo, hi = w.amin(-1).clamp(max=0.0) * ratio, w.amax(-1).clamp(min=0.0) * ratio
        scale = (hi - lo) / qmax
        zp = torch.round(-lo / torch.where(scale > 0, scale, 1.0)).clamp(0, qmax)
    return scale, zp


def _codes(w, scale, zp, bits: int):
    """Round-to-nearest codes of (..., block) groups on their grid (scale and zero point of shape (...))."""
    safe = torch.where(scale > 0, scale, 1.0)
    return torch.round(w / safe[..., None] + zp[..., None]).clamp(0, (1 << bits) - 1)


def _searched_grid(w, bits: int, symmetric: bool, a=None):
    """The grid of (..., block) groups; with ``a`` (broadcastable to w: the mean squared activation of each
    input channel) the range shrink of ``CLIP_GRID`` that minimizes sum_k a_k (w_k - dq(w_k))^2 per group."""
    scale, zp = _grid(w, bits, symmetric)
    if a is None:
        return scale, zp
    best = (((_codes(w, scale, zp, bits) - zp[..., None]) * scale[..., None] - w) ** 2 * a).sum(-1)
    for ratio in CLIP_GRID[1:]:
        s2, z2 = _grid(w, bits, symmetric, ratio)
        err = (((_codes(w, s2, z2, bits) - z2[..., None]) * s2[..., None] - w) ** 2 * a).sum(-1)
        better = err < best
        scale, zp = torch.where(better, s2, scale), torch.where(better, z2, zp)
        best = torch.minimum(err, best)
    return scale, zp


def _padded_groups(w_nk, block_size: int):
    """(N, K) -> (N, kb, block) float32, K zero-padded to a whole number of blocks."""
    w = torch.as_tensor(w_nk, dtype=torch.float32)
    N, K = w.shape
    kb = math.ceil(K / block_size)
    return torch.nn.functional.pad(w, (0, kb * block_size - K)).view(N, kb, block_size)


def quantize_groups(w_nk, bits: int, block_size: int, symmetric: bool = False, act_sq=None):
    """Round-to-nearest groups along K for each of N rows.

    w_nk: (N, K) float tensor, the layout of a torch Linear weight (out, in) = MatMulNBits' B.
    act_sq: optional (K,) mean squared activation of each input channel (from the calib split):
    then each group's range is shrunk by the factor of ``CLIP_GRID`` that minimizes the
    activation-weighted error sum_k E[x_k^2] (w_k - dq(w_k))^2, i.e. the expected output error.
    Returns q (N, kb, block) uint8 codes, scale (N, kb) float32, zero point (N, kb) uint8,
    with kb = ceil(K / block); K is zero-padded to a whole number of blocks.
    """
    w = _padded_groups(w_nk, block_size)  # (N, kb, block)
    a = None
    if act_sq is not None:
        a = _padded_groups(torch.as_tensor(act_sq, dtype=torch.float32)[None, :], block_size)  # (1, kb, block)
    scale, zp = _searched_grid(w, bits, symmetric, a)
    return _codes(w, scale, zp, bits).to(torch.uint8), scale.float(), zp.to(torch.uint8)


def gptq_groups(w_nk, hessian, bits: int, block_size: int, symmetric: bool = False, damp: float = GPTQ_DAMP,
                clip_search: bool = True, act_order: bool = True):
    """GPTQ codes in ``quantize_groups``' layout (q (N, kb, block) uint8, scale (N, kb), zero point (N, kb) uint8).

    hessian: (K, K) second moments E[x x^T] of the layer's input over the calibration tokens (any positive
    multiple of it gives the same codes). ``damp`` times its mean diagonal is added to the diagonal (GPTQ's
    dampening: a channel the calibration text never moves still gets a well-posed update). With ``clip_search``
    each group's grid is also searched over ``CLIP_GRID``, weighted by the diagonal, as ``quantize_groups`` does.
    ``act_order``: the columns are taken in order of falling input energy (GPTQ's act-order) while each group's
    grid is set beforehand on the weights as they are ("static groups": the layout keeps a group's scale on a fixed
    range of input channels, so no reordering index is stored); otherwise in their own order, each group's grid
    set when its first column is reached. Input channels the calibration never activated (a zero diagonal) are
    rounded on their group's grid, never zeroed: a user's input may still move them.
    """
    w = _padded_groups(w_nk, block_size).reshape(len(w_nk), -1).double()  # (N, Kp)
    N, Kp = w.shape
    groups = Kp // block_size
    K = len(hessian)
    h = torch.zeros(Kp, Kp, dtype=torch.float64)
    h[:K, :K] = torch.as_tensor(hessian, dtype=torch.float64)
    dead = torch.diagonal(h) <= 0
    h[dead, dead] = 1.0  # a dead channel's error goes nowhere: its row and column of H are zero but for this
    diag = torch.diagonal(h).clone()
    h += torch.eye(Kp, dtype=torch.float64) * damp * diag.mean()
    a = diag.float()[None, :] if clip_search else None
    scale = torch.zeros(N, groups)
    zp = torch.zeros(N, groups)

    def set_grid(g: int, weights) -> None:  # weights: (N, block) of group g
        lo, hi = g * block_size, (g + 1) * block_size
        scale[:, g], zp[:, g] = _searched_grid(weights.float(), bits, symmetric, None if a is None else a[:, lo:hi])

    perm = torch.argsort(diag, descending=True, stable=True) if act_order else torch.arange(Kp)
    if act_order:
        for g in range(groups):
            set_grid(g, w[:, g * block_size:(g + 1) * block_size])
    w, h = w[:, perm], h[perm][:, perm]
    # U upper-triangular with H^-1 = U^T U: row j of U, over j's later columns, is how j's error moves them.
    u = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    q = torch.zeros(N, Kp, dtype=torch.float32)
    for lo in range(0, Kp, block_size):  # a lazy batch of columns: updates inside it at once, beyond it once at its end
        hi = lo + block_size
        err = torch.zeros(N, block_size, dtype=torch.float64)
        for j in range(lo, hi):
            g = int(perm[j]) // block_size
            if not act_order and j % block_size == 0:
                set_grid(g, w[:, j:j + block_size])
            code = _codes(w[:, j].float()[:, None], scale[:, g], zp[:, g], bits)[:, 0]
            q[:, perm[j]] = code
            err[:, j - lo] = (w[:, j] - ((code - zp[:, g]) * scale[:, g]).double()) / u[j, j]
            w[:, j:hi] -= err[:, j - lo:j - lo + 1] * u[j, j:hi][None, :]
        w[:, hi:] -= err @ u[lo:hi, hi:]
    return q.view(N, groups, block_size).to(torch.uint8), scale.float(), zp.to(torch.uint8)


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


def bits_per_weight(bits: int, block_size: int, K: int, symmetric: bool = False) -> float:
    """Stored bits per weight of a row of ``K`` input channels in MatMulNBits' layout: the codes of whole groups (a
    last partial group is padded), an fp32 scale per group and (asymmetric) the row's zero points packed at ``bits``.
    Where ``block_size`` divides K: int4 at 128 4.28, at 64 4.56, at 32 5.13; int8 at 128 8.31. Where it does not,
    the padding counts: int4 at 128 on SmolLM2's 576 channels stores 4.76 bits per weight, more than at 64 (4.57)."""
    groups = -(-K // block_size)
    row_bytes = groups * block_size * bits / 8 + 4 * groups + (0 if symmetric else math.ceil(groups * bits / 8))
    return 8 * row_bytes / K


def row_output_error(w_nk, w_quantized_nk, hessian) -> torch.Tensor:
    """(N,) float64: each output row's squared error over the calibration inputs, (dW H dW^T)_jj, with H the
    inputs' second moments (K, K) and dW the quantized weight less the float one."""
    d = (torch.as_tensor(w_quantized_nk).double() - torch.as_tensor(w_nk).double())
    return ((d @ torch.as_tensor(hessian, dtype=torch.float64)) * d).sum(1)


def mixed_precision_plan(losses: dict[str, dict[tuple[int, int], float]], costs: dict[str, dict[tuple[int, int], float]],
                         sizes: dict[str, int], budget_bits: float) -> dict[str, tuple[int, int]]:
    """A (bits, block_size) option per part under an average of ``budget_bits`` stored bits per weight.

    ``losses[part][option]``: what quantizing that part with that option costs the model (any common scale; here
    ``tasks.weights.mixed``'s gradient-weighted output error); ``costs[part][option]``: the bits it stores then
    (``bits_per_weight`` times its weights); ``sizes[part]``: its number of weights. Every part starts at its
    cheapest option; the upgrade that removes the most loss per added bit is taken while the budget holds (a greedy
    knapsack, as mixed-precision searches by sensitivity do: HAWQ-V2, Dong et al. 2020). Raises ValueError when even
    the cheapest options do not fit the budget."""
    plan = {part: min(options, key=lambda o, part=part: (costs[part][o], losses[part][o])) for part, options in losses.items()}
    weights = sum(sizes[p] for p in losses)
    used = sum(costs[p][plan[p]] for p in plan)
    if used > budget_bits * weights * (1 + 1e-12):
        raise ValueError(f"a budget of {budget_bits} bits per weight is below the cheapest options' {used / weights:.3f}")
    while True:
        best = None  # (loss removed per added bit, part, option)
        for part, options in losses.items():
            now = plan[part]
            for option, loss in options.items():
                added = costs[part][option] - costs[part][now]
                if added > 0 and used + added <= budget_bits * weights and loss < options[now]:
                    gain = (options[now] - loss) / added
                    if best is None or gain > best[0]:
                        best = (gain, part, option)
        if best is None:
            return plan
        _, part, option = best
        used += costs[part][option] - costs[part][plan[part]]
        plan[part] = option
