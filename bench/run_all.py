"""Every benchmark of bench/, one after another, and one report: `make bench`.

    python -m bench.run_all [--out-dir bench/results] [--only flow_bench,engine_bench,...]

Each benchmark runs as its own process with the flags ``plan`` lists (never two at once: they measure latency
on the same cores) and writes its JSON into ``bench/results/latest/``; earlier full runs under
``bench/results/`` are left alone. Each states its own headline figures (its module's ``figures(payload)``)
and may draw a chart beside its JSON; this driver knows no benchmark's JSON. Then:

* ``bench/results/latest.json``: every benchmark's status, command, seconds and JSON payload, and the
  figures of the table;
* ``bench/results/latest.md``: one table, every figure with the command that produced it, and the
  charts the benchmarks drew.

``bench.flow.flow_bench`` runs first and keeps its project copy (``$FLOW_PROJECT``) until the end: the
hot-swap load test swaps its two published months. Without that copy (the flow failed) it falls back to its
stand-alone mode, and the table says so. A benchmark that fails is a FAILED row with its exit code and last error line,
and the exit code is 1; one that cannot run on this machine (``bench.engine.gpu_check`` without TensorRT) is
a SKIPPED row.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench.lib.flow_project import ENV
from bench.lib.report import REPO, write_report
from bench.lib.report import RESULTS as RESULTS_DIR
from bench.lib.tables import table

RESULTS = "$RESULTS"  # placeholders in the commands the table states
FLOW_PROJECT = "$FLOW_PROJECT"
FLOW_MONTHS = ("2026-11", "2026-12")


@dataclass(frozen=True)
class Bench:
    module: str  # bench.<kind>.<name>
    title: str
    args: tuple[str, ...]  # after `python -m <module>`; may hold $RESULTS and $FLOW_PROJECT
    mode: str  # what this run measures against the benchmark's full default run
    timeout: float  # seconds
    cwd: str = ""  # "" = the repository; $FLOW_PROJECT = the flow benchmark's project copy

    @property
    def name(self) -> str:
        return self.module.rpartition(".")[2]


def plan(flow_ready: bool) -> list[Bench]:
    """The benchmarks in the order they run; the one after flow_bench uses its project when it is there."""
    return [
        Bench("bench.flow.flow_bench", "monthly flow: first run, unchanged rerun, next month",
              ("--workdir", "$WORK/flow", "--out", f"{RESULTS}/flow_bench.json"),
              f"full: the whole flow on the embedded default, {FLOW_MONTHS[0]} twice then {FLOW_MONTHS[1]}", 2400),
        Bench("bench.serving.hotswap_bench", "hot-swap under open-loop load: 20, 50, 100 req/s, swaps every 1 s",
              ("--out", f"{RESULTS}/hotswap_bench.json") if flow_ready else ("--tiny", "--out", f"{RESULTS}/hotswap_bench.json"),
              "full (per rate 3 s + 8 s swapping + 3 s); " + (f"the flow's published {FLOW_MONTHS[0]} and {FLOW_MONTHS[1]} releases"
                                                       if flow_ready else "tiny world: the flow left no two releases"),
              600, FLOW_PROJECT if flow_ready else ""),
        Bench("bench.engine.engine_bench", "engine vs eager decode, LoRA as inputs vs merged",
              ("--out", f"{RESULTS}/engine_bench.json"), "full (default flags: tiny and 0.5B-width, 400 iterations)", 900),
        Bench("bench.engine.paged_kv_bench", "paged vs padded KV cache: bytes allocated for rows of 128-1024 tokens, decode tokens/s",
              ("--out", f"{RESULTS}/paged_kv_bench.json"), "full (default flags: 200 iterations, blocks of 16 tokens)", 900),
        Bench("bench.serving.mixed_adapters_bench", "8 clients over 4 adapters vs 8 on one: rows of several releases in one batch",
              ("--shape", "tiny", "--rounds", "16", "--max-tokens", "96", "--out", f"{RESULTS}/mixed_adapters_bench.json"),
              "full at the tiny shape (the 0.5B shape: --shape 0.5b, minutes to build)", 900),
        Bench("bench.engine.weight_quant_bench", "weight-only quantization: fp32 vs int8 vs int4 engines",
              ("--configs", "tiny,0.5b-width", "--variants", "fp32,int8,int4", "--pasts", "512", "--iters", "60",
               "--out", f"{RESULTS}/weight_quant_bench.json"),
              "quick: 3 variants at block 128, past 512 only, 60 iterations; the full run (about 15 min) adds the LoRA-merged, block-32, "
              "accuracy-level-0 and norm-folded variants and past 2048", 900),
        Bench("bench.engine.gpu_check", "TensorRT plan, parity vs ONNX Runtime, latency (NVIDIA only)",
              ("--out", f"{RESULTS}/gpu_check.json"), "full; needs an NVIDIA GPU with TensorRT", 900),
    ]


def command_text(bench: Bench) -> str:
    cmd = f"python -m {bench.module} {' '.join(bench.args)}".strip()
    return f"cd {bench.cwd} && {cmd}" if bench.cwd else cmd


def run_bench(bench: Bench, places: dict[str, str]) -> dict:
    """Run one benchmark; its status, seconds, and payload (the JSON it wrote)."""
    def fill(text: str) -> str:
        for key, value in places.items():
            text = text.replace(key, value)
        return text

    out = Path(fill(bench.args[bench.args.index("--out") + 1]))
    record = {"name": bench.name, "module": bench.module, "title": bench.title, "command": command_text(bench),
              "mode": bench.mode, "json": str(out)}
    cmd = [sys.executable, "-m", bench.module, *map(fill, bench.args)]
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


# ---------------------------------------------------------------- the report

def stated_figures(record: dict) -> list:
    """The figures a benchmark states of its payload: its module's ``figures``."""
    return importlib.import_module(record["module"]).figures(record["payload"])


