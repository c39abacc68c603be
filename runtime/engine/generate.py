"""Generation on any Engine: one prefill, then one decode step per token with the cache.

Batched prompts are left-padded: padding slots are masked out of attention and positions
count real tokens only, so a row decodes exactly as it would alone (up to float rounding).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import numpy as np

from runtime.engine.engine import Engine
from runtime.engine.sampling import TokenSampler, greedy
from runtime.engine.tokenizer import ChatPrompt, encode_prompt


def greedy_generate(
    engine: Engine,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    stop_tokens: Iterable[int] = (),
    pad_id: int = 0,
    batch_size: int = 8,
) -> list[list[int]]:
    """Generated token ids per prompt, the stop token excluded; batch_size=1 decodes per row."""
    results: list[list[int]] = []
    for start in range(0, len(prompts), batch_size):
        rows: list[list[int]] = [[] for _ in prompts[start : start + batch_size]]
        for step in decode_steps(engine, prompts[start : start + batch_size], max_new_tokens, stop_tokens, pad_id):
            for row, token in zip(rows, step):
                if token is not None:
                    row.append(token)
        results += rows
    return results


def left_padded(prompts: Sequence[Sequence[int]], pad_id: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A prefill's ids, positions and attention mask, each (B, L), prompts left-padded to the longest."""
    B, L = len(prompts), max(len(p) for p in prompts)
    ids = np.full((B, L), pad_id, dtype=np.int64)
    mask = np.zeros((B, L), dtype=np.int64)  # 1 = real token
    for b, p in enumerate(prompts):
        ids[b, L - len(p) :] = p
        mask[b, L - len(p) :] = 1
    pos = np.clip(np.cumsum(mask, axis=1) - 1, 0, None)  # 0 at each row's first real token
    return ids, pos, mask


def last_positions(ids: np.ndarray) -> np.ndarray:
    """(B, 1) the last new token of every row of ``ids`` (B, T): where a left-padded prefill samples, the only
    logits it needs (``Engine.forward``'s ``logit_positions``)."""
    B, T = ids.shape
    return np.full((B, 1), T - 1, dtype=np.int64)


def prefill(engine: Engine, ids: np.ndarray, pos: np.ndarray, mask: np.ndarray, chunk: int | None = None, **forward_args):
    """The left-padded prompts ``ids``, ``pos``, ``mask`` (B, T) through ``engine`` into a new cache: (logits of the
    last position (B, 1, V), cache). With ``chunk``, at most that many tokens per forward, each chunk through the
    cache the earlier ones left: a forward's activations (attention scores (B, heads, chunk, P + chunk) instead of
    (B, heads, T, T)) bound the peak memory of a long prompt, for the weights read once per chunk. ``forward_args``
    go to every forward (a stacked engine's ``slots``)."""
    if chunk is not None and chunk < 1:
        raise ValueError(f"prefill chunk must be >= 1 token, got {chunk}")
    T = ids.shape[1]
    step = chunk or T
    cache = None
    for a in range(0, T, step):
        b = min(a + step, T)
        logits, cache = engine.forward(ids[:, a:b], pos[:, a:b], mask[:, :b], cache,
                                       logit_positions=last_positions(ids[:, a:b]), **forward_args)
    return logits, cache


