"""Attention over a 4-bit per-channel KV cache as ONNX Runtime's ``com.microsoft.GroupQueryAttention`` computes it.

``gqa_quantized_attention`` is a PyTorch custom op. Its eager body, built from the functions of
``kernels.kv_quant``, is the reference; ``torch.onnx.export`` lowers it (``onnx_translation()``) to
one GroupQueryAttention node with ``k_quant_type = v_quant_type = PER_CHANNEL`` and
``kv_cache_bit_width = 4``. That op is ORT's fused CPU kernel: it reads the packed cache
directly instead of the dozen elementwise ops a hand-written dequantization needs, which
is what made the standard-ops quantized engine slower than the float cache (``bench/engine/kv_engine_bench.py``).

What the op does, checked against it (tests/kernels/test_gqa_attention.py), and therefore what the
reference does:
  * the new tokens' K and V are quantized with the static scales, u = clamp(round(x / s), -8, 7) + 8,
    packed two per byte, low nibble = even channel (``kv_quant.pack_bits`` at 4 bits), and appended to
    the past: ``present = past ++ new``;
  * attention then reads every slot, the new tokens' own included, dequantized from ``present``:
    unlike ``kv_quant.QuantizedKVCache``, whose chunk reads its own K/V in float, here a token
    sees itself through the quantizer (one token of error more per query);
  * causal by cache slot (query t of a chunk after P past slots sees slots 0..P + t), plus the
    additive ``bias`` (B, 1, T, P + T) that masks padded slots. A query that sees padded slots
    only (a left-padded prompt's padding) gets some finite output in both, not the same one:
    nothing reads it, since every real query masks those slots.

What the op supports fixes the scheme: symmetric static scales per (kv head, channel) for keys
*and* values, keys after RoPE (RoPE is applied by the backbone, ``do_rotary = 0``), no fp16 sink
or window. ``gqa_problems`` says what a ``KVQuantSpec`` would need to change.
"""

from __future__ import annotations

import math

import torch

from kernels.kv_quant import dequantize, pack_bits, quantize, unpack_bits_f32
from kernels.kv_spec import KVQuantSpec

GQA_BITS = 4
_OFFSET = 2.0 ** (GQA_BITS - 1)  # the op's "offset by 8": symmetric zero point of kv_quant


def gqa_problems(spec: KVQuantSpec) -> list[str]:
    """Why ``spec`` cannot run on the GroupQueryAttention path (empty: it can)."""
    want = {"k_bits": GQA_BITS, "v_bits": GQA_BITS, "k_granularity": "channel", "v_granularity": "channel",
            "k_symmetric": True, "v_symmetric": True, "sink_tokens": 0, "window_tokens": 0, "pre_rope_keys": False}
    return [f"{key}={getattr(spec, key)!r} (the op needs {value!r})" for key, value in want.items()
            if getattr(spec, key) != value]


@torch.library.custom_op("adapter_release::gqa_quantized_attention", mutates_args=())
def gqa_quantized_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past_k: torch.Tensor, past_v: torch.Tensor,
    k_scale: torch.Tensor, v_scale: torch.Tensor, bias: torch.Tensor, num_heads: int, kv_num_heads: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q (B, T, nh d), k/v (B, T, nkv d) post-RoPE float; past_k/v (B, nkv, P, d / 2) uint8;
    k/v_scale (1, nkv, 1, d) float32; bias (B, 1, T, P + T) -> (out (B, T, nh d), present_k, present_v)."""
    present_k, present_v = gqa_append(k, v, past_k, past_v, k_scale, v_scale, kv_num_heads)
    out = gqa_attend(q, present_k, present_v, k_scale, v_scale, bias, num_heads, kv_num_heads)
    return out, present_k, present_v


def gqa_append(k, v, past_k, past_v, k_scale, v_scale, kv_num_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The op's write: new k/v (B, T, nkv d) quantized with the static scales and appended to the
    packed past: (present_k, present_v), each (B, nkv, P + T, d / 2) uint8."""
    B, T, _ = k.shape
    nkv, d = kv_num_heads, k_scale.shape[-1]
    present = []
    for new, past, scale in ((k, past_k, k_scale), (v, past_v, v_scale)):
        new = new.view(B, T, nkv, d).transpose(1, 2)  # (B, nkv, T, d)
        present.append(torch.cat([past, pack_bits(quantize(new, scale, torch.tensor(_OFFSET), GQA_BITS), GQA_BITS)], dim=2))
    return present[0], present[1]