def table_rows(records: list[dict]) -> list[dict]:
    """One row per figure; a failed or skipped benchmark is one row that says so. A payload whose figures
    cannot be read turns the benchmark into a failure (it is not dropped)."""
    rows = []
    for rec in records:
        base = {"bench": rec["name"], "command": rec["command"], "mode": rec["mode"]}
        if rec["status"] == "ok":
            try:
                figures = stated_figures(rec)
            except (KeyError, TypeError, ValueError, ZeroDivisionError) as err:
                rec["status"], rec["reason"] = "failed", f"its JSON lacks a figure: {type(err).__name__}: {err}"
            else:
                rows += [base | {"figure": f, "value": v, "text": t} for f, v, t in figures]
                continue
        if rec["status"] == "failed" and rec.get("payload"):
            try:  # what a failed run did measure (flow_bench writes the runs before the failure)
                rows += [base | {"figure": f, "value": v, "text": t} for f, v, t in stated_figures(rec)]
            except (KeyError, TypeError, ValueError, ZeroDivisionError):
                pass
        word = "FAILED" if rec["status"] == "failed" else "SKIPPED (not measurable on this machine)"
        rows.append(base | {"figure": rec["title"], "value": None, "text": f"**{word}**: {rec.get('reason', '')}"})
    return rows


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
        "(`$WORK/flow/project`) the fresh git copy of the project in which `bench.flow.flow_bench` ran the monthly flow.",
        "",
        table(["benchmark", "status", "seconds", "mode"],
              ([rec["name"], rec["status"], f"{rec.get('seconds', 0):.0f}", rec["mode"]] for rec in report["benches"]),
              align="<<><", markdown=True),
        "",
        table(["benchmark", "figure", "value", "command"],
              ([row["bench"], row["figure"], row["text"], f"`{row['command']}`"] for row in report["figures"]),
              align="<<<<", markdown=True),
    ]
    if report["plots"]:
        lines += ["", "## Plots", ""]
        for title, path in report["plots"]:
            lines += [f"![{title}]({path})", ""]
    return "\n".join(lines).rstrip() + "\n"


def charts(records: list[dict], out_dir: Path) -> list[tuple[str, str]]:
    """(title, path relative to ``out_dir``) of the chart each benchmark that ran drew beside its JSON."""
    return [(rec["title"], os.path.relpath(png, out_dir)) for rec in records
            if rec["status"] == "ok" and (png := Path(rec["json"]).with_suffix(".png")).exists()]


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
    ap.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
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
            if bench.name == "hotswap_bench":  # decided once the flow benchmark has run
                bench = next(b for b in plan(flow_ready=flow_ready(Path(places[FLOW_PROJECT]))) if b.name == bench.name)
            records.append(run_bench(bench, run_places))
        wall = time.perf_counter() - start
    report = build_report(records, {RESULTS: places[RESULTS]}, wall, machine_info(load_before))
    report["plots"] = charts(records, out_dir)
    write_report(out_dir / "latest.json", report)
    (out_dir / "latest.md").write_text(render_markdown(report))
    print(f"wrote {out_dir / 'latest.md'}: {len(records)} benchmarks in {wall / 60:.1f} min; "
          + ", ".join(f"{r['name']} {r['status']}" for r in records))
    return 0 if report["ok"] else 1


def flow_ready(project: Path) -> bool:
    """The flow benchmark left two packaged releases (hotswap_bench serves them)."""
    from tasks.config import parse_config
    from tasks.layout import PACKAGE, RELEASE_DIR

    layout = parse_config({"data": {"month": FLOW_MONTHS[0]}}).layout  # the flow benchmark runs the defaults
    return len(list((project / layout.output_dir).glob(f"*/{PACKAGE}/{RELEASE_DIR}/manifest.json"))) >= 2


if __name__ == "__main__":
    sys.exit(main())
