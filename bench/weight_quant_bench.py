"""Weight-only quantization benchmark: fp32 vs int8 vs int4 (RTN, norm-folded, block 128 and 32) ONNX Runtime engines.

One command, batch 1, 2 threads, every engine with LoRA as inputs (rank 8 on q/k/v/o, a
random non-zero adapter) plus LoRA-merged exports of the same precision for the LoRA-as-input
overhead. All variants of a config are timed interleaved (A B C ..., A B C ...), so load from
other processes on the machine hits them alike; medians and p10 are reported, with ratios.

    python -m bench.weight_quant_bench [--configs tiny,0.5b-width] [--pasts 512,2048] [--out bench/results/weight_quant.json]

Measured: decode ms/token after a past of P, prefill of 128 tokens. Target (issues 3 and 8):
LoRA-as-input overhead <= 20% tiny, <= 5% 0.5B-width. The comparison with llama.cpp, in the same
run, is ``bench/llama_cpp_bench.py`` (``make bench-peer``).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from bench.engine_bench import RANK, TARGETS, engine_steps, interleaved, make_backbone_and_adapter
from bench.report import write_report
from runtime.engine.interface import ENGINE_ONNX
from tasks.weight_graph import DEFAULT_BLOCK_SIZE

CONFIGS = {
    "tiny": dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, intermediate_size=1024,
                 num_hidden_layers=4, vocab_size=512),
    # Qwen2-0.5B widths, 6 layers as in the measurements (llama.cpp numbers are for the same).
    "0.5b-width": dict(hidden_size=896, num_attention_heads=14, num_key_value_heads=2, intermediate_size=4864,
                       num_hidden_layers=6, vocab_size=512),
}
B = DEFAULT_BLOCK_SIZE
# name -> (weights, fold_norms, accuracy_level, merged LoRA, block size)
VARIANTS = {
    "fp32": ("fp32", False, 0, False, B),
    "fp32_merged": ("fp32", False, 0, True, B),
    "int8": ("int8", False, 4, False, B),
    "int8_merged": ("int8", False, 4, True, B),
    "int8_b32": ("int8", False, 4, False, 32),
    "int8_acc0": ("int8", False, 0, False, B),
    "int4": ("int4", False, 4, False, B),
    "int4_merged": ("int4", False, 4, True, B),
    "int4_b32": ("int4", False, 4, False, 32),
    "int4_acc0": ("int4", False, 0, False, B),
    "int4_fold": ("int4", True, 4, False, B),
}


def build_variants(name: str, dims: dict, threads: int, work: Path, variants: list[str]):
    from runtime.engine.adapter import load_adapter
    from runtime.engine.backends.onnxruntime import OrtEngine
    from runtime.engine.interface import INTERFACE_FILE, write_interface
    from runtime.engine.model import read_config
    from tasks.compile import compile_engine, export_backbone
    from tasks.weight_engines import quantize_engine_dir

    root = work / name
    model_dir, adapter_dir = make_backbone_and_adapter(root, dims)
    cfg = read_config(model_dir)
    compile_engine(model_dir, root / "engine", RANK, TARGETS, ort_threads=threads)
    iface_lora = OrtEngine(root / "engine", threads=threads).interface
    lora = load_adapter(adapter_dir, iface_lora)
    merged_dir = root / "engine_merged"
    merged_dir.mkdir()
    iface = export_backbone(model_dir, merged_dir / ENGINE_ONNX, RANK, (), merged_lora=lora)
    write_interface(iface, merged_dir / INTERFACE_FILE)
    engines, sizes = {}, {}
    for v in variants:
        weights, fold, level, merged, block = VARIANTS[v]
        src = merged_dir if merged else root / "engine"
        out = root / f"v_{v}"
        quantize_engine_dir(src, out, weights, block, fold, ("lm_head", "embed"), level)
        sizes[v] = (out / ENGINE_ONNX).stat().st_size
        engine = OrtEngine(out, threads=threads)
        if not merged:
            engine.set_adapter(lora)
        engines[v] = engine
    return cfg, engines, sizes


def bench_config(name: str, dims: dict, iters: int, threads: int, work: Path, pasts: list[int], variants: list[str]) -> dict:
    cfg, engines, sizes = build_variants(name, dims, threads, work, variants)
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


def print_table(results: dict) -> None:
    for name, res in results.items():
        print(f"\n== {name}: {res['dims']}  (1-min load average after: {res['loadavg_1m_after']:.2f})")
        cols = list(next(iter(res["rows"].values())))
        print(f"{'variant':<14}{'MiB':>8}" + "".join(f"{c:>17}" for c in cols) + "   (median; p10 in brackets)")
        for v, row in res["rows"].items():
            cells = "".join(f"{row[c]:>9.3f} [{res['rows_p10'][v][c]:>6.2f}]" for c in cols)
            print(f"{v:<14}{res['onnx_bytes'][v] / 2**20:>8.1f}{cells}")
        for k, r in res["ratios"].items():
            shown = "  ".join(f"{c}: " + (f"{x:+.1%}" if k.startswith("lora") else f"{x:.2f}x") for c, x in r.items())
            print(f"  {k:<28} {shown}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="decode/prefill latency of fp32 vs int8 vs int4 weight engines")
    ap.add_argument("--out", type=Path, default=Path("bench/results/weight_quant.json"))
    ap.add_argument("--configs", default="tiny,0.5b-width")
    ap.add_argument("--pasts", default="512,2048")
    ap.add_argument("--variants", default=",".join(VARIANTS))
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
            results[name] = bench_config(name, CONFIGS[name], args.iters, args.threads, Path(work), pasts, variants)
    print_table(results)
    import onnxruntime

    payload = {
        "batch": 1, "threads": args.threads, "iters": args.iters, "lora_rank": RANK, "targets": list(TARGETS),
        "variants": {v: dict(zip(("weights", "fold_norms", "accuracy_level", "merged", "block_size"), VARIANTS[v]))
                     for v in variants},
        "versions": {"torch": torch.__version__, "onnxruntime": onnxruntime.__version__},
        "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
        "loadavg_1m_before": load_before, "results": results,
    }
    write_report(args.out, payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
