"""Files replaced atomically: a crash at any point leaves the old bytes or the new ones, never a mix.

A temporary dot-file in the same folder, fsync, rename over the old file, fsync of the folder. The
lowest package that writes such files holds it: a TensorRT backend caches its built plan with it, a
release is packed and a device's state recorded with it (``runtime.release``), and the pipeline writes
its own records with it (``tasks/``). Temporary names start with ``TEMP_PREFIX``, so a static HTTP
server or a folder watcher passes over them and a device removes the strays at its next start.
"""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

TEMP_PREFIX = ".tmp-"


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` so that a crash at any point leaves the old bytes or the new ones."""
    _replace_atomically(path, lambda fh: fh.write(data))


def atomic_copy(source: Path, path: Path) -> None:
    """Replace ``path`` with a copy of the file ``source``, as ``atomic_write`` does (streamed, not read whole)."""
    def copy(fh):
        with open(source, "rb") as src:
            shutil.copyfileobj(src, fh)
    _replace_atomically(path, copy)


def _replace_atomically(path: Path, write) -> None:
    """``write(fh)`` into a dot-file beside ``path`` (never served or listed as a finished file), fsync it,
    rename it over ``path`` and fsync the folder; a failed write leaves ``path`` as it was and no temporary."""
    tmp = path.with_name(f"{TEMP_PREFIX}{path.name}-{os.getpid()}-{threading.get_ident()}")
    try:
        with open(tmp, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
