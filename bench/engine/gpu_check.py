"""The checks a session lent an NVIDIA GPU runs first, in one command (`make gpu-check`).

    python -m bench.engine.gpu_check [--params params.yaml] [--real-params examples/smollm2.yaml] [--skip-unavailable]

Each part is one row of one table and one entry of the JSON (``--out``):

1. ``finetune/default``: the fine-tune stage's ``finetune`` on the GPU (``train.device: cuda``, bf16
   autocast where the GPU computes bf16) and on the CPU, same seed and steps, on the embedded default
   of ``--params`` (its base built here first): steps/s of both, and the GPU adapter's validation loss
   against the CPU one's (within ``--val-tolerance``, relative).
2. ``finetune/real``: the same on the real-model profile ``--real-params`` (its checkpoint at
   ``base_model.path``), for ``--real-steps`` steps.
3. ``tensorrt/default`` and ``tensorrt/real``: the ONNX engine of a random backbone of ``--config`` shape
   (the default) and of the real checkpoint, each with two random LoRA adapters; the TensorRT plan
   (ONNX parser, timing cache, optimization profile); parity with ONNX Runtime (prefill + decode logits,
   greedy generations, an adapter swap on the same execution context); weight-only int8 and int4
   (``tasks.weights.graph`` format ``qdq_fp16``) against ONNX Runtime on the same graph; decode latency at
   past 128 / 512 and a 128-token prefill, ONNX Runtime on the CPU against each plan.
4. ``torch_tensorrt/default``: the second builder (torch.export -> torch-tensorrt) on the default.

A part that cannot run here is skipped with its reason (no CUDA device, no tensorrt or torch_tensorrt
package, no real-model profile or checkpoint): with ``--skip-unavailable`` (``make gpu-check``) a machine
without a GPU runs the whole script as a dry run that says what each part needs. Without it a machine
without TensorRT exits 2 ("cannot run here"), as ``bench.run_all`` expects. Exits 1 if a part failed.
Budget: about 10 minutes on an H200 (the real profile's plans are the largest part; not yet measured).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import numpy as np

from bench.lib.backbones import SHAPES, make_backbone_and_adapter, random_adapter
from bench.lib.report import RESULTS, Figure, write_report
from bench.lib.tables import format_ms, table
from bench.lib.timing import engine_latency

DEFAULT_REAL_PARAMS = Path("examples/smollm2.yaml")


class Unavailable(Exception):
    """A part this machine cannot run; the message says what is missing."""


def need_cuda() -> None:
    import torch

    if not torch.cuda.is_available():
        raise Unavailable(f"no CUDA device: torch.cuda.is_available() is False (torch {torch.__version__})")


def need_tensorrt():
    from runtime.engine.backends.tensorrt import TensorRTUnavailable, require_tensorrt

    try:
        return require_tensorrt()
    except TensorRTUnavailable as err:
        raise Unavailable(str(err)) from None


def need_real_profile(path: Path):
    """The real-model profile's config; Unavailable if the file or its checkpoint is absent."""
    from tasks.config import load_config

    if not path.exists():
        raise Unavailable(f"{path}: no real-model profile")
    cfg = load_config(path)
    if not Path(cfg.base_model.path, "config.json").exists():
        raise Unavailable(f"{path}: the real-model directory base_model.path {cfg.base_model.path} is absent")
    return cfg


def run_part(report: dict, name: str, part: Callable[[], dict]) -> None:
    """Run one part into ``report["parts"][name]``: ok, failed (with its traceback) or skipped (with why)."""
    start = time.perf_counter()
    try:
        result = part()
    except Unavailable as why:
        report["parts"][name] = {"status": "skipped", "reason": str(why)}
        return
    except Exception:  # one part failing must not hide the others' results
        report["parts"][name] = {"status": "failed", "reason": traceback.format_exc(limit=5)}
        return
    passed = result.pop("passed")
    report["parts"][name] = {"status": "ok" if passed else "failed", "seconds": round(time.perf_counter() - start, 1),
                             **result}


# ------------------------------------------------------------------ fine-tuning, GPU against CPU

