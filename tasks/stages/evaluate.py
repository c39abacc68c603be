"""The evaluate stage: exact-match accuracy and perplexity, base model vs base + adapter.

Accuracy is greedy decoding on the ``test`` split, split into the rules that changed since
the base model's month ("new") and those that did not ("regression"), plus one row per
rule. Perplexity is measured on held-out plain text (``heldout.txt`` of the month, or the
``val`` split's rows when a user's month brings no text).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Literal

from runtime.engine.latency import percentile
from runtime.engine.tokenizer import ChatPrompt, encode_prompt
from tasks.artifacts import atomic_output_dir, write_json
from tasks.cli import stage_main
from tasks.config import DEFAULT_KV_BLOCK_SIZE, EngineConfig, EvalConfig, ReleaseConfig, WeightAccuracyDrop
from tasks.device import choose_placement
from tasks.gate_rules import kv_size_vs_fp16, weights_accuracy_gate
from tasks.layout import METRICS_FILE, PREDICTIONS_FILE
from tasks.models import load_base_model
from tasks.plots import (
    KV_BITS_PNG,
    KV_GRID_CSV,
    LATENCY_CSV,
    LATENCY_PNG,
    kv_bits_figure,
    latency_figure,
    read_rows,
    save_figure,
)
from tasks.progress import Progress
from tasks.records import Example, heldout_corpus, read_jsonl
from tasks.scoring import accuracy_report, greedy_completions


def document_ids(tokenizer, text: str) -> list[int]:
    """A held-out text as the model sees a training example: special tokens (a BOS) first, eos last.
    A BOS at position 0 is context only: perplexity scores positions 1.., as the training loss does."""
    return encode_prompt(tokenizer, text) + [tokenizer.eos_token_id]


def perplexity(model, tokenizer, texts: list[str], batch_size: int) -> float:
    """exp of the mean next-token loss over every token of every text (eos appended)."""
    import torch

    tokenizer.padding_side = "right"
    total_nll, total_tokens = 0.0, 0
    for start in range(0, len(texts), batch_size):
        batch = tokenizer.pad({"input_ids": [document_ids(tokenizer, t) for t in texts[start : start + batch_size]]},
                              return_tensors="pt").to(model.device)
        with torch.no_grad():
            logits = model(**batch).logits[:, :-1]  # (B, T-1, V)
        targets = batch["input_ids"][:, 1:]
        mask = batch["attention_mask"][:, 1:].bool()
        nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
        total_nll += nll[mask].sum().item()
        total_tokens += int(mask.sum())
    return math.exp(total_nll / total_tokens)


def engine_perplexity(engine, tokenizer, texts: list[str]) -> float:
    """The same perplexity as ``perplexity``, computed from the engine's prefill logits, text by text."""
    import numpy as np

    total_nll, total_tokens = 0.0, 0
    for text in texts:
        ids = np.asarray([document_ids(tokenizer, text)], dtype=np.int64)  # (1, T)
        T = ids.shape[1]
        logits, _ = engine.forward(ids, np.arange(T)[None], np.ones((1, T), np.int64), None)  # (1, T, V)
        logits = logits[0, :-1].astype(np.float64)
        shifted = logits - logits.max(-1, keepdims=True)
        log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))  # (T-1, V)
        total_nll -= log_probs[np.arange(T - 1), ids[0, 1:]].sum()
        total_tokens += T - 1
    return math.exp(total_nll / total_tokens)


def _score(model, tokenizer, test: list[Example], texts: list[str], cfg: EvalConfig, name: str) -> tuple[dict, list[str]]:
    predictions = greedy_completions(model, tokenizer, [ex.prompt for ex in test], cfg.max_new_tokens, cfg.batch_size,
                                     desc=f"greedy decode: {name}")
    report = accuracy_report(test, predictions)
    report["perplexity"] = perplexity(model, tokenizer, texts, cfg.batch_size)
    return report, predictions


