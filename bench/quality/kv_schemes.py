"""KV-cache quantization schemes: quality and memory of each against the float cache (issue 4, items 4 and 5).

    python -m bench.quality.kv_schemes [--quick] [--out bench/results/kv_schemes.json] [--base --adapter --data --engine]

Two cases:
  * ``text``: real text every machine has offline, the Python standard library's own source.
    Files are split *by file* into train / calib / eval; a Qwen2 of the default shape (4 layers,
    hidden 256, 4 heads, 2 KV heads, head_dim 64, 512-token byte-level BPE) is trained on the
    train files for a few hundred steps (cached under ``--cache``), scales are calibrated on the
    calib files and every metric is measured on the eval files. The inspection records of the
    default month are too regular to reveal quantization error; this case is where the
    acceptance thresholds are checked.
  * ``default``: the default month (base + adapter + calib/test split) when ``--base``/``--adapter``
    /``--data`` are given: perplexity on held-out text and task accuracy with greedy decoding
    through the quantized cache.

Perplexity is measured in two passes: the prefix fills the quantized cache, then the suffix is
scored through it (``two_pass_logits``). A single fake-quantized pass would let every query read
its own float keys and hide the error of reading quantized ones back.

The "GQA op" row (what ONNX Runtime's fused GroupQueryAttention implements, the fast engine path)
is measured twice: in the grid through the reference cache like every row, and exactly as the
engine computes it (``GQA_ROW``: ``runtime.engine.kv_model``'s eager GQA module, where the prompt and every
new token also read themselves back quantized), two-pass and decode-like.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import sys
import sysconfig
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

import torch

from bench.lib.charts import save_chart
from bench.lib.report import RESULTS, Figure, write_report
from bench.lib.tables import table
from kernels.kv_spec import PRE_ROPE_SCHEME, KVQuantSpec
from tasks.checks.kv_quality import fill_cache, greedy_through_cache, heldout_sequences, next_token_nll, two_pass_logits
from tasks.kv_stats import DEFAULT_CLIP_PERCENTILE as CLIP

TEXT_MODEL = dict(  # the embedded default's shape (tasks/config.py BaseModelConfig)
    hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=64, intermediate_size=512, rope_theta=10000.0,
)


# ---------------------------------------------------------------- the real-text case

def stdlib_files() -> dict[str, list[Path]]:
    """Top-level ``*.py`` of this interpreter's standard library, split by file name (stable)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    split: dict[str, list[Path]] = {"train": [], "calib": [], "eval": []}
    for path in sorted(root.glob("*.py")):
        bucket = int(hashlib.sha256(path.name.encode()).hexdigest(), 16) % 10
        split["calib" if bucket == 0 else "eval" if bucket in (1, 2) else "train"].append(path)
    return split


def chunk_tokens(tokenizer, files: list[Path], seq_len: int, max_chunks: int | None = None) -> torch.Tensor:
    """Each file tokenized on its own and cut into whole ``seq_len`` windows: (N, seq_len) int64."""
    rows = []
    for path in files:
        ids = tokenizer(path.read_text(errors="replace"), add_special_tokens=False)["input_ids"]
        rows += [ids[i : i + seq_len] for i in range(0, len(ids) - seq_len + 1, seq_len)]
    if max_chunks is not None and len(rows) > max_chunks:
        rows = random.Random(0).sample(rows, max_chunks)
    return torch.tensor(rows, dtype=torch.long)


