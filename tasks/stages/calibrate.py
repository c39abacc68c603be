"""The calibration stage: per-channel KV-cache scales for this release (base + this month's adapter).

The adapter changes K and V (it targets k_proj and v_proj), so scales belong to a release:
a new adapter gets new scales. The stage runs base + adapter over the ``calib`` split,
collects per-channel ranges of keys (before RoPE when ``spec.pre_rope_keys``) and values, and
writes into ``out_dir`` (format: ``runtime.engine.kv_scales.write_kv_scales``):

  kv_scales.safetensors  ``layer.{i}.k_scale`` (nkv, d), ``layer.{i}.k_zero`` (asymmetric keys only),
                         ``layer.{i}.v_scale``, ``layer.{i}.v_zero`` (per-channel values; written
                         whatever ``v_granularity`` is, since ORT's GroupQueryAttention wants them),
                         plus the identity fields as safetensors metadata.
  kv_scales.json         how they were computed: split, rows, tokens, clipping, spec,
                         base_model_hash, adapter_sha256, interface, key outlier ratios.

``runtime.engine.kv_scales.read_kv_scales`` refuses, with a distinct ``KVScalesError.reason``, a file that
is missing, malformed, non-finite, zero or made for another adapter, backbone, interface or spec.
There is no fallback to 1.0: an uncalibrated cache would silently clip every key.

    python -m tasks.stages.calibrate --params params.yaml   (settings from the ``kv`` section)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from runtime.engine.adapter_config import ADAPTER_WEIGHTS
from runtime.engine.hashing import sha256_file
from runtime.engine.kv_scales import KV_SCALES_FILE, KV_SCALES_FORMAT_VERSION, KVScales, write_kv_scales
from tasks.artifacts import atomic_output_dir
from tasks.cli import stage_main
from tasks.config import ReleaseConfig
from tasks.kv_stats import (
    DEFAULT_CLIP_PERCENTILE,
    choose_rotation,
    jsonl_batches,
    kv_scales_from_stats,
    load_release_backbone,
)

# ---------------------------------------------------------------- statistics


# ---------------------------------------------------------------- the stage


def save_kv_scales(out_dir: Path, scales: KVScales) -> Path:
    """Write ``scales`` as the all-or-nothing folder ``out_dir``; bad scales are refused before it
    exists (``runtime.engine.kv_scales.KVScalesError``). Returns the .safetensors path."""
    with atomic_output_dir(Path(out_dir)) as tmp:
        write_kv_scales(tmp, scales)
    return Path(out_dir) / KV_SCALES_FILE


def calibrate_kv_scales(
    base_dir: Path,
    adapter_dir: Path,
    calib_jsonl: Path,
    out_dir: Path,
    spec: "KVQuantSpec",  # noqa: F821  (the scheme to calibrate; no default: a release names its own)
    clip_percentile: float = DEFAULT_CLIP_PERCENTILE,
    batch_size: int = 16,
    max_seq_len: int = 96,
    engine_dir: Path | None = None,
    threads: int = 1,
    key_positions: int = 0,
) -> Path:
    """Calibrate per-channel K/V scales of base + adapter on ``calib_jsonl``; return the .safetensors path."""
    import torch

    from tasks.models import load_tokenizer

    torch.set_num_threads(threads)
    adapter_file = Path(adapter_dir) / ADAPTER_WEIGHTS
    if not adapter_file.exists():
        raise FileNotFoundError(f"{adapter_file} is missing: scales are calibrated for an adapter")
    backbone, base_hash, interface = load_release_backbone(Path(base_dir), Path(adapter_dir), engine_dir)
    tokenizer = load_tokenizer(Path(base_dir))
    batches, rows = jsonl_batches(tokenizer, Path(calib_jsonl), batch_size, max_seq_len)
    stats, rotation, chosen = choose_rotation(backbone, batches, spec, clip_percentile, key_positions or None)
    record = chosen | {
        "format_version": KV_SCALES_FORMAT_VERSION,
        "split": "calib",
        "calib_path": str(calib_jsonl),
        "rows": rows,
        "tokens": stats["tokens"],
        "clip_percentile": clip_percentile,
        "key_positions": key_positions,
        "max_seq_len": max_seq_len,
        "spec": spec.to_dict(),
        "base_model_hash": base_hash,
        "adapter_sha256": sha256_file(adapter_file),
        "interface": interface,
        "torch": torch.__version__,
    }
    return save_kv_scales(Path(out_dir), kv_scales_from_stats(stats, spec, record, rotation))


# ---------------------------------------------------------------- CLI

# What the stage writes instead of scales when a release ships none: the profile keeps the float cache
# (``kv.enabled: false``), or its engine serves quantized pages, whose scales the device computes as each page fills.
# DVC's stage graph is fixed, so the stage runs and its output exists, but nothing is calibrated.
KV_DISABLED_FILE = "kv_disabled.json"
KV_PAGES_FILE = "kv_pages.json"


def _note(cfg: ReleaseConfig, name: str, note: dict) -> Path:
    with atomic_output_dir(cfg.layout.kv_dir) as tmp:
        (tmp / name).write_text(json.dumps(note, indent=2) + "\n")
    return cfg.layout.kv_dir / name


def run_stage(cfg: ReleaseConfig) -> Path:
    """The calibrate stage: scales for this release's base + adapter, bound to the engine interface; when the
    release ships none (``ReleaseConfig.ships_kv_scales``), only a note saying why (no model is loaded)."""
    from runtime.engine.interface import INTERFACE_FILE

    kv = cfg.kv
    if not kv.enabled:
        return _note(cfg, KV_DISABLED_FILE, {"kv_enabled": False, "why": "kv.enabled is false: the release ships no KV scales"})
    if not cfg.ships_kv_scales:
        from runtime.engine.model import read_config

        pages = kv.page_spec(read_config(cfg.base_model.path).head_dim)
        return _note(cfg, KV_PAGES_FILE, {"kv_cache": cfg.engine.kv_cache, "pages": pages.to_dict(),
                                          "why": "quantized pages take each page's scales from its own K/V on the "
                                                 "device: the release ships no KV scales"})
    spec = kv.spec()
    layout = cfg.layout
    engine_dir = layout.engine_dir
    return calibrate_kv_scales(
        Path(cfg.base_model.path),
        layout.adapter_dir,
        layout.data_dir / "calib.jsonl",
        layout.kv_dir,
        spec,
        kv.clip_percentile,
        batch_size=kv.calib_batch_size,
        max_seq_len=cfg.train.max_seq_len,
        engine_dir=engine_dir if (engine_dir / INTERFACE_FILE).exists() else None,
        # One thread, not train.threads: on 2 threads the first forward of a process differed in the
        # last bits from run to run (measured: 1 process in 4; later batches never), so a repeated
        # month got other scales (up to 3.5e-5 apart). One thread gave the same statistics in every
        # process; calibration is a few forward passes, so the thread costs seconds at most.
        threads=1,
        key_positions=kv.calib_key_positions,
    )


def main(argv: list[str] | None = None) -> int:
    return stage_main(
        "Calibrate this release's KV-cache scales (base + adapter on the calib split).",
        lambda cfg: (f"KV scales written to {path}" if (path := run_stage(cfg)).name not in (KV_DISABLED_FILE, KV_PAGES_FILE)
                     else f"no KV scales to calibrate: {json.loads(path.read_text())['why']} ({path})"),
        argv,
    )


if __name__ == "__main__":
    sys.exit(main())
