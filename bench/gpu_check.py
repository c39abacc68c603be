"""Every GPU check at once, for when an NVIDIA machine is available.

    python -m bench.gpu_check [--out bench/results/gpu_check.json] [--config tiny]

1. compile the ONNX engine (CPU, cached) for a random backbone + adapter,
2. build the TensorRT plan with the ONNX parser (timing cache, optimization profile),
3. parity: TensorRT vs ONNX Runtime, same adapter, prefill + decode logits (max abs diff),
   greedy generations identical, and an adapter swap on the same execution context,
4. the torch-tensorrt builder on the same forward (reported, not fatal if it fails),
5. weight-only int8 and int4 (``tasks.weight_graph`` format ``qdq_fp16``: symmetric blocked
   DequantizeLinear into fp16 MatMuls): plan build, parity with ONNX Runtime running the same graph
   (exact dequantization), greedy generations identical,
6. latency table: decode at past 128 / 512 and a 128-token prefill, ORT-CPU vs TensorRT fp32 / int8 / int4.
Prints a table and writes JSON; exits non-zero if a check fails.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import traceback
from pathlib import Path

import numpy as np


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("bench/results/gpu_check.json"))
    ap.add_argument("--config", default="tiny", choices=["tiny", "0.5b-width"])
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--tolerance", type=float, default=1e-3, help="fp32 TensorRT (TF32 off) vs ORT max abs logit diff")
    ap.add_argument("--fp16-tolerance", type=float, default=1e-2,
                    help="weight-only engines (fp16 GEMMs) vs ORT on the same graph: max abs logit diff / max abs logit")
    args = ap.parse_args(argv)

    from bench.engine_bench import CONFIGS, make_backbone_and_adapter, measure
    from runtime.engine.adapter import load_adapter
    from runtime.engine.backends.onnxruntime import OrtEngine
    from runtime.engine.backends.tensorrt import (
        TensorRTEngine, TensorRTUnavailable, build_plan, build_plan_torch_tensorrt, require_tensorrt,
    )
    from runtime.engine.generate import greedy_generate
    from runtime.engine.model import read_config
    from tasks.compile import compile_engine
    from tasks.weight_engines import open_on_cpu, quantize_engine_dir

    try:
        trt = require_tensorrt()
    except TensorRTUnavailable as err:
        print(f"gpu_check: cannot run here: {err}", file=sys.stderr)
        return 2
    report: dict = {"tensorrt": trt.__version__, "config": args.config, "checks": {}}
    ok = True
    with tempfile.TemporaryDirectory() as work:
        root = Path(work)
        model_dir, adapter_dir = make_backbone_and_adapter(root, CONFIGS[args.config])
        _, second_dir = make_backbone_and_adapter(root / "second", CONFIGS[args.config])
        engine_dir = root / "engine"
        compile_engine(model_dir, engine_dir)
        build_plan(engine_dir)
        ort_engine, trt_engine = OrtEngine(engine_dir), TensorRTEngine(engine_dir)
        lora = load_adapter(adapter_dir, ort_engine.interface)
        ort_engine.set_adapter(lora)
        trt_engine.set_adapter(lora)

        cfg = read_config(model_dir)
        ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 24))
        diffs = []
        for engine in (ort_engine, trt_engine):
            pos, mask = np.broadcast_to(np.arange(24), (2, 24)), np.ones((2, 24), np.int64)
            a, cache = engine.forward(ids[:, :16], pos[:, :16], mask[:, :16], None)
            b, _ = engine.forward(ids[:, 16:], pos[:, 16:], mask, cache)
            diffs.append(np.concatenate([a, b], axis=1))
        max_diff = float(np.abs(diffs[0] - diffs[1]).max())
        prompts = [ids[0, :10].tolist(), ids[1, :5].tolist()]
        same_greedy = greedy_generate(ort_engine, prompts, 16) == greedy_generate(trt_engine, prompts, 16)
        # The second adapter was made on another random backbone: its provenance would be
        # refused, so only its weights are used (require_provenance=False) to exercise a swap.
        context = trt_engine._context
        other = load_adapter(second_dir, trt_engine.interface, require_provenance=False)
        trt_engine.set_adapter(other)
        ort_engine.set_adapter(other)
        swapped = [e.forward(ids[:, :16], np.broadcast_to(np.arange(16), (2, 16)), np.ones((2, 16), np.int64), None)[0]
                   for e in (ort_engine, trt_engine)]
        trt_engine.set_adapter(lora)
        ort_engine.set_adapter(lora)
        swap_same_context = trt_engine._context is context and float(np.abs(swapped[0] - swapped[1]).max()) <= args.tolerance
        report["checks"]["parity"] = {"max_abs_logit_diff": max_diff, "greedy_identical": same_greedy,
                                      "adapter_swap_same_context": swap_same_context}
        ok &= max_diff <= args.tolerance and same_greedy and swap_same_context

        try:
            build_plan_torch_tensorrt(model_dir, engine_dir)
            report["checks"]["torch_tensorrt_build"] = "ok"
        except Exception:  # second builder: reported, not fatal
            report["checks"]["torch_tensorrt_build"] = traceback.format_exc(limit=3)

        rows = {"ort_cpu_lora_inputs": measure(ort_engine, cfg, args.iters),
                "tensorrt_lora_inputs": measure(trt_engine, cfg, args.iters)}
        for weights in ("int8", "int4"):
            name = f"tensorrt_{weights}_qdq_fp16"
            try:
                wdir = root / f"engine-{weights}-qdq_fp16"
                quantize_engine_dir(engine_dir, wdir, weights, fmt="qdq_fp16")
                build_plan(wdir)
                want_engine, got_engine = open_on_cpu(wdir), TensorRTEngine(wdir)
                for e in (want_engine, got_engine):
                    e.set_adapter(lora)
                pos, mask = np.broadcast_to(np.arange(24), (2, 24)), np.ones((2, 24), np.int64)
                want, got = (e.forward(ids, pos, mask, None)[0] for e in (want_engine, got_engine))
                rel = float(np.abs(want - got).max() / np.abs(want).max())
                greedy = greedy_generate(want_engine, prompts, 16) == greedy_generate(got_engine, prompts, 16)
                report["checks"][name] = {"max_abs_logit_diff_relative": rel, "greedy_identical": greedy,
                                          "plan_bytes": (wdir / "model.plan").stat().st_size}
                ok &= rel <= args.fp16_tolerance and greedy
                rows[name] = measure(got_engine, cfg, args.iters)
            except Exception:  # one format failing must not hide the others' results
                report["checks"][name] = traceback.format_exc(limit=5)
                ok = False
        report["latency_ms"] = rows
    print(json.dumps(report["checks"], indent=2))
    cols = list(next(iter(report["latency_ms"].values())))
    print(f"{'backend':<24}" + "".join(f"{c:>18}" for c in cols))
    for name, row in report["latency_ms"].items():
        print(f"{name:<24}" + "".join(f"{row[c]:>18.3f}" for c in cols))
    report["passed"] = bool(ok)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    print(f"{'PASSED' if ok else 'FAILED'}; wrote {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
