"""A fresh, clone-like copy of the project for tests that run the real monthly flow."""

import os
import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "DVC_NO_ANALYTICS": "1", "HF_HUB_OFFLINE": "1", "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
       "TOKENIZERS_PARALLELISM": "false"}
MODEL = "inspection-adapter"  # publish.model_name


def git(cwd, *args) -> str:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True).stdout.strip()


def copy_project(root: Path) -> Path:
    """Copy the tracked and new (not ignored) files into ``root`` and commit them in a new git repository."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for rel in filter(lambda r: r and r != "dvc.lock", listed):  # a clone has no lock of this machine's runs
        src = REPO / rel
        if src.is_file():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, root / rel)
    git(root, "init", "-q", "-b", "main")
    git(root, "config", "user.email", "e2e@localhost")
    git(root, "config", "user.name", "e2e")
    git(root, "add", "-A")
    git(root, "commit", "-q", "-m", "project")
    return root