def finetune_part(cfg, work: Path, steps: int | None, tolerance: float, accelerated: str = "cuda") -> dict:
    """The fine-tune of ``cfg`` on the CPU and on the ``accelerated`` device (``train.device``) from the
    same seed: speed and validation loss. ``accelerated="cpu"`` runs the part where no GPU is (its test)."""
    if accelerated == "cuda":
        need_cuda()
    from tasks.stages.base_model import build_base_model
    from tasks.stages.data import prepare_data
    from tasks.stages.finetune import finetune

    data_dir = prepare_data(cfg.data, cfg.base_model.trained_through, work / "data")
    if cfg.base_model.source == "embedded":
        base_dir = build_base_model(cfg.base_model, cfg.data, cfg.train, work / "base", cfg.base_build_hash())
    else:
        base_dir = Path(cfg.base_model.path)
    runs = {}
    # Every core for the CPU reference: a machine lent a GPU has more than train.threads, and the check has a budget.
    threads = max(cfg.train.threads, os.cpu_count() or 1)
    for role, device in (("cpu", "cpu"), ("accelerated", accelerated)):
        train = cfg.train.model_copy(update={"device": device, "processes": 1, "threads": threads,
                                             **({"steps": steps} if steps else {})})
        start = time.perf_counter()
        adapter = finetune(base_dir, data_dir, work / f"finetune-{role}", cfg.lora, train, cfg.params_hash())
        seconds = time.perf_counter() - start
        trained = json.loads((adapter.parent / "train_metrics.json").read_text())
        runs[role] = {key: trained[key] for key in ("device", "precision", "steps", "final_val_loss")} | {
            "seconds": round(seconds, 1), "steps_per_s": trained["steps"] / seconds}
    cpu, fast = runs["cpu"], runs["accelerated"]
    rel = abs(fast["final_val_loss"] - cpu["final_val_loss"]) / cpu["final_val_loss"]
    return {"passed": rel <= tolerance, **runs, "val_loss_rel_diff": rel, "speedup": fast["steps_per_s"] / cpu["steps_per_s"]}


def finetune_summary(part: dict) -> str:
    cpu, fast = part["cpu"], part["accelerated"]
    return (f"{fast['device']} {fast['precision']} {fast['steps_per_s']:.2f} steps/s vs cpu {cpu['steps_per_s']:.2f} "
            f"({part['speedup']:.1f}x); val loss {fast['final_val_loss']:.4f} vs {cpu['final_val_loss']:.4f} "
            f"({100 * part['val_loss_rel_diff']:.2f}%)")


# ------------------------------------------------------------------ TensorRT plans against ONNX Runtime

def random_adapters(model_dir: Path, work: Path) -> tuple[Path, Path]:
    """Two random LoRA adapters (seeds 0 and 1) of the backbone at ``model_dir``."""
    import torch
    from transformers import AutoModelForCausalLM

    out = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True)
        out.append(random_adapter(model, model_dir, work / f"adapter-{seed}"))
    return out[0], out[1]


Backbone = Callable[[], tuple[Path, tuple[Path, Path]]]  # makes or finds a checkpoint and two adapters of it


