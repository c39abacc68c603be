"""Every benchmark of bench/, one after another, and one report: `make bench`.

    python -m bench.run_all [--out-dir bench/results] [--only flow_bench,engine_bench,...]

Each benchmark runs as its own process with the flags listed in ``BENCHES`` (never two at once: they
measure latency on the same cores) and writes its JSON into ``bench/results/latest/``; earlier full runs
under ``bench/results/`` are left alone. Then:

* ``bench/results/latest.json``: every benchmark's status, command, seconds and JSON payload, and the
  figures of the table;
* ``bench/results/latest.md``: one table, every figure with the command that produced it, and the
  plots ``latest_*.png`` beside it.

``bench.flow_bench`` runs first and keeps its project copy (``$FLOW_PROJECT``) until the end: the KV
quality report measures the default month on its 2026-11 adapter, and the hot-swap load test swaps its
two published months. Without that copy (the flow failed) they fall back to their stand-alone modes,
and the table says so. A benchmark that fails is a FAILED row with its exit code and last error line,
and the exit code is 1; one that cannot run on this machine (``bench.gpu_check`` without TensorRT) is
a SKIPPED row.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench.report import write_report
from runtime.engine.adapter_config import ADAPTER_CONFIG

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "DVC_NO_ANALYTICS": "1", "HF_HUB_OFFLINE": "1", "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
       "TOKENIZERS_PARALLELISM": "false"}
RESULTS = "$RESULTS"  # placeholders in the commands the table states
FLOW_PROJECT = "$FLOW_PROJECT"
FLOW_MONTHS = ("2026-11", "2026-12")


@dataclass(frozen=True)
class Bench:
    name: str
    title: str
    args: tuple[str, ...]  # after `python -m bench.<name>`; may hold $RESULTS and $FLOW_PROJECT
    mode: str  # what this run measures against the benchmark's full default run
    timeout: float  # seconds
    cwd: str = ""  # "" = the repository; $FLOW_PROJECT = the flow benchmark's project copy


def plan(flow_ready: bool) -> list[Bench]:
    """The benchmarks in the order they run; the two after flow_bench use its project when it is there."""
    adapter = f"{FLOW_PROJECT}/artifacts/{FLOW_MONTHS[0]}/finetune/adapter"
    month = ("--base", f"{FLOW_PROJECT}/models/base", "--adapter", adapter, "--data", f"{FLOW_PROJECT}/data/{FLOW_MONTHS[0]}",
             "--engine", f"{FLOW_PROJECT}/engine")
    return [
        Bench("flow_bench", "monthly flow: first run, unchanged rerun, next month",
              ("--workdir", "$WORK/flow", "--out", f"{RESULTS}/flow_bench.json"),
              f"full: the whole flow on the embedded default, {FLOW_MONTHS[0]} twice then {FLOW_MONTHS[1]}", 2400),
        Bench("kv_quality", "KV-cache quantization: quality and bytes per token (PyTorch reference cache)",
              ("--quick",) + (month if flow_ready else ()) + ("--out", f"{RESULTS}/kv_quality.json"),
              "quick (--quick): stdlib-text model trained 20 steps, 8 windows of 64 tokens, 64 test rows; the full "
              "run trains 600 steps (about 4 min more) and its quality figures are the ones to quote"
              + ("; default month = the flow's 2026-11 base + adapter" if flow_ready else
                 "; no default month: the flow benchmark left no adapter"), 900),
        Bench("hotswap_bench", "hot-swap under open-loop load: 20, 50, 100 req/s, swaps every 1 s",
              ("--out", f"{RESULTS}/hotswap_bench.json") if flow_ready else ("--tiny", "--out", f"{RESULTS}/hotswap_bench.json"),
              "full (per rate 3 s + 8 s swapping + 3 s); " + (f"the flow's published {FLOW_MONTHS[0]} and {FLOW_MONTHS[1]} releases"
                                                       if flow_ready else "tiny world: the flow left no two releases"),
              600, FLOW_PROJECT if flow_ready else ""),
        Bench("engine_bench", "engine vs eager decode, LoRA as inputs vs merged",
              ("--out", f"{RESULTS}/engine_bench.json"), "full (default flags: tiny and 0.5B-width, 400 iterations)", 900),
        Bench("kv_engine_bench", "quantized vs float KV cache inside the ONNX Runtime engine",
              ("--out", f"{RESULTS}/kv_engine_bench.json"), "full (default flags: 300 iterations)", 900),
        Bench("paged_kv_bench", "paged vs padded KV cache: bytes allocated for rows of 128-1024 tokens, decode tokens/s",
              ("--out", f"{RESULTS}/paged_kv_bench.json"), "full (default flags: 200 iterations, blocks of 16 tokens)", 900),
        Bench("mixed_adapters_bench", "8 clients over 4 adapters vs 8 on one: rows of several releases in one batch",
              ("--shape", "tiny", "--rounds", "16", "--max-tokens", "96", "--out", f"{RESULTS}/mixed_adapters_bench.json"),
              "full at the tiny shape (the 0.5B shape: --shape 0.5b, minutes to build)", 900),
        Bench("weight_quant_bench", "weight-only quantization: fp32 vs int8 vs int4 engines",
              ("--configs", "tiny,0.5b-width", "--variants", "fp32,int8,int4", "--pasts", "512", "--iters", "60",
               "--out", f"{RESULTS}/weight_quant_bench.json"),
              "quick: 3 variants at block 128, past 512 only, 60 iterations; the full run (about 15 min) adds the LoRA-merged, block-32, "
              "accuracy-level-0 and norm-folded variants and past 2048", 900),
        Bench("gpu_check", "TensorRT plan, parity vs ONNX Runtime, latency (NVIDIA only)",
              ("--out", f"{RESULTS}/gpu_check.json"), "full; needs an NVIDIA GPU with TensorRT", 900),
    ]


def command_text(bench: Bench) -> str:
    cmd = f"python -m bench.{bench.name} {' '.join(bench.args)}".strip()
    return f"cd {bench.cwd} && {cmd}" if bench.cwd else cmd


def run_bench(bench: Bench, places: dict[str, str]) -> dict:
    """Run one benchmark; its status, seconds, and payload (the JSON it wrote)."""
    def fill(text: str) -> str:
        for key, value in places.items():
            text = text.replace(key, value)
        return text

    out = Path(fill(bench.args[bench.args.index("--out") + 1]))
    record = {"name": bench.name, "title": bench.title, "command": command_text(bench), "mode": bench.mode,
              "json": str(out)}
    cmd = [sys.executable, "-m", f"bench.{bench.name}", *map(fill, bench.args)]
    print(f"\n=== {record['command']}", flush=True)
    log = out.with_suffix(".stderr.log")  # progress bars and logs; its tail explains a failure
    start = time.perf_counter()
    with log.open("w") as err_file:
        try:  # stdout (the benchmark's own table) goes to the terminal as it comes
            rc = subprocess.run(cmd, cwd=fill(bench.cwd) or REPO, env=ENV, stderr=err_file, timeout=bench.timeout).returncode
        except subprocess.TimeoutExpired:
            rc = None
    stderr = log.read_text(errors="replace") + (f"\ntimed out after {bench.timeout:.0f} s" if rc is None else "")
    record["seconds"] = round(time.perf_counter() - start, 1)
    record["returncode"] = rc
    if rc == 2 and "cannot run here" in stderr:
        record |= {"status": "skipped", "reason": _last_line(stderr)}
    elif rc != 0:
        record |= {"status": "failed", "reason": f"exit {rc}: {_last_line(stderr)}", "stderr_tail": stderr[-3000:]}
    elif not out.exists():
        record |= {"status": "failed", "reason": f"exit 0 but no {out.name} written"}
    else:
        record["status"] = "ok"
    if out.exists():  # a failed run may still have written its figures (flow_bench does)
        record["payload"] = json.loads(out.read_text())
    print(f"=== {bench.name}: {record['status']} in {record['seconds']:.0f} s {record.get('reason', '')}", flush=True)
    return record


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else "(no output on stderr)"


# ---------------------------------------------------------------- figures: (figure, value, formatted)

def _ms(x: float) -> str:
    return f"{x:.3f} ms" if x < 10 else f"{x:.1f} ms"


def _pct(x: float) -> str:
    return f"{x:+.1f} %"


def engine_figures(p: dict) -> list[tuple]:
    rows = []
    names = {"eager_torch_lora": "eager PyTorch forward + LoRA", "eager_hf_peft": "eager transformers + PEFT",
             "ort_lora_inputs": "engine (ONNX Runtime), LoRA as inputs", "ort_merged": "engine, LoRA merged into weights"}
    for cfg, res in p["results"].items():
        for backend, label in names.items():
            v = res["rows"][backend]["decode_512_ms"]
            rows.append((f"{cfg}: decode ms/token, past 512, {label}", v, _ms(v)))
        r = res["ratios"]
        rows.append((f"{cfg}: engine speed-up over eager PyTorch, decode past 512", r["eager_over_engine_decode_512"],
                     f"{r['eager_over_engine_decode_512']:.2f}x"))
        rows.append((f"{cfg}: engine speed-up over transformers + PEFT, decode past 512", r["hf_over_engine_decode_512"],
                     f"{r['hf_over_engine_decode_512']:.2f}x"))
        for key, label in (("decode_128", "decode past 128"), ("decode_512", "decode past 512"), ("prefill_128", "prefill 128")):
            v, p10 = 100 * r[f"lora_overhead_{key}"], 100 * r[f"lora_overhead_{key}_p10"]
            rows.append((f"{cfg}: LoRA-as-input overhead vs merged, {label} (median; p10)", v, f"{_pct(v)} ({_pct(p10)})"))
    return rows


def paged_kv_figures(p: dict) -> list[tuple]:
    rows = []
    for name, row in p["results"]["rows"].items():
        v = row["kv_allocated_over_needed"]
        rows.append((f"KV bytes allocated / needed, 8 rows of 128-1024 tokens, {name}", v, f"{v:.3f}"))
    for name, r in p["results"]["ratios"].items():
        v = r["paged_over_padded_tokens_per_s"]
        rows.append((f"paged / padded decode tokens/s, 8 rows, {name}", v, f"{v:.2f}x"))
    return rows


def kv_engine_figures(p: dict) -> list[tuple]:
    res, rows = p["results"], []
    pasts = sorted(int(k.split("_")[1]) for k in res["rows"]["float32"] if k.startswith("decode_") and k.endswith("_ms")
                   and "p10" not in k)
    for name, row in res["rows"].items():
        for P in pasts:
            rows.append((f"decode ms/token, past {P}, {name} KV cache", row[f"decode_{P}_ms"], _ms(row[f"decode_{P}_ms"])))
    for name, r in res["ratios_vs_float"].items():
        for P in pasts:
            rows.append((f"{name} / float32 decode latency, past {P}", r[f"decode_{P}"], f"{r[f'decode_{P}']:.2f}x"))
    last = pasts[-1]
    for name, row in res["rows"].items():
        v = row[f"kv_bytes_per_token_{last}"]
        rows.append((f"KV bytes per token stored by the engine at past {last}, {name}", v, f"{v:,.0f} B"))
    return rows


def kv_quality_figures(p: dict) -> list[tuple]:
    rows = []
    text = p["text"]["results"]
    ctx = p["context_len"]
    model = f"stdlib-text model ({'quick' if p.get('quick') else 'full'})"
    for name in ("int8", "K4/V4 chosen"):
        if name in text:
            r = text[name]
            rows.append((f"{model}: {name} Δ perplexity vs float cache", r["ppl_increase_pct"], f"{r['ppl_increase_pct']:+.3f} %"))
    for name in ("float", "K4/V4 chosen"):
        if name in text:
            r = text[name]
            rows.append((f"KV bytes per token at {ctx} tokens, {name} (vs fp16)", r["bytes_per_token"],
                         f"{r['bytes_per_token']:,.1f} B ({r['compression_vs_fp16']:.2f}x)"))
    if "default_month" in p:
        d = p["default_month"]["results"]
        chosen, flt = d["K4/V4 chosen"], d["float"]
        rows.append(("default month (flow's 2026-11 adapter): K4/V4 chosen Δ perplexity vs float cache",
                     chosen["ppl_increase_pct"], f"{chosen['ppl_increase_pct']:+.3f} %"))
        if "task_accuracy" in chosen:
            rows.append(("default month: task accuracy, float cache → K4/V4 chosen cache", chosen["task_accuracy"],
                         f"{flt['task_accuracy']:.3f} → {chosen['task_accuracy']:.3f} ({p['default_month']['test_rows']} rows)"))
    acc = p.get("acceptance", {})
    failing = [k for k, v in acc.items() if not v]
    rows.append(("acceptance checks of bench/kv_quality.py passing", len(acc) - len(failing),
                 f"{len(acc) - len(failing)} of {len(acc)}" + (f" (failing: {', '.join(failing)})" if failing else "")))
    return rows


def hotswap_figures(p: dict) -> list[tuple]:
    s, q = p["swaps"], p["requests"]
    rows = [
        ("releases swapped", None, f"{' ↔ '.join(p['releases'])} ({p['source']})"),
        ("swap latency, server side (verify + bind + activate) p50 / p99 / max", s["server_ms_p99"],
         f"{s['server_ms_p50']:.2f} / {s['server_ms_p99']:.2f} / {s['server_ms_max']:.2f} ms"),
        ("swap latency as the swapping caller saw it p50 / p99", s["client_ms_p99"],
         f"{s['client_ms_p50']:.2f} / {s['client_ms_p99']:.2f} ms"),
        ("swaps accepted", s["accepted"], f"{s['accepted']} of {s['count']}"),
        (f"requests failed (open loop, {p['arrivals']} arrivals)", q["failed"], f"{q['failed']} of {q['total']}"),
        ("responses not on the release active when sent", q["release_inconsistent"], f"{q['release_inconsistent']} of {q['ok']}"),
    ]
    for b in sorted(p["by_rate"].values(), key=lambda b: b["rate_per_s"]):
        lat = b["latency_from_schedule"]
        rows.append((f"latency from the scheduled send at {b['rate_per_s']:g} req/s p50 / p95 / p99", lat["p99_ms"],
                     f"{lat['p50_ms']:.1f} / {lat['p95_ms']:.1f} / {lat['p99_ms']:.1f} ms ({b['failed']} of {b['sent']} failed)"))
    return rows


def weight_quant_figures(p: dict) -> list[tuple]:
    rows = []
    for cfg, res in p["results"].items():
        for v, row in res["rows"].items():
            mib = res["onnx_bytes"][v] / 2**20
            rows.append((f"{cfg}: decode ms/token, past 512, {v} weights ({mib:.1f} MiB model.onnx)", row["decode_512_ms"],
                         _ms(row["decode_512_ms"])))
        for key, r in res["ratios"].items():
            if key.startswith("fp32_over_"):
                rows.append((f"{cfg}: {key.removeprefix('fp32_over_')} speed-up over fp32, decode past 512",
                             r["decode_512_ms"], f"{r['decode_512_ms']:.2f}x"))
    return rows


def real_model_quality_figures(p: dict) -> list[tuple]:
    """Each row of ``bench.real_model_quality``'s table against its reference (ours, fp32, float cache)."""
    text = f"{len(p['documents'])} docs x {p['scored_per_document']} tokens at context {p['context']}"
    rows = [(f"real model ({text}): {r['engine']} {r['weights']} weights, {r['kv']} KV ({r.get('kv_read', '-')}): "
             "Δ perplexity vs ours fp32 float cache", r["ppl_increase_pct"],
             f"{r['ppl_increase_pct']:+.2f} % (ppl {r['ppl']:.3f}, KL {r['kl_mean']:.2e})") for r in p["rows"]]
    if p.get("not_measured"):
        rows.append(("real model: rows not measured (time budget spent)", len(p["not_measured"]), "; ".join(p["not_measured"])))
    return rows


