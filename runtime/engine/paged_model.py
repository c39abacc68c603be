"""A backbone whose cache is paged: what the version-6 engine exports (``runtime.engine.interface.paged_kv_tensors``).

``PagedKVBackbone`` wraps the padded forward (``runtime.engine.model.Backbone``, float cache, or
``runtime.engine.kv_model.QuantizedKVBackbone``, packed cache) and changes only where the past comes from
and what goes out:

  1. read: every cache tensor of a layer is a pool of fixed-size blocks (N, nkv, bs, w); one Gather by the
     block table (B, M) gives each row its M blocks, laid end to end as the padded past (B, nkv, M bs, w).
     Slots a row has not filled (the tail of its last block, the blocks past its count) hold whatever the
     pool holds there; the attention mask (B, M bs + T) masks them, as it masks left padding today;
  2. the wrapped forward runs as it does on a padded past (same attention, same quantizer);
  3. write: only the new tokens' slots leave the graph (the last T of each ``present``), which the runtime
     copies into each row's blocks. The gathered past is a transient of one layer that ONNX Runtime's
     memory planner frees after its attention: what persists is the pool, sized by the device's budget.

Why a gather and not a contrib op: ORT's ``PagedAttention`` runs on CUDA only, and its ``GroupQueryAttention``
takes a padded past; the gather keeps the one quantized attention the padded engine runs (same
integers, same logits) and the standard-ops float engine alike. Shapes: B batch, T new tokens, M blocks
per row in the table, bs block size, N blocks in the pool, w the stored width (d, or d / 2 packed).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn


def gathered(pool: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """pool (N, nkv, bs, w) read through block_table (B, M) -> the rows' pasts (B, nkv, M bs, w).

    One Gather of (block, head) slabs straight into the past's order, (B, nkv, M) slab indices, so the
    result is the past by a free reshape: gathering whole blocks (B, M, nkv, bs, w) needs a Transpose after
    it, a second copy of the past per layer and step (measured: paged decode 0.82x the padded engine's
    tokens/s with it, tiny engine, 8 rows of 128-1024 tokens)."""
    B, M = block_table.shape
    N, nkv, bs, w = pool.shape
    slabs = block_table[:, None, :] * nkv + torch.arange(nkv, device=pool.device)[None, :, None]  # (B, nkv, M)
    return pool.reshape(N * nkv, bs, w)[slabs].reshape(B, nkv, M * bs, w)  # (B, nkv, M, bs, w) -> (B, nkv, M bs, w)


class PagedKVBackbone(nn.Module):
    """forward(input_ids, position_ids, attention_mask, block_table, pools, static, lora, logit_positions) -> (logits, *new slots).

    ``pools``: per layer the pool of every cache tensor the wrapped forward takes as its past, in the
    wrapped interface's order; then the static KV inputs (none for the float backbone) and the LoRA inputs
    (torch.export takes no ``*args``); ``logit_positions`` as ``Backbone.forward``'s. attention_mask
    (B, M bs + T): 1 for a row's filled slots and its real new tokens.
    """

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner
        self.quantized = hasattr(inner, "spec")  # QuantizedKVBackbone; Backbone has none
        self.backbone = inner.backbone if self.quantized else inner

    @property
    def cfg(self):
        return self.backbone.cfg

    def forward(self, input_ids, position_ids, attention_mask, block_table, pools: list, static: list, lora: list,
                logit_positions=None):
        T = input_ids.shape[1]
        past = [gathered(p, block_table) for p in pools]  # each (B, nkv, M bs, w)
        P = past[0].shape[2]
        if not self.quantized:
            return self._forward_float(input_ids, position_ids, attention_mask, past, lora, logit_positions)
        cache, per_layer = [], len(pools) // self.cfg.num_layers
        empty_sink = past[0].new_zeros((past[0].shape[0], self.cfg.num_kv_heads, 0, self.cfg.head_dim), dtype=torch.float16)
        for i in range(self.cfg.num_layers):  # the padded engine's order: the layer's past_*, then its two sinks
            cache += past[i * per_layer : (i + 1) * per_layer] + [empty_sink, empty_sink]
        logits, *outputs = self.inner(input_ids, position_ids, attention_mask, cache, static, lora, logit_positions)
        per_out = per_layer + 2  # present_* of the layer, then new_key / new_value in fp16 (for a sink: none here)
        return (logits, *(outputs[i * per_out + j].narrow(2, P, T)
                          for i in range(self.cfg.num_layers) for j in range(per_layer)))

    def _forward_float(self, input_ids, position_ids, attention_mask, past: list, lora: list, logit_positions=None):
        """The float backbone's layers (``Block.project_qkv``, ``Block.finish``) with attention over the
        gathered past and the new tokens side by side, never concatenated: ``Block.forward`` builds
        present = past ++ new, a copy of the past that the gather has already made once (measured with it:
        paged decode 0.77x the padded engine's tokens/s, float cache, 8 rows of 128-1024 tokens)."""
        bb = self.backbone
        B, T = input_ids.shape
        P, nkv, d = past[0].shape[2], self.cfg.num_kv_heads, self.cfg.head_dim
        g = self.cfg.num_heads // nkv
        x, cos, sin, mask = bb.prepare(input_ids, position_ids, attention_mask, P)  # mask (B, 1, g T, P + T)
        new = []
        loras = bb.layer_loras(tuple(lora), T)
        for i, block in enumerate(bb.blocks):
            lora_i = loras[i]
            q, k, v = block.project_qkv(x, B, T, cos, sin, lora_i)  # (B, nh, T, d), (B, nkv, T, d) x 2
            qg = q.reshape(B, nkv, g * T, d)  # (B, nkv, g T, d): Block.forward's GQA fold
            scores = torch.cat([qg @ past[2 * i].transpose(-1, -2), qg @ k.transpose(-1, -2)], dim=-1)  # (B, nkv, g T, P + T)
            att = torch.softmax(scores * (1.0 / math.sqrt(d)) + mask, dim=-1)
            y = att[..., :P] @ past[2 * i + 1] + att[..., P:] @ v  # (B, nkv, g T, d)
            x = block.finish(x, y, B, T, lora_i)
            new += [k, v]
        return (bb.head(x, B, T, logit_positions), *new)
