"""How the benchmarks time a step: alternating short rounds of every backend (``interleaved``), and the step of an
engine (``engine_steps``: one decoded token after a past, or a prefill)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class PerRound:
    """A step whose resources exist only during its own rounds: ``open()`` is a context manager that
    yields the zero-argument step and frees what it holds on exit. ``interleaved`` enters it for each of
    the step's rounds and leaves it before the next step runs, so no two of them are held at once (a
    llama.cpp context returning every position's logits holds n_ctx x vocabulary floats: 400 MB at
    2,049 x 49,152, six of them 2.4 GB beside our engines on a 24 GB machine shared by four jobs)."""

    open: Callable[[], AbstractContextManager[Callable[[], object]]]


def interleaved(steps: dict, iters: int, rounds: int = 20, warmup: int = 3, settle: int = 3) -> dict[str, dict[str, float]]:
    """Median, 10th- and 95th-percentile ms per call of each step, measured in alternating short rounds
    (A B C, A B C, ...) so a load change on the machine hits every backend alike instead of
    biasing the one measured last. The median is the reported latency; p10 shows what the
    backend does when nothing else competes for the cores. A step is a zero-argument callable, or a
    ``PerRound`` opened for each of its rounds (its ``settle`` calls are then its warm-up).

    Each round starts with ``settle`` untimed calls: right after another engine ran, its worker
    threads still spin or sleep and the next engine's first calls pay for it, which no device
    running one engine sees. Measured at 0.5B width, int4 against llama.cpp Q4_0, past 512, 20
    calls a round: ours took 4.19, 3.66, 2.79, 2.54 ms for calls 1-4, then 2.3; llama.cpp 6.71 for
    call 1, then 2.3-4.5."""
    for fn in steps.values():
        for _ in range(0 if isinstance(fn, PerRound) else warmup):
            fn()
    samples: dict[str, list[float]] = {name: [] for name in steps}
    per_round = max(1, iters // rounds)
    for _ in range(rounds):
        for name, step in steps.items():
            with step.open() if isinstance(step, PerRound) else nullcontext(step) as fn:
                for _ in range(settle):
                    fn()
                for _ in range(per_round):
                    t0 = time.perf_counter()
                    fn()
                    samples[name].append((time.perf_counter() - t0) * 1e3)
    return {
        name: {"median": statistics.median(v), "p10": float(np.percentile(v, 10)), "p95": float(np.percentile(v, 95))}
        for name, v in samples.items()
    }


def engine_steps(engine, cfg, P: int | None, prefill: int = 128, last_logits: bool = False):
    """A zero-argument callable: one decode token after a cache of P, or a prefill (P=None), with the logits of every
    position or (``last_logits``, an engine with a ``logit_positions`` input) of the last one only, as a server's."""
    rng = np.random.default_rng(0)
    if P is None:
        ids = rng.integers(0, cfg.vocab_size, (1, prefill))
        pos, mask = np.arange(prefill)[None], np.ones((1, prefill), dtype=np.int64)
        last = np.array([[prefill - 1]], dtype=np.int64) if last_logits else None
        return lambda: engine.forward(ids, pos, mask, None, logit_positions=last)
    ids = rng.integers(0, cfg.vocab_size, (1, P + 1))
    pos, mask = np.arange(P + 1)[None], np.ones((1, P + 1), dtype=np.int64)
    _, cache = engine.forward(ids[:, :P], pos[:, :P], mask[:, :P], None)
    return lambda: engine.forward(ids[:, P:], pos[:, P:], mask, cache)  # the cache is not extended


def engine_latency(engine, cfg, iters: int, pasts=(128, 512), prefill: int = 128) -> dict:
    """One engine alone: median ms of a decoded token after each past, and of a prefill."""
    out = {f"decode_{P}_ms": interleaved({"x": engine_steps(engine, cfg, P)}, iters)["x"]["median"] for P in pasts}
    prefill_ms = interleaved({"x": engine_steps(engine, cfg, None, prefill)}, max(5, iters // 10), rounds=5)
    out[f"prefill_{prefill}_ms"] = prefill_ms["x"]["median"]
    return out
