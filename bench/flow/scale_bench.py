"""The real target size: the whole monthly flow on a backbone of Qwen2-0.5B's shape (issue 16).

    python -m bench.flow.scale_bench [--workdir DIR] [--out bench/results/scale_bench.json] [--iters 200]

Not in CI. Steps, all in one run:

1. **The backbone.** A Hugging Face directory with Qwen2-0.5B's config (24 layers, hidden 896, 14
   heads, 2 KV heads, intermediate 4864, vocabulary 151,936, tied embeddings, q/k/v bias), bf16
   safetensors of random weights (about 988 MB) and the embedded default's tokenizer
   (``bench.lib.backbones.build_qwen2_05b_shape``). Built once into ``--workdir`` and reused.
2. **The monthly flow.** ``python -m flows.monthly_release --params FILE`` in a fresh copy of the
   project (``bench.lib.flow_project.copy_project``), with ``base_model.source: local`` on that directory
   and a short schedule (``SCHEDULE``: small splits, a few fine-tune steps, a short evaluation).
   Random weights learn nothing in 4 steps, so the quality gates are opened (``OPEN_GATES``); the
   bench measures cost, not quality, and says so. The serving engine is ``engine.weights: int4``.
   Every stage process (``python -m tasks.stages.<stage>``, run by DVC under the flow) records its own wall
   time and peak RSS at exit (``getrusage``, ``STAGE_HOOK``: a ``sitecustomize`` on the stage's
   path); the flow's whole process tree is measured by ``os.wait4``.
3. **Sizes.** Every ONNX file of every engine directory (graph, external data, ORT's optimized
   graph and its data), the largest single file against protobuf's 2 GiB cap; the package's bytes
   (``check.json``) and their share of the bf16 checkpoint.
4. **Decode.** One token after a past of 512 (batch 1, 2 threads, the release's adapter bound) on
   the serving engines fp32 / int8 / int4 (the release's 4-bit quantized pages), and
   int4 with the LM head at int8 and at int4; all timed in one interleaved loop
   (``bench.lib.timing.interleaved``) with, when the ``peer`` extra is installed, llama.cpp F32 /
   Q8_0 / Q4_0 of the same directory (the same adapter applied at run time:
   ``bench.lib.llama_cpp_peer``). Without it the llama.cpp rows are skipped and the bench says so.
5. **The LM head** (151,936 x 896 = 136M parameters, the largest single read per token): each
   head precision's decode time and its output error against the fp32 serving engine on the calib
   split (mean KL and top-1 agreement, ``bench.lib.divergence.output_error``) and held-out
   perplexity. With random weights the output error is a weak proxy for a trained model's; the
   embedded default's month measures it on a trained model (``bench.quality.weight_quant_quality``).

Targets (issue 16): the whole flow within 60 minutes on 2 cores, peak RSS at most 12 GB, the package
at most 0.5% of the bf16 checkpoint, int4 decode no slower than llama.cpp Q4_0 on the same shape.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

from bench.lib.backbones import QWEN2_05B, TOKENIZER_FILES, build_qwen2_05b_shape
from bench.lib.divergence import output_error
from bench.lib.flow_project import ENV, copy_project, mlflow_parent_runs
from bench.lib.llama_cpp_peer import (
    INSTALL_HINT,
    convert_adapter_to_gguf,
    convert_to_gguf,
    converter_dir,
    gguf_source_dir,
    llama_steps,
    load_llama,
    quantize_gguf,
    require_llama_cpp,
)
from bench.lib.report import RESULTS, Figure, write_report
from bench.lib.tables import format_ms, table
from bench.lib.timing import engine_steps, interleaved
from runtime.engine.interface import CACHE_KEY_FILE

GIB = 2**30
PROTOBUF_CAP = 2 * GIB  # protobuf refuses to parse or serialize one message of 2 GiB or more
PAST = 512
MONTH = "2026-11"

# A short month: every stage runs on every split, only on fewer rows and steps than the default's.
SCHEDULE = {
    "data": {"month": MONTH, "train_size": 64, "val_size": 16, "calib_size": 16, "test_size": 32, "heldout_lines": 16},
    "train": {"steps": 4, "batch_size": 4, "warmup_steps": 1},
    "eval": {"batch_size": 16, "latency_prompts": 4, "latency_steps": 8},
    "engine": {"weights": "int4"},
}
# Random weights answer nothing right: the quality gates would stop the flow before packaging. The size
# gate stays as it is (the package must still be under 2% of the base).
OPEN_GATES = {"min_accuracy_new": 0.0, "min_accuracy_regression": 0.0, "champion_tolerance": 1.0,
              "max_kv_accuracy_drop": 1.0, "max_kv_ppl_increase_pct": 1e6, "max_decode_step_ratio": 1e6, "max_forgetting_pct": 1e6}
STAGES = ("data", "base_model", "compile", "finetune", "calibrate", "evaluate", "gates", "package")
# Each stage process appends {stage, seconds, peak RSS} to $SCALE_BENCH_STAGE_LOG when it exits. ru_maxrss
# is the process's own high-water mark (KiB on Linux); RUSAGE_CHILDREN that of any process it waited for.
STAGE_HOOK = '''\
import atexit, json, os, resource, sys, time

_START = time.time()


def _record():
    script = os.path.abspath(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    folder = os.path.dirname(script)
    if (os.path.basename(os.path.dirname(folder)), os.path.basename(folder)) != ("tasks", "stages"):
        return
    rss = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
    with open(os.environ["SCALE_BENCH_STAGE_LOG"], "a") as fh:
        fh.write(json.dumps({"stage": os.path.basename(script)[:-3], "seconds": time.time() - _START,
                             "peak_rss_bytes": rss * 1024}) + "\\n")


if os.environ.get("SCALE_BENCH_STAGE_LOG"):
    atexit.register(_record)
'''
TARGETS = {"flow_minutes": 60.0, "peak_rss_gb": 12.0, "package_pct_of_bf16": 0.5}
HEAD_BITS = (None, 8, 4)  # the LM head precisions compared on the int4 serving engine (None: fp32)
# ours against llama.cpp with the same adapter applied at run time (like for like); the first is the target
PAIRS = (("ort_int4", "llama_q4_0_lora"), ("ort_int8", "llama_q8_0_lora"), ("ort_fp32", "llama_f32_lora"))
# What is timed in one interleaved loop. All engines at once held 17 GB (llama.cpp repacks its weights into
# anonymous memory beside the mapped file): the fp32 pair is timed in a loop of its own; every pair of
# PAIRS and every LM head variant is compared within one loop.
DECODE_GROUPS = (("ort_int4", "ort_int4_head32", "ort_int4_head4", "ort_int8", "llama_q4_0_lora", "llama_q8_0_lora"),
                 ("ort_fp32", "llama_f32_lora"))


# ---------------------------------------------------------------- 2. the flow, stage by stage

def write_params(project: Path, model_dir: Path, out: Path) -> dict:
    """The project's params.yaml with the schedule, the local backbone and the open gates."""
    raw = yaml.safe_load((project / "params.yaml").read_text())
    for section, values in SCHEDULE.items():
        raw.setdefault(section, {}).update(values)
    raw["base_model"].update({"source": "local", "path": str(model_dir)})
    gates = raw.setdefault("gates", {})
    gates.update({k: v for k, v in OPEN_GATES.items()})
    if "min_accuracy" in gates:  # the overall-accuracy gate, where the project has it
        gates["min_accuracy"] = 0.0
    out.write_text(yaml.safe_dump(raw, sort_keys=False))
    return raw