def real_model_speed_figures(p: dict) -> list[tuple]:
    """Decode ms per token of every case of ``bench.real_model_speed``, then ours over llama.cpp's counterpart."""
    rows = []
    for name, row in p["rows"].items():
        for P in p["pasts"]:
            s = row[f"decode_{P}"]
            rows.append((f"real model: {name} decode ms/token, past {P}, batch 1", s["median"],
                         f"{_ms(s['median'])} (p10 {_ms(s['p10'])}, p95 {_ms(s['p95'])})"))
    for c in p["comparisons"]:
        rows.append((f"real model: {c['ours']} / {c['peer']} decode median, past {c['past']}", c["ratio"],
                     f"{c['ratio']:.2f}x ({'no slower' if c['pass'] else 'slower'})"))
    return rows


def flow_figures(p: dict) -> list[tuple]:
    labels = {"first": "first run", "rerun": "unchanged rerun (same month)", "next": "next month"}
    rows = []
    for r in p["runs"]:
        ok = "" if r["returncode"] == 0 else f" (FAILED, exit {r['returncode']})"
        rows.append((f"monthly flow wall time, {labels[r['name']]} {r['month']}", r["seconds"], f"{r['seconds']:.1f} s{ok}"))
    for r in p["runs"]:
        src = "MLflow metric and artifacts agree" if r.get("engine_builds_mlflow") is not None and r["engine_builds_agree"] \
            else "artifacts (no MLflow run: nothing new to record)" if r.get("engine_builds_mlflow") is None \
            else "MLFLOW AND ARTIFACTS DISAGREE"
        ran = f"; stages run: {', '.join(r['stages_ran'])}" if r.get("stages_ran") is not None else ""
        rows.append((f"engine builds, {labels[r['name']]} {r['month']}", r["engine_builds"], f"{r['engine_builds']} ({src}{ran})"))
    if "rerun_over_first" in p:
        rows.append(("unchanged rerun / first run wall time", p["rerun_over_first"], f"{100 * p['rerun_over_first']:.1f} %"))
    return rows


