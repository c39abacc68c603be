"""Engine benchmark: eager PyTorch vs the ONNX Runtime engine (LoRA as inputs) vs a LoRA-merged export.

One command, one run, side by side, batch 1, 2 threads:
  decode latency per token with a past of 128 and of 512 tokens, and a 128-token prefill.
on the tiny default backbone and on a 0.5B-width configuration (random weights, few layers).

    python -m bench.engine.engine_bench [--out bench/results/engine_bench.json] [--configs tiny,0.5b-width]

Targets (issue 3): engine decode >= 4x faster than eager at past 512 on tiny; LoRA-as-input
overhead over merged <= 20% on tiny and <= 5% on 0.5B-width. Vocabulary is the tiny
tokenizer's (512) for both, so the LM head does not hide the per-layer LoRA cost.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
from pathlib import Path

import torch

from bench.lib.backbones import RANK, SHAPES, TARGETS, make_backbone_and_adapter
from bench.lib.charts import bars, save_chart
from bench.lib.report import RESULTS, Figure, write_report
from bench.lib.tables import format_ms, table
from bench.lib.timing import engine_steps, interleaved
from runtime.engine.interface import ENGINE_ONNX

BACKENDS = {  # the rows of a config, and what each runs
    "eager_torch_lora": "eager PyTorch forward + LoRA", "eager_hf_peft": "eager transformers + PEFT",
    "ort_lora_inputs": "engine (ONNX Runtime), LoRA as inputs", "ort_merged": "engine, LoRA merged into weights"}


def hf_steps(model, P: int | None, prefill: int = 128):
    """transformers + PEFT (unmerged), eager: what serving without an engine would run."""
    from transformers import DynamicCache

    vocab = model.config.vocab_size
    if P is None:
        ids = torch.randint(0, vocab, (1, prefill))
        return lambda: model(ids, use_cache=False)
    ids = torch.randint(0, vocab, (1, P + 1))
    cache = DynamicCache(config=model.config)
    model(ids[:, :P], past_key_values=cache, use_cache=True)

    def step():
        model(ids[:, P:], past_key_values=cache, use_cache=True)
        cache.crop(-1)  # drop the new token: back to P; a view, negligible next to a forward

    return step


def bench_config(name: str, dims: dict, iters: int, threads: int, work: Path) -> dict:
    from runtime.engine.adapter import load_adapter
    from runtime.engine.backends.onnxruntime import OrtEngine
    from runtime.engine.backends.torch_eager import TorchEngine
    from runtime.engine.interface import INTERFACE_FILE, write_interface
    from runtime.engine.model import read_config
    from tasks.stages.compile import compile_engine, export_backbone

    root = work / name
    model_dir, adapter_dir = make_backbone_and_adapter(root, dims)
    cfg = read_config(model_dir)
    compile_engine(model_dir, root / "engine", RANK, TARGETS, ort_threads=threads)
    lora_engine = OrtEngine(root / "engine", threads=threads)
    lora = load_adapter(adapter_dir, lora_engine.interface)
    lora_engine.set_adapter(lora)
    merged_dir = root / "engine_merged"
    merged_dir.mkdir()
    iface = export_backbone(model_dir, merged_dir / ENGINE_ONNX, RANK, (), merged_lora=lora)
    write_interface(iface, merged_dir / INTERFACE_FILE)
    merged_engine = OrtEngine(merged_dir, threads=threads)

    eager = TorchEngine(model_dir, lora_engine.interface, threads=threads)
    eager.set_adapter(lora)
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    hf = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), adapter_dir)
    hf.eval()
    engines = {"eager_torch_lora": eager, "ort_lora_inputs": lora_engine, "ort_merged": merged_engine}
    names = list(BACKENDS)
    rows: dict[str, dict] = {name: {} for name in names}
    p10: dict[str, dict] = {name: {} for name in names}
    with torch.inference_mode():
        for P, key, n in ((128, "decode_128_ms", iters), (512, "decode_512_ms", iters), (None, "prefill_128_ms", max(10, iters // 10))):
            steps = {name: engine_steps(e, cfg, P) for name, e in engines.items()}
            steps["eager_hf_peft"] = hf_steps(hf, P)
            # Eager steps are 10-100x slower: give them a tenth of the calls so a run stays minutes.
            rounds = 20 if P is not None else 5
            fast = interleaved({k: v for k, v in steps.items() if k.startswith("ort_")}, n, rounds)
            slow = interleaved({k: v for k, v in steps.items() if k.startswith("eager_")}, max(rounds, n // 10), rounds)
            for name, stats in (fast | slow).items():
                rows[name][key], p10[name][key] = stats["median"], stats["p10"]
    e, m = rows["ort_lora_inputs"], rows["ort_merged"]
    ratios = {
        "eager_over_engine_decode_512": rows["eager_torch_lora"]["decode_512_ms"] / e["decode_512_ms"],
        "hf_over_engine_decode_512": rows["eager_hf_peft"]["decode_512_ms"] / e["decode_512_ms"],
        **{f"lora_overhead_{k[:-3]}": e[k] / m[k] - 1.0 for k in e},
        **{f"lora_overhead_{k[:-3]}_p10": p10["ort_lora_inputs"][k] / p10["ort_merged"][k] - 1.0 for k in e},
    }
    return {"dims": dims, "rows": rows, "rows_p10": p10, "ratios": ratios, "loadavg_1m_after": os.getloadavg()[0]}


def print_results(results: dict) -> None:
    for name, res in results.items():
        print(f"\n== {name}: {res['dims']}  (1-min load average after: {res['loadavg_1m_after']:.2f})")
        cols = list(next(iter(res["rows"].values())))
        for title, rows in (("median", res["rows"]), ("p10 (least disturbed calls)", res["rows_p10"])):
            print(f"  {title}, ms:")
            print(table(["backend", *cols], ([backend, *(f"{row[c]:.3f}" for c in cols)] for backend, row in rows.items())))
        print(table(["ratio", ""], ([k, f"{v:+.1%}" if k.startswith("lora_overhead") else f"{v:.2f}x"]
                                    for k, v in res["ratios"].items())))


def figures(p: dict) -> list[Figure]:
    """Per config: decode ms per token at past 512 of each backend, the engine's speed-ups over eager, the
    LoRA-as-input overhead."""
    def pct(x: float) -> str:
        return f"{x:+.1f} %"

    rows = []
    for cfg, res in p["results"].items():
        for backend, label in BACKENDS.items():
            v = res["rows"][backend]["decode_512_ms"]
            rows.append(Figure(f"{cfg}: decode ms/token, past 512, {label}", v, format_ms(v)))
        r = res["ratios"]
        rows.append(Figure(f"{cfg}: engine speed-up over eager PyTorch, decode past 512", r["eager_over_engine_decode_512"],
                           f"{r['eager_over_engine_decode_512']:.2f}x"))
        rows.append(Figure(f"{cfg}: engine speed-up over transformers + PEFT, decode past 512", r["hf_over_engine_decode_512"],
                           f"{r['hf_over_engine_decode_512']:.2f}x"))
        for key, label in (("decode_128", "decode past 128"), ("decode_512", "decode past 512"), ("prefill_128", "prefill 128")):
            v, p10 = 100 * r[f"lora_overhead_{key}"], 100 * r[f"lora_overhead_{key}_p10"]
            rows.append(Figure(f"{cfg}: LoRA-as-input overhead vs merged, {label} (median; p10)", v, f"{pct(v)} ({pct(p10)})"))
    return rows


def plot(p: dict, path: Path) -> None:
    def draw(ax):
        bars(ax, {cfg: {b: r["rows"][b]["decode_512_ms"] for b in r["rows"]} for cfg, r in p["results"].items()},
             "decode ms/token, past 512 (log)", log=True)
        ax.set_title("engine vs eager, LoRA as inputs vs merged")

    save_chart(path, draw, figsize=(7, 3.8))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="engine latency: eager vs ORT LoRA-inputs vs ORT merged")
    ap.add_argument("--out", type=Path, default=RESULTS / "engine_bench.json")
    ap.add_argument("--configs", default="tiny,0.5b-width")
    ap.add_argument("--iters", type=int, default=400)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]  # > threads means another process competed for the cores
    results = {}
    with tempfile.TemporaryDirectory() as work:
        for name in args.configs.split(","):
            results[name] = bench_config(name, SHAPES[name], args.iters, args.threads, Path(work))
    print_results(results)
    import onnxruntime

    payload = {
        "batch": 1, "threads": args.threads, "iters": args.iters, "lora_rank": RANK, "targets": list(TARGETS),
        "versions": {"torch": torch.__version__, "onnxruntime": onnxruntime.__version__},
        "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "loadavg_1m_before": load_before,
        "results": results,
    }
    write_report(args.out, payload)
    plot(payload, args.out.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
