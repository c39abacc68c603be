"""Weight-only quantization benchmark: fp32 vs int8 vs int4 (RTN, norm-folded, block 128 and 32) ONNX Runtime engines.

One command, batch 1, 2 threads, every engine with LoRA as inputs (rank 8 on q/k/v/o, a
random non-zero adapter) plus LoRA-merged exports of the same precision for the LoRA-as-input
overhead. All variants of a config are timed interleaved (A B C ..., A B C ...), so load from
other processes on the machine hits them alike; medians and p10 are reported, with ratios.

    python -m bench.engine.weight_quant_bench [--configs tiny,0.5b-width] [--pasts 512,2048] [--out bench/results/weight_quant_bench.json]

Measured: decode ms/token after a past of P, prefill of 128 tokens. Target (issues 3 and 8):
LoRA-as-input overhead <= 20% tiny, <= 5% 0.5B-width. The comparison with llama.cpp, in the same
run, is ``bench/engine/llama_cpp_bench.py`` (``make bench-peer``).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
from pathlib import Path

import torch

from bench.lib.backbones import RANK, TARGETS, WEIGHT_QUANT_SHAPES, WEIGHT_VARIANTS, build_weight_variants
from bench.lib.charts import bars, save_chart
from bench.lib.report import RESULTS, Figure, write_report
from bench.lib.tables import format_ms, table
from bench.lib.timing import engine_steps, interleaved


def bench_config(name: str, dims: dict, iters: int, threads: int, work: Path, pasts: list[int], variants: list[str]) -> dict:
    cfg, engines, sizes = build_weight_variants(name, dims, threads, work, variants)
    rows: dict[str, dict] = {v: {} for v in variants}
    p10: dict[str, dict] = {v: {} for v in variants}
    cases = [(P, f"decode_{P}_ms", iters, 20) for P in pasts] + [(None, "prefill_128_ms", max(10, iters // 10), 5)]
    for P, key, n, rounds in cases:
        stats = interleaved({v: engine_steps(e, cfg, P) for v, e in engines.items()}, n, rounds)
        for v, s in stats.items():
            rows[v][key], p10[v][key] = s["median"], s["p10"]
    ratios = {}
    for v in variants:
        if v != "fp32" and "fp32" in rows:
            ratios[f"fp32_over_{v}"] = {k: rows["fp32"][k] / rows[v][k] for k in rows[v]}
        if not v.endswith("_merged") and f"{v.split('_')[0]}_merged" in rows and v.split("_")[0] == v:
            m = rows[f"{v}_merged"]
            ratios[f"lora_overhead_{v}"] = {k: rows[v][k] / m[k] - 1.0 for k in m}
            ratios[f"lora_overhead_{v}_p10"] = {k: p10[v][k] / p10[f"{v}_merged"][k] - 1.0 for k in m}
    return {"dims": dims, "rows": rows, "rows_p10": p10, "ratios": ratios, "onnx_bytes": sizes,
            "loadavg_1m_after": os.getloadavg()[0]}


def print_results(results: dict) -> None:
    for name, res in results.items():
        print(f"\n== {name}: {res['dims']}  (1-min load average after: {res['loadavg_1m_after']:.2f})")
        cols = list(next(iter(res["rows"].values())))
        print(table(["variant", "MiB", *(f"{c} [p10]" for c in cols)],
                    ([v, f"{res['onnx_bytes'][v] / 2**20:.1f}", *(f"{row[c]:.3f} [{res['rows_p10'][v][c]:.2f}]" for c in cols)]
                     for v, row in res["rows"].items())))
        for k, r in res["ratios"].items():
            shown = "  ".join(f"{c}: " + (f"{x:+.1%}" if k.startswith("lora") else f"{x:.2f}x") for c, x in r.items())
            print(f"  {k:<28} {shown}")


def headline_past(p: dict) -> int:
    """The past the figures and the chart quote: 512 where the run decoded after it, else its longest past."""
    row = next(iter(next(iter(p["results"].values()))["rows"].values()))
    pasts = [int(key.split("_")[1]) for key in row if key.startswith("decode_")]
    return 512 if 512 in pasts else max(pasts)


def figures(p: dict) -> list[Figure]:
    """Per config: decode ms per token at the headline past of each variant with its model size, and each one's
    speed-up over fp32."""
    P, rows = headline_past(p), []
    for cfg, res in p["results"].items():
        for v, row in res["rows"].items():
            mib = res["onnx_bytes"][v] / 2**20
            rows.append(Figure(f"{cfg}: decode ms/token, past {P}, {v} weights ({mib:.1f} MiB model.onnx)",
                               row[f"decode_{P}_ms"], format_ms(row[f"decode_{P}_ms"])))
        for key, r in res["ratios"].items():
            if key.startswith("fp32_over_"):
                rows.append(Figure(f"{cfg}: {key.removeprefix('fp32_over_')} speed-up over fp32, decode past {P}",
                                   r[f"decode_{P}_ms"], f"{r[f'decode_{P}_ms']:.2f}x"))
    return rows


def plot(p: dict, path: Path) -> None:
    P = headline_past(p)

    def draw(ax):
        bars(ax, {cfg: {v: row[f"decode_{P}_ms"] for v, row in r["rows"].items()} for cfg, r in p["results"].items()},
             f"decode ms/token, past {P} (log)", log=True)
        ax.set_title("weight-only quantization")

    save_chart(path, draw)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="decode/prefill latency of fp32 vs int8 vs int4 weight engines")
    ap.add_argument("--out", type=Path, default=RESULTS / "weight_quant_bench.json")
    ap.add_argument("--configs", default="tiny,0.5b-width")
    ap.add_argument("--pasts", default="512,2048")
    ap.add_argument("--variants", default=",".join(WEIGHT_VARIANTS))
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]
    variants = args.variants.split(",")
    pasts = [int(p) for p in args.pasts.split(",")]
    results = {}
    with tempfile.TemporaryDirectory() as work:
        for name in args.configs.split(","):
            results[name] = bench_config(name, WEIGHT_QUANT_SHAPES[name], args.iters, args.threads, Path(work), pasts,
                                         variants)
    print_results(results)
    import onnxruntime

    payload = {
        "batch": 1, "threads": args.threads, "iters": args.iters, "lora_rank": RANK, "targets": list(TARGETS),
        "variants": {v: dict(zip(("weights", "fold_norms", "accuracy_level", "merged", "block_size"), WEIGHT_VARIANTS[v]))
                     for v in variants},
        "versions": {"torch": torch.__version__, "onnxruntime": onnxruntime.__version__},
        "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
        "loadavg_1m_before": load_before, "results": results,
    }
    write_report(args.out, payload)
    plot(payload, args.out.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