def run_measured(cmd: list[str], cwd: Path, env: dict, log: Path, timeout: float) -> dict:
    """Run ``cmd`` to its end; wall seconds, exit code and the peak RSS of its whole process tree
    (``os.wait4``: the largest high-water mark of the process and of every descendant it reaped)."""
    with open(log, "w") as fh:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
        timer = threading.Timer(timeout, lambda: os.killpg(proc.pid, 9))
        timer.start()
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        finally:
            timer.cancel()
        seconds = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here, not by Popen
    return {"seconds": round(seconds, 1), "returncode": proc.returncode, "timed_out": seconds >= timeout,
            "peak_rss_bytes": usage.ru_maxrss * 1024, "log": str(log)}


def run_flow(project: Path, params: Path, work: Path, timeout: float) -> dict:
    hook = work / "stage_hook"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(STAGE_HOOK)
    stage_log = work / "stages.jsonl"
    stage_log.unlink(missing_ok=True)
    env = ENV | {"PREFECT_HOME": str(work / "prefect-home"), "SCALE_BENCH_STAGE_LOG": str(stage_log),
                 "PYTHONPATH": os.pathsep.join(filter(None, [str(hook), os.environ.get("PYTHONPATH")]))}
    print(f"scale_bench: the monthly flow in {project} (log: {work / 'flow.log'}) ...", flush=True)
    flow = run_measured([sys.executable, "-m", "flows.monthly_release", "--params", str(params)], project, env,
                        work / "flow.log", timeout)
    stages = {}
    for line in stage_log.read_text().splitlines() if stage_log.exists() else []:
        rec = json.loads(line)
        stages[rec["stage"]] = {"seconds": round(rec["seconds"], 1), "peak_rss_bytes": rec["peak_rss_bytes"]}
    runs = mlflow_parent_runs(project, MONTH) if (project / "mlflow.db").exists() else []
    if runs:
        for name, s in runs[-1]["stages"].items():  # the flow's own view: DVC's time around each stage
            stages.setdefault(name, {})["flow_seconds"] = round(s["seconds"], 1) if s["seconds"] is not None else None
    ends = [line for line in Path(flow["log"]).read_text().splitlines() if "Flow run" in line and "Finished in state" in line]
    flow["outcome"] = ends[-1].split(" - ", 1)[-1] if ends else "no final state in the log"
    flow["stages"] = {s: stages[s] for s in STAGES if s in stages}
    print(f"scale_bench: flow rc {flow['returncode']} in {flow['seconds']:.0f} s, tree peak "
          f"{flow['peak_rss_bytes'] / 1e9:.2f} GB: {flow['outcome']!r}", flush=True)
    return flow


