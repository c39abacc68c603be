"""KV-cache quantization on real weights and real text: perplexity increase over the float cache.

    python -m bench.quality.kv_real_text --model real-models/SmolLM2-135M-Instruct [--docs 6] [--context 1024] [--score 256]

Text: ``tasks.real_model.text`` (Python's reference-manual topics and stdlib sources, offline); scales are
calibrated on its ``calib`` documents, perplexity is read on its ``eval`` documents: tokens
``context .. context + score`` of each, every one of them predicted with at least ``context`` tokens
of cache behind it.

The cache is filled the way decoding fills it, computed in one pass per document (exact, not an
approximation): with static per-channel scales every token's codes depend on that token alone, so
quantizing the prefix at once or token by token stores the same integers. Two read rules:
  * ``engine``: every token reads every slot quantized, its own included (ONNX Runtime's
    GroupQueryAttention appends the new token to the packed cache before it attends);
  * ``reference``: a token reads its own K/V in float and the past quantized
    (``kernels.kv_quant.QuantizedKVCache`` decoding token by token).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

from bench.lib.report import write_report
from kernels.kv_quant import hadamard_matrix
from kernels.kv_spec import PRE_ROPE_SCHEME, KVQuantSpec
from tasks.kv_stats import DEFAULT_CLIP_PERCENTILE, collect_kv_stats, scales_from_stats

# served: the KVQuantSpec defaults, what ONNX Runtime's GroupQueryAttention reads; pre-rope:
# kernels.kv_spec.PRE_ROPE_SCHEME; per-token: K and V scaled online per (token, kv head), QuaRot's
# pairing with a rotation (both on the standard-ops engine).
SCHEMES = {"served": KVQuantSpec(), "pre-rope": PRE_ROPE_SCHEME,
           "per-token": KVQuantSpec(k_granularity="token", v_granularity="token"),
           "per-token-zp": KVQuantSpec(k_granularity="token", v_granularity="token", k_symmetric=False, v_symmetric=False)}


def real_token_rows(tokenizer, split: str, n: int, length: int) -> torch.Tensor:
    """(n, length): the first ``length`` tokens of the first ``n`` documents long enough, prose and
    code alternating."""
    from tasks.real_model.text import real_documents

    docs = real_documents(split)
    prose = [t for name, t in docs if name.startswith("topic:")]
    code = [t for name, t in docs if name.startswith("stdlib:")]
    rows = []
    for text in [t for pair in zip(prose, code) for t in pair] + prose + code:
        ids = tokenizer(text)["input_ids"]
        if len(ids) >= length and len(rows) < n and ids[:length] not in rows:
            rows.append(ids[:length])
    if len(rows) < n:
        raise ValueError(f"only {len(rows)} {split} documents have {length} tokens")
    return torch.tensor(rows)


def quantized_logits(backbone, ids: torch.Tensor, spec, scales: dict | None, read: str = "engine") -> torch.Tensor:
    """Logits (B, T, V) with the K/V of every token stored through ``spec`` (None: float cache) in
    ``kernels.kv_quant.QuantizedKVCache`` (its fp16 sink, pre-RoPE keys, per-token scales and
    ``scales["rotation"]`` included), every layer's whole sequence appended at once."""
    from kernels.kv_quant import QuantizedKVCache

    bb = backbone
    B, T = ids.shape
    d = bb.cfg.head_dim
    g = bb.cfg.num_heads // bb.cfg.num_kv_heads
    pos = torch.arange(T).expand(B, T)
    cache = None if spec is None else QuantizedKVCache(spec, bb.cfg.num_layers, d, bb.inv_freq, **scales)
    x, cos, sin, mask = bb.prepare(ids, pos, torch.ones(B, T, dtype=torch.long), 0)
    for i, block in enumerate(bb.blocks):
        q, k, v = block.project_qkv(x, B, T, cos, sin, {})
        kq, vq = k, v
        if cache is not None:
            cache.append(i, k, v, pos)
            kq, vq = cache.get(i)
        qg = q.reshape(B, q.shape[1] // g, g * T, d)
        scores = qg @ kq.transpose(-1, -2)  # (B, nkv, g T, T)
        if spec is not None and read == "reference":  # own slot in float
            rows = torch.arange(g * T) % T
            own = (qg * k.repeat(1, 1, g, 1)).sum(-1)  # (B, nkv, g T)
            scores[..., torch.arange(g * T), rows] = own
        att = torch.softmax(scores * (1.0 / math.sqrt(d)) + mask, dim=-1)
        y = att @ vq
        if spec is not None and read == "reference":
            rows = torch.arange(g * T) % T
            a_own = att[..., torch.arange(g * T), rows].unsqueeze(-1)  # (B, nkv, g T, 1)
            y = y + a_own * (v - vq).repeat(1, 1, g, 1)
        x = block.finish(x, y, B, T, {})
    return bb.head(x, B, T)


def ppl_kl(logits: torch.Tensor, ref_logp: torch.Tensor | None, ids: torch.Tensor, start: int, end: int):
    """(sum of nll, count, sum of KL to ref, log-probs) over predictions of tokens start+1 .. end."""
    logp = torch.log_softmax(logits[:, start:end - 1].float(), -1)
    nll = -logp.gather(-1, ids[:, start + 1 : end, None]).squeeze(-1)
    kl = 0.0 if ref_logp is None else (ref_logp.exp() * (ref_logp - logp)).sum(-1).sum().item()
    return nll.sum().item(), nll.numel(), kl, logp


def parity_case(model_dir: Path, engine_dir: Path, prompts: int, clip: float, threads: int) -> dict:
    """``tasks.checks.engine_parity.quantized_prefill_parity`` of a compiled quantized-KV engine of the real
    model against its PyTorch module, on ``prompts`` real-text prompts of 16 to ~400 tokens, scales
    calibrated (``tasks.kv_stats.choose_rotation``) on the calib documents."""
    from kernels.kv_spec import KVQuantSpec
    from runtime.engine.backends.onnxruntime import OrtEngine
    from runtime.engine.hashing import backbone_hash
    from runtime.engine.model import load_backbone
    from tasks.checks.engine_parity import quantized_prefill_parity
    from tasks.config import EngineConfig
    from tasks.kv_stats import choose_rotation, kv_scales_from_stats
    from tasks.models import load_tokenizer

    engine = OrtEngine(engine_dir, threads=threads)
    iface = engine.interface
    spec = KVQuantSpec.from_dict(iface.kv_spec)
    backbone = load_backbone(model_dir).eval()
    tok = load_tokenizer(model_dir)
    calib = real_token_rows(tok, "calib", 8, 512)
    batches = [(calib[i : i + 2], torch.ones_like(calib[i : i + 2])) for i in range(0, len(calib), 2)]
    if "kv_rotation.0" in iface.input_names:
        stats, rotation, record = choose_rotation(backbone, batches, spec, clip)
    else:  # an engine of interface version 4 turns nothing
        stats, rotation, record = collect_kv_stats(backbone, batches, False, clip, progress=False), None, {}
    scales = kv_scales_from_stats(stats, spec, record | {"base_model_hash": backbone_hash(model_dir)}, rotation)
    engine.set_adapter(None, kv_scales=scales)  # no adapter: the base model on both sides
    rows = real_token_rows(tok, "eval", prompts, 400)
    lengths = [16 + (384 * j) // max(prompts - 1, 1) for j in range(prompts)]
    texts = [tok.decode(row[:n].tolist()) for row, n in zip(rows, lengths)]
    out = quantized_prefill_parity(engine, backbone, scales, EngineConfig().kv_attention(spec), tok, texts)
    return out | {"rotation": record.get("rotation"), "interface_version": iface.version}


def main(argv: list[str] | None = None) -> int:
    from dataclasses import replace

    from runtime.engine.model import load_backbone
    from tasks.models import load_tokenizer

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--docs", type=int, default=6)
    ap.add_argument("--calib-docs", type=int, default=8)
    ap.add_argument("--calib-len", type=int, default=512)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--score", type=int, default=256)
    ap.add_argument("--clip", type=float, default=DEFAULT_CLIP_PERCENTILE)
    ap.add_argument("--bits", default="8,4,3,2", help="widths: 4 = K4/V4, 4/8 = K4/V8")
    ap.add_argument("--rotations", default="none,hadamard")
    ap.add_argument("--reads", default="engine")
    ap.add_argument("--schemes", default="served", help=f"of {sorted(SCHEMES)}")
    ap.add_argument("--float-cache", type=Path, default=None, help="save/load the float pass here")
    ap.add_argument("--key-positions", type=int, default=0, help="calibrate keys at random positions below this")
    ap.add_argument("--sinks", default="-1", help="first tokens kept in fp16, e.g. 0,1; -1: the scheme's own")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--parity-engine", type=Path, default=None,
                    help="a compiled quantized-KV engine of --model: measure engine parity instead")
    ap.add_argument("--prompts", type=int, default=40)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.parity_engine is not None:
        report = parity_case(args.model, args.parity_engine, args.prompts, args.clip, args.threads)
        print(json.dumps(report, indent=2))
        if args.out:
            write_report(args.out, report)
        return 0
    t0 = time.time()
    backbone = load_backbone(args.model).eval()
    tok = load_tokenizer(args.model)
    T = args.context + args.score
    evals = real_token_rows(tok, "eval", args.docs, T)
    calib = real_token_rows(tok, "calib", args.calib_docs, args.calib_len)
    batches = [(calib[i : i + 2], torch.ones_like(calib[i : i + 2])) for i in range(0, len(calib), 2)]
    rows = []
    with torch.no_grad():
        if args.float_cache and args.float_cache.exists():
            ref = torch.load(args.float_cache)
        else:
            ref = [ppl_kl(quantized_logits(backbone, evals[j : j + 1], None, None), None, evals[j : j + 1],
                          args.context, T) for j in range(len(evals))]
            if args.float_cache:
                torch.save(ref, args.float_cache)
        float_nll = sum(r[0] for r in ref) / sum(r[1] for r in ref)
        print(f"float ppl {math.exp(float_nll):.4f} ({time.time() - t0:.0f}s)", flush=True)
        L, d = backbone.cfg.num_layers, backbone.cfg.head_dim
        for scheme, rot_name in ((s, r) for s in args.schemes.split(",") for r in args.rotations.split(",")):
            base = SCHEMES[scheme]
            if base.pre_rope_keys and rot_name != "none":
                continue
            rotation = None if rot_name == "none" else hadamard_matrix(d).expand(L, d, d)
            stats = collect_kv_stats(backbone, batches, base.pre_rope_keys, args.clip, progress=False, rotation=rotation,
                                     key_positions=args.key_positions or None)
            for bits in args.bits.split(","):  # "4" = K4/V4, "4/8" = K4/V8
                kb, vb = (int(b) for b in (bits.split("/") if "/" in bits else (bits, bits)))
                spec = replace(base, k_bits=kb, v_bits=vb)
                for read, sink in ((r, int(k)) for r in args.reads.split(",") for k in args.sinks.split(",")):
                    spec = replace(spec, sink_tokens=base.sink_tokens if sink < 0 else sink)
                    scales = scales_from_stats(stats, spec) | {"rotation": rotation}
                    nll = kl = n = 0.0
                    for j in range(len(evals)):
                        lg = quantized_logits(backbone, evals[j : j + 1], spec, scales, read)
                        a, c, k, _ = ppl_kl(lg, ref[j][3], evals[j : j + 1], args.context, T)
                        nll, n, kl = nll + a, n + c, kl + k
                    row = {"scheme": scheme, "bits": bits, "rotation": rot_name, "read": read, "sink": spec.sink_tokens, "clip": args.clip,
                           "key_positions": args.key_positions,
                           "ppl_increase_pct": 100 * (math.exp(nll / n - float_nll) - 1), "kl_mean": kl / n}
                    rows.append(row)
                    print(json.dumps(row), f"({time.time() - t0:.0f}s)", flush=True)
    if args.out:
        write_report(args.out, {"float_ppl": math.exp(float_nll), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
