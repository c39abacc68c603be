"""The release's plots as png files, from the CSVs the stages write (the same data ``dvc plots show`` reads).

- loss (train every step, validation at its interval) against the optimizer step: ``loss.png``;
- one decode step's latency on the engine against the past length it attends to: ``latency.png``;
- the held-out perplexity increase of the quantized KV cache against its bits: ``kv_bits.png``.

The stages write them beside their CSVs; the flow attaches both to MLflow; ``docs/img/`` holds
the default month's, shown in docs/release.md.
"""

from __future__ import annotations

import csv
from collections import defaultdict
from pathlib import Path

LOSS_CSV, VAL_LOSS_CSV, LOSS_PNG = "loss.csv", "val_loss.csv", "loss.png"  # base pre-training: pretrain_loss.csv ...
LATENCY_CSV, LATENCY_PNG = "latency.csv", "latency.png"
KV_GRID_CSV, KV_BITS_PNG = "kv_grid.csv", "kv_bits.png"


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def read_rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def save_figure(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    _pyplot().close(fig)
    return Path(path)


def _labelled(fig, ax, xlabel: str, ylabel: str, title: str, legend: bool):
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if legend:
        ax.legend()
    ax.grid(alpha=0.3)
    return fig


def loss_figure(train: list[tuple[int, float]], val: list[tuple[int, float]], title: str):
    """Train loss per step and validation loss at its steps, on a log scale."""
    fig, ax = _pyplot().subplots(figsize=(6, 3.5))
    ax.plot(*zip(*train), linewidth=1, label="train")
    if val:
        ax.plot(*zip(*val), marker="o", markersize=3, linewidth=1.5, label="validation")
    ax.set_yscale("log")
    return _labelled(fig, ax, "step", "loss", title, legend=True)


def latency_by_past_length(rows: list[dict[str, str]]) -> list[tuple[int, float, float]]:
    """(past length, median ms, max ms) over the prompts that decoded at that past length."""
    by_length: dict[int, list[float]] = defaultdict(list)
    for row in rows:
        by_length[int(row["past_length"])].append(float(row["decode_ms"]))
    out = []
    for length, times in sorted(by_length.items()):
        times.sort()
        out.append((length, times[len(times) // 2], times[-1]))
    return out


def latency_figure(rows: list[dict[str, str]], title: str):
    fig, ax = _pyplot().subplots(figsize=(6, 3.5))
    ax.scatter([int(r["past_length"]) for r in rows], [float(r["decode_ms"]) for r in rows], s=6, alpha=0.4,
               label="one step")
    summary = latency_by_past_length(rows)
    ax.plot([s[0] for s in summary], [s[1] for s in summary], linewidth=1.5, label="median")
    return _labelled(fig, ax, "past length (tokens in the KV cache)", "decode step (ms)", title, legend=True)


def kv_bits_figure(rows: list[dict[str, str]], title: str):
    """Held-out perplexity increase against the cache's bits per value (the release's spec marked)."""
    fig, ax = _pyplot().subplots(figsize=(6, 3.5))
    points = sorted((float(r["bits"]), float(r["ppl_increase_pct"]), r["config"]) for r in rows)
    ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", linewidth=1.5)
    for bits, pct, config in points:
        if config.startswith("release"):
            ax.annotate("release", (bits, pct), textcoords="offset points", xytext=(6, 6))
    return _labelled(fig, ax, "KV-cache bits per value", "held-out perplexity increase (%)", title, legend=False)