# ---------------------------------------------------------------- 3. sizes

def onnx_files(engine_dir: Path) -> dict:
    """Every ONNX graph and external data file of an engine directory, in bytes."""
    files = {p.name: p.stat().st_size for p in sorted(engine_dir.iterdir())
             if p.is_file() and (p.suffix == ".onnx" or p.name.endswith(".onnx.data"))}
    graphs = [n for name, n in files.items() if name.endswith(".onnx")]  # protobuf; .data files are raw bytes
    return {"files": files, "largest_protobuf_bytes": max(graphs, default=0),
            "protobuf_under_cap": all(n < PROTOBUF_CAP for n in graphs)}


def package_size(project: Path, cfg, model_dir: Path) -> dict:
    check_file = project / cfg.layout.package_check_file
    if not check_file.exists():
        return {"error": f"{check_file} missing: the package stage did not finish"}
    check = json.loads(check_file.read_text())
    bf16 = sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))
    return {"package_bytes": check["package_bytes"], "checkpoint_bf16_bytes": bf16,
            "pct_of_bf16": 100.0 * check["package_bytes"] / bf16, "check_pct_of_base": check["pct_of_base"]}


# ---------------------------------------------------------------- 4./5. decode and the LM head

def serving_dirs(project: Path, cfg) -> dict:
    """The release's serving engines: the flow's fp32 one with the served cache (``engine/kvpages-paged16-stacked``:
    ``tasks.config.EngineConfig.cache_engine_dir``, so every precision reads the same cache) and int4 one, int8 built here as
    the compile stage builds it, and int4 with each other LM head precision; {name: directory}, and the
    served head's bits."""
    from tasks.weights.engines import WEIGHTS_FILE, ensure_quantized_engine, quantize_engine_dir

    float_dir = project / cfg.engine.cache_engine_dir
    dirs = {"fp32": float_dir, "int4": project / cfg.layout.serving_engine_dir}
    ensure_quantized_engine(float_dir, Path(f"{float_dir}-int8"), "int8", cfg.engine.weight_block("int8"))
    dirs["int8"] = Path(f"{float_dir}-int8")
    served_head = json.loads((dirs["int4"] / WEIGHTS_FILE).read_text()).get("head_bits")  # None: fp32
    for head in HEAD_BITS:
        if head != served_head:
            out = Path(f"{float_dir}-int4-head{head or 32}")
            if not (out / CACHE_KEY_FILE).exists():
                keep = ("lm_head", "embed") if head is None else ("embed",)
                quantize_engine_dir(float_dir, out, "int4", cfg.engine.weight_block("int4"), keep=keep, head_bits=head)
            dirs[f"int4_head{head or 32}"] = out
    return dirs, served_head


