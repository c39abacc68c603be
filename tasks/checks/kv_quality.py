"""KV-cache quantization quality of one release: what the quantized cache costs in accuracy and perplexity.

The evaluate stage measures it with the release's own calibrated scales (``kv/kv_scales.safetensors``),
through the reference cache of ``kernels.kv_quant`` that the quantized engine matches to the integer.
Keys and values are scored two-pass (``two_pass_logits``): the prefix's K/V are quantized into the
cache, then the suffix reads them, as a decode step does; a single fake-quantized pass would let
every query read its own float key. Task accuracy decodes greedily with every token's K/V stored
quantized (``greedy_through_cache``). The same functions drive ``bench/quality/kv_schemes.py``.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import torch

from runtime.engine.tokenizer import ChatPrompt, encode_prompt, until_stop


def fill_cache(backbone, present: tuple, positions: torch.Tensor, spec, scales: dict | None):
    """A QuantizedKVCache holding ``present`` (the float K/V of a prefix); None spec = float cache."""
    from kernels.kv_quant import QuantizedKVCache

    if spec is None:
        return None
    cache = QuantizedKVCache(spec, backbone.cfg.num_layers, backbone.cfg.head_dim, backbone.inv_freq, **(scales or {}))
    for i in range(backbone.cfg.num_layers):
        cache.append(i, present[2 * i], present[2 * i + 1], positions)
    return cache


def two_pass_logits(backbone, ids: torch.Tensor, prefix_len: int, spec, scales: dict | None, prefix_present=None):
    """Fill the (quantized) cache with ``ids[:, :prefix_len]``, then run the suffix through it.

    Returns (logits (B, T - prefix_len, V) of the suffix, cache, past fed to the suffix pass).
    """
    B, T = ids.shape
    pos = torch.arange(T).expand(B, T)
    mask = torch.ones(B, T, dtype=torch.long)
    with torch.no_grad():
        if prefix_present is None:
            _, prefix_present = backbone(ids[:, :prefix_len], pos[:, :prefix_len], mask[:, :prefix_len], backbone.empty_past(B))
        cache = fill_cache(backbone, prefix_present, pos[:, :prefix_len], spec, scales)
        past = prefix_present if cache is None else cache.past()
        logits, _ = backbone(ids[:, prefix_len:], pos[:, prefix_len:], mask, past)
    return logits, cache, past


def greedy_through_cache(backbone, tokenizer, prompts: list[str | ChatPrompt], spec, scales: dict | None, max_new_tokens: int = 8) -> list[str]:
    """Greedy decoding where every token's K/V goes through the quantized cache (prefill + decode).

    Prompts are grouped by token length so no batch needs padding (the sink is then always a real token).
    """
    from kernels.kv_quant import QuantizedKVCache

    encoded = [encode_prompt(tokenizer, p) for p in prompts]  # the ids training and the device see
    by_len: dict[int, list[int]] = {}
    for i, ids in enumerate(encoded):
        by_len.setdefault(len(ids), []).append(i)
    out = [""] * len(prompts)
    L = backbone.cfg.num_layers
    with torch.no_grad():
        for _, rows in sorted(by_len.items()):  # rows of one prompt length decode as one batch
            ids = torch.tensor([encoded[i] for i in rows])  # (B, T)
            B = len(rows)
            cache = None if spec is None else QuantizedKVCache(spec, L, backbone.cfg.head_dim, backbone.inv_freq, **(scales or {}))
            past = backbone.empty_past(B)
            step_ids, start, generated = ids, 0, []
            for _ in range(max_new_tokens):
                n = step_ids.shape[1]
                pos = torch.arange(start, start + n).expand(B, n)
                logits, present = backbone(step_ids, pos, torch.ones(B, start + n, dtype=torch.long), past)
                if cache is None:
                    past = present
                else:
                    for i in range(L):
                        cache.append(i, present[2 * i][:, :, -n:], present[2 * i + 1][:, :, -n:], pos)
                    past = cache.past()
                step_ids = logits[:, -1].argmax(-1, keepdim=True)  # (B, 1)
                generated.append(step_ids)
                start += n
            gen = torch.cat(generated, 1).tolist()
            for r, toks in zip(rows, gen):
                out[r] = tokenizer.decode(until_stop(toks, tokenizer.stop_ids), skip_special_tokens=True)
    return out


def heldout_sequences(tokenizer, lines: list[str]) -> list[list[int]]:
    """Each held-out document tokenized on its own, with the special tokens evaluation uses.

    Documents, not a concatenated stream: the models here learn documents of ~50 tokens, and a
    stream would score positions they never saw, where any cache looks equally bad.
    """
    return [ids for ids in (tokenizer(line)["input_ids"] for line in lines) if len(ids) >= 4]


def next_token_nll(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(negative log-likelihood (B, n - 1), log-probabilities (B, n - 1, V)) of logits (B, n, V) whose
    position t predicts ``targets[:, t]`` (B, n - 1); the last position predicts past the window."""
    logp = torch.log_softmax(logits[:, :-1].float(), -1)
    return -logp.gather(-1, targets[..., None]).squeeze(-1), logp


