"""The gates stage: ``gates/gates.json``, the evaluation gates' verdicts (``tasks.gate_rules``) on this
month's metrics and the registry's champion. The package stage refuses to run unless they all passed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tasks.artifacts import write_json
from tasks.cli import stage_main
from tasks.config import ReleaseConfig, StageError
from tasks.gate_rules import (
    accuracy_measure,
    current_champion,
    evaluation_gates,
    failed_reason,
    gate_report,
    render_gate_table,
    scored_metrics,
)


def run_stage(cfg: ReleaseConfig) -> Path:
    """The gates stage: ``gates/gates.json`` from the evaluation and the registry's champion. A failed
    gate is a verdict, not an error: the file is written either way, and packaging reads it."""
    metrics_file = cfg.layout.metrics_file
    if not metrics_file.exists():
        raise StageError(f"{metrics_file} is missing: run the evaluate stage first")
    metrics = json.loads(metrics_file.read_text())
    champion = current_champion(Path(cfg.publish.registry_dir), cfg.data.product)
    if champion is not None and champion["month"] == cfg.data.month:
        champion = None  # a month is not compared with its own earlier release
    gates = evaluation_gates(metrics, cfg.gates, champion, cfg.engine, cfg.kv.enabled)
    out = cfg.layout.gates_file
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(out, gate_report(gates) | {"champion": champion, "accuracy_measure": accuracy_measure(scored_metrics(metrics))})
    return out


def _run_and_report(cfg: ReleaseConfig) -> str:
    report = json.loads(run_stage(cfg).read_text())
    verdict = "all gates passed" if report["passed"] else f"FAILED: {failed_reason(report)}"
    return render_gate_table(report) + "\n" + verdict


def main(argv: list[str] | None = None) -> int:
    return stage_main("Evaluate the release gates on this month's metrics.", _run_and_report, argv)


if __name__ == "__main__":
    sys.exit(main())
