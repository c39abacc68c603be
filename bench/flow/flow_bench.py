"""Monthly flow wall time: first run, unchanged rerun, next month; engine builds per run.

    python -m bench.flow.flow_bench [--out bench/results/flow_bench.json] [--workdir DIR] [--months 2026-11,2026-12]

Copies the project's git-tracked files as the working tree has them, without ``dvc.lock``, into a fresh
git repository (``bench.lib.flow_project.copy_project``, as the ``project`` fixture of ``tests/test_release.py``
does: what a clone of this checkout holds, whatever else a release left in it), then runs
``python -m flows.monthly_release --params FILE`` there as ``make release`` does:

1. ``first``:  the first month; everything is built (base model, engine, fine-tune, ...) and published;
2. ``rerun``:  the same month again, nothing changed: DVC reproduces nothing, nothing is published;
3. ``next``:   the next month: a new adapter on the engine compiled in 1.

Per run: wall seconds, exit code, outcome, and engine builds. Engine builds come from the MLflow
parent run the flow records (metric ``engine_builds``) when it records one; an unchanged rerun records
none (the release is already published), so for every run they are also read from the artifacts:
``artifacts/engine_build.json`` (``tasks.layout``) is rewritten only when the compile stage runs, and says whether it
built (``engine_builds``: 2 with the default quantized-cache engine, the float one beside it) or found
the engines of this backbone (0). Both must agree.

``--workdir`` keeps the project copy there (``bench.run_all`` reuses its releases); otherwise it is
a temporary directory, removed at the end. Exits 1 if a run failed, after writing the JSON.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from bench.lib.charts import save_chart
from bench.lib.flow_project import ENV, copy_project, mlflow_parent_runs
from bench.lib.report import RESULTS, Figure, write_report

RUN_LABELS = {"first": "first run", "rerun": "unchanged rerun (same month)", "next": "next month"}


def _fingerprint(path: Path) -> tuple | None:
    if not path.exists():
        return None
    return path.stat().st_mtime_ns, hashlib.sha256(path.read_bytes()).hexdigest()


def engine_builds_from_artifacts(build_file: Path, before: tuple | None) -> int:
    """Engines the compile stage built during the run; 0 if it reused them or did not run."""
    if _fingerprint(build_file) == before or not build_file.exists():
        return 0  # the compile stage did not run: nothing was built
    return int(json.loads(build_file.read_text()).get("engine_builds", 0))


def run_month(root: Path, work: Path, env: dict, name: str, month: str, timeout: float) -> dict:
    from tasks.config import parse_config

    raw = yaml.safe_load((root / "params.yaml").read_text())
    raw["data"]["month"] = month
    params = work / f"params-{name}.yaml"
    params.write_text(yaml.safe_dump(raw))
    build_file = root / parse_config(raw).layout.engine_build_file
    before_build = _fingerprint(build_file)
    known = {r["run_id"] for r in mlflow_parent_runs(root, month)} if (root / "mlflow.db").exists() else set()
    print(f"flow_bench: {name} ({month}) ...", flush=True)
    start = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, "-m", "flows.monthly_release", "--params", str(params)], cwd=root,
                              env=env, capture_output=True, text=True, timeout=timeout)
        rc, stdout, stderr = done.returncode, done.stdout, done.stderr
    except subprocess.TimeoutExpired as err:
        rc, stdout, stderr = None, str(err.stdout or ""), f"timed out after {timeout:.0f} s"
    seconds = time.perf_counter() - start
    row = {"name": name, "month": month, "seconds": round(seconds, 2), "returncode": rc,
           "outcome": (stdout.strip().splitlines() or [""])[-1],
           "engine_builds_artifacts": engine_builds_from_artifacts(build_file, before_build)}
    new = [r for r in mlflow_parent_runs(root, month) if r["run_id"] not in known] if (root / "mlflow.db").exists() else []
    if new:
        metrics = new[-1]["metrics"]
        row |= {"mlflow_run_id": new[-1]["run_id"], "mlflow_status": new[-1]["status"],
                "engine_builds_mlflow": int(metrics["engine_builds"]) if "engine_builds" in metrics else None,
                "stages_reproduced": int(metrics.get("stages_reproduced", -1)),
                "stage_seconds": {s: v["seconds"] for s, v in new[-1]["stages"].items()},
                "stages_ran": sorted(s for s, v in new[-1]["stages"].items() if v["reproduced"])}
    else:
        row |= {"mlflow_run_id": None, "engine_builds_mlflow": None}
    row["engine_builds"] = row["engine_builds_artifacts"]
    row["engine_builds_agree"] = row["engine_builds_mlflow"] in (None, row["engine_builds_artifacts"])
    if rc != 0:
        row["stderr_tail"] = stderr[-3000:]
    print(f"flow_bench: {name}: rc {rc} in {seconds:.1f} s, engine builds {row['engine_builds']}, {row['outcome']!r}",
          flush=True)
    return row


def figures(p: dict) -> list[Figure]:
    """Wall time and engine builds of each run (and where the builds were read), and the rerun's share of the first."""
    rows = []
    for r in p["runs"]:
        ok = "" if r["returncode"] == 0 else f" (FAILED, exit {r['returncode']})"
        rows.append(Figure(f"monthly flow wall time, {RUN_LABELS[r['name']]} {r['month']}", r["seconds"],
                           f"{r['seconds']:.1f} s{ok}"))
    for r in p["runs"]:
        src = "MLflow metric and artifacts agree" if r.get("engine_builds_mlflow") is not None and r["engine_builds_agree"] \
            else "artifacts (no MLflow run: nothing new to record)" if r.get("engine_builds_mlflow") is None \
            else "MLFLOW AND ARTIFACTS DISAGREE"
        ran = f"; stages run: {', '.join(r['stages_ran'])}" if r.get("stages_ran") is not None else ""
        rows.append(Figure(f"engine builds, {RUN_LABELS[r['name']]} {r['month']}", r["engine_builds"],
                           f"{r['engine_builds']} ({src}{ran})"))
    if "rerun_over_first" in p:
        rows.append(Figure("unchanged rerun / first run wall time", p["rerun_over_first"], f"{100 * p['rerun_over_first']:.1f} %"))
    return rows