def prefill_by_position(engine: Engine, prompts: Sequence[Sequence[int]], starts: np.ndarray, chunk: int, cache=None,
                        **forward_args):
    """Whole prompts through a paged engine into ``cache``, whose row b holds the first ``starts[b]`` tokens of
    ``prompts[b]`` already (shared pages; None: an empty cache, every start 0), in chunks fixed by absolute position:
    forward k takes every row's tokens at positions [k chunk, (k + 1) chunk). So a row's chunks, and with them which
    of its tokens read each other in float and which read earlier ones through the cache (sealed pages), are the ones
    it has alone, whatever its company and wherever its shared prefix ends on a chunk boundary; a left-padded batch
    would cut each row at other positions. In a forward a row's tokens are padded on either side (a row that starts
    later, one that ends sooner) or the row is all padding; a paged cache stores only the real tokens. (logits of each
    row's last token (B, 1, V), cache)."""
    B = len(prompts)
    ends = np.array([len(p) for p in prompts], dtype=np.int64)
    if np.any(starts >= ends):
        raise ValueError("every prompt needs at least one token after what its cache holds")
    last_logits = None
    for k in range(int(starts.min()) // chunk, (int(ends.max()) - 1) // chunk + 1):
        first, last = np.clip(starts, k * chunk, (k + 1) * chunk), np.clip(ends, k * chunk, (k + 1) * chunk)  # (B,)
        has = last > first
        if not has.any():
            continue
        offset = int(first[has].min())  # the chunk's first column is this position
        T = int(last[has].max()) - offset
        ids, pos, real = (np.zeros((B, T), dtype=np.int64) for _ in range(3))
        for b in np.flatnonzero(has):
            cols = slice(first[b] - offset, last[b] - offset)
            ids[b, cols] = prompts[b][first[b] : last[b]]
            pos[b, cols] = np.arange(first[b], last[b])
            real[b, cols] = 1
        ending = has & (last == ends)  # rows whose last token is in this chunk
        at = np.where(ending, last - 1 - offset, 0)[:, None]  # (B, 1)
        logits, cache = engine.forward(ids, pos, real, cache, logit_positions=at, **forward_args)
        if logits.shape[1] > 1:  # an engine without logit_positions returns every position's
            logits = np.take_along_axis(logits, at[:, :, None], axis=1)
        if last_logits is None:
            last_logits = np.empty((B, 1, logits.shape[-1]), dtype=logits.dtype)
        last_logits[ending] = logits[ending]
    return last_logits, cache


def decode_steps(
    engine: Engine,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    stop_tokens: Iterable[int] = (),
    pad_id: int = 0,
    sample: TokenSampler = greedy,
) -> Iterator[list[int | None]]:
    """One prefill, then one decode step per token: yields, per step, each row's new token, or None
    for a row that has stopped (its stop token is never yielded). Ends when every row has stopped or
    after ``max_new_tokens`` steps. A consumer that stops iterating stops the decode (streaming)."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    stop = set(int(t) for t in stop_tokens)
    B = len(prompts)
    ids, pos, mask = left_padded(prompts, pad_id)
    logits, cache = prefill(engine, ids, pos, mask)  # (B, 1, V)
    done = np.zeros(B, dtype=bool)
    next_pos = pos[:, -1:] + 1  # (B, 1)
    for step in range(max_new_tokens):
        token = sample(logits[:, -1])  # (B,)
        out: list[int | None] = []
        for b in range(B):
            if not done[b] and int(token[b]) in stop:
                done[b] = True
            out.append(None if done[b] else int(token[b]))
        if done.all():
            return
        yield out
        if step == max_new_tokens - 1:
            return
        mask = np.concatenate([mask, np.ones((B, 1), dtype=np.int64)], axis=1)  # (B, S + 1)
        logits, cache = engine.forward(token[:, None].astype(np.int64), next_pos, mask, cache)  # decode
        next_pos = next_pos + 1


def generate_text(engine: Engine, tokenizer, prompts: Sequence[str | ChatPrompt], max_new_tokens: int, batch_size: int = 8) -> list[str]:
    """Text in, text out with a tokenizer from ``tasks.models.load_tokenizer``; stops at any of its
    ``stop_ids``, as the device does. For evaluation."""
    encoded = [encode_prompt(tokenizer, p) for p in prompts]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    tokens = greedy_generate(engine, encoded, max_new_tokens, tokenizer.stop_ids, pad, batch_size)
    return [tokenizer.decode(t, skip_special_tokens=True) for t in tokens]
