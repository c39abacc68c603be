"""The backbone with a quantized KV cache, in standard ONNX ops: what the quantized engine exports.

``QuantizedKVBackbone`` reuses ``runtime.engine.model.Backbone``'s weights and its block pieces
(``project_qkv``, ``finish``); only attention differs. Slots are [sink | quantized past | new]:

  1. scores: q against the fp16 sink, the quantized past and the new tokens' float keys,
     one softmax over all of them (the mask covers sink + P + T slots);
  2. the quantized past is never materialized as float K/V when the width divides 8 (2, 4, 8
     bits, d % 8 == 0) and keys are post-RoPE: dequantization is folded into the small side,
     q . ((u - z) s) = (q s) . u - (q s) . z and sum_p a_p (u_p - z_p) s_p = (a s) u - (a s) z,
     and the packed bytes are split into per-byte-position parts (channels j::per) instead
     of being interleaved back. Measured (bench/engine/kv_engine_bench.py): dequantizing the whole past
     to float every step cost several times the float engine's whole decode step on 2 CPU cores.
     Keys quantized before RoPE are dequantized (per byte position too) and re-rotated, each
     slot at its own position (``past_positions``, cos/sin from a table): RoPE does not fold
     into q, so this costs several elementwise passes over the past every step;
  3. write: the new tokens' K/V are rounded to fp16, keys un-rotated (pre-RoPE), quantized
     and packed, and appended to the packed past (``present_*``). Past bytes never change.

Step 3 mirrors ``kernels.kv_quant.QuantizedKVCache`` operation for operation (fp16 rounding
first, then un-rotate, then quantize), so the engine stores the same integers as the PyTorch
reference. Everything here is Cast/Mul/Div/Round/Clip/Concat/Slice/ReduceSum and friends:
no contrib op, so the graph stays parseable by TensorRT's ONNX parser (not yet run on one).

Not in the graph: the fp16 *window* of recent tokens (``window_tokens`` must be 0) and the
choice of which new tokens fill the sink, which the runtime makes (it only matters while the
first ``sink_tokens`` tokens arrive; see ``runtime.engine.backends.onnxruntime``).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from kernels.gqa_attention import gqa_append, gqa_attend, gqa_problems, gqa_quantized_attention
from kernels.kv_quant import (
    pack_bits,
    quantize,
    quantize_per_token,
    unpack_bits_f32,
    unpack_parts_f32,
)
from kernels.kv_spec import KVQuantSpec
from kernels.rope import apply_rope, rope_cos_sin, rope_rotate
from runtime.engine.model import Backbone

# How the engine reads its quantized cache: "standard" = the ONNX ops below (TensorRT can parse
# them); "gqa" = ONNX Runtime's fused GroupQueryAttention (kernels/gqa_attention.py), for the
# schemes that op supports.
KV_ATTENTION = ("standard", "gqa")

# Positions the pre-RoPE key table covers: runtime.engine.tracing's MAX_PAST + MAX_SEQ (4 MiB at d = 64).
ROPE_TABLE = 8192


def check_engine_spec(spec: KVQuantSpec, attention: str = "standard") -> None:
    """Refuse what the in-graph cache does not implement, or what ``attention`` cannot read."""
    if spec.window_tokens:
        raise ValueError(
            f"window_tokens={spec.window_tokens}: the engine's quantized cache has no fp16 window yet; use window_tokens=0"
        )
    if attention not in KV_ATTENTION:
        raise ValueError(f"attention={attention!r}: one of {KV_ATTENTION}")
    problems = gqa_problems(spec) if attention == "gqa" else []
    if problems:
        raise ValueError(f"{spec.name} cannot run on GroupQueryAttention: " + "; ".join(problems))


def _per_row(rotation):
    """A rotation (d, d), or one per row (B, d, d) on a stacked engine as (B, 1, d, d): either multiplies
    (B, heads, T, d) from the right."""
    return rotation[:, None] if rotation is not None and rotation.dim() == 3 else rotation


def per_row_scales(q, k, v, k_scale, v_scale, num_heads: int):
    """Per-row static scales around GroupQueryAttention, which takes one scale per (kv head, channel) for the
    whole batch: (q s_k, k / s_k, v / s_v, unit scales (1, nkv, 1, d)); the caller multiplies the op's output
    by s_v. The op then stores round(k / s_k) (the codes a per-row scale gives, up to the rounding of the
    division), scores q s_k . u_k = q . (u_k s_k) and mixes sum_p a_p u_v, which times s_v is sum_p a_p v_p.
    q (B, T, nh d), k and v (B, T, nkv d), scales (B, nkv, d)."""
    B, nkv, d = k_scale.shape
    g = num_heads // nkv
    unit = torch.ones(1, nkv, 1, d, dtype=q.dtype)
    q = q * k_scale.repeat_interleave(g, dim=1).reshape(B, 1, num_heads * d)  # each query head its kv head's s_k
    return q, k / k_scale.reshape(B, 1, nkv * d), v / v_scale.reshape(B, 1, nkv * d), unit


class QuantizedKVBackbone(nn.Module):
    """forward(input_ids, position_ids, attention_mask, cache, static, lora, logit_positions) -> (logits, *outputs).

    cache, static: flat lists in the order of ``runtime.engine.interface.quantized_kv_tensors``;
    outputs: per layer the present_* tensors then new_key, new_value, in that order too.
    """

    def __init__(self, backbone: Backbone, spec: KVQuantSpec, attention: str = "standard"):
        super().__init__()
        check_engine_spec(spec, attention)
        self.backbone, self.spec, self.attention = backbone, spec, attention
        cfg = backbone.cfg
        self.L, self.d = cfg.num_layers, cfg.head_dim
        self.kinds = []  # per kind: (name, bits, granularity, symmetric), key first
        for kind, short in (("key", "k"), ("value", "v")):
            self.kinds.append((kind, getattr(spec, f"{short}_bits"), getattr(spec, f"{short}_granularity"),
                               getattr(spec, f"{short}_symmetric")))
        # Values per byte when the dequantization folds into attention (see module docstring), else None.
        aligned = {kind: 8 // bits if 8 % bits == 0 and self.d % 8 == 0 else None for kind, bits, _, _ in self.kinds}
        self.per = {"key": None if spec.pre_rope_keys else aligned["key"], "value": aligned["value"]}
        self.key_per = None
        if spec.pre_rope_keys:
            # RoPE of the past slots by table lookup (one Gather) instead of cos/sin of P x d angles
            # every step; the tables are kernels.rope's, so the same values as every other rotation.
            table = rope_cos_sin(torch.arange(ROPE_TABLE)[None], backbone.inv_freq)  # each (1, 1, N, d)
            cos, sin_signed = (t[0, 0] for t in table)  # (N, d)
            # Aligned widths read keys per byte position (channels j::per, ``unpack_parts_f32``): the tables
            # are stored in that order, so the past is never interleaved back. Channel c pairs with
            # c + d/2 in RoPE, which is index m + d/(2 per) of the same part: rotation stays in-part.
            self.key_per = aligned["key"] if aligned["key"] and self.d % (2 * aligned["key"]) == 0 else None
            perm = torch.cat([torch.arange(j, self.d, self.key_per or 1) for j in range(self.key_per or 1)])
            self.register_buffer("rope_cos", cos[:, perm], persistent=False)
            self.register_buffer("rope_sin_signed", sin_signed[:, perm], persistent=False)

    @staticmethod
    def _n_cache(gran: str, sym: bool) -> int:
        """Cache tensors per kind: packed, + scale (per token), + zero (per token, asymmetric)."""
        return 1 if gran == "channel" else (2 if sym else 3)

    def _parse(self, cache: list, static: list) -> list[dict]:
        """Per layer {"key": [packed, scale?, zero?], "value": [...], "sink": [k, v], "key_static": [scale, zero?] | None,
        ..., "rotation": (d, d) | None}."""
        layers = []
        for _ in range(self.L):
            layer = {}
            for kind, _bits, gran, sym in self.kinds:
                n = self._n_cache(gran, sym)
                layer[kind], cache = cache[:n], cache[n:]
                n = 0 if gran == "token" else (1 if sym else 2)
                layer[kind + "_static"], static = (static[:n] or None), static[n:]
            layer["sink"], cache = cache[:2], cache[2:]
            layer["rotation"] = None
            if not self.spec.pre_rope_keys:
                layer["rotation"], static = static[0], static[1:]
            layers.append(layer)
        return layers

    def forward(self, input_ids, position_ids, attention_mask, cache: list, static: list, lora: list, logit_positions=None):
        if self.attention == "gqa":
            return self._forward_gqa(input_ids, position_ids, attention_mask, cache, static, lora, logit_positions)
        spec, bb = self.spec, self.backbone
        cache = list(cache)
        past_positions = cache.pop(0) if spec.pre_rope_keys else None  # (B, P)
        layers = self._parse(cache, list(static))
        B, T = input_ids.shape
        sink_len, P = layers[0]["sink"][0].shape[2], layers[0]["key"][0].shape[2]
        x, cos, sin, mask = bb.prepare(input_ids, position_ids, attention_mask, sink_len + P)  # mask (B, 1, g T, S)
        past_rope = None
        if spec.pre_rope_keys:  # cos/sin of every quantized slot, once for all layers: per part (B, 1, P, d / per)
            per = self.key_per or 1
            pcos, psin = (t[past_positions].unsqueeze(1) for t in (self.rope_cos, self.rope_sin_signed))  # (B, 1, P, d)
            w = self.d // per
            past_rope = [(pcos[..., j * w : (j + 1) * w], psin[..., j * w : (j + 1) * w]) for j in range(per)]

        outputs = []
        g = bb.cfg.num_heads // bb.cfg.num_kv_heads
        loras = bb.layer_loras(tuple(lora), T)
        for i, block in enumerate(bb.blocks):
            layer, lora_i = layers[i], loras[i]
            q, k, v = self._rotated(layer, *block.project_qkv(x, B, T, cos, sin, lora_i))  # new tokens, post-RoPE
            qg = q.reshape(B, q.shape[1] // g, g * T, self.d)  # (B, nkv, g T, d)
            sink_k, sink_v = (t.float() for t in layer["sink"])  # (B, nkv, sink, d)
            scores = torch.cat([qg @ sink_k.transpose(-1, -2), self._key_scores(qg, layer, past_rope),
                                qg @ k.transpose(-1, -2)], dim=-1)  # (B, nkv, g T, S)
            att = torch.softmax(scores * (1.0 / math.sqrt(self.d)) + mask, dim=-1)
            a_sink, a_past, a_new = att[..., :sink_len], att[..., sink_len : sink_len + P], att[..., sink_len + P :]
            y = a_sink @ sink_v + self._value_mix(a_past, layer) + a_new @ v  # (B, nkv, g T, d)
            x = block.finish(x, self._unrotated(layer, y), B, T, lora_i)
            outputs += self._append(layer, k, v, position_ids)
        return (bb.head(x, B, T, logit_positions), *outputs)

    def forward_reading(self, read_codes: list, *args):
        """GQA mode, eager only: ``forward(*args)`` whose attention reads ``read_codes`` (per layer the
        packed present K and V, e.g. an engine's: ``tasks.checks.engine_parity``) instead of the codes this
        module stores; the outputs are still this module's own codes."""
        if self.attention != "gqa":
            raise ValueError("forward_reading runs the GroupQueryAttention path only")
        return self._forward_gqa(*args, read_codes=read_codes)

    def _forward_gqa(self, input_ids, position_ids, attention_mask, cache: list, static: list, lora: list,
                     logit_positions=None, read_codes: list | None = None):
        """Attention by ``kernels.gqa_attention`` (one GroupQueryAttention node per layer in ONNX).

        The sink inputs stay in the signature (same interface as the standard-ops engine) but are
        empty: the scheme has no sink. The new K/V are rounded to fp16 before they are quantized,
        as ``kernels.kv_quant.QuantizedKVCache`` stores them, so both hold the same integers.
        """
        bb = self.backbone
        layers = self._parse(list(cache), list(static))
        B, T = input_ids.shape
        sink_len, P = layers[0]["sink"][0].shape[2], layers[0]["key"][0].shape[2]
        x, cos, sin, _ = bb.prepare(input_ids, position_ids, attention_mask, sink_len + P)
        slots = attention_mask[:, sink_len:]  # (B, P + T): sink slots come first and there are none
        bias = torch.where(slots > 0, 0.0, torch.finfo(torch.float32).min)[:, None, None, :].expand(B, 1, T, P + T)
        nh, nkv, d = bb.cfg.num_heads, bb.cfg.num_kv_heads, self.d
        outputs = []
        loras = bb.layer_loras(tuple(lora), T)
        for i, block in enumerate(bb.blocks):
            layer, lora_i = layers[i], loras[i]
            q, k, v = self._rotated(layer, *block.project_qkv(x, B, T, cos, sin, lora_i))  # (B, heads, T, d), post-RoPE
            k16, v16 = k.to(torch.float16), v.to(torch.float16)
            q_rows = q.transpose(1, 2).reshape(B, T, nh * d)
            k_rows, v_rows = (t.float().transpose(1, 2).reshape(B, T, nkv * d) for t in (k16, v16))
            k_scale, v_scale = (layer[kind + "_static"][0] for kind in ("key", "value"))  # (nkv, d), or (B, nkv, d)
            rows_scaled = k_scale.dim() == 3
            if rows_scaled:  # each row its release's scales, folded around the op (``per_row_scales``)
                q_rows, k_rows, v_rows, unit = per_row_scales(q_rows, k_rows, v_rows, k_scale, v_scale, nh)
                scales = [unit, unit]
            else:
                scales = [t.reshape(1, nkv, 1, d) for t in (k_scale, v_scale)]
            if read_codes is None:
                y, present_k, present_v = gqa_quantized_attention(
                    q_rows, k_rows, v_rows, layer["key"][0], layer["value"][0], *scales, bias, nh, nkv)  # y (B, T, nh d)
            else:  # store our own codes, attend over the given ones: the op's two halves
                present_k, present_v = gqa_append(k_rows, v_rows, layer["key"][0], layer["value"][0], *scales, nkv)
                y = gqa_attend(q_rows, read_codes[2 * i], read_codes[2 * i + 1], *scales, bias, nh, nkv)
            if rows_scaled:
                y = y * v_scale.repeat_interleave(nh // nkv, dim=1).reshape(B, 1, nh * d)  # (B, T, nh d)
            y = y.view(B, T, nh, d).transpose(1, 2).reshape(B, nkv, (nh // nkv) * T, d)  # finish's layout
            x = block.finish(x, self._unrotated(layer, y), B, T, lora_i)
            outputs += [present_k, present_v, k16, v16]
        return (bb.head(x, B, T, logit_positions), *outputs)

    @staticmethod
    def _rotated(layer: dict, q, k, v):
        """q, k, v (B, heads, T, d) turned by the release's rotation R (d, d): (q R)(k R)^T = q k^T, so
        the cache can hold k R and v R (``kernels.kv_quant.KVRotation``). With R = I every product
        is exact (one term x 1, the rest x 0), so an unrotated release computes what it did before."""
        r = _per_row(layer["rotation"])
        return (q, k, v) if r is None else (q @ r, k @ r, v @ r)

    @staticmethod
    def _unrotated(layer: dict, y):
        """The attention output (B, nkv, g T, d) of rotated values turned back: (a V R) R^T = a V."""
        r = _per_row(layer["rotation"])
        return y if r is None else y @ r.transpose(-1, -2)

    def run_gqa_chunks(self, ids, bounds: list[tuple[int, int]], static: list, lora: tuple = ()) -> tuple[list, list]:
        """Eager GQA-mode run of ``ids`` (B, T) chunk by chunk (``bounds``: [(start, end), ...] from 0),
        each chunk through the packed cache the previous ones left, as the engine is driven. Returns
        (logits per chunk, packed [key.0, value.0, key.1, ...]). No padding: every slot is real."""
        cfg = self.backbone.cfg
        B = ids.shape[0]
        packed = [torch.zeros(B, cfg.num_kv_heads, 0, self.d // 2, dtype=torch.uint8) for _ in range(2 * self.L)]
        no_sink = torch.zeros(B, cfg.num_kv_heads, 0, self.d, dtype=torch.float16)
        logits = []
        for a, b in bounds:
            cache = [t for i in range(self.L) for t in (packed[2 * i], packed[2 * i + 1], no_sink, no_sink)]
            out, *rest = self(ids[:, a:b], torch.arange(a, b).expand(B, b - a), torch.ones(B, b, dtype=torch.long),
                              cache, static, lora)
            packed = [t for i in range(self.L) for t in rest[4 * i : 4 * i + 2]]
            logits.append(out)
        return logits, packed

    # ------------------------------------------------------------ read side
    # Packed bytes are read as per-byte-position parts (``kernels.kv_quant.unpack_parts_f32``: part j
    # holds channels j::per), never interleaved back. Not folded further into the small side
    # (sum_j w_j u_j = sum_j (w_j - 2^b w_(j-1)) (r >> j b) saves two passes but multiplies bytes up
    # to 255: measured, its ~10x larger rounding error flipped a stored 4-bit value at a rounding
    # boundary within 40 tokens, so the integers no longer matched the reference).

    def _static(self, tensors: list, bits: int):
        # (nkv, 1, d), or per row (B, nkv, 1, d) on a stacked engine (interface version 7): broadcasts over tokens
        scale = tensors[0].unsqueeze(-2)
        zero = tensors[1].unsqueeze(-2) if len(tensors) > 1 else torch.full_like(scale, 2.0 ** (bits - 1))
        return scale, zero

    def _scale_zero(self, layer: dict, kind: str, bits: int, gran: str, sym: bool):
        """(scale, zero): static (nkv, 1, d), or per token (B, nkv, P, 1) (zero may be a float)."""
        if gran == "channel":
            return self._static(layer[kind + "_static"], bits)
        s = layer[kind][1].float()
        return s, (2.0 ** (bits - 1) if sym else layer[kind][2].float())

    def _dequantized(self, layer: dict, j: int, past_rope):
        kind, bits, gran, sym = self.kinds[j]
        s, z = self._scale_zero(layer, kind, bits, gran, sym)
        x = (unpack_bits_f32(layer[kind][0], bits, self.d) - z) * s  # (B, nkv, P, d): kernels' dequantize
        if kind == "key" and past_rope is not None:
            x = apply_rope(x, *past_rope[0])
        return x

    def _key_scores_pre_rope(self, qg, layer: dict, past_rope):
        """Pre-RoPE keys at an aligned width: dequantize and rotate per byte position, no interleave."""
        kind, bits, gran, sym = self.kinds[0]
        per = self.key_per
        s, z = self._scale_zero(layer, kind, bits, gran, sym)
        out = 0
        for j, u in enumerate(unpack_parts_f32(layer[kind][0], bits)):  # u (B, nkv, P, d / per)
            sj, zj = (s[..., j::per], z[..., j::per]) if gran == "channel" else (s, z)
            k = apply_rope((u - zj) * sj, *past_rope[j])  # post-RoPE keys of channels j::per
            out = out + qg[..., j::per] @ k.transpose(-1, -2)
        return out

    def _key_scores(self, qg, layer: dict, past_rope):
        """q . k over the quantized past: (B, nkv, g T, P), unscaled."""
        kind, bits, gran, sym = self.kinds[0]
        per = self.per["key"]
        if self.spec.pre_rope_keys and self.key_per:
            return self._key_scores_pre_rope(qg, layer, past_rope)
        if per is None:
            return qg @ self._dequantized(layer, 0, past_rope).transpose(-1, -2)
        s, z = self._scale_zero(layer, kind, bits, gran, sym)
        parts = unpack_parts_f32(layer[kind][0], bits)
        if gran == "channel":  # (q s) . u - (q s) . z
            qs = qg * s  # (B, nkv, g T, d)
            return self._dot_parts(qs, parts, per) - (qs * z).sum(-1, keepdim=True)
        raw = self._dot_parts(qg, parts, per)  # (B, nkv, g T, P): q . u
        zq = qg.sum(-1, keepdim=True) * (z if sym else z.transpose(-1, -2))  # (B, nkv, g T, 1 or P)
        return (raw - zq) * s.transpose(-1, -2)  # per-token scale (B, nkv, 1, P)

    @staticmethod
    def _dot_parts(w, parts: list, per: int):
        """w (B, nkv, g T, d) . u over channels, u given per byte position: (B, nkv, g T, P)."""
        out = 0
        for j, u in enumerate(parts):
            out = out + w[..., j::per] @ u.transpose(-1, -2)  # (B, nkv, g T, d / per) @ (B, nkv, d / per, P)
        return out

    def _value_mix(self, a, layer: dict):
        """sum over the quantized past of a_p v_p: (B, nkv, g T, d)."""
        kind, bits, gran, sym = self.kinds[1]
        per = self.per["value"]
        if per is None:
            return a @ self._dequantized(layer, 1, None)
        s, z = self._scale_zero(layer, kind, bits, gran, sym)
        if gran == "token":
            a = a * s.transpose(-1, -2)  # (B, nkv, g T, P): fold the per-token scale into the weights
        ys = [a @ u for u in unpack_parts_f32(layer[kind][0], bits)]  # per x (B, nkv, g T, d / per)
        y = torch.stack(ys, dim=-1).flatten(-2)  # (B, nkv, g T, d): channels back in order
        if gran == "token":
            return y - (a.sum(-1, keepdim=True) * z if sym else a @ z)
        return (y - a.sum(-1, keepdim=True) * z) * s

    # ------------------------------------------------------------ write side

    def _append(self, layer: dict, k, v, position_ids) -> list:
        """The new tokens quantized as kernels.kv_quant.QuantizedKVCache does, appended to the
        packed past; then the new tokens in fp16 (for the sink)."""
        outputs, new_fp16 = [], []
        for (kind, bits, gran, sym), new in zip(self.kinds, (k, v)):
            new = new.to(torch.float16)  # (B, nkv, T, d), as the reference stores it before quantizing
            new_fp16.append(new)
            x = new.float()
            if kind == "key" and self.spec.pre_rope_keys:
                x = rope_rotate(x, position_ids, self.backbone.inv_freq, inverse=True)  # pre-RoPE
            if gran == "channel":
                s, z = self._static(layer[kind + "_static"], bits)
                new_tensors = [pack_bits(quantize(x, s, z, bits), bits)]
            else:
                u, s, z = quantize_per_token(x, bits, sym)  # s, z (B, nkv, T, 1)
                new_tensors = [pack_bits(u, bits), s.to(torch.float16)] + ([] if sym else [z.to(torch.float16)])
            outputs += [torch.cat([p, t], dim=2) for p, t in zip(layer[kind], new_tensors)]
        return outputs + new_fp16
