"""Greedy generation on any Engine: one prefill, then one decode step per token with the cache.

Batched prompts are left-padded: padding slots are masked out of attention and positions
count real tokens only, so a row decodes exactly as it would alone (up to float rounding).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from runtime.engine import Engine
from runtime.tokenizer import encode_prompt


def greedy_generate(
    engine: Engine,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    stop_tokens: Iterable[int] = (),
    pad_id: int = 0,
    batch_size: int = 8,
) -> list[list[int]]:
    """Generated token ids per prompt, the stop token excluded; batch_size=1 decodes per row."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    stop = set(int(t) for t in stop_tokens)
    results: list[list[int]] = []
    for start in range(0, len(prompts), batch_size):
        results += _generate_batch(engine, prompts[start : start + batch_size], max_new_tokens, stop, pad_id)
    return results


def _generate_batch(engine: Engine, prompts, max_new_tokens: int, stop: set[int], pad_id: int) -> list[list[int]]:
    B, L = len(prompts), max(len(p) for p in prompts)
    ids = np.full((B, L), pad_id, dtype=np.int64)  # (B, L), left-padded
    mask = np.zeros((B, L), dtype=np.int64)  # (B, L), 1 = real token
    for b, p in enumerate(prompts):
        ids[b, L - len(p) :] = p
        mask[b, L - len(p) :] = 1
    pos = np.clip(np.cumsum(mask, axis=1) - 1, 0, None)  # (B, L): 0 at each row's first real token

    logits, cache = engine.forward(ids, pos, mask, None)  # prefill
    out: list[list[int]] = [[] for _ in range(B)]
    done = np.zeros(B, dtype=bool)
    next_pos = pos[:, -1:] + 1  # (B, 1)
    for step in range(max_new_tokens):
        token = logits[:, -1].argmax(-1)  # (B,)
        for b in range(B):
            if not done[b]:
                if int(token[b]) in stop:
                    done[b] = True
                else:
                    out[b].append(int(token[b]))
        if done.all() or step == max_new_tokens - 1:
            break
        mask = np.concatenate([mask, np.ones((B, 1), dtype=np.int64)], axis=1)  # (B, S + 1)
        logits, cache = engine.forward(token[:, None].astype(np.int64), next_pos, mask, cache)  # decode
        next_pos = next_pos + 1
    return out


def generate_text(engine: Engine, tokenizer, prompts: Sequence[str], max_new_tokens: int, batch_size: int = 8) -> list[str]:
    """Text in, text out with a tokenizer from ``tasks.base_model.load_tokenizer``; stops at any of its
    ``stop_ids``, as the device does. For evaluation."""
    encoded = [encode_prompt(tokenizer, p) for p in prompts]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    tokens = greedy_generate(engine, encoded, max_new_tokens, tokenizer.stop_ids, pad, batch_size)
    return [tokenizer.decode(t, skip_special_tokens=True) for t in tokens]