def device_memory_figures(p: dict) -> list[tuple]:
    """Per load and server of ``bench.device_memory_bench``: the peak resident set and the KV bytes, then the headlines."""
    from bench.device_memory_bench import fmt_gb as gb
    from bench.device_memory_bench import fmt_mb as mb

    d = p["dims"]
    shape = f"{p['shape']} shape ({d['num_hidden_layers']} layers, hidden {d['hidden_size']}, vocabulary {d['vocab_size']})"
    rows = []
    for load, by in p["loads"].items():
        for server, r in by.items():
            name = "ours (int4, 4-bit KV)" if server == "ours" else "llama-server (Q4_0, q4_0 KV)"
            killed = f"; killed over {p['rss_limit_gb']:g} GB" if r["over_rss_limit_at_s"] is not None else ""
            rows.append((f"{shape}, {load} ({p['arrival']} arrival, {p['max_tokens']} tokens each): {name} peak resident set",
                         r["peak_rss_bytes"], f"{gb(r['peak_rss_bytes'])} (ready {gb(r['ready_rss_bytes'])}, at the end "
                         f"{gb(r['end_rss_bytes'])}; {r['errors']} errors{killed})"))
            ratio = r["kv_allocated_over_needed"]
            rows.append((f"{shape}, {load}: {name} KV bytes allocated / needed", ratio,
                         f"{'-' if ratio is None else f'{ratio:.2f}x'} ({mb(r['kv_allocated_bytes'])} / "
                         f"{mb(r['kv_needed_bytes'])})"))
    if p["not_run"]:
        rows.append(("loads not measured (the run cut short, or the server absent)", len(p["not_run"]),
                     ", ".join(f"{run} (failed: {p['failed'][run][-200:]})" if run in p["failed"] else run
                               for run in p["not_run"])))
    for key in ("kv_allocated_over_needed", "rss_vs_llama_server", "mixed_adapters_vs_one"):
        v = p[key]
        rows.append((key, v, f"{v:.2f}x" if v is not None else f"not measured: {p.get(key + '_note', '')}".rstrip(": ")))
    return rows