def gqa_attend(q, present_k, present_v, k_scale, v_scale, bias, num_heads: int, kv_num_heads: int) -> torch.Tensor:
    """The op's read: q (B, T, nh d), the last T of the S packed slots being its own tokens, attends over
    every slot dequantized -> out (B, T, nh d). Also what the engine parity check attends with when it
    feeds the engine's own codes back (``tasks.checks.engine_parity``)."""
    B, T, _ = q.shape
    nkv, d = kv_num_heads, k_scale.shape[-1]
    read = [dequantize(unpack_bits_f32(packed, GQA_BITS, d), scale, torch.tensor(_OFFSET))  # (B, nkv, S, d)
            for packed, scale in ((present_k, k_scale), (present_v, v_scale))]
    keys, values = (x.repeat_interleave(num_heads // nkv, dim=1) for x in read)  # (B, nh, S, d)
    S = keys.shape[2]
    P = S - T
    causal = torch.arange(S)[None, :] <= (torch.arange(T) + P)[:, None]  # (T, S)
    qh = q.view(B, T, num_heads, d).transpose(1, 2)  # (B, nh, T, d)
    scores = (qh @ keys.transpose(-1, -2)) * (1.0 / math.sqrt(d)) + bias
    scores = scores.masked_fill(~causal, float("-inf"))
    out = torch.softmax(scores, dim=-1) @ values  # (B, nh, T, d)
    return out.transpose(1, 2).reshape(B, T, num_heads * d)


@gqa_quantized_attention.register_fake
def _(q, k, v, past_k, past_v, k_scale, v_scale, bias, num_heads, kv_num_heads):
    B, T, _ = q.shape
    nkv, P, w = past_k.shape[1], past_k.shape[2], past_k.shape[3]
    return q.new_empty(q.shape), past_k.new_empty((B, nkv, P + T, w)), past_v.new_empty((B, nkv, P + T, w))


def _register_onnx_schema() -> None:
    """Give ONNX's schema registry ORT's own definition of the op: the exporter builds nodes from
    registered schemas only, and contrib ops are not in ONNX's. Without the optional ``output_qk``
    output: the exporter gives a node every output of its schema, and ORT refuses that one
    unless ``qk_output`` is set."""
    import onnx.defs as defs
    from onnxruntime.capi.onnxruntime_pybind11_state import get_all_operator_schema

    if defs.has("GroupQueryAttention", "com.microsoft"):
        return
    ort = next(s for s in get_all_operator_schema() if s.name == "GroupQueryAttention" and s.domain == "com.microsoft")
    option = {str(o).rsplit(".", 1)[-1]: o for o in defs.OpSchema.FormalParameterOption.__members__.values()}

    def params(formal):
        return [defs.OpSchema.FormalParameter(p.name, p.typeStr, param_option=option[str(p.option).rsplit(".", 1)[-1]])
                for p in formal]

    attr_type = defs.OpSchema.AttrType.__members__
    defs.register_schema(defs.OpSchema(
        ort.name, ort.domain, ort.since_version,
        inputs=params(ort.inputs), outputs=params([p for p in ort.outputs if p.name != "output_qk"]),
        type_constraints=[(t.type_param_str, list(t.allowed_type_strs), "") for t in ort.type_constraints],
        attributes=[defs.OpSchema.Attribute(a.name, attr_type[str(a.type).rsplit(".", 1)[-1]], required=False)
                    for a in ort.attributes.values()],
    ))


def onnx_translation() -> dict:
    """``custom_translation_table`` entry for ``torch.onnx.export``: the op as one com.microsoft node."""
    import onnxscript
    from onnxscript import opset18 as op

    _register_onnx_schema()
    msft = onnxscript.values.Opset("com.microsoft", 1)

    def gqa(q, k, v, past_k, past_v, k_scale, v_scale, bias, num_heads: int, kv_num_heads: int):
        total = op.Add(op.Shape(past_k, start=2, end=3), op.Shape(k, start=1, end=2))  # (1,): P + T
        seqlens_k = op.Cast(op.Expand(op.Sub(total, op.Constant(value_ints=[1])), op.Shape(q, start=0, end=1)), to=6)
        total_len = op.Cast(op.Squeeze(total), to=6)  # int32 scalar
        # Every row of a chunk is a real token (padding is masked by ``bias``); said explicitly, the
        # op also takes chunks of several tokens after a past at batch > 1.
        query_seqlens = op.Cast(op.Expand(op.Shape(k, start=1, end=2), op.Shape(q, start=0, end=1)), to=6)
        out, present_k, present_v = msft.GroupQueryAttention(
            q, k, v, past_k, past_v, seqlens_k, total_len, None, None, None, bias, None, k_scale, v_scale,
            None, None, query_seqlens,
            num_heads=num_heads, kv_num_heads=kv_num_heads, k_quant_type="PER_CHANNEL",
            v_quant_type="PER_CHANNEL", kv_cache_bit_width=GQA_BITS,
        )
        return out, present_k, present_v

    return {torch.ops.adapter_release.gqa_quantized_attention.default: gqa}
