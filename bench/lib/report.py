"""What every benchmark does last: write its JSON payload, stamped with how it was measured, and say where;
and the form in which a benchmark states its headline figures.

Every benchmark imports this module when it starts, so the time and load average read here at import
are those of the start of its run; ``write_report`` adds the end's under the payload's ``recorded``
key, with the command. ``bench.benchmarks_page`` quotes them beside every figure of docs/benchmarks.md:
timings from 2 shared cores mean little without the load they were taken under.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "bench" / "results"  # every benchmark's default --out is a file here
RECORDED = "recorded"  # the payload key of the run's command, dates and load


class Figure(NamedTuple):
    """One headline figure of a benchmark's JSON, as its ``figures(payload)`` states it: what it is, the number
    (None where the figure is a text) and how the report shows it."""

    name: str
    value: float | int | None
    text: str


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]  # 1, 5 and 15 minutes


_STARTED_AT, _LOAD_AT_START = _now(), _load()


def command_line(argv: list[str] | None = None) -> str:
    """The command that is running, as a person types it: ``python -m bench.<kind>.<name> <flags>``, the module
    named by the script's path from its ``bench`` folder down (a benchmark's ``main`` called by another program,
    a test: that program's command)."""
    argv = sys.argv if argv is None else argv
    parts = Path(argv[0]).with_suffix("").parts
    if "bench" not in parts:
        return shlex.join(["python", *argv])
    start = len(parts) - 1 - parts[::-1].index("bench")
    return shlex.join(["python", "-m", ".".join(parts[start:]), *argv[1:]])


def recorded() -> dict:
    """The run's command, start and end (UTC), load averages (1/5/15 min) at both, and the machine."""
    return {"command": command_line(), "started_at": _STARTED_AT, "finished_at": _now(),
            "loadavg_start": _LOAD_AT_START, "loadavg_end": _load(), "cpus": os.cpu_count(),
            "machine": platform.processor() or platform.machine(), "python": platform.python_version()}


def write_report(out: Path, payload: dict) -> None:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload | {RECORDED: recorded()}, indent=2, sort_keys=True) + "\n")
    print(f"\nwrote {out}")


def progress(message: str) -> None:
    """A line of a long run's progress, with the wall-clock time."""
    print(f"{time.strftime('%H:%M:%S')} {message}", flush=True)
