"""Weight-only quantization of an engine's graph: fp32 MatMul weights -> ``com.microsoft.MatMulNBits``
(ONNX Runtime) or standard ``DequantizeLinear`` in front of each MatMul (TensorRT).

Decode at batch 1 reads every weight once per token, so on a small CPU it is bound by memory
bandwidth: 8-bit weights read 4x fewer bytes than fp32, 4-bit 8x fewer. The backbone is
compiled once, so its weights are quantized once, here, by rewriting the exported float graph
(the codes: ``kernels/weight_quant.py``):

* only a MatMul/Gemm whose weight is a *constant initializer* is touched. The LoRA A/B/scale
  tensors are graph inputs, so every LoRA path stays float and one quantized engine still
  serves every monthly adapter;
* ``fold_norms``: an RMSNorm scale g in front of a projection is folded into it before
  quantizing: ``(x_hat * g) @ W == x_hat @ (diag(g) W)`` exactly in real arithmetic. The
  projection then reads the normalized activations before the scale; the scaled ones are
  still computed for the LoRA paths, which need ``x_hat * g``;
* ``keep``: the LM head and/or the embedding table stay fp32. The table is read by a Gather (one row per
  token), never a MatMul: quantized, it becomes ONNX Runtime's ``com.microsoft.GatherBlockQuantized``
  over the same blocked codes (rows of the table along its hidden axis), dequantizing only the rows it
  gathers. At Qwen2-0.5B's shape the fp32 table is 151,936 x 896 x 4 B = 545 MB of resident memory;
* ``fmt`` (``WEIGHT_FORMATS``): the graph form of the same codes. TensorRT cannot parse the ONNX
  Runtime contrib op; it takes weight-only quantization as a blocked ``DequantizeLinear``
  (opset 21) of a constant signed int4/int8 weight, symmetric (TensorRT has no zero points),
  feeding a MatMul, and its weight-only kernels want fp16 activations (W4A16 / W8A16), hence
  ``qdq_fp16``: a Cast to fp16 around each quantized MatMul, everything else in fp32.

``calibrate_activations`` reads, from the same float graph, the activation statistics the
calibrated clip search of ``kernels.weight_quant.quantize_groups`` weighs its error by, or the full second
moments GPTQ (``kernels.weight_quant.gptq_groups``) spreads each column's rounding error with.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kernels.weight_quant import DEFAULT_BLOCK_SIZES, gptq_groups, pack_codes, quantize_groups
from runtime.engine.adapter import zero_lora_inputs
from runtime.engine.interface import ADAPTER_MASK, BLOCK_TABLE, FLOAT_BLOCK_TABLE, LOGIT_POSITIONS, read_interface

log = logging.getLogger(__name__)

# How the codes are written into the graph: the contrib op ONNX Runtime runs (asymmetric by
# default), or the standard Q/DQ form TensorRT builds (always symmetric), with fp32 or fp16 GEMMs.
WEIGHT_FORMATS = ("matmulnbits", "qdq", "qdq_fp16")
QDQ_OPSET = 21  # blocked DequantizeLinear and int4 tensors
# MatMulNBits accuracy_level: 0 = fp32 compute (dequantize, then sgemm), 4 = int8 compute
# (activations quantized per block to int8 on the fly; the fast path of MLAS on x86 and Arm).
# Measured (ORT 1.32, 2 cores, 0.5B width): 8-bit at level 0 decodes 13x slower than fp32
# (no packed kernel: the weight is dequantized on every call); 4-bit at level 0 is 1.6x slower
# than at level 4. Level 0 is for exact parity tests only.
INT8_COMPUTE_LEVEL = 4
DEFAULT_ACCURACY_LEVEL = INT8_COMPUTE_LEVEL
DEFAULT_BLOCK_SIZE = DEFAULT_BLOCK_SIZES["int4"]  # the functions' default below, for either width
# The LM head's codes, at most this many bytes to one MatMulNBits (its columns in slices, concatenated). ONNX
# Runtime repacks each weight when a session opens and keeps the original's pages mapped until that weight is
# done: one 136 MB head (Qwen2-0.5B's 151,936 x 896 at 8 bits) was the process's peak, 0.12 GB over its resident
# set once open. Slices of 16 MB leave 16 MB of it.
HEAD_SLICE_MAX_BYTES = 16 << 20


class WeightQuantError(RuntimeError):
    """A graph or precision this quantizer refuses; the message says why."""


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


@dataclass
class _Rewrite:
    """What the rewrite of one graph accumulates: the new nodes and initializers, the norm-scale Muls
    folded into projections, the weight bytes before and after, and the summary's lists."""

    nodes: list = field(default_factory=list)
    initializers: list = field(default_factory=list)
    folded: dict = field(default_factory=dict)  # norm-scale Mul name -> (node, name of its g initializer)
    bytes_before: int = 0
    bytes_after: int = 0
    quantized: list[str] = field(default_factory=list)
    kept_fp32: list[str] = field(default_factory=list)

    def add(self, nodes: list, tensors: list, fp32_bytes: int, quantized_bytes: int, line: str) -> None:
        self.nodes += nodes
        self.initializers += tensors
        self.bytes_before += fp32_bytes
        self.bytes_after += quantized_bytes
        self.quantized.append(line)