def mixed_adapters_figures(p: dict) -> list[tuple]:
    """``bench.mixed_adapters_bench``: median tokens/s per load, then the ratios (issue 27's target: mixed >= 0.9x one)."""
    rows = [(f"{p['shape']} shape, {p['clients']} clients, {p['max_tokens']} tokens each after {p['prompt_tokens']}: {load} "
             f"(releases per decode step {p['releases_per_decode_step'][load]:.2f})", v,
             f"{v:.0f} tok/s ({p['median_tokens_per_cpu_s'][load]:.0f} per CPU s)")
            for load, v in p["median_tokens_per_s"].items()]
    for key in ("mixed_adapters_vs_one", "mixed_adapters_vs_one_per_cpu_s", "mixed_vs_today_one", "today_mixed_vs_today_one",
                "stacked_one_vs_today_one", "stacked_one_vs_today_one_per_cpu_s"):
        rows.append((key, p[key], f"{p[key]:.3f}x"))
    return rows


def gpu_figures(p: dict) -> list[tuple]:
    rows = [("GPU checks passed", p.get("passed"), str(p.get("passed")))]
    for backend, row in p.get("latency_ms", {}).items():
        for key, v in row.items():
            rows.append((f"{backend}: {key}", v, _ms(v)))
    return rows


