"""docs/benchmarks.md, written from the benchmarks' own JSON, never by hand.

    python -m bench.benchmarks_page [--results bench/results] [--out docs/benchmarks.md]

`make bench` (``bench.run_all``) ends with this; run alone it rewrites the page from what
``bench/results/`` holds, after a benchmark run by hand (``python -m bench.serving.serve_bench``...).
Every benchmark's JSON is stamped by ``bench.lib.report`` with its command, start and end and the load
averages at both. For each benchmark the newest stamped file (its default ``bench/results/<name>.json``
or ``bench.run_all``'s ``bench/results/latest/<name>.json``) gives one row per figure, and every row
names the command, the date and the load. The figures are those the benchmark states (its module's
``figures``, the module found from the stamped command); a benchmark that states none shows the numbers
of its JSON by key. A JSON without the stamp (written before it existed) is named at the end, not quoted.
``bench/results/`` is not in git: a benchmark whose JSON is not there keeps the section the page already had
(its figures, command, date and load as they were).
"""

from __future__ import annotations

import argparse
import importlib
import json
import shlex
import sys
from pathlib import Path

from bench.lib.report import RECORDED, REPO, RESULTS
from bench.lib.tables import table

PAGE = REPO / "docs" / "benchmarks.md"
REPORT_FILES = {"latest.json"}  # bench.run_all's summary of a run, not a benchmark's payload
MAX_KEYED_ROWS = 60
UNQUOTED = "Not quoted "  # the page's last paragraph: the JSON files without a stamp


def newest_results(results_dir: Path) -> tuple[dict[str, tuple[Path, dict]], list[Path]]:
    """{benchmark: (file, payload)} of the newest stamped JSON per benchmark, and the unstamped files."""
    newest: dict[str, tuple[Path, dict]] = {}
    unstamped = []
    files = sorted(results_dir.glob("*.json")) + sorted(results_dir.glob("latest/*.json"))
    for path in files:
        if path.name in REPORT_FILES:
            continue
        payload = json.loads(path.read_text())
        stamp = payload.get(RECORDED) if isinstance(payload, dict) else None
        if stamp is None:
            unstamped.append(path)
        elif path.stem not in newest or stamp["finished_at"] > newest[path.stem][1][RECORDED]["finished_at"]:
            newest[path.stem] = (path, payload)
    return newest, unstamped


def keyed_numbers(value, key: str = "") -> list[tuple[str, float, str]]:
    """(dotted key, number, text) of every number in a payload, for a benchmark without a figure list."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return []
    if isinstance(value, (int, float)):
        return [(key, value, f"{value:,.4g}")]
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else []
    return [row for k, v in items if k != RECORDED for row in keyed_numbers(v, f"{key}.{k}" if key else str(k))]


def load_text(stamp: dict) -> str:
    start, end = stamp["loadavg_start"], stamp["loadavg_end"]
    return f"{start[0]:.2f} → {end[0]:.2f} (1 min; 15 min {end[2]:.2f}), {stamp['cpus']} CPUs"


def benchmark_module(command: str):
    """The module of the benchmark a stamped command ran (``python -m bench.<kind>.<name> ...``), found by its file
    name, which is unique in bench/ (a command stamped before bench/ had kinds names ``bench.<name>``); None if
    no benchmark has that name."""
    words = shlex.split(command)
    if "-m" not in words[:-1]:
        return None
    name = words[words.index("-m") + 1].rpartition(".")[2]
    found = sorted((REPO / "bench").glob(f"*/{name}.py"))
    return importlib.import_module(f"bench.{found[0].parent.name}.{name}") if found else None


def figure_rows(payload: dict) -> list[tuple[str, str]]:
    module = benchmark_module(payload[RECORDED]["command"])
    if hasattr(module, "figures"):
        try:
            return [(figure, text) for figure, _, text in module.figures(payload)]
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as err:
            return [("figures", f"**not readable**: {type(err).__name__}: {err}")]
    rows = keyed_numbers(payload)
    shown = [(key, text) for key, _, text in rows[:MAX_KEYED_ROWS]]
    if len(rows) > MAX_KEYED_ROWS:
        shown.append(("…", f"{len(rows) - MAX_KEYED_ROWS} more numbers in its JSON"))
    return shown


def page_sections(page: str) -> dict[str, list[str]]:
    """{benchmark: its lines, heading to table} of a page this module wrote."""
    sections: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in page.splitlines():
        if line.startswith("## "):
            current = sections.setdefault(line[3:].strip(), [])
        elif line.startswith(UNQUOTED):
            current = None
        if current is not None:
            current.append(line)
    return {name: lines[: max(i for i, line in enumerate(lines) if line.strip()) + 1] + [""]
            for name, lines in sections.items()}


def render_page(results_dir: Path, previous: str = "") -> str:
    """The page from ``results_dir``'s JSON; ``previous`` (the page as it was) gives the sections of the
    benchmarks without a JSON there."""
    newest, unstamped = newest_results(results_dir)
    kept = {name: lines for name, lines in page_sections(previous).items() if name not in newest}
    lines = [
        "# Benchmarks",
        "",
        "Written by `make bench` (`python -m bench.benchmarks_page` rewrites it from `bench/results/`); do not edit.",
        "Every figure names the command that measured it, when it finished (UTC) and the load average of the",
        "machine at its start and end: on shared cores a timing means little without it. How each benchmark measures, and past runs quoted",
        "before this page was generated: [measuring.md](measuring.md).",
        "",
    ]
    if not newest and not kept:
        lines += ["No benchmark results in `bench/results/` yet: run `make bench`.", ""]
    for name in sorted(newest.keys() | kept.keys()):
        if name in kept:
            lines += kept[name]
            continue
        path, payload = newest[name]
        stamp = payload[RECORDED]
        shown_path = path.relative_to(REPO) if path.is_relative_to(REPO) else path
        cells = (f"`{stamp['command']}`", stamp["finished_at"], load_text(stamp))
        lines += [f"## {name}", "", f"From `{shown_path}`.", "",
                  table(["figure", "value", "command", "finished", "load average"],
                        ([figure, text, *cells] for figure, text in figure_rows(payload)), align="<<<<<", markdown=True),
                  ""]
    if unstamped:
        lines += [UNQUOTED + "(written before benchmarks stamped their command, date and load): "
                  + ", ".join(f"`{p.name}`" for p in unstamped), ""]
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="write docs/benchmarks.md from the benchmarks' JSON")
    ap.add_argument("--results", type=Path, default=RESULTS)
    ap.add_argument("--out", type=Path, default=PAGE)
    args = ap.parse_args(argv)
    args.out.write_text(render_page(args.results, args.out.read_text() if args.out.is_file() else ""))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
