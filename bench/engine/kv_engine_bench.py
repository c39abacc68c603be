"""Quantized KV cache inside the engine: decode latency vs the float cache, ONNX Runtime CPU.

One run, interleaved (float, quantized, float, ...; see ``bench.lib.timing.interleaved``),
batch 1, 2 threads, on the tiny default backbone with a rank-8 LoRA as inputs:
  decode latency per token with a past of 512 and of 2048 tokens, and the KV bytes stored per token.

Engines (``runtime/engine/kv_model.py``):
  float32            the float-KV engine of issue 3 (the cache is fp32 ORT values)
  K4pre/V4t sink1    standard ONNX ops, kernels.kv_spec.PRE_ROPE_SCHEME: per-channel asymmetric keys before
                     RoPE, per-token symmetric values, one fp16 sink token (RoPE re-applied at every step)
  K4post/V4t sink1   standard ONNX ops, symmetric per-channel keys after RoPE: no RoPE at read
  K4c/V4c GQA op     ONNX Runtime's GroupQueryAttention reading the packed cache: static symmetric
                     per-channel K (after RoPE) and V, no sink (``kernels/gqa_attention.py``)

    python -m bench.engine.kv_engine_bench [--out bench/results/kv_engine_bench.json] [--iters 300]

Target (issue 4): quantized decode not slower than float at past 2048. Scales are calibrated on
random tokens: fine for latency, meaningless for quality (that is bench/quality/kv_schemes.py).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from bench.lib.backbones import RANK, SHAPES, TARGETS, make_backbone_and_adapter, random_kv_scales
from bench.lib.charts import bars, save_chart
from bench.lib.report import RESULTS, Figure, write_report
from bench.lib.tables import format_ms, table
from bench.lib.timing import engine_steps, interleaved
from kernels.kv_spec import PRE_ROPE_SCHEME, KVQuantSpec

SPECS = {  # name -> (KVQuantSpec fields, how the engine reads the cache)
    "K4pre/V4t sink1": (PRE_ROPE_SCHEME.to_dict(), "standard"),
    "K4post/V4t sink1": (PRE_ROPE_SCHEME.to_dict() | dict(k_symmetric=True, pre_rope_keys=False), "standard"),
    "K4c/V4c GQA op": (KVQuantSpec().to_dict(), "gqa"),  # the KVQuantSpec defaults: the scheme the release ships
}
PASTS = (512, 2048)


def cache_bytes_per_token(engine, cache, past: int) -> float:
    arrays = engine.cache_to_numpy(cache)
    arrays = arrays.values() if isinstance(arrays, dict) else arrays
    return sum(a.nbytes for a in arrays if a.dtype != np.int64) / past  # positions are bookkeeping, not KV


def run(iters: int, threads: int, work: Path) -> dict:
    from runtime.engine.adapter import load_adapter
    from runtime.engine.backends.onnxruntime import OrtEngine
    from runtime.engine.model import read_config
    from tasks.stages.compile import compile_engine

    dims = SHAPES["tiny"]
    model_dir, adapter_dir = make_backbone_and_adapter(work, dims)
    cfg = read_config(model_dir)
    compile_engine(model_dir, work / "engine_float", RANK, TARGETS, ort_threads=threads)
    engines = {"float32": OrtEngine(work / "engine_float", threads=threads)}
    lora = load_adapter(adapter_dir, engines["float32"].interface)
    engines["float32"].set_adapter(lora)
    for name, (fields, attention) in SPECS.items():
        spec = KVQuantSpec(**fields)
        engine_dir = work / f"engine_{len(engines)}"
        compile_engine(model_dir, engine_dir, RANK, TARGETS, ort_threads=threads, kv_spec=spec.to_dict(),
                       kv_attention=attention)
        engines[name] = OrtEngine(engine_dir, threads=threads)
        engines[name].set_adapter(lora, kv_scales=random_kv_scales(model_dir, lora, spec))

    rows: dict[str, dict] = {name: {} for name in engines}
    for P in PASTS:
        steps = {name: engine_steps(e, cfg, P) for name, e in engines.items()}
        stats = interleaved(steps, iters, rounds=20)
        for name, e in engines.items():
            _, cache = e.forward(np.zeros((1, P), np.int64), np.arange(P)[None], np.ones((1, P), np.int64), None)
            rows[name][f"decode_{P}_ms"] = stats[name]["median"]
            rows[name][f"decode_{P}_p10_ms"] = stats[name]["p10"]
            rows[name][f"kv_bytes_per_token_{P}"] = cache_bytes_per_token(e, cache, P)
    base = rows["float32"]
    ratios = {name: {f"decode_{P}": row[f"decode_{P}_ms"] / base[f"decode_{P}_ms"] for P in PASTS}
              | {f"decode_{P}_p10": row[f"decode_{P}_p10_ms"] / base[f"decode_{P}_p10_ms"] for P in PASTS}
              for name, row in rows.items() if name != "float32"}
    return {"dims": dims, "rows": rows, "ratios_vs_float": ratios, "loadavg_1m_after": os.getloadavg()[0]}


def print_results(res: dict) -> None:
    print(f"\n== tiny {res['dims']}  (1-min load average after: {res['loadavg_1m_after']:.2f})")
    cols = [f"decode_{P}_ms" for P in PASTS] + [f"decode_{P}_p10_ms" for P in PASTS] + [f"kv_bytes_per_token_{PASTS[-1]}"]
    print(table(["cache", *cols], ([name, *(f"{row[c]:.3f}" for c in cols)] for name, row in res["rows"].items())))
    for name, r in res["ratios_vs_float"].items():
        print(f"  {name:<18} quantized / float: " + "  ".join(f"{k} {v:.2f}x" for k, v in r.items()))


def measured_pasts(rows: dict) -> list[int]:
    """The pasts a run measured, from its float row's keys (``decode_<P>_ms``)."""
    return sorted(int(k.split("_")[1]) for k in rows["float32"] if k.startswith("decode_") and k.endswith("_ms")
                  and "p10" not in k)