def decode_latency(engine, reference, tokenizer, prompts: list[str | ChatPrompt],
                   steps: int) -> tuple[dict, list[tuple[int, int, float]]]:
    """Wall time of single decode steps, batch 1, adapter bound: what one device request waits per token, each step
    timed beside the same step of ``reference`` (the float engine the backbone was compiled into, nothing bound).

    The gate reads their ratio, not the milliseconds: a neighbour's job on a shared machine moved the p95 alone
    from 88 to 516 ms on the real-model profile (docs/real-model.md). ``step_ratio`` is the release's 10th
    percentile step over the reference's: the fastest tenth of each engine's steps, those the machine's load did not
    interrupt. The median of per-step ratios was not robust: under load a longer step is preempted more often than a
    short one (embedded default, load 6.5, 2 threads: 1.71, 3.47 and 1.94 in three runs; the 10th percentiles' ratio
    1.59-1.74). Both engines are opened at ``EvalConfig.latency_threads`` (1): at 2 intra-op threads on 2 cores
    beside two busy processes each op waits for its slower thread, and an engine of more ops pays that more often
    (embedded default's pages, 2 threads: 1.79 quiet, 3.18 beside two CPU-bound processes, 4.16 in CI; 1 thread:
    1.70, 1.64 and 1.60 beside three). The two steps alternate in order from step to step, so that a drift in load favours neither. Each
    prompt is prefilled on both (not timed), then ``steps`` tokens are decoded one forward each, the reference fed
    the release's tokens.

    Returns the summary (ms, the ratio, the 1-minute load average before and after) and every step of the release
    as (prompt index, past length it attends to, ms), in order."""
    import os
    import time

    import numpy as np

    load_before = os.getloadavg()[0]
    samples: list[tuple[int, int, float]] = []
    reference_ms = []
    for index, prompt in enumerate(prompts):
        ids = np.array([encode_prompt(tokenizer, prompt)], dtype=np.int64)  # (1, T)
        T = ids.shape[1]
        logits, cache = engine.forward(ids, np.arange(T)[None], np.ones_like(ids), None)
        _, reference_cache = reference.forward(ids, np.arange(T)[None], np.ones_like(ids), None)
        for step in range(steps):
            token = logits[:, -1].argmax(-1)[:, None].astype(np.int64)  # (1, 1)
            position, mask = np.array([[T + step]]), np.ones((1, T + step + 1), dtype=np.int64)
            ms = {}
            for name in ("release", "reference")[:: 1 if step % 2 == 0 else -1]:
                start = time.perf_counter()
                if name == "release":
                    logits, cache = engine.forward(token, position, mask, cache)
                else:
                    _, reference_cache = reference.forward(token, position, mask, reference_cache)
                ms[name] = 1000.0 * (time.perf_counter() - start)
            samples.append((index, T + step, ms["release"]))
            reference_ms.append(ms["reference"])
    times = [ms for _, _, ms in samples]
    p10, reference_p10 = percentile(times, 10), percentile(reference_ms, 10)
    summary = {"p10_ms": p10, "p50_ms": percentile(times, 50), "p95_ms": percentile(times, 95),
               "max_ms": max(times), "reference_p10_ms": reference_p10,
               "reference_p50_ms": percentile(reference_ms, 50), "step_ratio": p10 / reference_p10,
               "steps": len(samples), "prompts": len(prompts), "batch": 1,
               "loadavg_1m": [load_before, os.getloadavg()[0]]}
    return summary, samples


