"""A backbone whose cache is paged: what the version-6 engine exports (``runtime.engine.interface.paged_kv_tensors``).

``PagedKVBackbone`` runs the float backbone's layers (``runtime.engine.model.Backbone``) and changes only where the
past comes from and what goes out:

  1. read: every cache tensor of a layer is a pool of fixed-size blocks (N, nkv, bs, d); one Gather by the
     block table (B, M) gives each row its M blocks, laid end to end as the padded past (B, nkv, M bs, d).
     Slots a row has not filled (the tail of its last block, the blocks past its count) hold whatever the
     pool holds there; the attention mask (B, M bs + T) masks them, as it masks left padding today;
  2. attention reads that past and the new tokens side by side (``attend_past``), as on a padded past;
  3. write: only the new tokens' slots leave the graph (the last T of each ``present``), which the runtime
     copies into each row's blocks. The gathered past is a transient of one layer that ONNX Runtime's
     memory planner frees after its attention: what persists is the pool, sized by the device's budget.

``QuantizedPagesBackbone`` (version 9) reads two kinds of blocks: each row's float pages (its first page, the sink,
and its open page) and its sealed pages (codes, their scales and minima, ``kernels.kv_spec.PageQuantSpec``), which it
attends together with the float pages and the new tokens without materializing them as float K/V: the scales are
applied as the codes become floats and the minima fold into the query and weight side
(``kernels.page_quant.sealed_key_scores``, ``sealed_value_mix``).

Why a gather and not a contrib op: ORT's ``PagedAttention`` runs on CUDA only, and its ``GroupQueryAttention``
takes a padded past; the gather keeps standard ONNX ops. Shapes: B batch, T new tokens, M blocks per row in the
table, bs block size, N blocks in the pool, w the stored width (d, or packed codes).
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import torch
import torch.nn as nn

from kernels.kv_spec import PageQuantSpec
from kernels.page_quant import key_scale_minimum, sealed_key_scores, sealed_value_mix
from runtime.engine.interface import SEALED_ROLES


def gathered_blocks(pool: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """pool (N, nkv, bs, w) read through block_table (B, M) -> the rows' blocks (B, nkv, M, bs, w).

    One Gather of (block, head) slabs straight into the past's order, (B, nkv, M) slab indices: gathering whole
    blocks (B, M, nkv, bs, w) needs a Transpose after it, a second copy of the past per layer and step (measured:
    paged decode 0.82x the padded engine's tokens/s with it, tiny engine, 8 rows of 128-1024 tokens)."""
    N, nkv, bs, w = pool.shape
    slabs = block_table[:, None, :] * nkv + torch.arange(nkv, device=pool.device)[None, :, None]  # (B, nkv, M)
    return pool.reshape(N * nkv, bs, w)[slabs]


def gathered(pool: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """pool (N, nkv, bs, w) read through block_table (B, M) -> the rows' pasts (B, nkv, M bs, w), by a free reshape
    of ``gathered_blocks``."""
    B, M = block_table.shape
    _, nkv, bs, w = pool.shape
    return gathered_blocks(pool, block_table).reshape(B, nkv, M * bs, w)


class PagedKVBackbone(nn.Module):
    """forward(input_ids, position_ids, attention_mask, block_table, pools, lora, logit_positions) -> (logits, *new K/V).

    ``pools``: per layer ``pool_key.i``, ``pool_value.i`` (N, nkv, bs, d); then the LoRA inputs (torch.export takes
    no ``*args``); ``logit_positions`` as ``Backbone.forward``'s. attention_mask (B, M bs + T): 1 for a row's filled
    slots and its real new tokens.
    """

    def __init__(self, backbone: nn.Module):
        super().__init__()
        self.backbone = backbone

    @property
    def cfg(self):
        return self.backbone.cfg

    def forward(self, input_ids, position_ids, attention_mask, block_table, pools: list, lora: list,
                logit_positions=None):
        past = [gathered(p, block_table) for p in pools]  # each (B, nkv, M bs, d)
        return attend_past(self.backbone, input_ids, position_ids, attention_mask, past[0].shape[2],
                           lambda i: [float_segment(past[2 * i], past[2 * i + 1])], lora, logit_positions)


class PastSegment(NamedTuple):
    """A stretch of a layer's past as attention reads it: its ``length`` slots, ``scores(qg)`` (B, nkv, g T, d) ->
    (B, nkv, g T, length) unscaled q . k, and ``mix(a)`` weights (B, nkv, g T, length) -> sum of a v (B, nkv, g T, d).
    Float K/V multiply as they are (``float_segment``); sealed pages read their codes (``QuantizedPagesBackbone``)."""

    length: int
    scores: Callable[[torch.Tensor], torch.Tensor]
    mix: Callable[[torch.Tensor], torch.Tensor]


def float_segment(k: torch.Tensor, v: torch.Tensor) -> PastSegment:
    """Float K and V (B, nkv, P_j, d)."""
    return PastSegment(k.shape[2], lambda qg: qg @ k.transpose(-1, -2), lambda a: a @ v)


def attend_past(bb, input_ids, position_ids, attention_mask, P, segments: Callable[[int], list[PastSegment]], lora: list,
                logit_positions=None):
    """The float backbone ``bb``'s layers (``Block.project_qkv``, ``Block.finish``) with attention over a past of
    ``P`` slots in segments and the new tokens side by side, never concatenated: ``Block.forward`` builds
    present = past ++ new, a copy of the past that the gather has already made once (measured with it: paged decode
    0.77x the padded engine's tokens/s, float cache, 8 rows of 128-1024 tokens). ``segments(i)``: layer i's past as
    ``PastSegment``s in the mask's order, their lengths summing to P; called inside the layer, so what a segment
    makes from the pools (a gather, codes read as floats) is a transient of that layer alone. Returns (logits, *new K/V)."""
    cfg = bb.cfg
    B, T = input_ids.shape
    nkv, d = cfg.num_kv_heads, cfg.head_dim
    g = cfg.num_heads // nkv
    x, cos, sin, mask = bb.prepare(input_ids, position_ids, attention_mask, P)  # mask (B, 1, g T, P + T)
    new = []
    loras = bb.layer_loras(tuple(lora), T)
    for i, block in enumerate(bb.blocks):
        lora_i = loras[i]
        q, k, v = block.project_qkv(x, B, T, cos, sin, lora_i)  # (B, nh, T, d), (B, nkv, T, d) x 2
        qg = q.reshape(B, nkv, g * T, d)  # (B, nkv, g T, d): Block.forward's GQA fold
        past = segments(i)
        scores = torch.cat([seg.scores(qg) for seg in past] + [qg @ k.transpose(-1, -2)], dim=-1)  # (B, nkv, g T, P + T)
        att = torch.softmax(scores * (1.0 / math.sqrt(d)) + mask, dim=-1)
        y, start = None, 0
        for seg in past:
            part = seg.mix(att[..., start : start + seg.length])  # (B, nkv, g T, d)
            y, start = part if y is None else y + part, start + seg.length
        y = y + att[..., P:] @ v
        x = block.finish(x, y, B, T, lora_i)
        new += [k, v]
    return (bb.head(x, B, T, logit_positions), *new)


class QuantizedPagesBackbone(nn.Module):
    """forward(input_ids, position_ids, attention_mask, block_table, float_block_table, float_pools, sealed_pools, lora,
    logit_positions) -> (logits, *new K/V): the version-9 engine (``runtime.engine.interface.pages_interface``).

    ``float_pools``: per layer ``pool_key.i``, ``pool_value.i`` (blocks, nkv, bs, d) float32, read through
    ``float_block_table`` (B, F <= 2); ``sealed_pools``: per layer the pools of
    ``runtime.engine.interface.quantized_pages_tensors``, read through ``block_table`` (B, M). attention_mask
    (B, F bs + M bs + T): float slots, sealed slots, new tokens. The new tokens attend each other in float; only
    pages the runtime sealed before this forward are read quantized. Outputs: the new tokens' float K/V per layer,
    which the runtime writes and seals (``runtime.engine.kv_pages.PagesCache.append``)."""

    def __init__(self, backbone: nn.Module, spec: PageQuantSpec, block_size: int):
        super().__init__()
        problems = spec.problems(backbone.cfg.head_dim) + spec.layer_problems(backbone.cfg.num_layers)
        if problems:
            raise ValueError(f"{spec.name} cannot hold this backbone's heads: " + "; ".join(problems))
        self.backbone, self.spec, self.block_size = backbone, spec, block_size

    @property
    def cfg(self):
        return self.backbone.cfg

    def forward(self, input_ids, position_ids, attention_mask, block_table, float_block_table, float_pools: list,
                sealed_pools: list, lora: list, logit_positions=None):
        spec, bs = self.spec, self.block_size
        F, M = float_block_table.shape[1], block_table.shape[1]

        def segments(i: int) -> list[PastSegment]:  # sealed pages read page by page (kernels.page_quant's read)
            roles = len(SEALED_ROLES)
            k_codes, k_scale, k_min, k_base, v_codes, v_scale, v_min = (
                gathered_blocks(p, block_table) for p in sealed_pools[roles * i : roles * (i + 1)])
            k_scale, k_min = key_scale_minimum(k_scale, k_min, k_base)  # (B, nkv, M, 1, d) float32: small beside the codes
            layer = spec.layer(i)  # its widths: calibration may have widened some layers
            sealed = PastSegment(M * bs, lambda qg: sealed_key_scores(qg, k_codes, k_scale, k_min, layer.k_bits, bs),
                                 lambda a: sealed_value_mix(a, v_codes, v_scale, v_min, layer.v_bits))
            float_k, float_v = (gathered(p, float_block_table) for p in float_pools[2 * i : 2 * i + 2])  # (B, nkv, F bs, d)
            return [float_segment(float_k, float_v), sealed]

        return attend_past(self.backbone, input_ids, position_ids, attention_mask, (F + M) * bs, segments, lora,
                           logit_positions)
