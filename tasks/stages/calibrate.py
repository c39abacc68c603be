"""The calibrate stage: what this release's KV cache takes from calibration.

The served cache is quantized pages (``engine.kv_cache: quantized_pages``, ``kernels.kv_spec.PageQuantSpec``): the
device computes each page's scales from its own K/V when the page fills, so a release ships no KV scales and
nothing is calibrated here. The stage writes a note of what the release's cache is into ``layout.kv_dir``, because
DVC's stage graph is fixed: the stage runs and its output exists whatever the profile. (The static per-channel
scales this stage calibrated once were removed with the static cache: docs/kv-cache-real-weights.md.)

    python -m tasks.stages.calibrate --params params.yaml   (settings from the ``kv`` section)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tasks.artifacts import atomic_output_dir
from tasks.cli import stage_main
from tasks.config import ReleaseConfig
from tasks.layout import KV_DISABLED_FILE, KV_PAGES_FILE


def _note(cfg: ReleaseConfig, name: str, note: dict) -> Path:
    with atomic_output_dir(cfg.layout.kv_dir) as tmp:
        (tmp / name).write_text(json.dumps(note, indent=2) + "\n")
    return cfg.layout.kv_dir / name


def run_stage(cfg: ReleaseConfig) -> Path:
    """The calibrate stage: the note of what this release's KV cache is (no model is loaded)."""
    if not cfg.kv.enabled:
        return _note(cfg, KV_DISABLED_FILE, {"kv_enabled": False, "why": "kv.enabled is false: the KV gates measure nothing"})
    from runtime.engine.model import read_config

    pages = cfg.kv.page_spec(read_config(cfg.base_model.path).head_dim)
    return _note(cfg, KV_PAGES_FILE, {"kv_cache": cfg.engine.kv_cache, "pages": pages.to_dict(),
                                      "layer_kl_budget": cfg.kv.layer_kl_budget,
                                      "why": "quantized pages take each page's scales from its own K/V on the "
                                             "device: the release ships no KV scales; per-layer widths "
                                             "(kv.layer_kl_budget) are chosen once per backbone by the compile "
                                             "stage (tasks/checks/page_widths.py)"})


def main(argv: list[str] | None = None) -> int:
    return stage_main(
        "Write what this release's KV cache takes from calibration (quantized pages: nothing).",
        lambda cfg: f"no KV scales to calibrate: {json.loads((path := run_stage(cfg)).read_text())['why']} ({path})",
        argv,
    )


if __name__ == "__main__":
    sys.exit(main())