def _score_on_engine(
    engine_cfg: EngineConfig,
    adapter_dir: Path,
    merged_model,
    tokenizer,
    test: list[Example],
    texts: list[str],
    cfg: EvalConfig,
    release_backbone=None,
) -> tuple[dict, dict, list[str], list[tuple[int, int, float]]]:
    """Accuracy, perplexity and decode latency of base + adapter on the serving engine, and its
    parity with PyTorch + merged PEFT (an engine with quantized pages: its pages byte for byte against
    ``release_backbone``'s, the adapter-merged backbone from ``tasks.models.load_release_backbone``). The last item
    is every timed decode step (``decode_latency``)."""
    from runtime.engine.adapter import load_adapter
    from runtime.engine.engine import open_engine
    from runtime.engine.generate import generate_text
    from tasks.checks.engine_parity import DECODE_STEPS, parity_verdict, teacher_forced_agreement

    engine = open_engine(engine_cfg.serving_engine_dir, backend=engine_cfg.backend, threads=engine_cfg.threads)
    lora = load_adapter(adapter_dir, engine.interface)
    prompts = [ex.prompt for ex in test]
    kv_parity = {}
    engine.set_adapter(lora)
    # A quantized-pages engine decodes over quantized pages, which no float reference computes: its prompts are
    # compared as prefills (float), its pages byte for byte (pages_parity), what they cost by the KV gates.
    decode_steps = 0 if engine.interface.kv_pages else DECODE_STEPS
    agreement = teacher_forced_agreement(engine, merged_model, tokenizer, prompts, decode_steps).report()
    if engine.interface.kv_pages:
        from tasks.checks.engine_parity import pages_parity

        kv_parity = pages_parity(engine, release_backbone, tokenizer, prompts)
    on_engine = generate_text(engine, tokenizer, prompts, cfg.max_new_tokens, cfg.batch_size)
    parity = parity_verdict(
        merged_model, tokenizer, prompts, agreement,
        greedy_completions(merged_model, tokenizer, prompts, cfg.max_new_tokens, cfg.batch_size,
                           desc="greedy decode: merged adapter (parity)"),
        on_engine, engine_cfg.parity_max_logit_error, engine_cfg.parity_max_kl, cfg.max_new_tokens,
        float_cache=not engine.interface.kv_pages,
    )
    parity["backend"] = engine_cfg.backend
    parity["weights"] = engine_cfg.weights
    parity["kv_cache"] = engine_cfg.kv_cache
    parity["kv_block_size"] = engine_cfg.kv_block_size  # 0: the padded cache
    parity |= kv_parity
    parity["interface_hash"] = engine.interface.interface_hash
    report = accuracy_report(test, on_engine)
    report["perplexity"] = engine_perplexity(engine, tokenizer, texts)
    if engine.interface.kv_pages:  # a prefill reads float: what the pages cost shows only in decoding
        from tasks.checks.page_quality import engine_page_quality, float_pages_engine, heldout_sequences

        report["pages_heldout"] = engine_page_quality(engine, heldout_sequences(tokenizer, texts))
        # The same engine's answers with a float cache: what its pages cost the answers, apart from its weights
        # (an int4 engine's answers differ from float PyTorch's by its weights too, the weights gate's measure).
        float_pages = generate_text(float_pages_engine(engine), tokenizer, prompts, cfg.max_new_tokens, cfg.batch_size)
        report["pages_answers"] = {"accuracy_float_pages": accuracy_report(test, float_pages)["accuracy"],
                                   "answers_differing": sum(a != b for a, b in zip(float_pages, on_engine))}
    if cfg.latency_threads != engine_cfg.threads:  # timed at their own thread count (EvalConfig.latency_threads)
        del engine
        engine = open_engine(engine_cfg.serving_engine_dir, backend=engine_cfg.backend, threads=cfg.latency_threads)
        engine.set_adapter(lora)
    reference = open_engine(engine_cfg.dir, backend=engine_cfg.backend, threads=cfg.latency_threads)
    reference.set_adapter(None)
    report["decode_latency"], latency_samples = decode_latency(engine, reference, tokenizer, prompts[: cfg.latency_prompts],
                                                               cfg.latency_steps)
    report["decode_latency"]["threads"] = cfg.latency_threads
    return report, parity, on_engine, latency_samples


