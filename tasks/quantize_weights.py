"""Weight-only quantization of a compiled engine: fp32 MatMul weights -> ``com.microsoft.MatMulNBits``
(ONNX Runtime) or standard ``DequantizeLinear`` in front of each MatMul (TensorRT).

Decode at batch 1 reads every weight once per token, so on a small CPU it is bound by memory
bandwidth: 8-bit weights read 4x fewer bytes than fp32, 4-bit 8x fewer. The backbone is
compiled once, so its weights are quantized once, here, by rewriting the exported float graph:

* only a MatMul/Gemm whose weight is a *constant initializer* is touched. The LoRA A/B/scale
  tensors are graph inputs, so every LoRA path stays float and one quantized engine still
  serves every monthly adapter;
* each output column is quantized in groups of ``block_size`` input channels (round to
  nearest, asymmetric min/max with a zero point, the layout MatMulNBits reads:
  B ``(N, K/block, block*bits/8)`` uint8, scales ``(N, K/block)``, zero points packed the same way);
* ``fold_norms``: an RMSNorm scale g in front of a projection is folded into it before
  quantizing: ``(x_hat * g) @ W == x_hat @ (diag(g) W)`` exactly in real arithmetic. The
  projection then reads the normalized activations before the scale; the scaled ones are
  still computed for the LoRA paths, which need ``x_hat * g``;
* ``keep``: the LM head (and the embedding table, which is a Gather, never a MatMul) stay fp32;
* ``fmt`` (``WEIGHT_FORMATS``): the graph form of the same codes. TensorRT cannot parse the ONNX
  Runtime contrib op; it takes weight-only quantization as a blocked ``DequantizeLinear``
  (opset 21) of a constant signed int4/int8 weight, symmetric (TensorRT has no zero points),
  feeding a MatMul, and its weight-only kernels want fp16 activations (W4A16 / W8A16), hence
  ``qdq_fp16``: a Cast to fp16 around each quantized MatMul, everything else in fp32.

``reference_backbone`` is the PyTorch side of the same quantization: the same integer codes,
dequantized, loaded into ``runtime.model.Backbone``; the engine must match it (tests).

    python -m tasks.quantize_weights --engine-dir engine --out-dir engine-int4 --weights int4 [--fold-norms]
        [--adapter-dir A --data-dir D]   # also measure accuracy + perplexity vs the float engine
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import shutil
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

# engine.weights -> bits per weight (None = the float export, untouched)
WEIGHT_BITS = {"fp32": None, "int8": 8, "int4": 4}
WEIGHTS_FILE = "weights.json"  # written next to interface.json: how the engine's weights were stored
# How the codes are written into the graph: the contrib op ONNX Runtime runs (asymmetric by
# default), or the standard Q/DQ form TensorRT builds (always symmetric), with fp32 or fp16 GEMMs.
WEIGHT_FORMATS = ("matmulnbits", "qdq", "qdq_fp16")
QDQ_OPSET = 21  # blocked DequantizeLinear and int4 tensors
# ONNX Runtime fuses DequantizeLinear + MatMul into MatMulNBits at this accuracy level; 0 keeps
# the dequantized weights and fp32 activations exact, so ORT checks a Q/DQ graph against its reference.
QDQ_EXACT_ORT_CONFIG = {"session.qdq_matmulnbits_accuracy_level": "0"}
# MatMulNBits accuracy_level: 0 = fp32 compute (dequantize, then sgemm), 4 = int8 compute
# (activations quantized per block to int8 on the fly; the fast path of MLAS on x86 and Arm).
# Measured (ORT 1.32, 2 cores, 0.5B width): 8-bit at level 0 decodes 13x slower than fp32
# (no packed kernel: the weight is dequantized on every call); 4-bit at level 0 is 1.6x slower
# than at level 4. Level 0 is for exact parity tests only.
INT8_COMPUTE_LEVEL = 4
DEFAULT_ACCURACY_LEVEL = INT8_COMPUTE_LEVEL
# Input channels per quantization group. 128 instead of 32 (measured on 2 cores, 0.5B width, ORT 1.32,
# one interleaved run): decode at past 512 int4 3.24 -> 2.59 ms, int8 4.33 -> 3.61 ms; prefill of 128
# int4 107 -> 80 ms (fewer scales to read and apply). On the default month both block sizes keep test
# accuracy at 1.000 and held-out perplexity within 0.03% of the float engine (int4 RTN 2.1317 at
# either size, float 2.1312); calib-split KL int4 6.8e-5 -> 8.5e-5 nats.
DEFAULT_BLOCK_SIZE = 128
# The LM head of a serving engine (the compile stage's int8/int4 copy): int8 whatever the body's bits.
# At Qwen2-0.5B's shape it is 136M of the 494M parameters (vocabulary 151,936 x 896) and the largest
# read per token: kept fp32 it is 544 of the int4 engine's 736 MB per token. Measured there
# (bench.scale_bench: random weights, the release's adapter and 4-bit KV cache, past 512, 2 cores under
# other load, one interleaved loop; median / p10 ms): int4 body with an fp32 head 83.4 / 39.8, int8 head
# 53.6 / 27.4, int4 head 59.2 / 25.3; the head's own output error on the calib split (KL against the
# fp32 head) 1.2e-5 nats at int8, 1.9e-3 at int4 (150x), for at most a p10 8% faster. llama.cpp's Q4_0
# keeps this tensor at Q8_0 too (its Q6_K needs rows of a multiple of 256 columns; 896 is not).
SERVING_HEAD_BITS = 8
SERVING_KEEP = ("embed",)  # the embedding table is a Gather (one row per token), never quantized
# Points of accuracy a quantized engine may lose against the float engine (issue 8 acceptance).
MAX_ACCURACY_DROP = {"int8": 0.005, "int4": 0.02}


class WeightQuantError(RuntimeError):
    """A graph or precision this quantizer refuses; the message says why."""


# ---------------------------------------------------------------- quantization (PyTorch, shared)


# Range shrink factors tried per group by the calibrated scheme (AWQ/GPTQ-style clip search:
# a slightly clipped range rounds the many small weights more finely than it hurts the few large ones).
CLIP_GRID = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7)


def _rtn(w, bits: int, symmetric: bool, ratio=1.0):
    """Codes, scale, zero point of (N, kb, block) groups whose min/max range is scaled by ``ratio``."""
    import torch

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
    import torch

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
    import torch

    w = torch.as_tensor(w_nk, dtype=torch.float32)
    if norm_scale is not None:
        w = w * norm_scale[None, :]
    out = dequantize_groups(*quantize_groups(w, bits, block_size, symmetric), K=w.shape[1])
    return out / norm_scale[None, :] if norm_scale is not None else out


# ---------------------------------------------------------------- MatMulNBits packing (numpy)


def pack_codes(q: np.ndarray, bits: int) -> np.ndarray:
    """(..., n) uint8 codes -> (..., n * bits / 8) bytes; 4-bit: element 2j in the low nibble."""
    if bits == 8:
        return np.ascontiguousarray(q, dtype=np.uint8)
    if q.shape[-1] % 2:
        q = np.concatenate([q, np.zeros(q.shape[:-1] + (1,), np.uint8)], axis=-1)
    return np.ascontiguousarray(q[..., 0::2] | (q[..., 1::2] << 4), dtype=np.uint8)


# ---------------------------------------------------------------- graph rewrite (onnx)


def _lm_head_nodes(graph) -> set[str]:
    """Names of the MatMul/Gemm nodes that produce ``logits`` through reshapes only."""
    producer = {o: n for n in graph.node for o in n.output}
    found, frontier = set(), [o.name for o in graph.output if o.name == "logits"]
    while frontier:
        node = producer.get(frontier.pop())
        if node is None:
            continue
        if node.op_type in ("MatMul", "Gemm"):
            found.add(node.name)
        elif node.op_type in ("Reshape", "Identity", "Squeeze", "Unsqueeze", "Flatten"):
            frontier.append(node.input[0])
    return found


def _const_weight(node, inits: dict, producer: dict):
    """The (K, N) numpy weight of a MatMul/Gemm when it is a constant initializer (or a
    Transpose of one: a tied LM head reads the embedding table transposed); else None."""
    from onnx import numpy_helper

    attrs = {a.name: a for a in node.attribute}
    if node.op_type == "Gemm":
        get = lambda k, d: (attrs[k].f if attrs[k].type == 1 else attrs[k].i) if k in attrs else d  # noqa: E731
        if get("alpha", 1.0) != 1.0 or get("beta", 1.0) != 1.0 or get("transA", 0) != 0:
            return None
        trans_b = get("transB", 0)
    else:
        trans_b = 0
    name = node.input[1]
    if name in inits:
        w = numpy_helper.to_array(inits[name])
    elif name in producer and producer[name].op_type == "Transpose" and producer[name].input[0] in inits:
        perm = [a.ints for a in producer[name].attribute if a.name == "perm"]
        if perm and list(perm[0]) != [1, 0]:
            return None
        w = numpy_helper.to_array(inits[producer[name].input[0]]).T
    else:
        return None
    if w.ndim != 2 or w.dtype != np.float32:
        return None
    return w.T if trans_b else w  # (K, N)


def quantize_engine_weights(
    onnx_in: str | Path,
    onnx_out: str | Path,
    bits: int,
    block_size: int = DEFAULT_BLOCK_SIZE,
    fold_norms: bool = False,
    keep: tuple[str, ...] = ("lm_head", "embed"),
    accuracy_level: int = DEFAULT_ACCURACY_LEVEL,
    symmetric: bool = False,
    act_sq: dict | None = None,
    fmt: str = "matmulnbits",
    head_bits: int | None = None,
) -> dict:
    """Rewrite every constant-weight MatMul/Gemm of ``onnx_in`` into MatMulNBits (or, with ``fmt``
    qdq / qdq_fp16, a DequantizeLinear + MatMul, always symmetric); return a summary.

    ``keep`` names what stays fp32: "lm_head" (the projection to ``logits``); "embed" is the
    Gather table, which is never quantized here (listed so the summary says so). A quantized LM head
    takes ``head_bits`` (None: ``bits``, like every other projection).
    ``act_sq``: {name of a projection's input: (K,) mean squared activation} from
    ``calibrate_activations``; with it each group's clipping range is searched (``quantize_groups``).
    """
    import onnx
    import torch
    from onnx import helper, numpy_helper

    if bits not in (4, 8) or head_bits not in (None, 4, 8):
        raise WeightQuantError(f"bits must be 4 or 8, got {bits} (LM head: {head_bits})")
    if block_size < 16 or block_size & (block_size - 1):
        raise WeightQuantError(f"block_size must be a power of two >= 16 (MatMulNBits), got {block_size}")
    if fmt not in WEIGHT_FORMATS:
        raise WeightQuantError(f"format must be one of {list(WEIGHT_FORMATS)}, got {fmt!r}")
    symmetric = symmetric or fmt != "matmulnbits"
    unknown = set(keep) - {"lm_head", "embed"}
    if unknown:
        raise WeightQuantError(f"keep: unknown entries {sorted(unknown)}; expected lm_head and/or embed")
    t0 = time.perf_counter()
    model = onnx.load(str(onnx_in))
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    producer = {o: n for n in graph.node for o in n.output}
    lm_head = _lm_head_nodes(graph)
    if not lm_head:
        raise WeightQuantError(f"{onnx_in}: no MatMul produces 'logits'; not an engine graph")

    new_nodes, new_inits, summary = [], [], {"quantized": [], "kept_fp32": []}
    folded: dict[str, tuple] = {}  # norm-scale Mul name -> (node, name of its g initializer)
    bytes_before = bytes_after = 0
    for node in graph.node:
        w_kn = _const_weight(node, inits, producer) if node.op_type in ("MatMul", "Gemm") else None
        is_head = node.name in lm_head
        if w_kn is None or (is_head and "lm_head" in keep):
            if w_kn is not None:
                summary["kept_fp32"].append(f"{node.name} {list(w_kn.shape)} (lm_head)")
            new_nodes.append(node)
            continue
        K, N = w_kn.shape
        n_bits = (head_bits or bits) if is_head else bits
        a_name = node.input[0]
        a_sq = None if act_sq is None else act_sq.get(a_name)
        g = None
        # A norm scale in front: a Mul by a (K,) constant (the RMSNorm weight).
        mul = producer.get(a_name)
        if fold_norms and mul is not None and mul.op_type == "Mul":
            const = [i for i in mul.input if i in inits and tuple(inits[i].dims) == (K,)]
            if len(const) == 1:
                g_np = numpy_helper.to_array(inits[const[0]]).astype(np.float32)
                # A zero scale would make the PyTorch reference (which divides by g) undefined.
                if np.all(np.isfinite(g_np)) and np.all(g_np != 0):
                    g = torch.from_numpy(g_np)
                    folded[mul.name] = (mul, const[0])
                    a_name = mul.output[0] + "_unit"  # x_hat: the norm output before its scale
        w_nk = torch.from_numpy(np.array(w_kn.T, dtype=np.float32, order="C"))  # (N, K), a writable copy
        if g is not None:
            w_nk = w_nk * g[None, :]
            a_sq = None if a_sq is None else a_sq / g.double().numpy() ** 2  # moments of x_hat = h / g
        q, scale, zp = quantize_groups(w_nk, n_bits, block_size, symmetric, a_sq)
        if not torch.isfinite(scale).all():
            raise WeightQuantError(f"{node.name}: non-finite quantization scales")
        base = f"{node.name}_w{n_bits}"
        has_bias = node.op_type == "Gemm" and len(node.input) > 2 and node.input[2]
        out = node.output[0] + "_nobias" if has_bias else node.output[0]
        if fmt == "matmulnbits":
            nodes, tensors, n_bytes = _matmulnbits_nodes(base, a_name, out, q, scale, zp, n_bits, K, block_size,
                                                         symmetric, accuracy_level)
        else:
            nodes, tensors, n_bytes = _qdq_nodes(base, a_name, out, q, scale, zp, n_bits, K, block_size,
                                                 fmt == "qdq_fp16")
        new_nodes += nodes
        new_inits += tensors
        bytes_before += w_kn.nbytes
        bytes_after += n_bytes
        if has_bias:
            # A separate Add: MatMulNBits' optional bias input is absent from older ORT kernels.
            new_nodes.append(helper.make_node("Add", [out, node.input[2]], [node.output[0]], name=base + "_bias"))
        summary["quantized"].append(f"{node.name} K={K} N={N}" + (" (norm folded)" if g is not None else "")
                                    + (f" (lm_head, {n_bits} bits)" if is_head else ""))

    new_nodes = _unit_scale_norms(new_nodes, folded, inits, new_inits)
    summary["folded_norms"] = len(folded)
    # Drop what the rewrite orphaned: float weights, a Transpose feeding only a quantized head,
    # a norm-scale Mul whose only consumer was a folded projection.
    del graph.node[:]
    graph.node.extend(new_nodes)
    graph.initializer.extend(new_inits)
    _prune(graph)
    if fmt == "matmulnbits":
        if not any(o.domain == "com.microsoft" for o in model.opset_import):
            model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    else:
        # Blocked DequantizeLinear needs opset 21; the ops of the float export (opset 18) keep their
        # meaning there (19-21 only add types and Pad's wrap mode), and the checker validates it.
        for o in model.opset_import:
            if o.domain in ("", "ai.onnx"):
                o.version = max(o.version, QDQ_OPSET)
    from runtime.backends import onnxruntime as ort_backend

    # Protobuf caps one file at 2 GiB: a large graph's initializers go to <name>.data beside it, and
    # the checker then reads it by path (the in-memory form refuses a message over the cap).
    big = model.ByteSize() > ort_backend.EXTERNAL_DATA_MIN_BYTES
    if not big:
        onnx.checker.check_model(model)
    onnx.save(model, str(onnx_out), save_as_external_data=big, location=Path(onnx_out).name + ".data")
    if big:
        onnx.checker.check_model(str(onnx_out))
    summary |= {
        "bits": bits,
        "block_size": block_size,
        "fold_norms": fold_norms,
        "symmetric": symmetric,
        "format": fmt,
        "accuracy_level": accuracy_level if fmt == "matmulnbits" else None,
        "clip_search": act_sq is not None,
        "keep": list(keep),
        "head_bits": None if "lm_head" in keep else head_bits or bits,
        "quantized_weight_bytes_fp32": int(bytes_before),
        "quantized_weight_bytes": int(bytes_after),
        "seconds": round(time.perf_counter() - t0, 2),
    }
    summary["kept_fp32"].append("embedding table (Gather)")
    log.info("quantized %d matmuls to %d bits in %.1fs", len(summary["quantized"]), bits, summary["seconds"])
    return summary


def _matmulnbits_nodes(base: str, a_name: str, out: str, q, scale, zp, bits: int, K: int, block_size: int,
                       symmetric: bool, accuracy_level: int):
    """One MatMulNBits reading packed (N, kb, block) codes; returns (nodes, initializers, bytes)."""
    from onnx import helper, numpy_helper

    N = q.shape[0]
    packed = pack_codes(q.numpy(), bits)  # (N, kb, block * bits / 8)
    tensors = [numpy_helper.from_array(packed, base + "_q"), numpy_helper.from_array(scale.numpy(), base + "_scales")]
    inputs = [a_name, base + "_q", base + "_scales"]
    if not symmetric:
        zp_packed = pack_codes(zp.numpy(), bits)  # (N, ceil(kb * bits / 8))
        tensors.append(numpy_helper.from_array(zp_packed, base + "_zp"))
        inputs.append(base + "_zp")
    attrs = dict(K=K, N=N, bits=bits, block_size=block_size)
    if accuracy_level:
        attrs["accuracy_level"] = accuracy_level
    node = helper.make_node("MatMulNBits", inputs, [out], name=base, domain="com.microsoft", **attrs)
    return [node], tensors, packed.nbytes + scale.numel() * 4 + (0 if symmetric else zp_packed.nbytes)


def _qdq_nodes(base: str, a_name: str, out: str, q, scale, zp, bits: int, K: int, block_size: int, fp16: bool):
    """DequantizeLinear of a constant signed (K, N) int4/int8 weight, blocked along K, into a
    MatMul: the weight-only form TensorRT's ONNX parser takes. With ``fp16`` the scales, the
    dequantized weight and the MatMul are fp16, with a Cast on either side."""
    import torch
    from onnx import TensorProto, helper, numpy_helper

    N = q.shape[0]
    codes = (q.to(torch.int16) - zp.to(torch.int16)[..., None]).reshape(N, -1)[:, :K]  # symmetric: within +-(2^(bits-1)-1)
    codes = codes.T.contiguous().numpy().astype(np.int8)  # (K, N)
    # TensorRT refuses a zero scale; an all-zero group has codes 0, so any positive scale is exact.
    s = np.where(scale.numpy() > 0, scale.numpy(), 1.0).T  # (kb, N)
    s = s.astype(np.float16 if fp16 else np.float32)
    if not (np.isfinite(s).all() and (s > 0).all()):
        raise WeightQuantError(f"{base}: a scale is not a positive finite {s.dtype} (too small for fp16?)")
    if bits == 4:
        raw = pack_codes(codes.reshape(-1).astype(np.uint8) & 0xF, 4).tobytes()  # two's complement nibbles
        weight = helper.make_tensor(base + "_q", TensorProto.INT4, codes.shape, raw, raw=True)
    else:
        raw = codes.tobytes()
        weight = numpy_helper.from_array(codes, base + "_q")
    tensors = [weight, numpy_helper.from_array(s, base + "_scales")]
    dq = helper.make_node("DequantizeLinear", [base + "_q", base + "_scales"], [base + "_w"], name=base + "_dq",
                          axis=0, block_size=block_size)
    if not fp16:
        nodes = [dq, helper.make_node("MatMul", [a_name, base + "_w"], [out], name=base)]
    else:
        nodes = [helper.make_node("Cast", [a_name], [base + "_x16"], name=base + "_in16", to=TensorProto.FLOAT16), dq,
                 helper.make_node("MatMul", [base + "_x16", base + "_w"], [base + "_y16"], name=base),
                 helper.make_node("Cast", [base + "_y16"], [out], name=base + "_out32", to=TensorProto.FLOAT)]
    return nodes, tensors, len(raw) + s.nbytes


def calibrate_activations(onnx_path: str | Path, token_ids: list[list[int]], threads: int = 2) -> dict:
    """Mean squared value of each input channel of every constant-weight projection, over
    every token of ``token_ids`` (prefill, one sequence at a time, LoRA inputs zero: the
    statistics belong to the backbone, so one calibration serves every monthly adapter).

    Read from the float graph itself (the projections' inputs exposed as extra outputs), so it
    needs no mapping from graph nodes back to module names. Returns {input name: (K,) float64}.
    """
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper

    model = onnx.load(str(onnx_path))
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    producer = {o: n for n in graph.node for o in n.output}
    names = sorted({n.input[0] for n in graph.node if n.op_type in ("MatMul", "Gemm") and _const_weight(n, inits, producer) is not None})
    existing = {o.name for o in graph.output}
    del model, graph, inits, producer
    # The graph again without its weights: a large model's are in its external data file, which the
    # session reads from that folder (a graph serialized with them would pass protobuf's 2 GiB cap).
    model = onnx.load(str(onnx_path), load_external_data=False)
    model.graph.output.extend(helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in names if n not in existing)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.add_session_config_entry("session.model_external_initializers_file_folder_path", str(Path(onnx_path).parent))
    session = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    feeds_fixed = {}
    for spec in session.get_inputs():
        if spec.name.startswith("past_"):
            feeds_fixed[spec.name] = np.zeros((1, spec.shape[1], 0, spec.shape[3]), np.float32)
        elif spec.name.startswith("lora_"):
            feeds_fixed[spec.name] = np.zeros(spec.shape, np.float32)
    sums: dict[str, np.ndarray] = {}
    count = 0
    for ids in token_ids:
        T = len(ids)
        feeds = feeds_fixed | {"input_ids": np.asarray([ids], np.int64), "position_ids": np.arange(T, dtype=np.int64)[None],
                               "attention_mask": np.ones((1, T), np.int64)}
        for name, value in zip(names, session.run(names, feeds)):
            x = value.reshape(-1, value.shape[-1]).astype(np.float64)  # (tokens, K)
            sums[name] = sums.get(name, 0.0) + (x * x).sum(0)
        count += T
    if not count:
        raise WeightQuantError("calibration needs at least one token")
    stats = {name: total / count for name, total in sums.items()}
    bad = [n for n, v in stats.items() if not np.isfinite(v).all()]
    if bad:
        raise WeightQuantError(f"non-finite calibration statistics for {bad[:5]}")
    return stats


def _unit_scale_norms(nodes: list, folded: dict, inits: dict, new_inits: list) -> list:
    """Give each folded norm a scale of ones; its scaled output, if anything else (a LoRA path)
    still reads it, is recomputed by a Mul right after it: exactly ``x_hat * g`` as before.

    Why ones instead of dropping the Mul: ONNX Runtime fuses ``x / sqrt(mean(x^2) + eps) * w``
    into one SimplifiedLayerNormalization only when the scale Mul is there (measured: without
    it, 5 separate ops per norm).
    """
    from onnx import helper, numpy_helper

    consumers = _consumers_of(nodes)
    out = []
    for node in nodes:
        if node.name not in folded:
            out.append(node)
            continue
        mul, g_name = folded[node.name]
        scaled = mul.output[0]
        ones = g_name + "_ones"
        if ones not in {t.name for t in new_inits}:
            new_inits.append(numpy_helper.from_array(np.ones(tuple(inits[g_name].dims), np.float32), ones))
        x_hat = [i for i in mul.input if i != g_name][0]
        out.append(helper.make_node("Mul", [x_hat, ones], [scaled + "_unit"], name=mul.name + "_unit"))
        if consumers.get(scaled):  # e.g. LoRA A of q/k/v reads the scaled norm output
            out.append(helper.make_node("Mul", [scaled + "_unit", g_name], [scaled], name=mul.name))
    return out


def _consumers_of(nodes: list) -> dict[str, list]:
    out = defaultdict(list)
    for node in nodes:
        for name in node.input:
            out[name].append(node)
    return out


def _prune(graph) -> None:
    """Remove nodes and initializers nothing reads any more (repeated until stable)."""
    outputs = {o.name for o in graph.output}
    while True:
        used = {i for n in graph.node for i in n.input} | outputs
        dead = [n for n in graph.node if not any(o in used for o in n.output)]
        if not dead:
            break
        for n in dead:
            graph.node.remove(n)
    used = {i for n in graph.node for i in n.input} | outputs
    keep = [i for i in graph.initializer if i.name in used]
    del graph.initializer[:]
    graph.initializer.extend(keep)


# ---------------------------------------------------------------- PyTorch reference


_NORM_BEFORE = {  # which RMSNorm scale multiplies each projection's input
    "q_proj": "input_layernorm", "k_proj": "input_layernorm", "v_proj": "input_layernorm",
    "gate_proj": "post_attention_layernorm", "up_proj": "post_attention_layernorm",
}


def reference_weights(
    weights: dict, num_layers: int, bits: int, block_size: int = DEFAULT_BLOCK_SIZE, fold_norms: bool = False,
    keep: tuple[str, ...] = ("lm_head", "embed"), symmetric: bool = False, tied: bool = True,
    head_bits: int | None = None,
) -> dict:
    """Hugging Face-named weights with every projection replaced by what the quantized engine
    multiplies by (``fake_quantize``); the input of ``runtime.model.Backbone``."""
    out = dict(weights)
    for i in range(num_layers):
        for m in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
            kind = "mlp" if m in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            key = f"model.layers.{i}.{kind}.{m}.weight"
            g = weights[f"model.layers.{i}.{_NORM_BEFORE[m]}.weight"] if fold_norms and m in _NORM_BEFORE else None
            out[key] = fake_quantize(weights[key], bits, block_size, symmetric, g)
    if "lm_head" not in keep:
        head = weights["model.embed_tokens.weight"] if tied or "lm_head.weight" not in weights else weights["lm_head.weight"]
        g = weights["model.norm.weight"] if fold_norms else None
        out["lm_head.weight"] = fake_quantize(head, head_bits or bits, block_size, symmetric, g)
    return out


def int8_rounded_linear(x, w, b=None, block_size: int = DEFAULT_BLOCK_SIZE):
    """``runtime.model._linear`` after rounding each row of ``x`` as MatMulNBits does at accuracy
    level 4: per block of ``block_size`` input channels, symmetric int8 with scale amax / 127,
    round half to even. Everything after the rounding is float, as in the kernel's int32 sums."""
    import torch

    from runtime.model import _linear

    N, K = x.shape
    pad = -K % block_size  # a partial last block: zeros change neither its amax nor the sums
    blocks = torch.nn.functional.pad(x, (0, pad)).view(N, -1, block_size)
    scale = blocks.abs().amax(-1, keepdim=True) / 127.0
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    rounded = (torch.round(blocks * inv).clamp(-127, 127) * scale).view(N, -1)[:, :K]
    return _linear(rounded, w, b)


def reference_backbone(model_dir: str | Path, bits: int, block_size: int = DEFAULT_BLOCK_SIZE, fold_norms: bool = False,
                       keep: tuple[str, ...] = ("lm_head", "embed"), lora_modules: tuple[str, ...] = (),
                       symmetric: bool = False, accuracy_level: int = 0, head_bits: int | None = None):
    """``runtime.model.Backbone`` with the dequantized weights of the same quantization; at
    ``accuracy_level`` 4 every quantized projection also rounds its input (``int8_rounded_linear``),
    as the engine does. The LoRA path reads the unrounded input, as in the engine."""
    import dataclasses
    import functools

    from runtime.model import Backbone, read_config, read_weights

    if accuracy_level == INT8_COMPUTE_LEVEL and fold_norms:
        # The folded engine rounds the norm output before its scale; this reference applies the
        # scale first (fake_quantize divides it back out of the weight), so it would round other values.
        raise ValueError("reference_backbone: int8 activation rounding with folded norm scales is not modelled; "
                         "use accuracy_level=0 (fp32 compute) for a folded engine")
    cfg = read_config(model_dir)
    w = reference_weights(read_weights(model_dir), cfg.num_layers, bits, block_size, fold_norms, keep, symmetric,
                          cfg.tie_word_embeddings, head_bits)
    if "lm_head" not in keep:
        cfg = dataclasses.replace(cfg, tie_word_embeddings=False)  # the head now differs from the table
    backbone = Backbone(cfg, w, lora_modules).eval()
    if accuracy_level == INT8_COMPUTE_LEVEL:
        rounded = functools.partial(int8_rounded_linear, block_size=block_size)
        for block in backbone.blocks:
            block.linear = rounded
        if "lm_head" not in keep:
            backbone.linear = rounded
    return backbone


# ---------------------------------------------------------------- engine directories + quality


def weights_key_fields(weights: str, block_size: int = DEFAULT_BLOCK_SIZE, fold_norms: bool = False,
                       keep: tuple[str, ...] = ("lm_head", "embed"), accuracy_level: int = DEFAULT_ACCURACY_LEVEL,
                       fmt: str = "matmulnbits", head_bits: int | None = None) -> dict:
    """The part of the engine cache key (and of the interface) that says how weights are stored:
    two engines that differ in any of these must never be taken for one another. Empty for
    fp32: a float engine keeps the key (and the cached build) it had before this option existed.
    The accuracy level is MatMulNBits' own; a Q/DQ graph has none."""
    if weights == "fp32":
        return {}
    fields = {"weights": weights, "weights_block_size": block_size, "weights_fold_norms": fold_norms,
              "weights_keep": sorted(keep), "weights_format": fmt}
    if fmt == "matmulnbits":
        fields["weights_accuracy_level"] = accuracy_level
    if "lm_head" not in keep and head_bits not in (None, WEIGHT_BITS[weights]):  # absent with the body's bits, as before
        fields["weights_head_bits"] = head_bits
    return fields


def quantized_cache_key(float_key: dict, fields: dict) -> dict:
    """``tasks.compile.cache_key`` of the float engine + the weight fields, re-hashed."""
    key = {k: v for k, v in float_key.items() if k != "key"} | fields
    key["key"] = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
    return key


def quantize_engine_dir(engine_dir: Path, out_dir: Path, weights: str, block_size: int = DEFAULT_BLOCK_SIZE,
                        fold_norms: bool = False, keep: tuple[str, ...] = ("lm_head", "embed"),
                        accuracy_level: int = DEFAULT_ACCURACY_LEVEL, act_sq: dict | None = None,
                        fmt: str = "matmulnbits", head_bits: int | None = None) -> dict:
    """A copy of a compiled engine directory whose model.onnx has ``weights`` precision, in graph
    form ``fmt`` (``WEIGHT_FORMATS``).

    Writes ``model.onnx``, ``interface.json`` (the same inputs and hash, plus the weight precision) and
    ``weights.json`` (precision + quantizer settings + summary). The ORT-optimized graph is
    written by the first ``OrtEngine`` that opens the directory.
    """
    import dataclasses

    from runtime.interface import read_interface, write_interface

    if weights not in WEIGHT_BITS:
        raise WeightQuantError(f"weights must be one of {sorted(WEIGHT_BITS)}, got {weights!r}")
    engine_dir, out_dir = Path(engine_dir), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    bits = WEIGHT_BITS[weights]
    if bits is None:
        for f in [engine_dir / "model.onnx", *engine_dir.glob("model.onnx*.data")]:  # the graph and its external data
            shutil.copy2(f, out_dir / f.name)
        summary = {"bits": 32}
    else:
        summary = quantize_engine_weights(engine_dir / "model.onnx", out_dir / "model.onnx", bits, block_size,
                                          fold_norms, keep, accuracy_level, act_sq=act_sq, fmt=fmt, head_bits=head_bits)
    fields = weights_key_fields(weights, block_size, fold_norms, keep, accuracy_level, fmt, head_bits)
    if act_sq is not None and bits is not None:  # the codes depend on the calibration data
        digest = hashlib.sha256()
        for name in sorted(act_sq):
            digest.update(name.encode() + np.asarray(act_sq[name], np.float64).tobytes())
        fields["weights_calibration"] = digest.hexdigest()
    record = {**summary, **fields, "weights": weights}
    (out_dir / WEIGHTS_FILE).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    iface = read_interface(engine_dir)
    stored = None if bits is None else {"precision": weights, "format": fmt, "block_size": block_size}
    exporter = json.loads((engine_dir / "interface.json").read_text()).get("exporter")
    write_interface(dataclasses.replace(iface, weights=stored), out_dir / "interface.json", exporter)
    src_key = engine_dir / "cache_key.json"
    if src_key.exists():  # written last, as tasks.compile does: its presence means "complete"
        key = quantized_cache_key(json.loads(src_key.read_text()), fields)
        (out_dir / "cache_key.json").write_text(json.dumps(key, indent=2, sort_keys=True) + "\n")
    return record


def ensure_quantized_engine(float_dir: Path, out_dir: Path, weights: str, block_size: int = DEFAULT_BLOCK_SIZE,
                            fmt: str = "matmulnbits") -> dict:
    """``quantize_engine_dir`` unless ``out_dir`` already holds the build for this float engine and
    these settings; written to a temporary sibling and renamed, like the float engine. The LM head
    is quantized too, at ``SERVING_HEAD_BITS``."""
    from tasks.artifacts import atomic_output_dir

    keep, head_bits = SERVING_KEEP, SERVING_HEAD_BITS
    fields = weights_key_fields(weights, block_size, keep=keep, fmt=fmt, head_bits=head_bits)
    expected = quantized_cache_key(json.loads((Path(float_dir) / "cache_key.json").read_text()), fields)["key"]
    key_file = Path(out_dir) / "cache_key.json"
    if key_file.exists() and json.loads(key_file.read_text()).get("key") == expected:
        return {"weights": weights, "weights_builds": 0, "weights_dir": str(out_dir)}
    with atomic_output_dir(Path(out_dir)) as tmp:
        record = quantize_engine_dir(Path(float_dir), tmp, weights, block_size, keep=keep, fmt=fmt, head_bits=head_bits)
    return {"weights": weights, "weights_builds": 1, "weights_dir": str(out_dir), "weights_record": record}


def open_on_cpu(engine_dir: Path, threads: int = 2):
    """An ``OrtEngine`` on any engine directory this module writes. A Q/DQ graph (TensorRT's form)
    runs with exact fp32 dequantization (``QDQ_EXACT_ORT_CONFIG``), as TensorRT computes it,
    not with ONNX Runtime's int8 activation rounding."""
    from runtime.backends.onnxruntime import OrtEngine
    from runtime.interface import read_interface

    stored = read_interface(engine_dir).weights  # the format is recorded in the interface
    qdq = stored is not None and stored["format"] != "matmulnbits"
    return OrtEngine(engine_dir, threads=threads, session_config=QDQ_EXACT_ORT_CONFIG if qdq else None)


def open_with_adapter(engine_dir: Path, adapter_dir: Path, threads: int = 2):
    """``open_on_cpu`` with the adapter's LoRA inputs bound (refuses an adapter made for another interface)."""
    from runtime.adapter import load_adapter

    engine = open_on_cpu(engine_dir, threads)
    engine.set_adapter(load_adapter(adapter_dir, engine.interface))
    return engine


def engine_quality(engine, tokenizer, data_dir: Path, max_new_tokens: int = 8, batch_size: int = 64) -> dict:
    """Accuracy (all / new / regression rules) on ``test`` and perplexity on held-out text of an
    engine with the adapter bound (``open_with_adapter``)."""
    from runtime.generate import generate_text
    from tasks.data import HELDOUT_TEXT, read_jsonl, read_text_corpus
    from tasks.evaluate import accuracy_report, engine_perplexity

    test = read_jsonl(Path(data_dir) / "test.jsonl")
    report = accuracy_report(test, generate_text(engine, tokenizer, [ex.prompt for ex in test], max_new_tokens, batch_size))
    heldout = Path(data_dir) / HELDOUT_TEXT
    texts = read_text_corpus(heldout) if heldout.exists() else [e.prompt + e.completion for e in read_jsonl(Path(data_dir) / "val.jsonl")]
    report["perplexity"] = engine_perplexity(engine, tokenizer, texts)
    return report


def output_error(reference, candidate, tokenizer, prompts: list[str]) -> dict:
    """How far ``candidate``'s next-token distributions are from ``reference``'s on every prompt
    token (prefill): mean KL(ref || cand) in nats and top-1 agreement. Used on the calib split
    to choose a quantization scheme, so the test split stays untouched by the choice."""
    kls, agree, total = 0.0, 0, 0
    for prompt in prompts:
        ids = np.asarray([tokenizer(prompt)["input_ids"]], dtype=np.int64)  # (1, T)
        T = ids.shape[1]
        args = (ids, np.arange(T)[None], np.ones((1, T), np.int64), None)
        p, q = (e.forward(*args)[0][0].astype(np.float64) for e in (reference, candidate))  # (T, V)
        lp, lq = (z - z.max(-1, keepdims=True) for z in (p, q))
        lp -= np.log(np.exp(lp).sum(-1, keepdims=True))
        lq -= np.log(np.exp(lq).sum(-1, keepdims=True))
        kls += float((np.exp(lp) * (lp - lq)).sum())
        agree += int((p.argmax(-1) == q.argmax(-1)).sum())
        total += T
    return {"kl_mean": kls / total, "top1_agreement": agree / total, "tokens": total}


_HEAD_FP32, _HEAD_QUANT = ("lm_head", "embed"), ("embed",)
SCHEMES = {  # name -> (weights, fold_norms, keep, calibrated clip search, format)
    "int8_rtn": ("int8", False, _HEAD_FP32, False, "matmulnbits"),
    "int8_fold": ("int8", True, _HEAD_FP32, False, "matmulnbits"),
    "int8_rtn_head": ("int8", False, _HEAD_QUANT, False, "matmulnbits"),
    "int4_rtn": ("int4", False, _HEAD_FP32, False, "matmulnbits"),
    "int4_fold": ("int4", True, _HEAD_FP32, False, "matmulnbits"),
    "int4_clip": ("int4", False, _HEAD_FP32, True, "matmulnbits"),
    "int4_fold_clip": ("int4", True, _HEAD_FP32, True, "matmulnbits"),
    "int4_rtn_head": ("int4", False, _HEAD_QUANT, False, "matmulnbits"),
    "int4_fold_head": ("int4", True, _HEAD_QUANT, False, "matmulnbits"),
    # What TensorRT runs (symmetric codes, fp16 GEMMs), scored here by ONNX Runtime on the same graph.
    "int8_trt": ("int8", False, _HEAD_FP32, False, "qdq_fp16"),
    "int4_trt": ("int4", False, _HEAD_FP32, False, "qdq_fp16"),
}


def compare_schemes(engine_dir: Path, base_dir: Path, adapter_dir: Path, data_dir: Path, work_dir: Path,
                    schemes: list[str] | None = None, block_size: int = DEFAULT_BLOCK_SIZE, threads: int = 2) -> dict:
    """Every scheme vs the float engine: calib-split output error (the selection criterion) and
    test accuracy + held-out perplexity of base + adapter (the acceptance measure)."""
    from tasks.base_model import load_tokenizer
    from tasks.data import read_jsonl

    unknown = set(schemes or ()) - set(SCHEMES)
    if unknown:
        raise WeightQuantError(f"unknown schemes {sorted(unknown)}; known: {sorted(SCHEMES)}")
    tokenizer = load_tokenizer(Path(base_dir))
    calib = [ex.prompt + ex.completion for ex in read_jsonl(Path(data_dir) / "calib.jsonl")]
    reference = open_with_adapter(engine_dir, adapter_dir, threads)
    results = {"fp32": {"quality": engine_quality(reference, tokenizer, data_dir)}}
    act_sq = None
    for name in schemes or list(SCHEMES):
        weights, fold, keep, calibrated, fmt = SCHEMES[name]
        if calibrated and act_sq is None:
            act_sq = calibrate_activations(Path(engine_dir) / "model.onnx", [tokenizer(t)["input_ids"] for t in calib], threads)
        out = Path(work_dir) / name
        record = quantize_engine_dir(engine_dir, out, weights, block_size, fold, keep,
                                     act_sq=act_sq if calibrated else None, fmt=fmt)
        engine = open_with_adapter(out, adapter_dir, threads)
        quality = engine_quality(engine, tokenizer, data_dir)
        results[name] = {
            "calib_error": output_error(reference, engine, tokenizer, calib),
            "quality": quality,
            "gate": accuracy_gate(results["fp32"]["quality"], quality, weights),
            "weight_bytes_ratio": record["quantized_weight_bytes"] / record["quantized_weight_bytes_fp32"],
        }
        log.info("%s: %s", name, {k: results[name]["calib_error"][k] for k in ("kl_mean", "top1_agreement")})
    return results


def render_comparison(results: dict) -> str:
    lines = ["| scheme | calib KL (nats) | calib top-1 agree | accuracy | new | regression | perplexity | gate |",
             "|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        q, c = r["quality"], r.get("calib_error", {"kl_mean": 0.0, "top1_agreement": 1.0})
        gate = "-" if "gate" not in r else ("pass" if r["gate"]["passed"] else "FAIL")
        # new/regression are None on a month whose rows carry no `changed` field
        new, regression = (("n/a" if q[k] is None else f"{q[k]:.4f}") for k in ("accuracy_new", "accuracy_regression"))
        lines.append(f"| {name} | {c['kl_mean']:.2e} | {c['top1_agreement']:.4f} | {q['accuracy']:.4f} | "
                     f"{new} | {regression} | {q['perplexity']:.4f} | {gate} |")
    return "\n".join(lines) + "\n"


def accuracy_gate(float_report: dict, quant_report: dict, weights: str, max_drop: dict | None = None) -> dict:
    """Pass/fail of a quantized engine against the float engine: accuracy overall, on new and
    on regression rules may each drop at most ``max_drop[weights]`` (fraction, 0.005 = 0.5 points)."""
    limit = (max_drop or MAX_ACCURACY_DROP)[weights]
    drops = {}
    for key in ("accuracy", "accuracy_new", "accuracy_regression"):
        if float_report.get(key) is not None and quant_report.get(key) is not None:
            drops[key] = float_report[key] - quant_report[key]
    failures = [f"{k} dropped {d * 100:.2f} points (limit {limit * 100:.2f})" for k, d in drops.items() if d > limit + 1e-12]
    return {
        "weights": weights,
        "max_drop": limit,
        "drops": drops,
        "perplexity_ratio": quant_report["perplexity"] / float_report["perplexity"]
        if float_report.get("perplexity") and quant_report.get("perplexity") else None,
        "passed": not failures,
        "failures": failures,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Quantize a compiled engine's weights (MatMulNBits); optionally gate its accuracy.")
    ap.add_argument("--engine-dir", type=Path, required=True, help="a compiled float engine (tasks.compile)")
    ap.add_argument("--out-dir", type=Path, required=True)
    ap.add_argument("--weights", choices=sorted(WEIGHT_BITS), default="int8")
    ap.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE)
    ap.add_argument("--fold-norms", action="store_true")
    ap.add_argument("--quantize-lm-head", action="store_true", help="also quantize the LM head (kept fp32 by default)")
    ap.add_argument("--accuracy-level", type=int, default=DEFAULT_ACCURACY_LEVEL, choices=(0, 1, 4))
    ap.add_argument("--format", choices=WEIGHT_FORMATS, default="matmulnbits",
                    help="matmulnbits (ONNX Runtime) or qdq / qdq_fp16 (TensorRT weight-only; symmetric)")
    ap.add_argument("--base-dir", type=Path, help="with --adapter-dir and --data-dir: measure and gate accuracy")
    ap.add_argument("--adapter-dir", type=Path)
    ap.add_argument("--data-dir", type=Path)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--compare", action="store_true",
                    help="instead: every scheme in SCHEMES (out-dir holds one engine each + comparison.json)")
    ap.add_argument("--schemes", help="with --compare: a comma-separated subset of SCHEMES")
    args = ap.parse_args(argv)
    if args.compare:
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
        results = compare_schemes(args.engine_dir, args.base_dir, args.adapter_dir, args.data_dir, args.out_dir,
                                  args.schemes.split(",") if args.schemes else None, args.block_size, args.threads)
        (args.out_dir / "comparison.json").write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
        print(render_comparison(results))
        return 0
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    keep = ("embed",) if args.quantize_lm_head else ("lm_head", "embed")
    try:
        record = quantize_engine_dir(args.engine_dir, args.out_dir, args.weights, args.block_size, args.fold_norms,
                                     keep, args.accuracy_level, fmt=args.format)
    except WeightQuantError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    result = {"weights": record}
    if args.base_dir and args.adapter_dir and args.data_dir:
        from tasks.base_model import load_tokenizer

        tokenizer = load_tokenizer(args.base_dir)
        ref, got = (engine_quality(open_with_adapter(d, args.adapter_dir, args.threads), tokenizer, args.data_dir)
                    for d in (args.engine_dir, args.out_dir))
        result |= {"float": ref, "quantized": got}
        if args.weights != "fp32":
            result["gate"] = accuracy_gate(ref, got, args.weights)
    print(json.dumps(result, indent=2, sort_keys=True))
    return 0 if result.get("gate", {"passed": True})["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
