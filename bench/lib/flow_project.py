"""A fresh, clone-like copy of the project for the monthly flow to run in, the environment it runs under, and
the parent runs it recorded in its MLflow tracking store. The flow benchmarks run the flow there; the
end-to-end, fault and production tests build their projects the same way (``tests/project_testkit.py``)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from bench.lib.report import REPO

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


def mlflow_parent_runs(root: Path, month: str) -> list:
    """The release's parent runs of ``month`` in the project's tracking store, oldest first."""
    from tasks.config import load_config
    from tasks.release.tracking import client_for

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