def _write_csv(path: Path, header: list[str], rows) -> None:
    import csv

    with open(path, "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(header)
        writer.writerows(rows)


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def render_table(metrics: dict) -> str:
    base, adapted = metrics["base"], metrics["adapter"]
    on_engine = metrics.get("adapter_on_engine")
    rows = [
        ("accuracy, new rules", "accuracy_new"),
        ("accuracy, regression rules", "accuracy_regression"),
        ("accuracy, all", "accuracy"),
        ("perplexity, held-out text", "perplexity"),
    ]
    header = "| metric | base | base + adapter |"
    if on_engine is not None:
        parity = metrics["engine_parity"]
        header += f" base + adapter on the {parity['backend']} engine ({parity['weights']} weights) |"
    lines = [f"# Evaluation, {metrics['month']}", "", header, "|" + "---|" * (header.count("|") - 1)]
    for label, key in rows:
        row = f"| {label} | {_fmt(base[key])} | {_fmt(adapted[key])} |"
        if on_engine is not None:
            row += f" {_fmt(on_engine.get(key))} |"
        lines.append(row)
    if on_engine is not None:
        parity = metrics["engine_parity"]
        lines += [
            "",
            f"Engine parity on {parity['prompts']} test prompts ({parity['positions_compared']} positions): logit "
            f"error {parity['max_logit_error']:.2f} float32 rounding budgets (limit {parity['max_logit_error_limit']:g}; "
            f"max abs difference {parity['max_abs_logit_diff']:.2e}), KL {parity['max_kl']:.1e} (limit "
            f"{parity['max_kl_limit']:.0e}), greedy outputs "
            f"{'identical' if parity['greedy_identical'] else 'DIFFERENT on rows ' + str(parity['greedy_mismatches'])}.",
        ]
        latency = on_engine.get("decode_latency")
        if latency:
            lines.append(f"Decode step on the engine, batch 1, adapter bound, {latency['threads']} "
                         f"thread(s): p50 {latency['p50_ms']:.2f} ms, "
                         f"p95 {latency['p95_ms']:.2f} ms over {latency['steps']} steps, "
                         f"{latency['step_ratio']:.2f}x the float engine's step timed beside it (10th percentiles).")
    kv = metrics.get("kv_cache")
    if kv:
        spec_label = next(row["config"] for row in kv["grid"] if row["config"].startswith("release"))
        lines += [
            "",
            f"Quantized KV cache, {spec_label}: "
            f"accuracy {kv['accuracy_float_cache']:.3f} -> {kv['accuracy_quantized_cache']:.3f}, held-out perplexity "
            f"{kv['perplexity_float_cache']:.4f} -> {kv['perplexity_quantized_cache']:.4f} ({kv['ppl_increase_pct']:+.2f}%), "
            f"its bytes {kv_size_vs_fp16(kv)}.",
        ]
    lines += ["", "| rule | changed | base | base + adapter |", "|---|---|---|---|"]
    for rule, acc in adapted["per_rule"].items():
        changed = "yes" if rule in metrics["changed_rules"] else "no"
        lines.append(f"| {rule} | {changed} | {_fmt(base['per_rule'][rule])} | {_fmt(acc)} |")
    return "\n".join(lines) + "\n"


def evaluate(
    base_dir: Path,
    adapter_dir: Path,
    data_dir: Path,
    out_dir: Path,
    cfg: EvalConfig,
    month: str,
    engine: EngineConfig | None = None,
    *,
    pages: "PageQuantSpec | None" = None,  # noqa: F821  (kernels.kv_spec; imported where measured)
    page_block_size: int = DEFAULT_KV_BLOCK_SIZE,
    max_weight_accuracy_drop: WeightAccuracyDrop,
    device: Literal["auto", "cpu", "cuda"] = "cpu",
) -> Path:
    """Score the base model and base + adapter (PyTorch, and on the compiled engine when given,
    with its decode latency; and through quantized pages, ``pages`` of ``page_block_size`` tokens: in PyTorch on
    held-out text and test rows, and on the engine itself where it serves them).
    The PyTorch scores run in fp32 on the device ``device`` picks (``tasks.device``); the engine's parity
    reference runs on the CPU, beside the engine it is compared with.

    Writes ``metrics.json``, ``report.md``, ``predictions.jsonl``, and the plots' data and figures
    when measured: ``latency.csv``/``latency.png`` (decode step against past length) and
    ``kv_grid.csv``/``kv_bits.png`` (perplexity increase against KV bits).
    """
    import torch
    from peft import PeftModel

    placement = choose_placement(device)
    print(f"evaluate: PyTorch scores on {placement.device} in fp32 ({placement.reason})", file=sys.stderr)
    test = read_jsonl(Path(data_dir) / "test.jsonl")
    _, texts = heldout_corpus(Path(data_dir))

    # Phases, reported as they finish: base, base + adapter, [the engine], [the quantized KV cache].
    progress = Progress("evaluate", 2 + (engine is not None) + (pages is not None), unit="phase")
    model, tokenizer = load_base_model(base_dir)
    model.to(placement.device)
    base_report, base_predictions = _score(model, tokenizer, test, texts, cfg, "base")
    progress.advance(accuracy_base=base_report["accuracy"])
    adapted = PeftModel.from_pretrained(model, adapter_dir)
    adapted.eval()
    with torch.no_grad():
        adapter_report, adapter_predictions = _score(adapted, tokenizer, test, texts, cfg, "adapter")
    progress.advance(accuracy_adapter=adapter_report["accuracy"])

    metrics = {
        "month": month,
        "changed_rules": sorted({ex.rule for ex in test if ex.changed and ex.rule}),
        "base": base_report,
        "adapter": adapter_report,
        "torch_device": placement.device,
    }
    engine_predictions, latency_samples = None, []
    release_backbone = None
    if pages is not None:
        from tasks.models import load_release_backbone

        # One load serves the pages' parity on the engine and their quality grid.
        release_backbone, _, _ = load_release_backbone(Path(base_dir), Path(adapter_dir),
                                                       Path(engine.dir) if engine is not None else None)
    if engine is not None:
        merged = adapted.merge_and_unload().to("cpu").eval()
        metrics["adapter_on_engine"], metrics["engine_parity"], engine_predictions, latency_samples = _score_on_engine(
            engine, Path(adapter_dir), merged, tokenizer, test, texts, cfg, release_backbone
        )
        if engine.weights != "fp32":
            # Quantized weights cannot match float logits to 1e-4; what must hold is accuracy.
            metrics["weights_gate"] = weights_accuracy_gate(adapter_report, metrics["adapter_on_engine"], engine.weights,
                                                            max_weight_accuracy_drop)
            metrics["weights_gate"]["mixed"] = _mixed_storage(Path(engine.serving_engine_dir))
        progress.advance(accuracy_engine=metrics["adapter_on_engine"]["accuracy"])
    if pages is not None:
        from tasks.checks.page_quality import heldout_sequences, release_page_quality

        metrics["kv_cache"] = release_page_quality(release_backbone, tokenizer, test, heldout_sequences(tokenizer, texts),
                                                   pages, page_block_size, cfg.max_new_tokens)
        from tasks.checks.page_widths import widths_summary

        widths = widths_summary(engine.dir, pages) if engine is not None else None
        if widths:
            metrics["kv_cache"]["layer_widths"] = widths
        on_engine = (metrics.get("adapter_on_engine") or {})
        if "pages_heldout" in on_engine:
            # What the device's pages cost, measured on the device's engine: its greedy answers against its own with
            # a float cache, and the held-out perplexity it decodes through the pages its runtime sealed.
            answers = on_engine.pop("pages_answers")
            metrics["kv_cache"]["on_engine"] = {"accuracy_drop": answers["accuracy_float_pages"] - on_engine["accuracy"],
                                                **answers, **on_engine.pop("pages_heldout")}
        progress.advance(kv_ppl_increase_pct=metrics["kv_cache"]["ppl_increase_pct"])
    progress.close()
    with atomic_output_dir(Path(out_dir)) as tmp:
        write_json(tmp / METRICS_FILE, metrics)
        if latency_samples:
            _write_csv(tmp / LATENCY_CSV, ["prompt", "past_length", "decode_ms"], latency_samples)
            save_figure(latency_figure(read_rows(tmp / LATENCY_CSV), f"Decode step on the engine, {month}"),
                        tmp / LATENCY_PNG)
        if "kv_cache" in metrics:
            grid = metrics["kv_cache"]["grid"]
            _write_csv(tmp / KV_GRID_CSV, list(grid[0]), [row.values() for row in grid])
            save_figure(kv_bits_figure(read_rows(tmp / KV_GRID_CSV), f"Quantized KV cache, {month}"), tmp / KV_BITS_PNG)
        (tmp / "report.md").write_text(render_table(metrics))
        with open(tmp / PREDICTIONS_FILE, "w") as fh:
            for i, (ex, b, a) in enumerate(zip(test, base_predictions, adapter_predictions)):
                row = {**ex.to_json(), "base": b, "adapter": a}
                if engine_predictions is not None:
                    row["adapter_on_engine"] = engine_predictions[i]
                fh.write(json.dumps(row, sort_keys=True) + "\n")
    return Path(out_dir) / METRICS_FILE


def _mixed_storage(engine_dir: Path) -> dict | None:
    """A mixed-precision engine's storage (``tasks.weights.mixed``): its stored bits per weight and how many parts
    took each option; None for one width everywhere."""
    from tasks.weights.engines import WEIGHTS_FILE

    mixed = json.loads((engine_dir / WEIGHTS_FILE).read_text()).get("mixed")
    return None if mixed is None else {k: mixed[k] for k in ("budget_bits", "bits_per_weight", "options")}


def run_stage(cfg: ReleaseConfig) -> Path:
    import torch

    from tasks.checks.page_widths import served_pages

    torch.set_num_threads(cfg.train.threads)
    return evaluate(
        base_dir=Path(cfg.base_model.path),
        adapter_dir=cfg.layout.adapter_dir,
        data_dir=cfg.layout.data_dir,
        out_dir=cfg.layout.eval_dir,
        cfg=cfg.eval,
        month=cfg.data.month,
        engine=cfg.engine,
        pages=served_pages(cfg) if cfg.kv.enabled else None,
        page_block_size=cfg.engine.kv_block_size or DEFAULT_KV_BLOCK_SIZE,
        max_weight_accuracy_drop=cfg.gates.max_weight_accuracy_drop,
        device=cfg.train.device,
    )


def main(argv: list[str] | None = None) -> int:
    return stage_main(
        "Evaluate the base model and base + adapter.",
        lambda cfg: (run_stage(cfg).parent / "report.md").read_text(),
        argv,
    )


if __name__ == "__main__":
    sys.exit(main())