FIGURES = {"flow_bench": flow_figures, "kv_quality": kv_quality_figures, "hotswap_bench": hotswap_figures,
           "engine_bench": engine_figures, "kv_engine_bench": kv_engine_figures, "paged_kv_bench": paged_kv_figures,
           "weight_quant_bench": weight_quant_figures, "gpu_check": gpu_figures,
           "real_model_quality": real_model_quality_figures, "real_model_speed": real_model_speed_figures,
           "device_memory_bench": device_memory_figures, "mixed_adapters_bench": mixed_adapters_figures}


def table_rows(records: list[dict]) -> list[dict]:
    """One row per figure; a failed or skipped benchmark is one row that says so. A payload whose figures
    cannot be read turns the benchmark into a failure (it is not dropped)."""
    rows = []
    for rec in records:
        base = {"bench": rec["name"], "command": rec["command"], "mode": rec["mode"]}
        if rec["status"] == "ok":
            try:
                figures = FIGURES[rec["name"]](rec["payload"])
            except (KeyError, TypeError, ValueError, ZeroDivisionError) as err:
                rec["status"], rec["reason"] = "failed", f"its JSON lacks a figure: {type(err).__name__}: {err}"
            else:
                rows += [base | {"figure": f, "value": v, "text": t} for f, v, t in figures]
                continue
        if rec["status"] == "failed" and rec.get("payload") and rec["name"] in FIGURES:
            try:  # what a failed run did measure (flow_bench writes the runs before the failure)
                rows += [base | {"figure": f, "value": v, "text": t} for f, v, t in FIGURES[rec["name"]](rec["payload"])]
            except (KeyError, TypeError, ValueError, ZeroDivisionError):
                pass
        word = "FAILED" if rec["status"] == "failed" else "SKIPPED (not measurable on this machine)"
        rows.append(base | {"figure": rec["title"], "value": None, "text": f"**{word}**: {rec.get('reason', '')}"})
    return rows


