"""The KV-quality grid of one release on a Dask cluster: calibration statistics and perplexities as Prefect tasks.

The evaluate stage computes this grid in one process (``tasks.checks.kv_quality.release_kv_quality``):
calibration statistics of base + adapter on ``calib.jsonl``, then the held-out suffix perplexity
through the release's KV spec and its neighbours at 8/3/2 bits (``grid_specs``). Here the same
functions run as Prefect tasks on a ``DaskTaskRunner``: one statistics task per RoPE placement
(the calibration grid) and one perplexity task per spec (the evaluation grid), so the grid spreads
over a local cluster's processes or over a remote Dask scheduler (docs/scale-out.md).

    python -m flows.kv_grid --base models/base --adapter artifacts/2026-11/finetune/adapter --data data/2026-11 \
        [--workers 2] [--threads] [--both-ropes] [--address tcp://scheduler:8786] [--out kv_grid.json]

Numbers are those of the sequential computation: every task is a pure function of its paths and
spec, and runs torch on ``threads_per_task`` threads (1 by default: the cluster's workers are
the parallelism).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from dataclasses import replace
from pathlib import Path

from prefect import flow, task  # after flows/__init__.py set Prefect's environment
from prefect.cache_policies import NO_CACHE

from tasks.kv_stats import DEFAULT_CLIP_PERCENTILE

FLOAT = "float"


@functools.lru_cache(maxsize=2)
def _release_model(base_dir: str, adapter_dir: str):
    """(backbone with the adapter merged, tokenizer), loaded once per worker process."""
    from tasks.kv_stats import load_release_backbone
    from tasks.models import load_tokenizer

    backbone, _, _ = load_release_backbone(Path(base_dir), Path(adapter_dir))
    return backbone, load_tokenizer(Path(base_dir))


def grid_configs(release_spec, both_ropes: bool = False) -> dict:
    """name -> KVQuantSpec (None = the float cache): the float reference, the release's spec and its
    8/3/2-bit neighbours (``tasks.checks.kv_quality.grid_specs``); with ``both_ropes`` every spec also with
    the keys quantized on the other side of RoPE, which needs its own calibration statistics."""
    from tasks.checks.kv_quality import grid_specs

    specs = grid_specs(release_spec)
    configs = {FLOAT: None} | specs
    if both_ropes:
        for name, s in specs.items():
            configs[f"{name} {'post' if s.pre_rope_keys else 'pre'}-RoPE keys"] = replace(s, pre_rope_keys=not s.pre_rope_keys)
    return configs


def _dask_worker() -> str | None:
    """The address of the Dask worker running this task (None under another task runner)."""
    try:
        from distributed import get_worker

        return get_worker().address
    except (ImportError, ValueError):
        return None


@task(task_run_name="kv-calibration-pre_rope={pre_rope_keys}", cache_policy=NO_CACHE)
def calibration_stats(base_dir: str, adapter_dir: str, calib_jsonl: str, pre_rope_keys: bool, clip_percentile: float,
                      batch_size: int, max_seq_len: int, threads: int) -> dict:
    """Per-channel K/V ranges over the calibration rows (``tasks.kv_stats.collect_kv_stats``)."""
    import torch

    from tasks.kv_stats import collect_kv_stats, jsonl_batches

    torch.set_num_threads(threads)
    backbone, tokenizer = _release_model(base_dir, adapter_dir)
    batches, _ = jsonl_batches(tokenizer, Path(calib_jsonl), batch_size, max_seq_len)
    return collect_kv_stats(backbone, batches, pre_rope_keys, clip_percentile, progress=False)


@task(task_run_name="kv-perplexity-{name}", cache_policy=NO_CACHE)
def grid_point(base_dir: str, adapter_dir: str, heldout_txt: str, name: str, spec: dict | None, stats: dict | None,
               threads: int) -> dict:
    """Held-out suffix perplexity through one spec's cache (scales from ``stats``), and its bytes per token."""
    import torch

    from kernels.kv_spec import KVQuantSpec, bytes_per_token
    from tasks.checks.kv_quality import heldout_sequences, suffix_perplexity
    from tasks.kv_stats import scales_from_stats

    torch.set_num_threads(threads)
    backbone, tokenizer = _release_model(base_dir, adapter_dir)
    documents = heldout_sequences(tokenizer, Path(heldout_txt).read_text().splitlines())
    kv_spec = None if spec is None else KVQuantSpec.from_dict(spec)
    scales = None if kv_spec is None else scales_from_stats(stats, kv_spec)
    cfg, context_len = backbone.cfg, max(len(d) for d in documents)  # bytes per token at the longest document
    return {
        "config": name if kv_spec is None else f"{name} ({kv_spec.name})",
        "bits": 16.0 if kv_spec is None else (kv_spec.k_bits + kv_spec.v_bits) / 2,
        "perplexity": suffix_perplexity(backbone, documents, kv_spec, scales),
        "bytes_per_token": bytes_per_token(kv_spec, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, context_len),
        "context_len": context_len,
        "worker": _dask_worker(),
    }


