"""Monthly flow wall time: first run, unchanged rerun, next month; engine builds per run.

    python -m bench.flow_bench [--out bench/results/flow_bench.json] [--workdir DIR] [--months 2026-11,2026-12]

Copies the project's git-tracked files as the working tree has them, without ``dvc.lock``, into a fresh
git repository, exactly as the ``project`` fixture of ``tests/test_release.py`` does (what a clone of
this checkout holds, whatever else a release left in it), then runs
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
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from bench.report import write_report

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "DVC_NO_ANALYTICS": "1", "HF_HUB_OFFLINE": "1", "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
       "TOKENIZERS_PARALLELISM": "false"}


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True).stdout.strip()


def copy_project(root: Path) -> Path:
    """A fresh, clone-like copy of the project in ``root``: the tracked files as the working tree has
    them (uncommitted edits included), committed. Nothing untracked comes along, so an engine or data
    that a ``make release`` in this checkout left behind cannot make the copy start warm.

    The end-to-end, fault and production tests build their projects with it too.
    """
    root.mkdir(parents=True, exist_ok=True)
    listed = subprocess.run(["git", "ls-files", "-z", "--cached"], cwd=REPO,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for rel in filter(lambda r: r and r != "dvc.lock", listed):  # a clone has no lock of this machine's runs
        src = REPO / rel
        if src.is_file():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, root / rel)
    git(root, "init", "-q", "-b", "main")
    git(root, "config", "user.email", "bench@localhost")
    git(root, "config", "user.name", "bench")
    git(root, "add", "-A")
    git(root, "commit", "-q", "-m", "project")
    return root


def _fingerprint(path: Path) -> tuple | None:
    if not path.exists():
        return None
    return path.stat().st_mtime_ns, hashlib.sha256(path.read_bytes()).hexdigest()


def engine_builds_from_artifacts(build_file: Path, before: tuple | None) -> int:
    """Engines the compile stage built during the run; 0 if it reused them or did not run."""
    if _fingerprint(build_file) == before or not build_file.exists():
        return 0  # the compile stage did not run: nothing was built
    return int(json.loads(build_file.read_text()).get("engine_builds", 0))


def mlflow_parent_runs(root: Path, month: str) -> list:
    """The release's parent runs of ``month`` in the project's tracking store, oldest first."""
    from tasks.config import load_config
    from tasks.tracking import client_for

    client, experiment_id = client_for(load_config(root / "params.yaml").publish, root)
    runs = client.search_runs([experiment_id], f"tags.month = '{month}'", order_by=["attributes.start_time ASC"])
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    out = []
    for parent in parents:
        children = client.search_runs([experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
        stages = {c.data.tags["stage"]: {"reproduced": c.data.metrics.get("reproduced") == 1.0,
                                          "seconds": c.data.metrics.get("seconds")} for c in children}
        out.append({"run_id": parent.info.run_id, "status": parent.info.status, "metrics": parent.data.metrics,
                    "stages": stages})
    return out


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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="monthly flow wall time: first run, unchanged rerun, next month")
    ap.add_argument("--out", type=Path, default=Path("bench/results/flow_bench.json"))
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
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