def train_text_model(out_dir: Path, steps: int = 300, seq_len: int = 256, batch_size: int = 8, lr: float = 2e-3) -> Path:
    """Tokenizer + Qwen2 of the default shape trained briefly on stdlib source; cached by settings."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tasks.artifacts import atomic_output_dir, write_json
    from tasks.stages.base_model import train_tokenizer

    settings = dict(TEXT_MODEL, steps=steps, seq_len=seq_len, batch_size=batch_size, lr=lr, vocab=512, seed=0)
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]
    final = Path(out_dir) / f"stdlib-qwen2-{key}"
    if (final / "card.json").exists():
        return final
    files = stdlib_files()
    with atomic_output_dir(final) as tmp:
        texts = [p.read_text(errors="replace") for p in files["train"]]
        tokenizer = train_tokenizer(texts, 512, tmp)
        data = chunk_tokens(tokenizer, files["train"], seq_len)  # (N, seq_len)
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(Qwen2Config(
            vocab_size=len(tokenizer), max_position_embeddings=2 * seq_len, tie_word_embeddings=True,
            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **TEXT_MODEL,
        ))
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
        warm = max(1, steps // 10)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: min(1.0, (s + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / steps))))
        )
        gen = torch.Generator().manual_seed(0)
        model.train()
        from tqdm import tqdm

        losses = []
        for step in (bar := tqdm(range(steps), desc="train stdlib model", unit="step", dynamic_ncols=True)):
            batch = data[torch.randint(len(data), (batch_size,), generator=gen)]
            loss = model(input_ids=batch, labels=batch).loss
            if not torch.isfinite(loss):
                raise RuntimeError(f"text model diverged at step {step}")
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step(), sched.step(), opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
            bar.set_postfix(loss=f"{losses[-1]:.3f}", refresh=False)
        model.save_pretrained(tmp)
        write_json(tmp / "card.json", {"settings": settings, "final_loss": sum(losses[-20:]) / 20,
                                       "train_files": len(files["train"]), "train_chunks": len(data)})
    return final


# ---------------------------------------------------------------- the grid

def grid() -> dict[str, KVQuantSpec | None]:
    """Configurations of the report; None is the float (fp32) cache every metric is compared with."""
    S = KVQuantSpec
    chosen = PRE_ROPE_SCHEME  # K4 per-channel asymmetric pre-RoPE, V4 per-token symmetric, fp16 sink of 1
    return {
        "float": None,
        # At 8 bits a per-token key scale has resolution to spare and never clips text the
        # calibration did not see (default month: +0.05% vs +0.24% with static per-channel keys).
        "int8": replace(chosen, k_bits=8, v_bits=8, k_granularity="token"),
        "K4/V4 chosen": chosen,
        "K4/V4 per-token keys (naive)": S(k_granularity="token", v_granularity="token"),
        "K4/V4 per-channel K post-RoPE": replace(chosen, pre_rope_keys=False),
        "K4/V4 static per-channel K+V sym (GQA op)": S(),  # the defaults: the scheme the release ships
        "K4/V4 chosen + window 32": replace(chosen, window_tokens=32),
        "K4 alone (V8)": replace(chosen, v_bits=8),
        "V4 alone (K8)": replace(chosen, k_bits=8),
        "K3/V5": replace(chosen, k_bits=3, v_bits=5),
        "K2/V2 asym sink 1 + window 32": replace(chosen, k_bits=2, v_bits=2, v_symmetric=False, window_tokens=32),
        "K2/V2 sym per-token": S(k_bits=2, v_bits=2, k_granularity="token", v_granularity="token"),
    }


GQA_ROW = "K4/V4 static per-channel K+V sym (GQA op)"


# ---------------------------------------------------------------- two-pass measurement

def gqa_engine_exact(backbone, ids: torch.Tensor, prefix_len: int, scales: dict, float_row: dict, chunk: int) -> dict:
    """Perplexity of ``GQA_ROW`` computed as the GQA engine computes it: prefix, then the suffix in
    one pass and in ``chunk``-token steps, through ``QuantizedKVBackbone(..., "gqa")``; deltas vs the float row."""
    from runtime.engine.kv_model import QuantizedKVBackbone

    module = QuantizedKVBackbone(backbone, grid()[GQA_ROW], "gqa")
    eye = torch.eye(backbone.cfg.head_dim)  # no rotation
    static = [t for i in range(backbone.cfg.num_layers) for t in (scales["k_scale"][i], scales["v_scale"][i], eye)]
    T = ids.shape[1]
    targets = ids[:, prefix_len + 1 :]
    row = {}
    for key, step, ref in (("", T, float_row["perplexity"]), ("_decode_like", chunk, float_row["perplexity_decode_like"])):
        bounds = [(0, prefix_len)] + [(a, min(T, a + step)) for a in range(prefix_len, T, step)]
        with torch.no_grad():
            logits, _ = module.run_gqa_chunks(ids, bounds, static)
        nll, _ = next_token_nll(torch.cat(logits[1:], 1), targets)
        ppl = math.exp(nll.mean().item())
        row[f"perplexity{key}"], row[f"ppl_increase_pct{key}"] = ppl, 100.0 * (ppl / ref - 1.0)
    return row





def chunked_logits(backbone, ids: torch.Tensor, prefix_len: int, spec, scales: dict | None, chunk: int,
                   prefix_present=None) -> torch.Tensor:
    """Decode-like variant: the suffix is scored ``chunk`` tokens at a time and each chunk's K/V
    join the quantized cache before the next, so suffix tokens also read each other quantized
    (in ``two_pass_logits`` they read each other in float). Returns (B, T - prefix_len, V)."""
    B, T = ids.shape
    pos = torch.arange(T).expand(B, T)
    out = []
    with torch.no_grad():
        if prefix_present is None:
            _, prefix_present = backbone(ids[:, :prefix_len], pos[:, :prefix_len], torch.ones(B, prefix_len, dtype=torch.long),
                                         backbone.empty_past(B))
        cache = fill_cache(backbone, prefix_present, pos[:, :prefix_len], spec, scales)
        past = prefix_present
        for start in range(prefix_len, T, chunk):
            end = min(T, start + chunk)
            logits, present = backbone(ids[:, start:end], pos[:, start:end], torch.ones(B, end, dtype=torch.long),
                                       past if cache is None else cache.past())
            out.append(logits)
            if cache is None:
                past = present
            else:
                for i in range(backbone.cfg.num_layers):
                    cache.append(i, present[2 * i][:, :, start:], present[2 * i + 1][:, :, start:], pos[:, start:end])
    return torch.cat(out, 1)


def attention_outputs(backbone, ids: torch.Tensor, prefix_len: int, past: tuple) -> list[torch.Tensor]:
    """Per layer, the attention output of the float run's suffix queries over ``past`` + the float
    suffix K/V: isolates each layer's cache error from the error carried in by earlier layers.

    Reads Block weights by their runtime/engine/model.py names (ln1, qkv_w, qkv_b); see the report.
    """
    from kernels.rope import apply_rope
    from runtime.engine.model import rms_norm

    cfg = backbone.cfg
    B, T = ids.shape
    Ts = T - prefix_len
    nh, nkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    captured = {}
    hooks = [blk.register_forward_pre_hook(lambda m, a, i=i: captured.__setitem__(i, a)) for i, blk in enumerate(backbone.blocks)]
    pos = torch.arange(T).expand(B, T)
    try:
        with torch.no_grad():
            _, present = backbone(ids[:, prefix_len:], pos[:, prefix_len:], torch.ones(B, T, dtype=torch.long),
                                  tuple(p.float() for p in past))
    finally:
        for h in hooks:
            h.remove()
    allowed = torch.arange(T)[None, :] <= (torch.arange(Ts) + prefix_len)[:, None]  # (Ts, S)
    outs = []
    with torch.no_grad():
        for i, blk in enumerate(backbone.blocks):
            x, _, _, cos, sin = captured[i][:5]
            h = rms_norm(x, blk.ln1, cfg.rms_norm_eps)
            qkv = h @ blk.qkv_w.t() + (blk.qkv_b if blk.qkv_b is not None else 0)
            q = qkv[:, : nh * d].view(B, Ts, nh, d).transpose(1, 2)  # (B, nh, Ts, d)
            q = apply_rope(q, cos, sin)
            k, v = present[2 * i], present[2 * i + 1]  # (B, nkv, S, d): past + this run's suffix
            k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
            outs.append(torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed))
    return outs


def measure(backbone, ids: torch.Tensor, prefix_len: int, configs: dict, scales_for, context_len: int,
            chunk: int = 0) -> dict:
    """Every metric of the report for each config on token windows ``ids`` (N, T); ``chunk`` > 0 adds
    the decode-like perplexity (suffix appended to the cache every ``chunk`` tokens)."""
    from kernels.kv_spec import bytes_per_token

    cfg = backbone.cfg
    B, T = ids.shape
    pos = torch.arange(T).expand(B, T)
    with torch.no_grad():
        _, prefix_present = backbone(ids[:, :prefix_len], pos[:, :prefix_len], torch.ones(B, prefix_len, dtype=torch.long),
                                     backbone.empty_past(B))
    targets = ids[:, prefix_len + 1 :]  # the suffix tokens the suffix logits predict
    results, ref = {}, None
    fp16 = bytes_per_token(None, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, context_len)
    for name, spec in configs.items():
        t0 = time.perf_counter()
        logits, cache, past = two_pass_logits(backbone, ids, prefix_len, spec, scales_for(spec), prefix_present)
        nll, logp = next_token_nll(logits, targets)  # (B, Ts - 1), (B, Ts - 1, V)
        att = attention_outputs(backbone, ids, prefix_len, past)
        row = {"spec": None if spec is None else spec.to_dict(), "nll": nll.mean().item(),
               "perplexity": math.exp(nll.mean().item()), "scored_tokens": nll.numel()}
        if chunk:
            chunked, _ = next_token_nll(chunked_logits(backbone, ids, prefix_len, spec, scales_for(spec), chunk,
                                                       prefix_present), targets)
            row["perplexity_decode_like"] = math.exp(chunked.mean().item())
        if ref is None:
            if spec is not None:
                raise ValueError("the first config must be the float cache")
            ref = {"logp": logp, "top1": logp.argmax(-1), "att": att, "ppl": row["perplexity"], "nll": nll}
        row["ppl_increase_pct"] = 100.0 * (row["perplexity"] / ref["ppl"] - 1.0)
        if chunk:
            ref.setdefault("ppl_chunked", row["perplexity_decode_like"])
            row["ppl_increase_pct_decode_like"] = 100.0 * (row["perplexity_decode_like"] / ref["ppl_chunked"] - 1.0)
        row["top1_agreement"] = (logp.argmax(-1) == ref["top1"]).float().mean().item()
        # How concentrated the damage is: the share of the summed NLL increase that the worst 1% of
        # tokens carry. Near 1 means a few confidently-wrong tokens move the perplexity.
        delta = (nll - ref["nll"]).flatten()
        worst = delta.topk(max(1, delta.numel() // 100)).values.sum()
        row["nll_increase_share_of_worst_1pct"] = (worst / delta.sum()).item() if delta.sum() > 0 else None
        row["kl_vs_float"] = (ref["logp"].exp() * (ref["logp"] - logp)).sum(-1).mean().item()
        row["attn_rel_error"] = [((a - r).norm() / r.norm()).item() for a, r in zip(att, ref["att"])]
        bpt = fp16 if spec is None else bytes_per_token(spec, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, context_len)
        row["bytes_per_token"] = bpt
        row["compression_vs_fp16"] = fp16 / bpt
        if cache is not None:  # the formula, checked against what the reference cache really stores
            static = _static_bytes(cache)  # shared by the B sequences of the batch
            row["stored_bytes_per_token_at_prefix"] = ((cache.stored_bytes() - static) / B + static) / prefix_len
            row["formula_bytes_per_token_at_prefix"] = bytes_per_token(
                spec, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, prefix_len)
        row["seconds"] = time.perf_counter() - t0
        results[name] = row
    return results


def _static_bytes(cache) -> int:
    """Per-channel scale bytes of a cache: shared by every sequence of a batch, not per sequence."""
    from kernels.kv_spec import CHANNEL_SCALE_BYTES

    total = 0
    for kind, gran, sym in (("k", cache.spec.k_granularity, cache.spec.k_symmetric),
                            ("v", cache.spec.v_granularity, cache.spec.v_symmetric)):
        scale, _ = cache.static[kind]
        if gran == "channel":
            total += scale.numel() * CHANNEL_SCALE_BYTES * (1 if sym else 2)
    return total


# ---------------------------------------------------------------- outliers (item 5)

def inject_key_outliers(backbone, factor: float = 20.0, pairs: tuple[int, ...] = (3, 17), kv_head: int = 0):
    """A copy of ``backbone`` whose keys have ``2 * len(pairs)`` channels scaled by ``factor`` in
    every layer (kv head ``kv_head``), with the matching query channels divided by ``factor``.

    RoPE rotates channel c with c + d/2, so both of a pair are scaled: q.k, and so the float
    model's output, is unchanged; only a quantizer sees the outliers.
    """
    import copy

    cfg = backbone.cfg
    nh, nkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    g = nh // nkv
    channels = [c for p in pairs for c in (p, p + d // 2)]
    out = copy.deepcopy(backbone)
    with torch.no_grad():
        for blk in out.blocks:
            k_rows = [nh * d + kv_head * d + c for c in channels]
            q_rows = [h * d + c for h in range(kv_head * g, (kv_head + 1) * g) for c in channels]
            for rows, f in ((k_rows, factor), (q_rows, 1.0 / factor)):
                blk.qkv_w[rows] *= f
                if blk.qkv_b is not None:
                    blk.qkv_b[rows] *= f
    return out



# ---------------------------------------------------------------- report

OUTLIER_CONFIGS = ("float", "K4/V4 chosen", "K4/V4 per-token keys (naive)", "K4/V4 per-channel K post-RoPE", GQA_ROW)
TASK_CONFIGS = ("float", "int8", "K4/V4 chosen", "K4/V4 per-token keys (naive)", "K3/V5", "K2/V2 asym sink 1 + window 32",
                "K2/V2 sym per-token")


def _batches(ids: torch.Tensor, size: int = 16) -> list:
    return [(ids[i : i + size], torch.ones_like(ids[i : i + size])) for i in range(0, len(ids), size)]


def _scales_for(stats_by_rope: dict):
    from tasks.kv_stats import scales_from_stats

    return lambda spec: None if spec is None else scales_from_stats(stats_by_rope[spec.pre_rope_keys], spec)


def text_case(cache_dir: Path, quick: bool, steps: int, context_len: int) -> dict:
    from runtime.engine.model import load_backbone
    from tasks.kv_stats import collect_kv_stats, key_outlier_ratio
    from tasks.models import load_tokenizer

    seq = 64 if quick else 256
    model_dir = train_text_model(cache_dir, steps=steps, seq_len=seq, lr=3e-3)
    tokenizer, backbone = load_tokenizer(model_dir), load_backbone(model_dir)
    files = stdlib_files()
    calib = chunk_tokens(tokenizer, files["calib"], seq, 8 if quick else 64)  # (N, seq)
    evals = chunk_tokens(tokenizer, files["eval"], seq, 8 if quick else 96)
    prefix = seq // 2
    out = {"model_dir": str(model_dir), "model_card": json.loads((model_dir / "card.json").read_text()),
           "calib_files": len(files["calib"]), "eval_files": len(files["eval"]),
           "calib_tokens": calib.numel(), "eval_windows": len(evals), "window_len": seq, "prefix_len": prefix}
    stats = {pre: collect_kv_stats(backbone, _batches(calib), pre, CLIP, progress=False) for pre in (True, False)}
    out["key_outlier_ratio"] = {"pre_rope": key_outlier_ratio(stats[True]["k_channel_amax"]),
                                "post_rope": key_outlier_ratio(stats[False]["k_channel_amax"])}
    out["results"] = measure(backbone, evals, prefix, grid(), _scales_for(stats), context_len, chunk=16)
    out["gqa_engine_exact"] = gqa_engine_exact(backbone, evals, prefix, _scales_for(stats)(grid()[GQA_ROW]),
                                               out["results"]["float"], chunk=16)

    # Item 5: 4 key channels x20 per layer (function unchanged), recalibrated, same evaluation.
    spiked = inject_key_outliers(backbone)
    stats = {pre: collect_kv_stats(spiked, _batches(calib), pre, CLIP, progress=False) for pre in (True, False)}
    configs = {k: v for k, v in grid().items() if k in OUTLIER_CONFIGS}
    out["outlier_case"] = {
        "injection": "key channels 3, 35, 17, 49 of kv head 0 x20 in every layer, matching query channels /20",
        "key_outlier_ratio": {"pre_rope": key_outlier_ratio(stats[True]["k_channel_amax"])},
        "results": measure(spiked, evals, prefix, configs, _scales_for(stats), context_len, chunk=16),
    }
    return out


def default_case(base: Path, adapter: Path, data: Path, out_dir: Path, quick: bool, context_len: int,
                 engine: Path | None = None) -> dict:
    """The default month: calibration through the real stage, perplexity and task accuracy through the cache."""
    from tasks.kv_stats import (
        cache_kwargs,
        collect_kv_stats,
        jsonl_batches,
        load_release_backbone,
        read_release_kv_scales,
    )
    from tasks.models import load_tokenizer
    from tasks.records import read_jsonl
    from tasks.scoring import accuracy_report
    from tasks.stages.calibrate import calibrate_kv_scales

    # An adapter fine-tuned against the compiled engine records its interface: check it against that engine.
    backbone, base_hash, _ = load_release_backbone(base, adapter, engine)
    tokenizer = load_tokenizer(base)
    configs = grid()
    # The stage itself, and its loader, for the chosen configuration.
    stage_dir = calibrate_kv_scales(base, adapter, data / "calib.jsonl", out_dir / "default_kv", configs["K4/V4 chosen"],
                                    engine_dir=engine).parent
    chosen = read_release_kv_scales(base, adapter, stage_dir, spec=configs["K4/V4 chosen"].to_dict())
    batches, rows = jsonl_batches(tokenizer, data / "calib.jsonl", 16, 96)
    stats = {pre: collect_kv_stats(backbone, batches, pre, CLIP, progress=False) for pre in (True, False)}
    scales_for = _scales_for(stats)
    # Whole documents, as the evaluate stage scores them: windows of joined documents would reach
    # positions the tiny base never saw, where its float perplexity is already ~100 and deltas mean nothing.
    # The documents of the most common length make one batch; each is scored with its first half cached.
    documents = heldout_sequences(tokenizer, (data / "heldout.txt").read_text().splitlines())
    seq = Counter(len(d) for d in documents).most_common(1)[0][0]
    evals = torch.tensor([d for d in documents if len(d) == seq][: 8 if quick else 64])
    out = {"calib_rows": rows, "calib_tokens": stats[True]["tokens"], "heldout_windows": len(evals),
           "window_len": seq, "prefix_len": seq // 2, "stage_record": chosen.record,
           "heldout_note": "held-out documents of the most common token length, first half cached"}
    out["results"] = measure(backbone, evals, seq // 2, configs, scales_for, context_len, chunk=16)
    out["gqa_engine_exact"] = gqa_engine_exact(backbone, evals, seq // 2, scales_for(configs[GQA_ROW]),
                                               out["results"]["float"], chunk=16)
    test = read_jsonl(data / "test.jsonl")[: 64 if quick else None]
    for name in TASK_CONFIGS:
        spec = configs[name]
        scales = cache_kwargs(chosen) if name == "K4/V4 chosen" else scales_for(spec)
        preds = greedy_through_cache(backbone, tokenizer, [ex.prompt for ex in test], spec, scales)
        rep = accuracy_report(test, preds)
        out["results"][name]["task_accuracy"] = rep["accuracy"]
        out["results"][name]["task_accuracy_new_rules"] = rep["accuracy_new"]
    out["test_rows"] = len(test)
    return out


def acceptance(report: dict) -> dict:
    r = report["text"]["results"]
    o = report["text"]["outlier_case"]["results"]
    chosen, naive = o["K4/V4 chosen"]["ppl_increase_pct"], o["K4/V4 per-token keys (naive)"]["ppl_increase_pct"]
    checks = {
        "k4v4_ppl_increase_le_0.5pct": r["K4/V4 chosen"]["ppl_increase_pct"] <= 0.5,
        "k4v4_compression_ge_3.5x_at_context": r["K4/V4 chosen"]["compression_vs_fp16"] >= 3.5,
        "int8_ppl_increase_le_0.1pct": r["int8"]["ppl_increase_pct"] <= 0.1,
        "outlier_per_channel_le_half_of_per_token": chosen <= 0.5 * naive,
        # The fast path (ORT's GroupQueryAttention), as the engine computes it, two-pass and decode-like.
        "gqa_engine_ppl_increase_le_0.5pct": max(report["text"]["gqa_engine_exact"]["ppl_increase_pct"],
                                                 report["text"]["gqa_engine_exact"]["ppl_increase_pct_decode_like"]) <= 0.5,
        "gqa_outlier_le_half_of_per_token": o[GQA_ROW]["ppl_increase_pct"] <= 0.5 * naive,
    }
    if "default_month" in report:  # the same thresholds on the default month, reported as they fall
        d = report["default_month"]["results"]
        checks["default_month_k4v4_ppl_increase_le_0.5pct"] = d["K4/V4 chosen"]["ppl_increase_pct"] <= 0.5
        checks["default_month_k4v4_window32_ppl_increase_le_0.5pct"] = d["K4/V4 chosen + window 32"]["ppl_increase_pct"] <= 0.5
        checks["default_month_int8_ppl_increase_le_0.1pct"] = d["int8"]["ppl_increase_pct"] <= 0.1
        g = report["default_month"]["gqa_engine_exact"]
        checks["default_month_gqa_engine_ppl_increase_le_0.5pct"] = max(
            g["ppl_increase_pct"], g["ppl_increase_pct_decode_like"]) <= 0.5
    return checks


def render_table(results: dict, context_len: int, with_task: bool = False) -> str:
    header = ["config", "ppl", "Δppl %", "Δppl % decode-like", "top-1 agree", "KL", "attn rel err (per layer)",
              f"B/token @{context_len}", "x vs fp16"] + (["task acc"] if with_task else [])
    rows = []
    for name, r in results.items():
        dl, acc = r.get("ppl_increase_pct_decode_like"), r.get("task_accuracy")
        rows.append([name, f"{r['perplexity']:.3f}", f"{r['ppl_increase_pct']:+.3f}", "" if dl is None else f"{dl:+.3f}",
                     f"{r['top1_agreement']:.4f}", f"{r['kl_vs_float']:.5f}", " ".join(f"{a:.3f}" for a in r["attn_rel_error"]),
                     f"{r['bytes_per_token']:.1f}", f"{r['compression_vs_fp16']:.2f}"]
                    + (["" if acc is None else f"{acc:.3f}"] if with_task else []))
    return table(header, rows, align="<>>>>><>>" + (">" if with_task else ""), markdown=True)


def gqa_line(case: dict) -> str:
    g = case["gqa_engine_exact"]
    return (f"{GQA_ROW}, exactly as the GQA engine computes it (every token also reads itself quantized): "
            f"Δppl {g['ppl_increase_pct']:+.3f}% two-pass, {g['ppl_increase_pct_decode_like']:+.3f}% decode-like")


def plot(report: dict, path: Path) -> None:
    res = report["text"]["results"]

    def draw(axes):
        import matplotlib.pyplot as plt

        memory, layers = axes
        colors = {name: plt.cm.tab20(i % 20) for i, name in enumerate(res)}
        for name, r in res.items():
            y = max(r["ppl_increase_pct"], 1e-3)
            memory.scatter(r["bytes_per_token"], y, s=25, color=colors[name])
            memory.annotate(name, (r["bytes_per_token"], y), fontsize=6)
        memory.set_xscale("log"), memory.set_yscale("log")
        memory.set_xlabel(f"KV bytes per token at {report['context_len']} tokens (scales, sink, window included)")
        memory.set_ylabel("Δppl % vs float cache (two-pass; ≤0 at 1e-3)")
        memory.set_title("stdlib text: quality vs memory")
        memory.grid(alpha=0.3)
        for name, r in res.items():
            if name != "float":
                layers.plot(range(len(r["attn_rel_error"])), r["attn_rel_error"], marker="o", label=name, linewidth=1,
                            color=colors[name])
        layers.set_yscale("log")
        layers.set_xlabel("layer")
        layers.set_ylabel("attention-output relative error")
        layers.set_title("per-layer attention error (float queries)")
        layers.legend(fontsize=6)
        layers.grid(alpha=0.3)

    save_chart(path, draw, ncols=2, figsize=(12, 4.5))


def figures(p: dict) -> list[Figure]:
    """Δ perplexity of int8 and the chosen 4-bit scheme, KV bytes per token, the default month's figures where it
    ran, and how many acceptance checks pass."""
    rows = []
    text = p["text"]["results"]
    ctx = p["context_len"]
    model = f"stdlib-text model ({'quick' if p.get('quick') else 'full'})"
    for name in ("int8", "K4/V4 chosen"):
        if name in text:
            r = text[name]
            rows.append(Figure(f"{model}: {name} Δ perplexity vs float cache", r["ppl_increase_pct"],
                               f"{r['ppl_increase_pct']:+.3f} %"))
    for name in ("float", "K4/V4 chosen"):
        if name in text:
            r = text[name]
            rows.append(Figure(f"KV bytes per token at {ctx} tokens, {name} (vs fp16)", r["bytes_per_token"],
                               f"{r['bytes_per_token']:,.1f} B ({r['compression_vs_fp16']:.2f}x)"))
    if "default_month" in p:
        d = p["default_month"]["results"]
        chosen, flt = d["K4/V4 chosen"], d["float"]
        rows.append(Figure("default month (flow's 2026-11 adapter): K4/V4 chosen Δ perplexity vs float cache",
                           chosen["ppl_increase_pct"], f"{chosen['ppl_increase_pct']:+.3f} %"))
        if "task_accuracy" in chosen:
            rows.append(Figure("default month: task accuracy, float cache → K4/V4 chosen cache", chosen["task_accuracy"],
                               f"{flt['task_accuracy']:.3f} → {chosen['task_accuracy']:.3f} "
                               f"({p['default_month']['test_rows']} rows)"))
    acc = p.get("acceptance", {})
    failing = [k for k, v in acc.items() if not v]
    rows.append(Figure("acceptance checks of bench/quality/kv_schemes.py passing", len(acc) - len(failing),
                       f"{len(acc) - len(failing)} of {len(acc)}" + (f" (failing: {', '.join(failing)})" if failing else "")))
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="KV-cache quantization schemes: quality and memory against the float cache.")
    p.add_argument("--out", default=RESULTS / "kv_schemes.json")
    p.add_argument("--cache", default=RESULTS / "kv_models", help="where the trained stdlib model is cached")
    p.add_argument("--quick", action="store_true", help="seconds, not minutes: tiny training and few windows (tests)")
    p.add_argument("--steps", type=int, default=None, help="training steps of the stdlib model (default 600, quick 20)")
    p.add_argument("--context-len", type=int, default=2048, help="context at which KV bytes per token are stated")
    p.add_argument("--base", help="default-month base model dir (with --adapter and --data)")
    p.add_argument("--adapter", help="default-month adapter dir")
    p.add_argument("--data", help="default-month data dir (calib.jsonl, test.jsonl, heldout.txt)")
    p.add_argument("--engine", help="the engine dir the adapter was fine-tuned against (its provenance names it)")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)  # the default month's scales are calibrated beside it
    steps = args.steps or (20 if args.quick else 600)
    t0 = time.perf_counter()
    report = {"context_len": args.context_len, "quick": args.quick, "threads": args.threads,
              "text": text_case(Path(args.cache), args.quick, steps, args.context_len)}
    if args.base and args.adapter and args.data:
        report["default_month"] = default_case(Path(args.base), Path(args.adapter), Path(args.data), out.parent,
                                               args.quick, args.context_len,
                                               engine=Path(args.engine) if args.engine else None)
    report["acceptance"] = acceptance(report)
    report["seconds"] = time.perf_counter() - t0
    tables = [f"## stdlib text ({report['text']['eval_windows']} windows of {report['text']['window_len']} tokens, "
              f"prefix {report['text']['prefix_len']} in the cache, suffix scored through it)",
              render_table(report["text"]["results"], args.context_len), gqa_line(report["text"]),
              "## injected key outliers (4 channels x20, float function unchanged)",
              render_table(report["text"]["outlier_case"]["results"], args.context_len)]
    if "default_month" in report:
        tables += ["## default month (held-out perplexity; task accuracy by greedy decoding through the cache)",
                   render_table(report["default_month"]["results"], args.context_len, with_task=True),
                   gqa_line(report["default_month"])]
    tables.append("acceptance: " + json.dumps(report["acceptance"]))
    text = "\n\n".join(tables)
    print(text)
    write_report(out, report)
    out.with_suffix(".md").write_text(text + "\n")
    plot(report, out.with_suffix(".png"))
    print(f"wrote {out.with_suffix('.md')}; {report['seconds']:.0f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