def open_serving(engine_dir: Path, project: Path, cfg, threads: int):
    """An engine with the release's adapter bound, as the device serves it (its quantized pages take their scales
    from their own K/V when they seal: the release ships none)."""
    from runtime.engine.adapter import load_adapter
    from tasks.weights.engines import open_on_cpu

    engine = open_on_cpu(engine_dir, threads)
    engine.set_adapter(load_adapter(project / cfg.layout.adapter_dir, engine.interface))
    return engine


def head_quality(dirs: dict, served_head: int | None, project: Path, cfg, threads: int) -> dict:
    """Held-out perplexity of every engine and its output error on the calib split against the fp32 engine
    and, for the int4 engines, against the int4 one whose LM head is fp32: the error of the head alone."""
    from tasks.models import load_tokenizer
    from tasks.records import HELDOUT_TEXT, read_jsonl, read_text_corpus
    from tasks.stages.evaluate import engine_perplexity

    data = project / cfg.layout.data_dir
    tokenizer = load_tokenizer(Path(cfg.base_model.path))
    calib = [ex.text for ex in read_jsonl(data / "calib.jsonl")]
    texts = read_text_corpus(data / HELDOUT_TEXT)
    engines = {n: open_serving(d, project, cfg, threads) for n, d in dirs.items()}
    fp32_head = engines["int4" if served_head is None else "int4_head32"]
    out = {}
    for name, engine in engines.items():
        row = {"perplexity": engine_perplexity(engine, tokenizer, texts)}
        if name != "fp32":
            row |= output_error(engines["fp32"], engine, tokenizer, calib)
        if name.startswith("int4") and engine is not fp32_head:
            row["head_only"] = output_error(fp32_head, engine, tokenizer, calib)
        out[name] = row
    return out


