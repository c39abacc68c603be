"""A benchmark's chart: a PNG beside its JSON (``bench.run_all`` shows every one it finds there)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path


def save_chart(path: Path, draw: Callable, ncols: int = 1, figsize: tuple[float, float] = (6, 3.5)) -> None:
    """A figure of ``ncols`` axes side by side, drawn by ``draw(axes)`` (one axes, or a tuple of them), saved
    as ``path``; matplotlib without a display."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=figsize)
    try:
        draw(axes)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)
    print(f"wrote {path}")


def bars(ax, groups: dict[str, dict[str, float]], ylabel: str, log: bool = False) -> None:
    """Grouped bars: a group per key of ``groups``, a bar per series in it, a series a colour across groups."""
    series = list(dict.fromkeys(s for g in groups.values() for s in g))
    width = 0.8 / max(1, len(series))
    for i, s in enumerate(series):
        xs = [j + i * width for j, g in enumerate(groups.values()) if s in g]
        ys = [g[s] for g in groups.values() if s in g]
        ax.bar(xs, ys, width, label=s)
    ax.set_xticks([j + width * (len(series) - 1) / 2 for j in range(len(groups))], list(groups))
    ax.set_ylabel(ylabel)
    if log:
        ax.set_yscale("log")
    ax.legend(fontsize=7)
    ax.grid(axis="y", alpha=0.3)
