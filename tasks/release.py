"""Run the monthly release stages in order: data, base model, fine-tune, evaluate.

This is the plain, orchestrator-free path behind ``make release``. Each stage is the same
function its ``python -m tasks.<stage>`` entry point calls; later stages (KV calibration,
engine compile, gates, packaging, publishing) join here as they are built.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from tasks import evaluate, finetune
from tasks.base_model import BaseModelError, prepare_base_model
from tasks.config import ConfigError, ReleaseConfig, load_config
from tasks.data import DataError, prepare_data
from tasks.training import TrainingDiverged


def run_release(cfg: ReleaseConfig) -> dict[str, float]:
    """Run every stage that exists; return the wall time of each in seconds."""
    timings: dict[str, float] = {}
    stages = [
        ("data", lambda: prepare_data(cfg.data, cfg.base_model.trained_through, cfg.data_dir())),
        ("base_model", lambda: prepare_base_model(cfg)),
        ("finetune", lambda: finetune.run_stage(cfg)),
        ("evaluate", lambda: evaluate.run_stage(cfg)),
    ]
    for name, stage in stages:
        print(f"==> {name}", flush=True)
        start = time.perf_counter()
        stage()
        timings[name] = time.perf_counter() - start
        print(f"    {name} done in {timings[name]:.1f} s", flush=True)
    return timings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run the monthly adapter release.")
    parser.add_argument("--params", default="params.yaml")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.params)
        timings = run_release(cfg)
    except (ConfigError, DataError, BaseModelError, TrainingDiverged) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    report = Path(cfg.release_dir()) / "eval" / "report.md"
    print(report.read_text())
    print("stage times: " + ", ".join(f"{k} {v:.1f} s" for k, v in timings.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
