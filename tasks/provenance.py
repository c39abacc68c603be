"""Where a release's code came from: the git revision of the checkout that built it."""

from __future__ import annotations

import subprocess
from pathlib import Path


def git_revision(cwd: Path | None = None) -> dict:
    """HEAD of the pipeline repository and whether its tracked files differ from it."""
    def git(*args):
        return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=30)

    try:
        head = git("rev-parse", "HEAD")
        if head.returncode != 0:
            return {"git_revision": "unknown", "git_dirty": None}
        dirty = git("status", "--porcelain", "--untracked-files=no")
        return {"git_revision": head.stdout.strip(), "git_dirty": bool(dirty.stdout.strip())}
    except (OSError, subprocess.TimeoutExpired):
        return {"git_revision": "unknown", "git_dirty": None}