def tensorrt_part(backbone: Backbone, work: Path, args) -> dict:
    """fp32 plan parity and adapter swap, int8/int4 weight-only plans, decode latency (module docstring, 3)."""
    trt = need_tensorrt()  # before building anything
    model_dir, adapters = backbone()
    from runtime.engine.adapter import load_adapter
    from runtime.engine.backends.onnxruntime import OrtEngine
    from runtime.engine.backends.tensorrt import TensorRTEngine, build_plan
    from runtime.engine.generate import greedy_generate
    from runtime.engine.model import read_config
    from tasks.stages.compile import compile_engine
    from tasks.weights.engines import open_on_cpu, quantize_engine_dir

    engine_dir = work / "engine"
    compile_engine(model_dir, engine_dir)
    build_plan(engine_dir)
    ort_engine, trt_engine = OrtEngine(engine_dir), TensorRTEngine(engine_dir)
    lora, other = (load_adapter(a, ort_engine.interface) for a in adapters)
    for engine in (ort_engine, trt_engine):
        engine.set_adapter(lora)
    cfg = read_config(model_dir)
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 24))
    pos, mask = np.broadcast_to(np.arange(24), (2, 24)), np.ones((2, 24), np.int64)
    logits = []
    for engine in (ort_engine, trt_engine):
        a, cache = engine.forward(ids[:, :16], pos[:, :16], mask[:, :16], None)  # prefill 16
        b, _ = engine.forward(ids[:, 16:], pos[:, 16:], mask, cache)  # 8 more on its cache
        logits.append(np.concatenate([a, b], axis=1))
    max_diff = float(np.abs(logits[0] - logits[1]).max())
    prompts = [ids[0, :10].tolist(), ids[1, :5].tolist()]
    same_greedy = greedy_generate(ort_engine, prompts, 16) == greedy_generate(trt_engine, prompts, 16)
    context = trt_engine._context
    for engine in (ort_engine, trt_engine):
        engine.set_adapter(other)
    swapped = [e.forward(ids[:, :16], pos[:, :16], mask[:, :16], None)[0] for e in (ort_engine, trt_engine)]
    for engine in (ort_engine, trt_engine):
        engine.set_adapter(lora)
    swap_ok = trt_engine._context is context and float(np.abs(swapped[0] - swapped[1]).max()) <= args.tolerance
    checks = {"fp32": {"max_abs_logit_diff": max_diff, "greedy_identical": same_greedy,
                       "adapter_swap_same_context": swap_ok}}
    ok = max_diff <= args.tolerance and same_greedy and swap_ok
    latency = {"ort_cpu": engine_latency(ort_engine, cfg, args.iters),
               "tensorrt_fp32": engine_latency(trt_engine, cfg, args.iters)}
    for weights in ("int8", "int4"):
        wdir = work / f"engine-{weights}-qdq_fp16"
        quantize_engine_dir(engine_dir, wdir, weights, fmt="qdq_fp16")
        build_plan(wdir)
        want_engine, got_engine = open_on_cpu(wdir), TensorRTEngine(wdir)
        for e in (want_engine, got_engine):
            e.set_adapter(lora)
        want, got = (e.forward(ids, pos, mask, None)[0] for e in (want_engine, got_engine))
        rel = float(np.abs(want - got).max() / np.abs(want).max())
        greedy = greedy_generate(want_engine, prompts, 16) == greedy_generate(got_engine, prompts, 16)
        checks[weights] = {"max_abs_logit_diff_relative": rel, "greedy_identical": greedy,
                           "plan_bytes": (wdir / "model.plan").stat().st_size}
        ok &= rel <= args.fp16_tolerance and greedy
        latency[f"tensorrt_{weights}_qdq_fp16"] = engine_latency(got_engine, cfg, args.iters)
    return {"passed": bool(ok), "tensorrt": trt.__version__, "checks": checks, "latency_ms": latency}


def tensorrt_summary(part: dict) -> str:
    checks, latency = part["checks"], part["latency_ms"]
    speeds = ", ".join(f"{name} {row['decode_512_ms']:.2f}" for name, row in latency.items())
    int8, int4 = (checks[w]["max_abs_logit_diff_relative"] for w in ("int8", "int4"))
    return (f"fp32 max|dlogit| {checks['fp32']['max_abs_logit_diff']:.1e}, int8 rel {int8:.1e}, int4 rel {int4:.1e}; "
            f"decode past 512 ms: {speeds}")


def torch_tensorrt_part(backbone: Backbone, work: Path) -> dict:
    need_tensorrt()
    try:
        import torch_tensorrt
    except ImportError as err:
        raise Unavailable(f"torch_tensorrt is not installed ({err})") from None
    from runtime.engine.backends.tensorrt import build_plan_torch_tensorrt
    from tasks.stages.compile import compile_engine

    model_dir, _ = backbone()
    engine_dir = work / "engine"
    compile_engine(model_dir, engine_dir)
    plan = build_plan_torch_tensorrt(model_dir, engine_dir)
    return {"passed": True, "torch_tensorrt": torch_tensorrt.__version__, "plan_bytes": plan.stat().st_size}


# ------------------------------------------------------------------ the run

def summary(name: str, part: dict) -> str:
    if part["status"] != "ok" and "reason" in part:
        return part["reason"].strip().splitlines()[-1]
    if name.startswith("finetune/"):
        return finetune_summary(part)
    if name.startswith("tensorrt/"):
        return tensorrt_summary(part)
    return f"plan {part['plan_bytes']} bytes"


