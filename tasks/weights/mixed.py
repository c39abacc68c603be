"""Mixed-precision int4: which parts of the backbone's projections get more bits, under a budget of stored bits per
weight (``engine.weight_mixed_bits``).

A uniform int4 engine spends the same bits on every weight, but the weights do not cost the model the same: on
SmolLM2-135M the value and key projections (small, and read by every later token through the KV cache) and a few
down projections hold most of int4's loss. So each part of a projection (the q, k and v rows of the fused qkv
matmul, gate and up of the fused MLP input, o, down) is quantized by GPTQ at every option of ``mixed_options``, and
what each costs the model is estimated as its output error weighted by how much the loss moves with that output:

    loss(part, option) = sum over its output rows j of  E[(dL/dy_j)^2] * (dW H dW^T)_jj

(a second-order estimate of the loss increase, Fisher-weighted: dW the option's codes less the float weight, H the
inputs' second moments GPTQ already reads, dL/dy_j the gradient of the next-token loss with respect to the row's
output on the same calibration text, through the PyTorch backbone). ``kernels.weight_quant.mixed_precision_plan``
then spends the budget where it removes the most loss per bit. Measured on SmolLM2-135M-Instruct's engine (8 eval
documents x 512 tokens after 1,024 of context, ``bench.quality.real_model_quality``, 2026-12-07): at 4.60 stored bits
per weight KL 0.073 and +6.00% perplexity, against 0.121 and +11.47% for GPTQ int4 at block 128 everywhere (4.64
bits as stored); docs/engine.md.

Everything here runs once per backbone, in the compile stage, and the plan is part of the engine's cache key.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)


def mixed_options(block_size: int) -> list[tuple[int, int]]:
    """The (bits, block_size) a part may take: int4 at the engine's block size, a half and a quarter of it, and int8
    at the block size and a half of it (MatMulNBits takes blocks of 16 and up). Which is cheapest depends on the
    part's input width: a block that does not divide it stores padding (``kernels.weight_quant.bits_per_weight``)."""
    halves = [b for b in (block_size, block_size // 2, block_size // 4) if b >= 16]
    return [(4, b) for b in halves] + [(8, b) for b in halves[:2]]


def check_budget(shapes: list[tuple[int, int]], block_size: int, budget_bits: float) -> None:
    """Refuse, before any calibration runs, a budget below what the projections of ``shapes`` ((K, N) each) store at
    their cheapest options."""
    from kernels.weight_quant import bits_per_weight
    from tasks.weights.graph import WeightQuantError

    weights = sum(K * N for K, N in shapes)
    cheapest = sum(min(bits_per_weight(*o, K) for o in mixed_options(block_size)) * K * N for K, N in shapes) / weights
    if cheapest > budget_bits * (1 + 1e-12):
        raise WeightQuantError(f"engine.weight_mixed_bits {budget_bits}: below the {cheapest:.3f} stored bits per weight "
                               f"of the cheapest options (int4 at the blocks of {mixed_options(block_size)} that fit "
                               "each input width best)")


def weight_fingerprint(w_kn: np.ndarray) -> str:
    """A projection's identity across PyTorch and its exported graph: the (K, N) float32 weight's bytes, hashed."""
    return hashlib.sha256(np.ascontiguousarray(w_kn, dtype=np.float32).tobytes()).hexdigest()


@dataclass(frozen=True)
class Sensitivity:
    """One fused projection of the backbone: its parts ((name, output rows) in row order) and the mean squared
    gradient of the next-token loss with respect to each output row, (N,) float64."""

    parts: tuple[tuple[str, int], ...]
    grad_sq: np.ndarray


def output_gradient_energy(model_dir: Path, windows: list[list[int]], threads: int = 2) -> dict[str, Sensitivity]:
    """{weight_fingerprint of a projection's (K, N) weight: its Sensitivity}, read by running the PyTorch backbone
    (``runtime.engine.model``, no adapter) forward and backward on ``windows`` of calibration token ids."""
    import torch

    from runtime.engine.model import float_linear, load_backbone
    from tasks.progress import Progress

    torch.set_num_threads(threads)
    backbone = load_backbone(model_dir)
    cfg = backbone.cfg
    backbone.embed.requires_grad_(True)  # so every projection's output carries a gradient (the weights need none)
    grad_sq: dict[int, torch.Tensor] = {}

    def add(key: int, g: torch.Tensor) -> None:
        grad_sq[key] = grad_sq.get(key, 0) + g.detach().double().pow(2).sum(0)

    def recording_linear(x, w, b=None):
        y = float_linear(x, w, b)
        key = id(w)
        y.register_hook(lambda g: add(key, g))
        return y

    projections = {}  # id(weight) -> (weight, parts)
    for i, block in enumerate(backbone.blocks):
        block.linear = recording_linear  # the instance's, over Block's staticmethod: the head keeps float_linear
        att, mlp = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        for w, modules in ((block.qkv_w, [att + m for m in ("q_proj", "k_proj", "v_proj")]), (block.o_w, [att + "o_proj"]),
                           (block.gate_up_w, [mlp + "gate_proj", mlp + "up_proj"]), (block.down_w, [mlp + "down_proj"])):
            rows = tuple((m, cfg.module_shape(m.rsplit(".", 1)[1])[1]) for m in modules)
            if sum(n for _, n in rows) != w.shape[0]:
                raise ValueError(f"{modules}: {w.shape[0]} output rows, parts of {[n for _, n in rows]}")
            projections[id(w)] = (w, rows)
    bar = Progress("loss gradients", len(windows), unit="window")
    tokens = 0
    for ids in windows:
        ids_t = torch.tensor([ids])
        logits, _ = backbone(ids_t, torch.arange(len(ids))[None], torch.ones_like(ids_t), backbone.empty_past(1))
        torch.nn.functional.cross_entropy(logits[0, :-1], ids_t[0, 1:]).backward()
        backbone.embed.grad = None
        tokens += len(ids)
        bar.advance()
    bar.close()
    return {weight_fingerprint(w.detach().t().numpy()): Sensitivity(rows, (grad_sq[key] / tokens).numpy())
            for key, (w, rows) in projections.items()}


@dataclass(frozen=True)
class PartCodes:
    """Codes of output rows lo..hi of a projection at one option, in ``kernels.weight_quant``'s layout."""

    lo: int
    hi: int
    bits: int
    block_size: int
    q: object  # (hi - lo, kb, block) uint8 torch tensor
    scale: object
    zp: object


def mixed_codes(projections: list[tuple[str, np.ndarray, np.ndarray]], sensitivity: dict[str, Sensitivity],
                block_size: int, budget_bits: float, symmetric: bool = False) -> tuple[dict[str, list[PartCodes]], dict]:
    """GPTQ codes of every projection, each part at the option ``mixed_precision_plan`` gives it.

    projections: [(graph node name, (K, N) float32 weight, (K, K) second moments of its input)]. Returns ({node name:
    its parts' codes in row order, adjacent parts at one option joined}, the record for weights.json: the budget,
    the bits per weight it came to, and each part's option)."""
    import torch

    from kernels.weight_quant import (
        bits_per_weight,
        dequantize_groups,
        gptq_groups,
        mixed_precision_plan,
        row_output_error,
    )
    from tasks.progress import Progress
    from tasks.weights.graph import WeightQuantError

    options = mixed_options(block_size)
    losses: dict[str, dict[tuple[int, int], float]] = {}
    costs: dict[str, dict[tuple[int, int], float]] = {}
    sizes: dict[str, int] = {}
    codes: dict[str, dict[tuple[int, int], tuple]] = {}
    spans: dict[str, list[tuple[str, int, int]]] = {}
    bar = Progress("GPTQ, every option", len(projections) * len(options), unit="matmul")
    for name, w_kn, hessian in projections:
        found = sensitivity.get(weight_fingerprint(w_kn))
        if found is None:
            raise WeightQuantError(f"{name}: its weight is none of the PyTorch backbone's projections (mixed precision "
                                   "maps each by its exact float weight)")
        K = w_kn.shape[0]
        w_nk = torch.from_numpy(np.array(w_kn.T, dtype=np.float32, order="C"))
        spans[name], lo = [], 0
        for part, rows in found.parts:
            spans[name].append((part, lo, lo + rows))
            sizes[part] = rows * K
            losses[part] = {}
            costs[part] = {o: bits_per_weight(*o, K, symmetric) * rows * K for o in options}
            lo += rows
        codes[name] = {}
        for option in options:
            q, scale, zp = gptq_groups(w_nk, hessian, *option, symmetric)
            err = row_output_error(w_nk, dequantize_groups(q, scale, zp, K), hessian).numpy() * found.grad_sq
            for part, lo, hi in spans[name]:
                losses[part][option] = float(err[lo:hi].sum())
            codes[name][option] = (q, scale, zp)
            bar.advance()
    bar.close()
    plan = mixed_precision_plan(losses, costs, sizes, budget_bits)
    chosen: dict[str, list[PartCodes]] = {}
    for name, parts in spans.items():
        chosen[name] = []
        for part, lo, hi in parts:
            option = plan[part]
            last = chosen[name][-1] if chosen[name] else None
            if last is not None and (last.bits, last.block_size) == option:
                lo = last.lo
                chosen[name].pop()
            q, scale, zp = codes[name][option]
            chosen[name].append(PartCodes(lo, hi, *option, q[lo:hi], scale[lo:hi], zp[lo:hi]))
    total = sum(sizes.values())
    record = {
        "budget_bits": budget_bits,
        "bits_per_weight": round(sum(costs[p][plan[p]] for p in plan) / total, 4),  # stored, padding included
        "options": {f"int{b}/b{bs}": sum(plan[p] == (b, bs) for p in plan) for b, bs in options},
        "parts": {p: f"int{plan[p][0]}/b{plan[p][1]}" for p in plan},
    }
    log.info("mixed precision: %s parts at %s, %.3f bits per weight (budget %.2f)", len(plan), record["options"],
             record["bits_per_weight"], budget_bits)
    return chosen, record