def peer_ggufs(model_dir: Path, adapter_dir: Path, work: Path, threads: int) -> tuple[dict, str | None]:
    """llama.cpp F32 / Q8_0 / Q4_0 files of the same directory and the release's adapter as GGUF (the
    converters run in child processes), or ({}, why) when the ``peer`` extra is not installed."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError as err:
        return {}, f"llama.cpp rows skipped: llama-cpp-python is not installed ({err}); {INSTALL_HINT}"
    llama_cpp = require_llama_cpp()
    llama_dir = converter_dir()
    gguf = work / "gguf"
    shutil.rmtree(gguf, ignore_errors=True)
    tokenizer_dir = gguf / "tokenizer"  # the backbone's own, copied: the converter's folder links the rest
    tokenizer_dir.mkdir(parents=True)
    for name in TOKENIZER_FILES:
        if (model_dir / name).is_file():
            shutil.copy2(model_dir / name, tokenizer_dir / name)
    hf_dir = gguf_source_dir(model_dir, tokenizer_dir, gguf / "src")
    f32 = convert_to_gguf(llama_dir, hf_dir, gguf / "model-f32.gguf", "f32")
    paths = {"f32": f32, "q8_0": convert_to_gguf(llama_dir, hf_dir, gguf / "model-q8_0.gguf", "q8_0"),
             "q4_0": quantize_gguf(llama_cpp, f32, gguf / "model-q4_0.gguf", llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0, threads)}
    lora = convert_adapter_to_gguf(llama_dir, adapter_dir, hf_dir, gguf / "adapter-f32.gguf")
    return {"models": paths, "lora": lora}, None


def load_peer(ggufs: dict, name: str, threads: int):
    """``llama_<type>_lora``: that GGUF with the adapter applied at run time (the like-for-like pairing
    of our LoRA inputs)."""
    kind = name.removeprefix("llama_").removesuffix("_lora")
    return load_llama(require_llama_cpp(), ggufs["models"][kind], PAST + 1, threads, flash_attn=True, lora=ggufs["lora"])


def decode(dirs: dict, ggufs: dict, project: Path, cfg, iters: int, threads: int) -> dict:
    """Median and p10 ms of one token after a past of ``PAST``, per ``DECODE_GROUPS``: each group's engines
    timed in one interleaved loop, then closed before the next group opens (memory: ``DECODE_GROUPS``)."""
    from runtime.engine.model import read_config

    model_cfg = read_config(Path(cfg.base_model.path))
    rows = {}
    for loop, group in enumerate(DECODE_GROUPS):
        steps, llms = {}, []
        for name in group:
            if name.startswith("ort_") and name[4:] in dirs:
                steps[name] = engine_steps(open_serving(dirs[name[4:]], project, cfg, threads), model_cfg, PAST)
            elif name.startswith("llama_") and ggufs:
                llms.append(load_peer(ggufs, name, threads))
                steps[name] = llama_steps(llms[-1], model_cfg.vocab_size, PAST)
        print(f"scale_bench: timing {', '.join(steps)} ...", flush=True)
        stats = interleaved(steps, iters, rounds=20)
        rows |= {n: {"median_ms": s["median"], "p10_ms": s["p10"], "loop": loop} for n, s in stats.items()}
        for llm in llms:
            llm.close()
        del steps, llms
        gc.collect()  # the engines' sessions go before the next group's open
    return rows


# ---------------------------------------------------------------- the run

def print_results(payload: dict) -> None:
    flow = payload["flow"]
    print(f"\n== the monthly flow on the Qwen2-0.5B shape: rc {flow['returncode']}, {flow['seconds'] / 60:.1f} min, "
          f"peak RSS of the process tree {flow['peak_rss_bytes'] / 1e9:.2f} GB")
    print(table(["stage", "wall s", "flow s", "peak RSS GB"],
                ([name, f"{st.get('seconds', float('nan')):.1f}",
                  f"{st['flow_seconds'] if st.get('flow_seconds') is not None else float('nan'):.1f}",
                  f"{st.get('peak_rss_bytes', 0) / 1e9:.2f}"] for name, st in flow["stages"].items())))
    print("\n== ONNX files (bytes; protobuf graphs must stay under 2 GiB, .data files are raw)")
    for d, info in payload["onnx"].items():
        cells = ", ".join(f"{n} {b:,}" for n, b in info["files"].items())
        print(f"{d}: {cells}  [largest protobuf {info['largest_protobuf_bytes']:,}: "
              f"{'under' if info['protobuf_under_cap'] else 'OVER'} the cap]")
    pkg = payload["package"]
    if "error" in pkg:
        print(f"\n== package: {pkg['error']}")
    else:
        print(f"\n== package: {pkg['package_bytes']:,} bytes = {pkg['pct_of_bf16']:.3f}% of the bf16 checkpoint "
              f"({pkg['checkpoint_bf16_bytes']:,} bytes)")
    print(f"\n== decode, one token after a past of {PAST}, batch 1, 2 threads, adapter bound (ms; calib split; head: "
          "against int4 with the fp32 head)")
    quality = payload.get("head_quality", {})
    rows = []
    for name, row in payload["decode"].items():
        q = quality.get(name.removeprefix("ort_"), {})
        errors = [(f"{e['kl_mean']:.2e}", f"{e['top1_agreement']:.4f}") if e else ("-", "-")
                  for e in (q if "kl_mean" in q else None, q.get("head_only"))]  # against fp32; of the head alone
        rows.append([name, f"{row['median_ms']:.2f}", f"{row['p10_ms']:.2f}", *errors[0], *errors[1],
                     f"{q['perplexity']:.1f}" if "perplexity" in q else "-"])
    print(table(["engine", "median", "p10", "KL vs fp32", "top-1", "head KL", "top-1", "ppl"], rows))
    if payload.get("peer_skipped"):
        print(payload["peer_skipped"])
    for c in payload["comparisons"]:
        print(f"  {c['ours']} / {c['peer']}: {c['ours_ms']:.2f} / {c['peer_ms']:.2f} ms = {c['ratio']:.2f}x")
    print("\n== targets")
    for name, t in payload["targets"].items():
        print(f"  {name}: {t['value']} (target {t['target']}): {'met' if t['met'] else 'MISSED'}")


def targets(payload: dict) -> dict:
    flow, pkg = payload["flow"], payload["package"]
    peak = max([flow["peak_rss_bytes"]] + [s.get("peak_rss_bytes", 0) for s in flow["stages"].values()])
    out = {"flow_minutes": {"value": round(flow["seconds"] / 60, 1), "target": f"<= {TARGETS['flow_minutes']}",
                            "met": flow["returncode"] == 0 and flow["seconds"] / 60 <= TARGETS["flow_minutes"]},
           "peak_rss_gb": {"value": round(peak / 1e9, 2), "target": f"<= {TARGETS['peak_rss_gb']}",
                           "met": peak / 1e9 <= TARGETS["peak_rss_gb"]}}
    if "pct_of_bf16" in pkg:
        out["package_pct_of_bf16"] = {"value": round(pkg["pct_of_bf16"], 3), "target": f"<= {TARGETS['package_pct_of_bf16']}",
                                      "met": pkg["pct_of_bf16"] <= TARGETS["package_pct_of_bf16"]}
    first = next((c for c in payload["comparisons"] if (c["ours"], c["peer"]) == PAIRS[0]), None)
    if first is not None:
        out["int4_vs_q4_0"] = {"value": round(first["ratio"], 3), "target": "<= 1.0", "met": first["ratio"] <= 1.0}
    return out


def figures(p: dict) -> list[Figure]:
    """The targets (flow minutes, peak RSS, package size, int4 against Q4_0), then decode ms of every engine."""
    rows = [Figure(f"Qwen2-0.5B shape: {name} (target {t['target']})", t["value"], f"{t['value']} ({'met' if t['met'] else 'MISSED'})")
            for name, t in p["targets"].items()]
    rows += [Figure(f"Qwen2-0.5B shape: decode ms/token after a past of {p['past']}, {name}", row["median_ms"],
                    format_ms(row["median_ms"])) for name, row in p["decode"].items()]
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="the whole monthly flow on the Qwen2-0.5B shape: time, memory, sizes, decode")
    ap.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "scale-bench",
                    help="the backbone (built once, reused), the project copy (fresh every run), logs")
    ap.add_argument("--out", type=Path, default=RESULTS / "scale_bench.json")
    ap.add_argument("--iters", type=int, default=200, help="decode calls per engine, in 20 interleaved rounds")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=5400.0, help="seconds for the flow")
    ap.add_argument("--reuse-flow", action="store_true",
                    help="skip the flow: measure sizes and decode on the project copy of the last run (its flow.json)")
    args = ap.parse_args(argv)
    from tasks.config import load_config

    work = args.workdir.resolve()
    work.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()[0]
    model_dir = build_qwen2_05b_shape(work / "qwen2-0.5b-shape", work)
    project, params, flow_record = work / "project", work / "params-scale.yaml", work / "flow.json"
    if args.reuse_flow:
        flow = json.loads(flow_record.read_text())
    else:
        shutil.rmtree(project, ignore_errors=True)
        copy_project(project)
        write_params(project, model_dir, params)
        flow = run_flow(project, params, work, args.timeout)
        flow_record.write_text(json.dumps(flow, indent=2, sort_keys=True) + "\n")
    cfg = load_config(params)
    payload = {"shape": QWEN2_05B, "schedule": SCHEDULE, "open_gates": OPEN_GATES, "past": PAST, "threads": args.threads,
               "flow": flow, "cpus": os.cpu_count(), "machine": platform.processor() or platform.machine(),
               "loadavg_1m_before": load_before}
    engine_dir = project / cfg.layout.engine_dir  # the float engine, its variants inside it
    payload["onnx"] = {str(d.relative_to(project)): onnx_files(d) for d in [engine_dir, *sorted(engine_dir.iterdir())]
                       if d.is_dir()}
    payload["package"] = package_size(project, cfg, model_dir)
    payload["decode"], payload["comparisons"] = {}, []
    if flow["returncode"] == 0:
        # The GGUF files first: the converters' child processes then run beside no open engine.
        ggufs, payload["peer_skipped"] = peer_ggufs(model_dir, project / cfg.layout.adapter_dir,
                                                    work, args.threads)
        if payload["peer_skipped"]:
            print(payload["peer_skipped"], flush=True)
        payload["gguf_bytes"] = {t: p.stat().st_size for t, p in ggufs.get("models", {}).items()}
        dirs, payload["served_head_bits"] = serving_dirs(project, cfg)
        payload["engine_dirs"] = {n: str(d) for n, d in dirs.items()}
        payload["head_quality"] = head_quality(dirs, payload["served_head_bits"], project, cfg, args.threads)
        gc.collect()  # its engines are closed before the timed ones open
        payload["decode"] = decode(dirs, ggufs, project, cfg, args.iters, args.threads)
        rows = payload["decode"]
        payload["comparisons"] = [{"ours": a, "peer": b, "ours_ms": rows[a]["median_ms"], "peer_ms": rows[b]["median_ms"],
                                   "ratio": rows[a]["median_ms"] / rows[b]["median_ms"]}
                                  for a, b in PAIRS if a in rows and b in rows]
    payload["targets"] = targets(payload)
    payload["loadavg_1m_after"] = os.getloadavg()[0]
    payload["bench_process_peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print_results(payload)
    write_report(args.out, payload)
    return 0 if flow["returncode"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