def plot(p: dict, path: Path) -> None:
    runs = p["runs"]

    def draw(ax):
        ax.bar([f"{r['name']}\n{r['month']}" for r in runs], [r["seconds"] for r in runs], color="tab:blue")
        for i, r in enumerate(runs):
            ax.annotate(f"{r['seconds']:.0f} s\nengine builds {r['engine_builds']}", (i, r["seconds"]),
                        ha="center", va="bottom", fontsize=8)
        ax.set_ylabel("wall seconds")
        ax.set_ylim(0, 1.25 * max(r["seconds"] for r in runs))
        ax.set_title("monthly flow: first run, unchanged rerun, next month")

    save_chart(path, draw)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="monthly flow wall time: first run, unchanged rerun, next month")
    ap.add_argument("--out", type=Path, default=RESULTS / "flow_bench.json")
    ap.add_argument("--workdir", type=Path, help="keep the project copy here (must not exist); default: a temp dir")
    ap.add_argument("--months", default="2026-11,2026-12", help="first month, next month")
    ap.add_argument("--timeout", type=float, default=1500.0, help="seconds per flow run")
    args = ap.parse_args(argv)
    first, following = args.months.split(",")
    tmp = None
    if args.workdir is None:
        tmp = tempfile.TemporaryDirectory(prefix="flow-bench-")
        work = Path(tmp.name)
    else:
        work = args.workdir.resolve()
        work.mkdir(parents=True, exist_ok=False)
    load_before = os.getloadavg()[0]
    try:
        root = copy_project(work / "project")
        env = ENV | {"PREFECT_HOME": str(work / "prefect-home")}
        runs = []
        for name, month in (("first", first), ("rerun", first), ("next", following)):
            runs.append(run_month(root, work, env, name, month, args.timeout))
            if runs[-1]["returncode"] != 0:
                break  # the following runs build on this one
    finally:
        if tmp is not None:
            tmp.cleanup()
    by_name = {r["name"]: r for r in runs}
    ok = len(runs) == 3 and all(r["returncode"] == 0 for r in runs)
    payload = {
        "cpus": os.cpu_count(), "loadavg_1m_before": load_before, "loadavg_1m_after": os.getloadavg()[0],
        "command": "python -m flows.monthly_release --params FILE (in a fresh git copy of the project)",
        "project": str(work / "project") if tmp is None else None, "runs": runs, "ok": ok,
        "seconds": {r["name"]: r["seconds"] for r in runs},
        "engine_builds_per_month": {m: sum(r["engine_builds"] for r in runs if r["month"] == m) for m in (first, following)
                                    if any(r["month"] == m for r in runs)},
        "engine_builds_agree": all(r["engine_builds_agree"] for r in runs),
    }
    if "first" in by_name and "rerun" in by_name:
        payload["rerun_over_first"] = by_name["rerun"]["seconds"] / by_name["first"]["seconds"]
    write_report(args.out, payload)
    plot(payload, args.out.with_suffix(".png"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
