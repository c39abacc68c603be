"""Latency summaries: the one percentile of the release's decode gate and the device's swap metrics.

Torch-free and import-free, so the serving path and the pipeline (``tasks/stages/evaluate.py``) share it.
"""

from __future__ import annotations


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (q in 0..100) of ``values``: the sample at index floor(n q / 100) of the
    sorted n, the last when that runs past the end (no interpolation: it is a measured time).
    None when there are no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * (q / 100)))]