def suffix_perplexity(backbone, sequences: list[list[int]], spec, scales: dict | None, batch_size: int = 64) -> float:
    """Perplexity of the second half of each document, read through a cache holding its first half.

    Documents are batched by length so no row needs padding.
    """
    by_len: dict[int, list[list[int]]] = {}
    for ids in sequences:
        by_len.setdefault(len(ids), []).append(ids)
    nll, count = 0.0, 0
    for T, rows in sorted(by_len.items()):
        prefix = T // 2
        for start in range(0, len(rows), batch_size):
            batch = torch.tensor(rows[start : start + batch_size])  # (B, T)
            logits, _, _ = two_pass_logits(backbone, batch, prefix, spec, scales)
            token_nll, _ = next_token_nll(logits, batch[:, prefix + 1 :])  # tokens prefix+1 .. T-1
            nll += token_nll.sum().item()
            count += token_nll.numel()
    return math.exp(nll / count)


def grid_specs(release_spec) -> dict:
    """The release's spec and its neighbours at other widths, for the quality-vs-bits plot."""
    return {
        f"K{b}/V{b}": replace(release_spec, k_bits=b, v_bits=b) for b in (8, 3, 2)
    } | {"release": release_spec}


def release_kv_quality(
    base_dir: Path,
    adapter_dir: Path,
    kv_dir: Path,
    calib_jsonl: Path,
    test,
    heldout_lines: list[str],
    max_new_tokens: int,
    backbone,
) -> dict:
    """Accuracy and perplexity of base + adapter with the float cache and with this release's
    quantized cache; plus the perplexity of the same spec at other widths (scales from the same
    calibration statistics) for the plot. ``test`` is a list of ``tasks.records.Example``; ``backbone``
    is the release's adapter-merged backbone (``tasks.kv_stats.load_release_backbone``)."""
    from kernels.kv_spec import KVQuantSpec, bytes_per_token
    from tasks.kv_stats import cache_kwargs, collect_kv_stats, jsonl_batches, read_release_kv_scales, scales_from_stats
    from tasks.models import load_tokenizer
    from tasks.scoring import accuracy_report

    tokenizer = load_tokenizer(Path(base_dir))
    release = read_release_kv_scales(base_dir, adapter_dir, kv_dir)
    spec, scales = KVQuantSpec.from_dict(release.spec), cache_kwargs(release)
    prompts = [ex.prompt for ex in test]
    float_acc = accuracy_report(test, greedy_through_cache(backbone, tokenizer, prompts, None, None, max_new_tokens))
    quant_acc = accuracy_report(test, greedy_through_cache(backbone, tokenizer, prompts, spec, scales, max_new_tokens))
    documents = heldout_sequences(tokenizer, heldout_lines)
    ppl_float = suffix_perplexity(backbone, documents, None, None)
    ppl_quant = suffix_perplexity(backbone, documents, spec, scales)
    context_len = max(len(d) for d in documents)

    record = release.record
    batches, _ = jsonl_batches(tokenizer, Path(calib_jsonl), 16, record.get("max_seq_len", 96))
    stats = collect_kv_stats(backbone, batches, spec.pre_rope_keys, record.get("clip_percentile", 100.0), progress=False,
                             rotation=scales.get("rotation"),  # the other widths turn K/V as the release does
                             key_positions=record.get("key_positions") or None)
    cfg = backbone.cfg
    fp16 = bytes_per_token(None, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, context_len)
    grid = []
    for name, s in grid_specs(spec).items():
        grid_scales = scales_from_stats(stats, s) | ({"rotation": scales["rotation"]} if "rotation" in scales else {})
        ppl = ppl_quant if name == "release" else suffix_perplexity(backbone, documents, s, grid_scales)
        bpt = bytes_per_token(s, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, context_len)
        grid.append({"config": f"{name} ({s.name})", "bits": (s.k_bits + s.v_bits) / 2, "bytes_per_token": bpt,
                     "compression_vs_fp16": fp16 / bpt, "ppl_increase_pct": 100.0 * (ppl / ppl_float - 1.0)})
    bpt = bytes_per_token(spec, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, context_len)
    return {
        "spec": spec.to_dict(),
        # What calibration saw and chose, per layer (tasks/kv_stats.py choose_rotation): the largest
        # key channel's range over the median channel's, and the cache rotation.
        "key_outlier_ratio": record.get("key_outlier_ratio"),
        "rotation": record.get("rotation", ["none"] * cfg.num_layers),
        "accuracy_float_cache": float_acc["accuracy"],
        "accuracy_quantized_cache": quant_acc["accuracy"],
        "accuracy_new_quantized_cache": quant_acc["accuracy_new"],
        "accuracy_drop": float_acc["accuracy"] - quant_acc["accuracy"],
        "perplexity_float_cache": ppl_float,
        "perplexity_quantized_cache": ppl_quant,
        "ppl_increase_pct": 100.0 * (ppl_quant / ppl_float - 1.0),
        "bytes_per_token": bpt,
        "compression_vs_fp16": fp16 / bpt,
        "context_len": context_len,  # bytes per token are for a cache this long (the longest document)
        "heldout_documents": len(documents),
        "grid": sorted(grid, key=lambda row: -row["bits"]),
    }
