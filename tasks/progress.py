"""Progress of a long stage, for the terminal and for whoever runs the stage.

A stage runs as a ``dvc repro`` subprocess, so its progress bar reaches only the terminal. When
the parent sets ``RELEASE_PROGRESS_FILE`` (``tasks/release/stage_runner.py`` does, for the Prefect flow), each
bar also appends JSON lines to that file: the first update, then at most one per
``REPORT_INTERVAL_S``, and the last. The parent tails the file and forwards the records (to
Prefect's progress artifacts and run log). Without the variable, ``dvc repro`` alone, only the bar.

A record: ``{"desc": "fine-tune LoRA", "n": 120, "total": 600, "unit": "step", "values": {"loss": 0.031}}``.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

PROGRESS_ENV = "RELEASE_PROGRESS_FILE"
REPORT_INTERVAL_S = 5.0  # a steady pace for the run log: a 10-minute stage writes ~120 lines


def _number(value: float) -> str:
    return str(value) if isinstance(value, int) else f"{value:.4f}"


class Progress:
    """A tqdm bar that also reports to ``$RELEASE_PROGRESS_FILE``; use as a context manager."""

    def __init__(self, desc: str, total: int, unit: str = "step", leave: bool = True, enabled: bool = True):
        """``enabled=False``: neither shown nor reported (a data-parallel rank other than the main one)."""
        from tqdm import tqdm

        self.desc, self.total, self.unit = desc, total, unit
        self.bar = tqdm(total=total, desc=desc, unit=unit, dynamic_ncols=True, leave=leave, disable=not enabled)
        self.values: dict[str, float] = {}
        self._path = os.environ.get(PROGRESS_ENV) if enabled else None
        self._last_report: float | None = None

    def advance(self, n: int = 1, **values: float) -> None:
        """``n`` more done; ``values`` (a loss, say) are shown beside the bar and reported."""
        if values:  # before the update, which redraws: the bar shows this step's values
            self.values.update(values)
            self.bar.set_postfix({k: _number(v) for k, v in self.values.items()}, refresh=False)
        self.bar.update(n)
        done = self.bar.n >= self.total
        if self._last_report is None or done or time.monotonic() - self._last_report >= REPORT_INTERVAL_S:
            self._report()

    def _report(self) -> None:
        self._last_report = time.monotonic()
        if not self._path:
            return
        record = {"desc": self.desc, "n": self.bar.n, "total": self.total, "unit": self.unit, "values": self.values}
        with open(self._path, "a") as fh:  # one short line per write: a reader never sees half a record
            fh.write(json.dumps(record) + "\n")

    def close(self) -> None:
        self.bar.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def describe(record: dict) -> str:
    """One log line: ``fine-tune LoRA: step 120/600 (20%), loss 0.0310``."""
    pct = 100.0 * record["n"] / record["total"] if record["total"] else 100.0
    text = f"{record['desc']}: {record['unit']} {record['n']}/{record['total']} ({pct:.0f}%)"
    return text + "".join(f", {k} {_number(v)}" for k, v in record["values"].items())


class ProgressReader:
    """Tails a progress file in a thread, calling ``on_record`` for each complete line, until closed.

    ``on_record`` runs in the reader's thread; ``close`` reads what is left, so no record is lost.
    """

    def __init__(self, path: Path, on_record: Callable[[dict], None], poll_s: float = 0.5):
        import contextvars

        self.path, self.on_record, self.poll_s = Path(path), on_record, poll_s
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text("")
        self._offset = 0
        self._stop = threading.Event()
        # The caller's context (a Prefect task run's, say) goes with the thread: what on_record
        # creates is attributed to that run.
        self._thread = threading.Thread(target=contextvars.copy_context().run, args=(self._loop,), daemon=True)
        self._thread.start()

    def _read_new(self) -> None:
        with open(self.path) as fh:
            fh.seek(self._offset)
            chunk = fh.read()
        complete = chunk[: chunk.rfind("\n") + 1]
        self._offset += len(complete.encode())
        for line in complete.splitlines():
            try:
                self.on_record(json.loads(line))
            except Exception as err:  # progress is for people: a lost update must not fail the stage
                logging.getLogger(__name__).warning("progress not forwarded: %s", err)

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            self._read_new()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._read_new()
        self.path.unlink(missing_ok=True)
