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

# The device checks files with this very function; the pipeline must hash them the same way.
from runtime.package import sha256_file  # noqa: F401


@contextlib.contextmanager
def atomic_output_dir(final: Path) -> Iterator[Path]:
    """Yield a fresh temporary directory that replaces ``final`` on success."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
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


def write_json(path: Path, payload: object) -> None:
    """JSON with sorted keys and a trailing newline, so diffs of metrics stay clean."""
    Path(path).write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")

