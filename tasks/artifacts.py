"""Helpers that keep stage outputs all-or-nothing.

A stage writes into a hidden temporary sibling and renames it into place only when
everything succeeded, so a crash or a bad input never leaves a half-written folder
that a later stage (or DVC) would take for a finished one.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def atomic_output_dir(final: Path) -> Iterator[Path]:
    """Yield a fresh temporary directory that replaces ``final`` on success."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    _remove_orphans(final)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-{os.getpid()}-", dir=final.parent))
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    backup = None
    if final.exists():
        backup = final.with_name(f".{final.name}.old-{os.getpid()}")
        os.replace(final, backup)
    os.replace(tmp, final)
    if backup is not None:
        shutil.rmtree(backup, ignore_errors=True)


def _remove_orphans(final: Path) -> None:
    """Temporary siblings left by a killed writer (its pid is in the name and no longer runs)."""
    for sibling in final.parent.glob(f".{final.name}.tmp-*-*"):
        pid = sibling.name[len(f".{final.name}.tmp-"):].split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(sibling, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def write_json(path: Path, payload: object) -> None:
    """JSON with sorted keys and a trailing newline, so diffs of metrics stay clean."""
    Path(path).write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")

