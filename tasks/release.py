"""Run the monthly release stages in order: data, base model, compile, fine-tune, KV calibration, evaluate.

This is the plain, orchestrator-free path behind ``make release``. Each stage is the same
function its ``python -m tasks.<stage>`` entry point calls; later stages (gates,
packaging, publishing) join here as they are built. The compile stage runs before
fine-tuning so the adapter records the interface of the engine it was made for.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from tasks import calibrate, evaluate, finetune
from tasks import compile as compile_stage
from tasks.artifacts import write_json
from tasks.base_model import prepare_base_model
from tasks.cli import stage_main
from tasks.config import ReleaseConfig
from tasks.data import prepare_data


def run_release(cfg: ReleaseConfig) -> dict[str, float]:
    """Run every stage that exists; return the wall time of each in seconds."""
    timings: dict[str, float] = {}
    stages = [
        ("data", lambda: prepare_data(cfg.data, cfg.base_model.trained_through, cfg.data_dir())),
        ("base_model", lambda: prepare_base_model(cfg)),
        ("compile", lambda: compile_stage.run_stage(cfg)),
        ("finetune", lambda: finetune.run_stage(cfg)),
        *([("calibrate", lambda: calibrate.run_stage(cfg))] if cfg.kv.enabled else []),
        ("evaluate", lambda: evaluate.run_stage(cfg)),
    ]
    for name, stage in stages:
        print(f"==> {name}", flush=True)
        start = time.perf_counter()
        stage()
        timings[name] = time.perf_counter() - start
        print(f"    {name} done in {timings[name]:.1f} s", flush=True)
    write_json(cfg.release_dir() / "stage_seconds.json", {k: round(v, 2) for k, v in timings.items()})
    return timings


def _run_and_report(cfg: ReleaseConfig) -> str:
    timings = run_release(cfg)
    report = (Path(cfg.release_dir()) / "eval" / "report.md").read_text()
    return report + "\nstage times: " + ", ".join(f"{k} {v:.1f} s" for k, v in timings.items())


def main(argv: list[str] | None = None) -> int:
    return stage_main("Run the monthly adapter release.", _run_and_report, argv)


if __name__ == "__main__":
    sys.exit(main())