def _check_settings(bits: int, head_bits: int | None, embed_bits: int | None, block_size: int, fmt: str,
                    keep: tuple[str, ...]) -> None:
    if bits not in (4, 8) or head_bits not in (None, 4, 8) or embed_bits not in (None, 4, 8):
        raise WeightQuantError(f"bits must be 4 or 8, got {bits} (LM head: {head_bits}, embedding: {embed_bits})")
    if block_size < 16 or block_size & (block_size - 1):
        raise WeightQuantError(f"block_size must be a power of two >= 16 (MatMulNBits), got {block_size}")
    if fmt not in WEIGHT_FORMATS:
        raise WeightQuantError(f"format must be one of {list(WEIGHT_FORMATS)}, got {fmt!r}")
    unknown = set(keep) - {"lm_head", "embed"}
    if unknown:
        raise WeightQuantError(f"keep: unknown entries {sorted(unknown)}; expected lm_head and/or embed")


def _folded_norm_scale(node, K: int, inits: dict, producer: dict, rewrite: _Rewrite):
    """(g, name of the projection's input once g is folded into its weight) when a norm scale feeds the
    projection: a Mul by a (K,) constant (the RMSNorm weight), every entry finite and non-zero (the PyTorch
    reference divides by g); else (None, the input as it is)."""
    import torch
    from onnx import numpy_helper

    a_name = node.input[0]
    mul = producer.get(a_name)
    if mul is None or mul.op_type != "Mul":
        return None, a_name
    const = [i for i in mul.input if i in inits and tuple(inits[i].dims) == (K,)]
    if len(const) != 1:
        return None, a_name
    g_np = numpy_helper.to_array(inits[const[0]]).astype(np.float32)
    if not (np.all(np.isfinite(g_np)) and np.all(g_np != 0)):
        return None, a_name
    rewrite.folded[mul.name] = (mul, const[0])
    return torch.from_numpy(g_np), mul.output[0] + "_unit"  # x_hat: the norm output before its scale


