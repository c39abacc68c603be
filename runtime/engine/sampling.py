"""Choosing the next token from the engine's logits, in numpy: greedy, or temperature and nucleus sampling.

A sampler maps the last position's logits of a batch, ``(B, V)`` float, to one token id per row,
``(B,)`` int64. ``greedy`` is argmax (what evaluation and ``temperature: 0`` use); ``Sampler`` draws
from ``softmax(logits / temperature)`` restricted to the smallest set of tokens whose probability
reaches ``top_p`` (Holtzman et al. 2020, "The Curious Case of Neural Text Degeneration", sec. 3.1),
from its own ``numpy.random.Generator``, so a request with a ``seed`` draws the same tokens again.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

TokenSampler = Callable[[np.ndarray], np.ndarray]  # (B, V) logits -> (B,) token ids


def greedy(logits: np.ndarray) -> np.ndarray:
    return logits.argmax(-1)


class Sampler:
    def __init__(self, temperature: float, top_p: float = 1.0, seed: int | None = None):
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0 to sample (0 is greedy), got {temperature}")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        self.temperature, self.top_p = temperature, top_p
        self.rng = np.random.default_rng(seed)

    def __call__(self, logits: np.ndarray) -> np.ndarray:
        scaled = logits.astype(np.float64) / self.temperature  # (B, V); float64 so exp does not overflow
        probs = np.exp(scaled - scaled.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        order = np.argsort(-probs, axis=-1, kind="stable")  # (B, V), most likely first
        sorted_probs = np.take_along_axis(probs, order, -1)
        # Keep a token while the mass before it is below top_p: the most likely token is always kept.
        keep = (np.cumsum(sorted_probs, -1) - sorted_probs) < self.top_p
        kept = np.where(keep, sorted_probs, 0.0)
        kept /= kept.sum(-1, keepdims=True)
        u = self.rng.random((logits.shape[0], 1))  # (B, 1)
        rank = np.minimum((np.cumsum(kept, -1) < u).sum(-1), logits.shape[-1] - 1)  # (B,) inverse CDF
        return np.take_along_axis(order, rank[:, None], -1)[:, 0]


def make_sampler(temperature: float, top_p: float = 1.0, seed: int | None = None) -> TokenSampler:
    """``greedy`` at temperature 0, else a seeded ``Sampler``."""
    return greedy if temperature == 0 else Sampler(temperature, top_p, seed)
