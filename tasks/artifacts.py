"""Helpers that keep stage outputs all-or-nothing.

A stage writes into a hidden temporary sibling and renames it into place only when
everything succeeded, so a crash or a bad input never leaves a half-written folder
that a later stage (or DVC) would take for a finished one.
"""

from __future__ import annotations

import contextlib
import hashlib
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


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