def _quantize_projection(node, w_kn: np.ndarray, n_bits: int, is_head: bool, block_size: int, symmetric: bool,
                         accuracy_level: int, fmt: str, fold_norms: bool, act_sq: dict | None, hessians: dict | None,
                         inits: dict, producer: dict, rewrite: _Rewrite, parts: list | None = None) -> None:
    """One MatMul/Gemm with a constant (K, N) weight as MatMulNBits (or Q/DQ), its bias as an Add; by GPTQ when
    ``hessians`` holds its input's second moments, else round to nearest (with the clip search given ``act_sq``).
    ``parts`` (``tasks.weights.mixed.PartCodes``, row order): codes chosen beforehand, one MatMulNBits per part."""
    import torch
    from onnx import helper

    K, N = w_kn.shape
    if parts is not None:
        _write_parts(node, K, N, parts, symmetric, accuracy_level, rewrite)
        return
    a_sq = None if act_sq is None else act_sq.get(node.input[0])
    hessian = None
    if hessians is not None:
        if node.input[0] not in hessians:  # never round to nearest in silence where GPTQ was asked for
            raise WeightQuantError(f"{node.name}: no calibration statistics for its input {node.input[0]!r} (GPTQ)")
        hessian = hessians[node.input[0]]
    g, a_name = _folded_norm_scale(node, K, inits, producer, rewrite) if fold_norms else (None, node.input[0])
    w_nk = torch.from_numpy(np.array(w_kn.T, dtype=np.float32, order="C"))  # (N, K), a writable copy
    if g is not None:  # the moments of x_hat = h / g
        w_nk = w_nk * g[None, :]
        a_sq = None if a_sq is None else a_sq / g.double().numpy() ** 2
        hessian = None if hessian is None else hessian / np.outer(g.numpy(), g.numpy())
    if hessian is not None:
        q, scale, zp = gptq_groups(w_nk, hessian, n_bits, block_size, symmetric)
    else:
        q, scale, zp = quantize_groups(w_nk, n_bits, block_size, symmetric, a_sq)
    if not torch.isfinite(scale).all():
        raise WeightQuantError(f"{node.name}: non-finite quantization scales")
    base = f"{node.name}_w{n_bits}"
    has_bias = node.op_type == "Gemm" and len(node.input) > 2 and node.input[2]
    out = node.output[0] + "_nobias" if has_bias else node.output[0]
    if fmt == "matmulnbits":
        nodes, tensors, n_bytes = matmulnbits_nodes(base, a_name, out, q, scale, zp, n_bits, K, block_size,
                                                     symmetric, accuracy_level,
                                                     HEAD_SLICE_MAX_BYTES if is_head else None)
    else:
        nodes, tensors, n_bytes = _qdq_nodes(base, a_name, out, q, scale, zp, n_bits, K, block_size,
                                             fmt == "qdq_fp16")
    if has_bias:
        # A separate Add: MatMulNBits' optional bias input is absent from older ORT kernels.
        nodes = [*nodes, helper.make_node("Add", [out, node.input[2]], [node.output[0]], name=base + "_bias")]
    slices = sum(n.op_type == "MatMulNBits" for n in nodes)
    rewrite.add(nodes, tensors, w_kn.nbytes, n_bytes,
                f"{node.name} K={K} N={N}" + (" (norm folded)" if g is not None else "")
                + (f" (lm_head, {n_bits} bits)" if is_head else "") + (f" in {slices} slices" if slices > 1 else ""))


def _write_parts(node, K: int, N: int, parts: list, symmetric: bool, accuracy_level: int, rewrite: _Rewrite) -> None:
    """A projection whose output rows are stored at different widths: a MatMulNBits per part, joined by a Concat."""
    from onnx import helper

    has_bias = node.op_type == "Gemm" and len(node.input) > 2 and node.input[2]
    out = node.output[0] + "_nobias" if has_bias else node.output[0]
    nodes, tensors, n_bytes, outs = [], [], 0, []
    for part in parts:
        base = f"{node.name}_w{part.bits}b{part.block_size}_r{part.lo}"
        outs.append(out if len(parts) == 1 else base + "_out")
        n, t, b = matmulnbits_nodes(base, node.input[0], outs[-1], part.q, part.scale, part.zp, part.bits, K,
                                    part.block_size, symmetric, accuracy_level)
        nodes, tensors, n_bytes = nodes + n, tensors + t, n_bytes + b
    if len(parts) > 1:
        nodes.append(helper.make_node("Concat", outs, [out], name=f"{node.name}_parts", axis=-1))
    if has_bias:
        nodes.append(helper.make_node("Add", [out, node.input[2]], [node.output[0]], name=f"{node.name}_bias"))
    widths = ", ".join(f"rows {p.lo}-{p.hi} int{p.bits}/b{p.block_size}" for p in parts)
    rewrite.add(nodes, tensors, K * N * 4, n_bytes, f"{node.name} K={K} N={N} ({widths})")


def projection_weights(onnx_path: str | Path, hessians: dict | None) -> list[tuple[str, np.ndarray, np.ndarray | None]]:
    """[(node name, (K, N) float32 weight, (K, K) second moments of its input, None without ``hessians``)] of every
    projection of an engine graph but the LM head: what ``tasks.weights.mixed.mixed_codes`` plans."""
    import onnx

    graph = onnx.load(str(onnx_path)).graph
    inits = {i.name: i for i in graph.initializer}
    producer = {o: n for n in graph.node for o in n.output}
    head = _lm_head_nodes(graph)
    found = []
    for node in graph.node:
        w_kn = _const_weight(node, inits, producer) if node.op_type in ("MatMul", "Gemm") else None
        if w_kn is not None and node.name not in head:
            if hessians is not None and node.input[0] not in hessians:
                raise WeightQuantError(f"{node.name}: no calibration statistics for its input {node.input[0]!r}")
            found.append((node.name, w_kn, None if hessians is None else hessians[node.input[0]]))
    return found


