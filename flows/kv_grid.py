"""The KV-quality grid of one release on a Dask cluster: what its quantized pages cost at every width, as Prefect tasks.

The evaluate stage computes this grid in one process (``tasks.checks.page_quality.release_page_quality``): the
held-out KL and perplexity of base + adapter reading the release's pages and the same pages at the other widths
(``grid_widths``). Here each width is a Prefect task on a ``DaskTaskRunner``, so the grid spreads over a local
cluster's processes or over a remote Dask scheduler (docs/scale-out.md).

    python -m flows.kv_grid --base models/base --adapter artifacts/2026-11/finetune/adapter --data data/2026-11 \
        [--pages '{"k_bits": 4, "v_bits": 4, "v_group_size": 64}'] [--block-size 16] [--workers 2] [--threads] \
        [--address tcp://scheduler:8786] [--out kv_grid.json]

Numbers are those of the sequential computation: every task is a pure function of its paths and spec, and runs
torch on ``threads_per_task`` threads (1 by default: the cluster's workers are the parallelism).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

from prefect import flow, task  # after flows/__init__.py set Prefect's environment
from prefect.cache_policies import NO_CACHE


@functools.lru_cache(maxsize=2)
def _release_model(base_dir: str, adapter_dir: str):
    """(backbone with the adapter merged, tokenizer), loaded once per worker process."""
    from tasks.models import load_release_backbone, load_tokenizer

    backbone, _, _ = load_release_backbone(Path(base_dir), Path(adapter_dir))
    return backbone, load_tokenizer(Path(base_dir))


def _dask_worker() -> str | None:
    """The address of the Dask worker running this task (None under another task runner)."""
    try:
        from distributed import get_worker

        return get_worker().address
    except (ImportError, ValueError):
        return None


@task(task_run_name="kv-pages-{name}", cache_policy=NO_CACHE)
def grid_point(base_dir: str, adapter_dir: str, heldout_txt: str, name: str, pages: dict, block_size: int,
               threads: int) -> dict:
    """Held-out KL and perplexity through one width's pages (each document's first half prefilled, its second half
    decoded, ``tasks.checks.page_quality.score_document``), and what they store per value at the longest document."""
    import torch

    from kernels.kv_spec import PageQuantSpec
    from tasks.checks.page_quality import heldout_sequences, score_document, summarize

    torch.set_num_threads(threads)
    backbone, tokenizer = _release_model(base_dir, adapter_dir)
    documents = heldout_sequences(tokenizer, Path(heldout_txt).read_text().splitlines())
    spec = PageQuantSpec.from_dict(pages)
    scores = [score_document(backbone, ids, spec, block_size, len(ids) // 2)[0] for ids in documents]
    context_len = max(len(d) for d in documents)
    return {"name": name, "config": f"{name} ({spec.name})", "bits": (spec.k_bits + spec.v_bits) / 2,
            **summarize(scores), "context_len": context_len,
            "stored_bits_per_value": spec.stored_bits_per_value(backbone.cfg.head_dim, block_size, context_len),
            "worker": _dask_worker()}


@flow(name="kv-quality-grid", log_prints=True)
def kv_quality_grid(base_dir: str, adapter_dir: str, heldout_txt: str, pages: dict, block_size: int = 16,
                    threads_per_task: int = 1) -> dict:
    """Every width of the release's pages, submitted to the flow's task runner."""
    from kernels.kv_spec import PageQuantSpec
    from tasks.checks.page_quality import grid_widths

    release = PageQuantSpec.from_dict(pages)
    points = [grid_point.submit(base_dir, adapter_dir, heldout_txt, name, spec.to_dict(), block_size, threads_per_task)
              for name, spec in grid_widths(release).items()]
    rows = [future.result() for future in points]
    return {"pages": release.to_dict(), "block_size": block_size,
            "grid": sorted(({k: v for k, v in row.items() if k != "worker"} for row in rows), key=lambda r: -r["bits"]),
            "workers": sorted({str(row["worker"]) for row in rows})}


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
    ap = argparse.ArgumentParser(description="the KV-quality grid of one release's quantized pages on a Dask cluster")
    ap.add_argument("--base", required=True, help="base model dir (models/base)")
    ap.add_argument("--adapter", required=True, help="adapter dir (artifacts/<month>/finetune/adapter)")
    ap.add_argument("--data", required=True, help="month data dir with heldout.txt")
    ap.add_argument("--pages", default="{}",
                    help="the release's pages as JSON (PageQuantSpec fields); {} = the PageQuantSpec defaults")
    ap.add_argument("--block-size", type=int, default=16, help="tokens per page (engine.kv_block_size)")
    ap.add_argument("--address", help="a running Dask scheduler (tcp://host:8786); default: a LocalCluster")
    ap.add_argument("--workers", type=int, default=2, help="LocalCluster workers")
    ap.add_argument("--threads", action="store_true", help="LocalCluster workers as threads of this process")
    ap.add_argument("--out", type=Path, help="write the grid as JSON here")
    args = ap.parse_args(argv)
    result = run_grid(dask_runner(args.address, args.workers, not args.threads), base_dir=args.base,
                      adapter_dir=args.adapter, heldout_txt=str(Path(args.data) / "heldout.txt"),
                      pages=json.loads(args.pages), block_size=args.block_size)
    for row in result["grid"]:
        print(f"{row['config']:<32} KL {row['kl_mean']:.2e}  Δppl {row['ppl_increase_pct']:+.3f} %  "
              f"{row['stored_bits_per_value']:.2f} stored bits/value at {row['context_len']} tokens")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