def table_cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def render_markdown(report: dict) -> str:
    m = report["machine"]
    lines = [
        "# Benchmark report (`make bench`)",
        "",
        f"{report['finished_at']} · {report['wall_seconds'] / 60:.1f} min wall time for every benchmark below · "
        f"{m['cpus']} CPUs ({m['machine']}), 1-min load average {m['loadavg_1m_before']:.2f} before and "
        f"{m['loadavg_1m_after']:.2f} after · python {m['python']}",
        "",
        f"Commands run from the repository root with `.venv/bin/python`, one at a time; `{RESULTS}` is "
        f"`{report['places'][RESULTS]}`, `$WORK` a temporary directory removed at the end, and `{FLOW_PROJECT}` "
        "(`$WORK/flow/project`) the fresh git copy of the project in which `bench.flow_bench` ran the monthly flow.",
        "",
        "| benchmark | status | seconds | mode |",
        "|---|---|---:|---|",
    ]
    for rec in report["benches"]:
        lines.append(f"| {rec['name']} | {rec['status']} | {rec.get('seconds', 0):.0f} | {table_cell(rec['mode'])} |")
    lines += ["", "| benchmark | figure | value | command |", "|---|---|---|---|"]
    for row in report["figures"]:
        lines.append(f"| {row['bench']} | {table_cell(row['figure'])} | {table_cell(row['text'])} | `{table_cell(row['command'])}` |")
    if report["plots"]:
        lines += ["", "## Plots", ""]
        for title, path in report["plots"]:
            lines += [f"![{title}]({path})", ""]
    if report.get("plot_errors"):
        lines += ["", "Plots not drawn: " + "; ".join(report["plot_errors"])]
    return "\n".join(lines).rstrip() + "\n"