def _set_opsets(model, fmt: str) -> None:
    from onnx import helper

    if fmt == "matmulnbits":
        if not any(o.domain == "com.microsoft" for o in model.opset_import):
            model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    else:
        # Blocked DequantizeLinear needs opset 21; the ops of the float export (opset 18) keep their
        # meaning there (19-21 only add types and Pad's wrap mode), and the checker validates it.
        for o in model.opset_import:
            if o.domain in ("", "ai.onnx"):
                o.version = max(o.version, QDQ_OPSET)


def _save_checked(model, onnx_out: str | Path) -> None:
    import onnx

    from runtime.engine.backends import onnxruntime as ort_backend

    # Protobuf caps one file at 2 GiB: a large graph's initializers go to <name>.data beside it, and
    # the checker then reads it by path (the in-memory form refuses a message over the cap).
    big = model.ByteSize() > ort_backend.EXTERNAL_DATA_MIN_BYTES
    if not big:
        onnx.checker.check_model(model)
    onnx.save(model, str(onnx_out), save_as_external_data=big, location=Path(onnx_out).name + ".data")
    if big:
        onnx.checker.check_model(str(onnx_out))


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
    embed_bits: int | None = None,
    hessians: dict | None = None,
    part_codes: dict | None = None,
) -> dict:
    """Rewrite every constant-weight MatMul/Gemm of ``onnx_in`` into MatMulNBits (or, with ``fmt``
    qdq / qdq_fp16, a DequantizeLinear + MatMul, always symmetric); return a summary.

    ``keep`` names what stays fp32: "lm_head" (the projection to ``logits``) and "embed" (the Gather
    table). A quantized LM head takes ``head_bits`` (None: ``bits``, like every other projection); a
    quantized table ``embed_bits`` (None: ``bits``), as GatherBlockQuantized (``matmulnbits`` format only:
    TensorRT's parser has no such op, so a Q/DQ graph keeps the table fp32).
    ``act_sq``: {name of a projection's input: (K,) mean squared activation} from
    ``calibrate_activations``; with it each group's clipping range is searched (``quantize_groups``).
    ``hessians``: {name of a projection's input: (K, K) second moments} (``calibrate_activations(...,
    second_moments=True)``); each projection whose input is there is quantized by GPTQ (``gptq_groups``, with
    the clip search on their diagonal), under a progress bar.
    ``part_codes``: {node name: its parts' codes} of a mixed-precision plan (``tasks.weights.mixed.mixed_codes``;
    MatMulNBits, unfolded norms): those projections are written as given, at their parts' widths.
    """
    import resource

    import onnx

    from tasks.progress import Progress

    _check_settings(bits, head_bits, embed_bits, block_size, fmt, keep)
    if part_codes is not None and (fmt != "matmulnbits" or fold_norms):
        raise WeightQuantError("mixed-precision parts are written as MatMulNBits over unfolded norms only")
    symmetric = symmetric or fmt != "matmulnbits"
    t0 = time.perf_counter()
    model = onnx.load(str(onnx_in))
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    producer = {o: n for n in graph.node for o in n.output}
    lm_head = _lm_head_nodes(graph)
    if not lm_head:
        raise WeightQuantError(f"{onnx_in}: no MatMul produces 'logits'; not an engine graph")

    rewrite = _Rewrite()
    quantize_table = "embed" not in keep and fmt == "matmulnbits"
    bar = Progress(f"GPTQ int{bits}", len(graph.node), unit="node", enabled=hessians is not None)
    for node in graph.node:
        bar.advance()
        table = _embedding_table(node, inits) if quantize_table else None
        if table is not None and table.shape[1] % block_size == 0:
            nodes, tensors, n_bytes = gather_block_quantized_nodes(node, table, embed_bits or bits, block_size, symmetric)
            rewrite.add(nodes, tensors, table.nbytes, n_bytes,
                        f"{node.name} V={table.shape[0]} H={table.shape[1]} (embedding, {embed_bits or bits} bits)")
            continue
        w_kn = _const_weight(node, inits, producer) if node.op_type in ("MatMul", "Gemm") else None
        is_head = node.name in lm_head
        if w_kn is None or (is_head and "lm_head" in keep):
            if w_kn is not None:
                rewrite.kept_fp32.append(f"{node.name} {list(w_kn.shape)} (lm_head)")
            rewrite.nodes.append(node)
            continue
        parts = None if part_codes is None or is_head else part_codes[node.name]
        _quantize_projection(node, w_kn, (head_bits or bits) if is_head else bits, is_head, block_size, symmetric,
                             accuracy_level, fmt, fold_norms, act_sq, hessians, inits, producer, rewrite, parts)
    bar.close()

    new_nodes = _unit_scale_norms(rewrite.nodes, rewrite.folded, inits, rewrite.initializers)
    # Drop what the rewrite orphaned: float weights, a Transpose feeding only a quantized head,
    # a norm-scale Mul whose only consumer was a folded projection.
    del graph.node[:]
    graph.node.extend(new_nodes)
    graph.initializer.extend(rewrite.initializers)
    _prune(graph)
    _set_opsets(model, fmt)
    _save_checked(model, onnx_out)
    quantized_table = any("(embedding" in line for line in rewrite.quantized)
    summary = {
        "quantized": rewrite.quantized,
        "kept_fp32": rewrite.kept_fp32 + ([] if quantized_table else ["embedding table (Gather)"]),
        "folded_norms": len(rewrite.folded),
        "bits": bits,
        "block_size": block_size,
        "fold_norms": fold_norms,
        "symmetric": symmetric,
        "format": fmt,
        "accuracy_level": accuracy_level if fmt == "matmulnbits" else None,
        "clip_search": act_sq is not None or hessians is not None,
        "method": "rtn" if hessians is None else "gptq",
        "keep": list(keep),
        "head_bits": None if "lm_head" in keep else head_bits or bits,
        "embed_bits": embed_bits or bits if quantized_table else None,
        "quantized_weight_bytes_fp32": int(rewrite.bytes_before),
        "quantized_weight_bytes": int(rewrite.bytes_after),
        "seconds": round(time.perf_counter() - t0, 2),
    }
    peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    log.info("quantized %d matmuls to %d bits (%s) in %.1fs, peak resident %.2f GB", len(summary["quantized"]), bits,
             summary["method"], summary["seconds"], peak_gb)
    return summary