@flow(name="kv-quality-grid", log_prints=True)
def kv_quality_grid(base_dir: str, adapter_dir: str, calib_jsonl: str, heldout_txt: str, spec: dict,
                    both_ropes: bool = False, clip_percentile: float = DEFAULT_CLIP_PERCENTILE, batch_size: int = 16,
                    max_seq_len: int = 96, threads_per_task: int = 1) -> dict:
    """The calibration grid, then the perplexity grid, submitted to the flow's task runner."""
    from kernels.kv_spec import KVQuantSpec

    release = KVQuantSpec.from_dict(spec)
    configs = grid_configs(release, both_ropes)
    stats = {pre: calibration_stats.submit(base_dir, adapter_dir, calib_jsonl, pre, clip_percentile, batch_size,
                                           max_seq_len, threads_per_task)
             for pre in sorted({s.pre_rope_keys for s in configs.values() if s is not None})}
    points = {name: grid_point.submit(base_dir, adapter_dir, heldout_txt, name, None if s is None else s.to_dict(),
                                      None if s is None else stats[s.pre_rope_keys], threads_per_task)
              for name, s in configs.items()}
    rows = {name: future.result() for name, future in points.items()}
    return grid_table(release, rows)


def grid_table(release_spec, rows: dict) -> dict:
    """Rows keyed by config name -> the report: perplexity increase and compression against the float cache."""
    ref = rows[FLOAT]
    table = []
    for name, row in rows.items():
        table.append({**{k: v for k, v in row.items() if k != "worker"}, "name": name,
                      "ppl_increase_pct": 100.0 * (row["perplexity"] / ref["perplexity"] - 1.0),
                      "compression_vs_fp16": ref["bytes_per_token"] / row["bytes_per_token"]})
    return {"spec": release_spec.to_dict(), "float_perplexity": ref["perplexity"], "context_len": ref["context_len"],
            "grid": sorted(table, key=lambda r: (-r["bits"], r["name"])),
            "workers": sorted({str(row["worker"]) for row in rows.values()})}


def dask_runner(address: str | None = None, workers: int = 2, processes: bool = True):
    """A DaskTaskRunner: on the scheduler at ``address``, or on a LocalCluster of ``workers`` single-threaded
    workers (processes, or threads of this process) bound to loopback, without the dashboard."""
    from prefect_dask import DaskTaskRunner

    if address:
        return DaskTaskRunner(address=address)
    kwargs = {"n_workers": workers, "processes": processes, "threads_per_worker": 1, "dashboard_address": None}
    if processes:  # threads talk over Dask's in-process transport, which has no host
        kwargs["host"] = "127.0.0.1"
    return DaskTaskRunner(cluster_class="distributed.LocalCluster", cluster_kwargs=kwargs)


def run_grid(runner, **kwargs) -> dict:
    return kv_quality_grid.with_options(task_runner=runner)(**kwargs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="the KV-quality grid of one release on a Dask cluster")
    ap.add_argument("--base", required=True, help="base model dir (models/base)")
    ap.add_argument("--adapter", required=True, help="adapter dir (artifacts/<month>/finetune/adapter)")
    ap.add_argument("--data", required=True, help="month data dir with calib.jsonl and heldout.txt")
    ap.add_argument("--spec", default="{}",
                    help="the release's KV spec as JSON (KVQuantSpec fields); {} = the KVQuantSpec defaults, the shipped scheme")
    ap.add_argument("--both-ropes", action="store_true", help="also every spec with keys on the other side of RoPE")
    ap.add_argument("--address", help="a running Dask scheduler (tcp://host:8786); default: a LocalCluster")
    ap.add_argument("--workers", type=int, default=2, help="LocalCluster workers")
    ap.add_argument("--threads", action="store_true", help="LocalCluster workers as threads of this process")
    ap.add_argument("--out", type=Path, help="write the grid as JSON here")
    args = ap.parse_args(argv)
    data = Path(args.data)
    result = run_grid(dask_runner(args.address, args.workers, not args.threads), base_dir=args.base,
                      adapter_dir=args.adapter, calib_jsonl=str(data / "calib.jsonl"),
                      heldout_txt=str(data / "heldout.txt"), spec=json.loads(args.spec), both_ropes=args.both_ropes)
    for row in result["grid"]:
        print(f"{row['config']:<48} ppl {row['perplexity']:.4f}  Δ {row['ppl_increase_pct']:+.3f} %  "
              f"{row['bytes_per_token']:.1f} B/token  x{row['compression_vs_fp16']:.2f}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