# ---------------------------------------------------------------- plots

def draw_plots(records: list[dict], out_dir: Path) -> tuple[list[tuple[str, str]], list[str]]:
    """PNG files beside latest.md from the benchmarks that ran; (title, relative path) and errors."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = {r["name"]: r["payload"] for r in records if r["status"] == "ok"}
    plots, errors = [], []

    def save(fig, name: str, title: str) -> None:
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=100)
        plt.close(fig)
        plots.append((title, name))

    def bars(ax, groups: dict[str, dict[str, float]], ylabel: str, log: bool = False) -> None:
        series = list(dict.fromkeys(s for g in groups.values() for s in g))
        width = 0.8 / max(1, len(series))
        for i, s in enumerate(series):
            xs = [j + i * width for j, g in enumerate(groups.values()) if s in g]
            ys = [g[s] for g in groups.values() if s in g]
            ax.bar(xs, ys, width, label=s)
        ax.set_xticks([j + width * (len(series) - 1) / 2 for j in range(len(groups))], list(groups))
        ax.set_ylabel(ylabel)
        if log:
            ax.set_yscale("log")
        ax.legend(fontsize=7)
        ax.grid(axis="y", alpha=0.3)

    try:
        if "flow_bench" in ok:
            runs = ok["flow_bench"]["runs"]
            fig, ax = plt.subplots(figsize=(6, 3.5))
            ax.bar([f"{r['name']}\n{r['month']}" for r in runs], [r["seconds"] for r in runs], color="tab:blue")
            for i, r in enumerate(runs):
                ax.annotate(f"{r['seconds']:.0f} s\nengine builds {r['engine_builds']}", (i, r["seconds"]),
                            ha="center", va="bottom", fontsize=8)
            ax.set_ylabel("wall seconds")
            ax.set_ylim(0, 1.25 * max(r["seconds"] for r in runs))
            ax.set_title("monthly flow: first run, unchanged rerun, next month")
            save(fig, "latest_flow.png", "monthly flow wall time and engine builds")
        if "engine_bench" in ok:
            res = ok["engine_bench"]["results"]
            fig, ax = plt.subplots(figsize=(7, 3.8))
            bars(ax, {cfg: {b: r["rows"][b]["decode_512_ms"] for b in r["rows"]} for cfg, r in res.items()},
                 "decode ms/token, past 512 (log)", log=True)
            ax.set_title("engine vs eager, LoRA as inputs vs merged")
            save(fig, "latest_engine.png", "engine vs eager decode latency")
        if "kv_engine_bench" in ok:
            rows = ok["kv_engine_bench"]["results"]["rows"]
            pasts = sorted(int(k.split("_")[1]) for k in rows["float32"] if k.endswith("_ms") and "p10" not in k)
            fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.8))
            bars(a1, {f"past {P}": {n: r[f"decode_{P}_ms"] for n, r in rows.items()} for P in pasts}, "decode ms/token")
            a1.set_title("quantized vs float KV cache: latency")
            a2.bar(list(rows), [r[f"kv_bytes_per_token_{pasts[-1]}"] for r in rows.values()], color="tab:green")
            a2.set_ylabel(f"KV bytes per token at past {pasts[-1]}")
            a2.set_title("bytes")
            a2.tick_params(axis="x", labelsize=7)
            save(fig, "latest_kv.png", "quantized vs float KV: latency and bytes")
        if "weight_quant_bench" in ok:
            res = ok["weight_quant_bench"]["results"]
            fig, ax = plt.subplots(figsize=(6, 3.5))
            bars(ax, {cfg: {v: row["decode_512_ms"] for v, row in r["rows"].items()} for cfg, r in res.items()},
                 "decode ms/token, past 512 (log)", log=True)
            ax.set_title("weight-only quantization (quick run)")
            save(fig, "latest_weight_quant.png", "fp32 vs int8 vs int4 weights")
    except Exception as err:  # a plot must not hide the table; the report says which failed
        errors.append(f"{type(err).__name__}: {err}")
    for rec in records:  # plots a benchmark draws itself
        png = Path(rec["json"]).with_suffix(".png")
        if rec["status"] == "ok" and png.exists():
            plots.append((f"{rec['name']} (drawn by the benchmark)", os.path.relpath(png, out_dir)))
    return plots, errors


def build_report(records: list[dict], places: dict[str, str], wall_seconds: float, machine: dict) -> dict:
    """latest.json: statuses, commands, figures and every payload; ``ok`` is False if any benchmark failed."""
    figures = table_rows(records)
    return {
        "finished_at": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "wall_seconds": round(wall_seconds, 1), "machine": machine, "places": places,
        "benches": records, "figures": figures, "plots": [],
        "ok": all(r["status"] != "failed" for r in records),
    }


def machine_info(load_before: float) -> dict:
    return {"cpus": os.cpu_count(), "machine": platform.processor() or platform.machine(),
            "python": platform.python_version(), "loadavg_1m_before": load_before, "loadavg_1m_after": os.getloadavg()[0]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="run every benchmark and write bench/results/latest.{json,md}")
    ap.add_argument("--out-dir", type=Path, default=REPO / "bench" / "results")
    ap.add_argument("--only", help="comma-separated benchmark names (default: all)")
    args = ap.parse_args(argv)
    out_dir = args.out_dir.resolve()
    results_dir = out_dir / "latest"
    results_dir.mkdir(parents=True, exist_ok=True)
    for stale in results_dir.iterdir():  # a benchmark that writes nothing this time must not show old numbers
        if stale.is_file():
            stale.unlink()
    only = set(args.only.split(",")) if args.only else None
    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    records: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="bench-") as work:
        places = {RESULTS: os.path.relpath(results_dir, REPO) if results_dir.is_relative_to(REPO) else str(results_dir),
                  FLOW_PROJECT: str(Path(work) / "flow" / "project"), "$WORK": work}
        run_places = places | {RESULTS: str(results_dir)}
        for bench in plan(flow_ready=False):
            if only is not None and bench.name not in only:
                continue
            if bench.name in ("kv_quality", "hotswap_bench"):  # decided once the flow benchmark has run
                bench = next(b for b in plan(flow_ready=flow_ready(Path(places[FLOW_PROJECT]))) if b.name == bench.name)
            records.append(run_bench(bench, run_places))
        wall = time.perf_counter() - start
    report = build_report(records, {RESULTS: places[RESULTS]}, wall, machine_info(load_before))
    report["plots"], report["plot_errors"] = draw_plots(records, out_dir)
    write_report(out_dir / "latest.json", report)
    (out_dir / "latest.md").write_text(render_markdown(report))
    print(f"wrote {out_dir / 'latest.md'}: {len(records)} benchmarks in {wall / 60:.1f} min; "
          + ", ".join(f"{r['name']} {r['status']}" for r in records))
    return 0 if report["ok"] else 1


def flow_ready(project: Path) -> bool:
    """The flow benchmark left a 2026-11 adapter and two packaged releases (kv_quality and hotswap use them)."""
    from tasks.config import parse_config
    from tasks.layout import PACKAGE, RELEASE_DIR

    layout = parse_config({"data": {"month": FLOW_MONTHS[0]}}).layout  # the flow benchmark runs the defaults
    return ((project / layout.adapter_dir / ADAPTER_CONFIG).exists()
            and len(list((project / layout.output_dir).glob(f"*/{PACKAGE}/{RELEASE_DIR}/manifest.json"))) >= 2)


if __name__ == "__main__":
    sys.exit(main())