def matmulnbits_nodes(base: str, a_name: str, out: str, q, scale, zp, bits: int, K: int, block_size: int,
                       symmetric: bool, accuracy_level: int, max_code_bytes: int | None = None):
    """One MatMulNBits reading packed (N, kb, block) codes; returns (nodes, initializers, bytes). With
    ``max_code_bytes``, codes over it go to equal slices of the N output columns (``base``_s0, _s1, ...), each a
    MatMulNBits of at most that many code bytes, joined by a Concat: the same codes (each row is quantized alone)."""
    from onnx import helper, numpy_helper

    N = q.shape[0]
    slices = 1 if max_code_bytes is None else -(-N * K * bits // 8 // max_code_bytes)
    if slices > 1:
        nodes, tensors, n_bytes, parts = [], [], 0, []
        for i, cols in enumerate(np.array_split(np.arange(N), slices)):
            lo, hi = int(cols[0]), int(cols[-1]) + 1
            parts.append(f"{out}_s{i}")
            n, t, b = matmulnbits_nodes(f"{base}_s{i}", a_name, parts[-1], q[lo:hi], scale[lo:hi],
                                        None if zp is None else zp[lo:hi], bits, K, block_size, symmetric, accuracy_level)
            nodes += n
            tensors += t
            n_bytes += b
        return nodes + [helper.make_node("Concat", parts, [out], name=f"{base}_concat", axis=-1)], tensors, n_bytes
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


def _embedding_table(node, inits: dict):
    """The (V, H) fp32 table a Gather along axis 0 reads from a constant initializer; else None."""
    from onnx import numpy_helper

    if node.op_type != "Gather" or node.input[0] not in inits:
        return None
    if any(a.name == "axis" and a.i != 0 for a in node.attribute):
        return None
    table = numpy_helper.to_array(inits[node.input[0]])
    return table if table.ndim == 2 and table.dtype == np.float32 else None


def gather_block_quantized_nodes(node, table: np.ndarray, bits: int, block_size: int, symmetric: bool):
    """The Gather ``node`` of ``table`` (V, H), H a whole number of blocks, as one GatherBlockQuantized over
    its blocked codes along H (``quantize_groups``: MatMulNBits' codes, scales and zero points, as (V, H bits / 8),
    (V, H / block) and (V, ceil(H / block bits / 8))); returns (nodes, initializers, bytes)."""
    import torch
    from onnx import helper, numpy_helper

    V, H = table.shape
    q, scale, zp = quantize_groups(torch.from_numpy(np.array(table)), bits, block_size, symmetric)  # a writable copy
    if not torch.isfinite(scale).all():
        raise WeightQuantError(f"{node.name}: non-finite quantization scales")
    base = f"{node.name}_w{bits}"
    packed = pack_codes(q.numpy(), bits).reshape(V, H * bits // 8)  # whole blocks: the rows' codes end to end
    tensors = [numpy_helper.from_array(packed, base + "_q"), numpy_helper.from_array(scale.numpy(), base + "_scales")]
    inputs = [base + "_q", node.input[1], base + "_scales"]
    if not symmetric:  # GatherBlockQuantized's default zero point is MatMulNBits' symmetric one (2^(bits-1))
        zp_packed = pack_codes(zp.numpy(), bits)  # (V, ceil(H / block * bits / 8))
        tensors.append(numpy_helper.from_array(zp_packed, base + "_zp"))
        inputs.append(base + "_zp")
    out = helper.make_node("GatherBlockQuantized", inputs, list(node.output), name=base, domain="com.microsoft",
                           gather_axis=0, quantize_axis=1, block_size=block_size, bits=bits)
    return [out], tensors, sum(t.nbytes for t in (packed, scale.numpy())) + (0 if symmetric else zp_packed.nbytes)


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


def calibrate_activations(onnx_path: str | Path, token_ids: list[list[int]], threads: int = 2,
                          second_moments: bool = False) -> dict:
    """Mean squared value of each input channel of every constant-weight projection, over
    every token of ``token_ids`` (prefill, one sequence at a time, LoRA inputs zero: the
    statistics belong to the backbone, so one calibration serves every monthly adapter).
    With ``second_moments`` the whole (K, K) matrix E[x x^T] of each input instead, in float32 (what GPTQ reads;
    at Qwen2-0.5B's shape 2.5 GB in all, most of it the 4,864-wide inputs of the 24 down projections).

    Read from the float graph itself (the projections' inputs exposed as extra outputs), so it
    needs no mapping from graph nodes back to module names; a float-cache graph, padded or paged (the
    prefill reads no past either way). Returns {input name: (K,) float64}, or (K, K) float32.
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
    iface = read_interface(Path(onnx_path).parent)  # an engine folder's graph: its interface lies beside it
    feeds_fixed = zero_lora_inputs(iface)  # one slot of a stacked engine, which the mask selects
    if iface.stacked:
        feeds_fixed[ADAPTER_MASK] = np.ones((1, 1), np.float32)
    # An empty cache: padded (no past slots), paged or quantized pages (empty block tables over pools of one block,
    # read by no row: the float pools and the sealed pages' codes, scales and minima alike).
    for spec in iface.inputs:
        if spec.name.startswith("past_"):
            feeds_fixed[spec.name] = np.zeros((1, spec.shape[1], 0, spec.shape[3]), np.float32)
        elif spec.name.startswith("pool_"):
            feeds_fixed[spec.name] = np.zeros((1, *spec.shape[1:]), np.dtype(spec.dtype))
        elif spec.name in (BLOCK_TABLE, FLOAT_BLOCK_TABLE):
            feeds_fixed[spec.name] = np.zeros((1, 0), np.int64)
    sums: dict[str, np.ndarray] = {}
    count = 0
    every_position = LOGIT_POSITIONS in {spec.name for spec in session.get_inputs()}  # the LM head reads every token
    from tasks.progress import Progress

    with Progress("calibration text", len(token_ids), unit="window", enabled=second_moments) as bar:
        for ids in token_ids:
            T = len(ids)
            feeds = feeds_fixed | {"input_ids": np.asarray([ids], np.int64),
                                   "position_ids": np.arange(T, dtype=np.int64)[None], "attention_mask": np.ones((1, T), np.int64)}
            if every_position:
                feeds[LOGIT_POSITIONS] = np.arange(T, dtype=np.int64)[None]
            for name, value in zip(names, session.run(names, feeds)):
                if second_moments:
                    x = value.reshape(-1, value.shape[-1]).astype(np.float32)  # (tokens, K)
                    sums[name] = sums.get(name, 0.0) + x.T @ x
                else:
                    x = value.reshape(-1, value.shape[-1]).astype(np.float64)
                    sums[name] = sums.get(name, 0.0) + (x * x).sum(0)
            count += T
            bar.advance()
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