def print_results(report: dict) -> None:
    print(table(["part", "status", "result"],
                ([name, part["status"].upper() if part["status"] == "failed" else part["status"], summary(name, part)]
                 for name, part in report["parts"].items()), align="<<<", markdown=True))


def figures(p: dict) -> list[Figure]:
    """Whether the checks passed, and the latency of every backend a part timed."""
    rows = [Figure("GPU checks passed", p.get("passed"), str(p.get("passed")))]
    for backend, row in p.get("latency_ms", {}).items():
        for key, v in row.items():
            rows.append(Figure(f"{backend}: {key}", v, format_ms(v)))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=RESULTS / "gpu_check.json")
    ap.add_argument("--params", type=Path, default=Path("params.yaml"), help="the default's settings (fine-tune)")
    ap.add_argument("--real-params", type=Path, default=DEFAULT_REAL_PARAMS,
                    help="the real-model profile; skipped with its reason if it or its checkpoint is absent")
    ap.add_argument("--config", default="tiny", choices=list(SHAPES), help="the default's backbone shape (TensorRT)")
    ap.add_argument("--steps", type=int, default=200,
                    help="fine-tune steps of the default on each device (its train.steps, 600, would not fit the budget)")
    ap.add_argument("--real-steps", type=int, default=20, help="fine-tune steps of the real model, on each device")
    ap.add_argument("--val-tolerance", type=float, default=0.05, help="GPU vs CPU adapter val loss, relative")
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--tolerance", type=float, default=1e-3, help="fp32 TensorRT (TF32 off) vs ORT max abs logit diff")
    ap.add_argument("--fp16-tolerance", type=float, default=1e-2,
                    help="weight-only engines (fp16 GEMMs) vs ORT on the same graph: max abs logit diff / max abs logit")
    ap.add_argument("--skip-unavailable", action="store_true",
                    help="skip each part this machine cannot run, with its reason (a dry run without a GPU)")
    args = ap.parse_args(argv)

    from tasks.config import load_config

    if not args.skip_unavailable:
        try:
            need_tensorrt()
        except Unavailable as why:
            print(f"gpu_check: cannot run here: {why}", file=sys.stderr)
            return 2
    default_cfg = load_config(args.params)
    report: dict = {"config": args.config, "params": str(args.params), "real_params": str(args.real_params), "parts": {}}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)

        @functools.cache  # tensorrt/default and torch_tensorrt/default share it
        def default_backbone() -> tuple[Path, tuple[Path, Path]]:
            model_dir, _ = make_backbone_and_adapter(work / "default", SHAPES[args.config])
            return model_dir, random_adapters(model_dir, work / "default")

        def real_backbone() -> tuple[Path, tuple[Path, Path]]:
            model_dir = Path(need_real_profile(args.real_params).base_model.path)
            return model_dir, random_adapters(model_dir, work / "real")

        def real_finetune() -> dict:
            need_cuda()  # the machine first, then the profile: a dry run names the hardware it lacks
            return finetune_part(need_real_profile(args.real_params), work / "ft-real", args.real_steps, args.val_tolerance)

        run_part(report, "finetune/default",
                 lambda: finetune_part(default_cfg, work / "ft-default", args.steps, args.val_tolerance))
        run_part(report, "finetune/real", real_finetune)
        run_part(report, "tensorrt/default", lambda: tensorrt_part(default_backbone, work / "trt-default", args))
        run_part(report, "tensorrt/real", lambda: tensorrt_part(real_backbone, work / "trt-real", args))
        run_part(report, "torch_tensorrt/default", lambda: torch_tensorrt_part(default_backbone, work / "tt-default"))
    report["latency_ms"] = {f"{name}/{backend}": row for name, part in report["parts"].items()
                            for backend, row in part.get("latency_ms", {}).items()}
    statuses = [part["status"] for part in report["parts"].values()]
    report["passed"] = "failed" not in statuses and "ok" in statuses
    write_report(args.out, report)  # first: the GPU time is spent
    print_results(report)
    print("FAILED" if "failed" in statuses else "PASSED" if "ok" in statuses else "DRY RUN (every part skipped)")
    return 1 if "failed" in statuses else 0


if __name__ == "__main__":
    sys.exit(main())