def figures(p: dict) -> list[Figure]:
    """Decode ms per token of each cache at each past, its ratio to the float cache, and the KV bytes per token."""
    res, rows = p["results"], []
    pasts = measured_pasts(res["rows"])
    for name, row in res["rows"].items():
        for P in pasts:
            rows.append(Figure(f"decode ms/token, past {P}, {name} KV cache", row[f"decode_{P}_ms"],
                               format_ms(row[f"decode_{P}_ms"])))
    for name, r in res["ratios_vs_float"].items():
        for P in pasts:
            rows.append(Figure(f"{name} / float32 decode latency, past {P}", r[f"decode_{P}"], f"{r[f'decode_{P}']:.2f}x"))
    last = pasts[-1]
    for name, row in res["rows"].items():
        v = row[f"kv_bytes_per_token_{last}"]
        rows.append(Figure(f"KV bytes per token stored by the engine at past {last}, {name}", v, f"{v:,.0f} B"))
    return rows


def plot(p: dict, path: Path) -> None:
    rows = p["results"]["rows"]
    pasts = measured_pasts(rows)

    def draw(axes):
        latency, size = axes
        bars(latency, {f"past {P}": {n: r[f"decode_{P}_ms"] for n, r in rows.items()} for P in pasts}, "decode ms/token")
        latency.set_title("quantized vs float KV cache: latency")
        size.bar(list(rows), [r[f"kv_bytes_per_token_{pasts[-1]}"] for r in rows.values()], color="tab:green")
        size.set_ylabel(f"KV bytes per token at past {pasts[-1]}")
        size.set_title("bytes")
        size.tick_params(axis="x", labelsize=7)

    save_chart(path, draw, ncols=2, figsize=(10, 3.8))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="decode latency: quantized vs float KV cache in the ORT engine")
    ap.add_argument("--out", type=Path, default=RESULTS / "kv_engine_bench.json")
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as work:
        res = run(args.iters, args.threads, Path(work))
    print_results(res)
    import onnxruntime

    payload = {
        "batch": 1, "threads": args.threads, "iters": args.iters, "lora_rank": RANK, "specs": SPECS,
        "versions": {"torch": torch.__version__, "onnxruntime": onnxruntime.__version__},
        "cpus": os.cpu_count(), "loadavg_1m_before": load_before, "results": res,
    }
    write_report(args.out, payload)
    plot(payload, args.out.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
