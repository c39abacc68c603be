"""What quantized pages (``engine.kv_cache: quantized_pages``) cost a release, in PyTorch, one forward per text.

A device reads a row's cache the way ``runtime.engine.kv_pages`` stores it: the first page (the attention sink) and
the open page in float, every full page between them sealed (``kernels.page_quant``), and the tokens of one prefill
chunk read each other's K/V in float. A page's codes depend only on that page's K/V, so prefilling ``prefill`` tokens
and then decoding the rest one token per step is a single causal forward in which query p reads key j

  * sealed (``kernels.page_quant.read_back``) when p was decoded (p >= prefill) and page(j) lies after the sink and
    before page(p): those pages were full, hence sealed, when p was decoded;
  * in float otherwise: the sink, p's own page (open while p is decoded), and everything a prefilled token reads.

``page_read_logits`` computes exactly that (``tests/tasks/test_page_quality.py`` holds it to a token-by-token decode
through the reference's pages): two attention reads per layer instead of one step per token, so a release's evaluation
and the real-model bench score thousands of tokens of real text in the time a decode loop scores a few hundred.

``release_page_quality`` is the evaluate stage's measure for such a release: what the pages cost in held-out KL and
perplexity (each document's first half prefilled, its second half decoded), in greedy task accuracy, and the same at the other widths (``GRID_BITS``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
import torch

from kernels.kv_spec import PageQuantSpec
from kernels.page_quant import read_back
from runtime.engine.kv_pages import PagesCache
from runtime.engine.tokenizer import ChatPrompt, encode_prompt, until_stop
from tasks.scoring import kl_sum

GRID_BITS = (8, 4, 3, 2)  # the widths the release's evaluation also measures (K and V alike), for the plot


def heldout_sequences(tokenizer, lines: list[str]) -> list[list[int]]:
    """Each held-out document tokenized on its own, with the special tokens evaluation uses.

    Documents, not a concatenated stream: the models here learn documents of ~50 tokens, and a
    stream would score positions they never saw, where any cache looks equally bad.
    """
    return [ids for ids in (tokenizer(line)["input_ids"] for line in lines) if len(ids) >= 4]


def sealed_reads(length: int, block_size: int, prefill: int) -> torch.Tensor:
    """(length, length) bool: query p reads key j from its sealed page (see the module's docstring)."""
    position = torch.arange(length)
    page = position // block_size
    return (page[None, :] >= 1) & (page[None, :] < page[:, None]) & (position[:, None] >= prefill)


PAGED_ROLES = ("keys", "values")


@torch.no_grad()
def page_read_logits(backbone, input_ids: torch.Tensor, spec: PageQuantSpec | None, block_size: int, prefill: int,
                     lora: tuple = (), paged: dict[int, tuple[str, ...]] | None = None,
                     start: tuple[int, torch.Tensor] | None = None, inputs: list | None = None,
                     logit_positions: torch.Tensor | None = None) -> torch.Tensor:
    """Logits (B, T, V) of rows ``input_ids`` (B, T) (no padding: positions 0..T-1) as a device computes them with
    ``spec``'s pages of ``block_size`` tokens, ``prefill`` tokens prefilled in one chunk and the rest decoded one by
    one. ``spec`` None: the float cache (one plain forward).

    For calibration (``tasks.checks.page_widths``): ``paged`` {layer: roles of ``PAGED_ROLES``} reads only those from pages,
    everything else in float; ``start`` (layer i, its input hidden state) skips the layers before i, whose input a
    float run recorded into ``inputs`` (one (B, T, D) per layer); ``logit_positions`` (B, K): logits (B, K, V) of
    those positions only."""
    B, T = input_ids.shape
    cfg = backbone.cfg
    nkv, d = cfg.num_kv_heads, cfg.head_dim
    g = cfg.num_heads // nkv
    x, cos, sin, mask = backbone.prepare(input_ids, torch.arange(T).expand(B, T), torch.ones(B, T, dtype=torch.long), 0)
    first, x = start if start is not None else (0, x)
    sealed = sealed_reads(T, block_size, prefill)
    sealed = sealed[None].expand(g, T, T).reshape(1, 1, g * T, T)  # Block.forward's GQA fold: g query heads per row
    loras = backbone.layer_loras(tuple(lora), T)
    for i, block in enumerate(backbone.blocks):
        if i < first:
            continue
        if inputs is not None:
            inputs.append(x)
        q, k, v = block.project_qkv(x, B, T, cos, sin, loras[i])  # (B, nh, T, d), (B, nkv, T, d) x 2
        qg = q.reshape(B, nkv, g * T, d)
        roles = () if spec is None else PAGED_ROLES if paged is None else paged.get(i, ())
        if not roles:
            scores = qg @ k.transpose(-1, -2)
            att = torch.softmax(scores * (1.0 / math.sqrt(d)) + mask, dim=-1)
            y = att @ v
        else:
            # Every row's pages at once: read_back takes (heads, n, d), and a page's scales are per head.
            k_read, v_read = (t.reshape(B, nkv, T, d) for t in
                              read_back(k.reshape(B * nkv, T, d), v.reshape(B * nkv, T, d), spec.layer(i), block_size))
            k_read, v_read = (k_read if "keys" in roles else k), (v_read if "values" in roles else v)
            scores = torch.where(sealed, qg @ k_read.transpose(-1, -2), qg @ k.transpose(-1, -2))
            att = torch.softmax(scores * (1.0 / math.sqrt(d)) + mask, dim=-1)
            y = (att * sealed) @ v_read + (att * ~sealed) @ v
        x = block.finish(x, y, B, T, loras[i])
    return backbone.head(x, B, T, logit_positions)


@dataclass(frozen=True)
class DocumentScore:
    """One document's scored tokens: the float cache's and the pages' negative log-likelihood (sums), and the summed
    KL(float || pages) of their next-token distributions, over ``tokens`` positions."""

    nll_float: float
    nll_pages: float
    kl: float
    tokens: int


def _document_score(float_logits: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor) -> tuple[DocumentScore, torch.Tensor]:
    """Logits (n, V) of the float cache and of the pages, row t predicting ``targets[t]``; (the score, the float
    cache's log-probabilities)."""
    float_logp, logp = (torch.log_softmax(x.double(), -1) for x in (float_logits, logits))
    at = torch.arange(len(targets))
    kl = kl_sum(float_logp, logp)
    return DocumentScore(-float(float_logp[at, targets].sum()), -float(logp[at, targets].sum()), kl, len(targets)), float_logp


def score_document(backbone, ids: list[int], spec: PageQuantSpec, block_size: int, prefill: int,
                   float_logits: torch.Tensor | None = None) -> tuple[DocumentScore, torch.Tensor]:
    """Score the tokens after ``prefill`` of one document (each predicted by the position before it) with the float
    cache and with ``spec``'s pages; (the score, the float cache's logits, to pass back for another spec on the same
    document)."""
    x = torch.tensor([ids])
    if float_logits is None:
        float_logits = page_read_logits(backbone, x, None, block_size, prefill)[0, prefill - 1 : -1]
    logits = page_read_logits(backbone, x, spec, block_size, prefill)[0, prefill - 1 : -1]
    return _document_score(float_logits, logits, x[0, prefill:])[0], float_logits


class FloatPages(PagesCache):
    """A quantized-pages engine's cache that seals nothing: every page of a row in a float block, read through
    ``float_block_table`` in order (the graph reads any number of float pages), the sealed table empty. The float
    cache through the same engine and the same graph, decoded on the same path as its pages: the reference that
    leaves the pages alone to differ (``engine_page_quality``)."""

    def tables(self) -> list[np.ndarray]:
        return [np.zeros((self.batch, 0), dtype=np.int64), self._table(self.float_blocks)]

    def past_mask(self, tables: list[np.ndarray]) -> np.ndarray:
        """(B, F bs): the first ``lengths`` slots of each row, its pages in order."""
        return np.arange(tables[1].shape[1] * self.pool.block_size)[None, :] < self.lengths[:, None]

    def append(self, outputs: dict[str, np.ndarray], real: np.ndarray) -> None:
        bs, old = self.pool.block_size, self.lengths
        new = old + real.sum(axis=1)
        wanted = -(-new // bs) - np.array([len(f) for f in self.float_blocks])  # (B,) pages each row starts now
        rows, steps = np.nonzero(real)
        slot = old[rows] + (np.cumsum(real, axis=1) - 1)[rows, steps]
        with self.pool.lock:
            taken, _ = self.pool.take(int(wanted.sum()), 0, [])
            for r in np.flatnonzero(wanted):
                self.float_blocks[r] += [taken.pop(0) for _ in range(wanted[r])]
            block = np.array([self.float_blocks[r][s // bs] for r, s in zip(rows, slot)], dtype=np.int64)
            for name, new_kv in outputs.items():
                self.pool.float.arrays[name][block, :, slot % bs] = new_kv[rows, :, steps]  # (K, nkv, d)
        self.lengths = new


def float_pages_engine(engine):
    """A fork of a quantized-pages engine (its session, pool and adapter) whose new caches are ``FloatPages``: greedy
    answers through it are the engine's with a float cache, decoded on the same kernels as through its pages."""
    twin = engine.fork()
    twin.empty_cache = lambda batch: FloatPages.empty(engine.pool, engine.page_spec, batch)
    return twin


def _decoded_logits(engine, ids: np.ndarray, prefill: int) -> np.ndarray:
    """(T - prefill, V): ``ids`` (1, T)'s first ``prefill`` tokens prefilled into a new cache of the engine's, then
    one token per step; the logits predicting tokens prefill..T-1."""
    T = ids.shape[1]
    logits, cache = engine.forward(ids[:, :prefill], np.arange(prefill)[None], np.ones((1, prefill), np.int64), None)
    decoded = [logits[0, -1].copy()]
    for t in range(prefill, T - 1):
        logits, cache = engine.forward(ids[:, t : t + 1], np.array([[t]]), np.ones((1, t + 1), np.int64), cache)
        decoded.append(logits[0, -1].copy())
    del cache  # its pages go back to the engine's pool
    return np.stack(decoded)


def engine_page_quality(engine, documents: list[list[int]]) -> dict:
    """``summarize`` of the documents on a quantized-pages engine itself: each document's first half prefilled and
    the rest decoded one token per step, through the pages the engine's runtime seals and through ``FloatPages`` on
    the same engine. Decode against decode, not against one prefill of the whole document: a quantized backbone's
    prefill and decode run different kernels (MatMulNBits at one row: KL 0.010-0.013 between them on SmolLM2 int4,
    with no page sealed), which is the weights' cost, not the pages'."""
    scores, float_engine = [], float_pages_engine(engine)
    for ids in documents:
        x, prefill = np.asarray([ids], dtype=np.int64), len(ids) // 2
        float_logits = _decoded_logits(float_engine, x, prefill)
        logits = _decoded_logits(engine, x, prefill)
        scores.append(_document_score(torch.from_numpy(float_logits), torch.from_numpy(logits),
                                      torch.from_numpy(x[0, prefill:]))[0])
    return summarize(scores)


def summarize(scores: list[DocumentScore]) -> dict:
    """Perplexities of the float cache and the pages, the increase in %, and the mean KL per scored token."""
    n = sum(s.tokens for s in scores)
    ppl_float = math.exp(sum(s.nll_float for s in scores) / n)
    ppl_pages = math.exp(sum(s.nll_pages for s in scores) / n)
    return {"perplexity_float_cache": ppl_float, "perplexity_quantized_cache": ppl_pages,
            "ppl_increase_pct": 100.0 * (ppl_pages / ppl_float - 1.0), "kl_mean": sum(s.kl for s in scores) / n,
            "tokens": n}


def greedy_through_pages(backbone, tokenizer, prompts: list[str | ChatPrompt], spec: PageQuantSpec | None,
                         block_size: int, max_new_tokens: int) -> list[str]:
    """Greedy answers as a device decodes them on ``spec``'s pages: each prompt prefilled, each new token decoded
    (``page_read_logits`` over the prompt and the answer so far). Prompts of one length go together (no padding)."""
    encoded = [encode_prompt(tokenizer, p) for p in prompts]
    by_len: dict[int, list[int]] = {}
    for i, ids in enumerate(encoded):
        by_len.setdefault(len(ids), []).append(i)
    out = [""] * len(prompts)
    for length, rows in by_len.items():
        x = torch.tensor([encoded[i] for i in rows])  # (B, length)
        for _ in range(max_new_tokens):
            logits = page_read_logits(backbone, x, spec, block_size, prefill=length)[:, -1]
            x = torch.cat([x, logits.argmax(-1, keepdim=True)], dim=1)
        for r, i in enumerate(rows):
            answer = until_stop(x[r, length:].tolist(), tokenizer.stop_ids)
            out[i] = tokenizer.decode(answer, skip_special_tokens=True)
    return out


def grid_widths(spec: PageQuantSpec) -> dict[str, PageQuantSpec]:
    """The release's pages and the same pages at every other width of ``GRID_BITS`` (K and V alike), by name."""
    widths = {bits: replace(spec, k_bits=bits, v_bits=bits, layer_bits=()) for bits in GRID_BITS}
    return {"release": spec} | {f"K{b}/V{b}": s for b, s in widths.items() if s != spec}


def release_page_quality(backbone, tokenizer, test, documents: list[list[int]], spec: PageQuantSpec, block_size: int,
                         max_new_tokens: int) -> dict:
    """What ``spec``'s pages cost base + adapter (``backbone``, the release's adapter-merged backbone): test accuracy
    with the float cache and through the pages, held-out perplexity and KL (each document's first half prefilled,
    its second half decoded: ``heldout_sequences``), and the same held-out figures at
    every width of ``GRID_BITS``. Documents shorter than three pages read no sealed page and are scored all the same."""
    from tasks.scoring import accuracy_report

    prompts = [ex.prompt for ex in test]
    float_acc = accuracy_report(test, greedy_through_pages(backbone, tokenizer, prompts, None, block_size, max_new_tokens))
    pages_acc = accuracy_report(test, greedy_through_pages(backbone, tokenizer, prompts, spec, block_size, max_new_tokens))
    widths = grid_widths(spec)
    scores: dict[str, list[DocumentScore]] = {name: [] for name in widths}
    for ids in documents:
        float_logits = None
        for name, s in widths.items():
            score, float_logits = score_document(backbone, ids, s, block_size, len(ids) // 2, float_logits)
            scores[name].append(score)
    context_len = max(len(d) for d in documents)
    cfg = backbone.cfg
    d = cfg.head_dim
    bits = spec.stored_bits_per_value(d, block_size, context_len)
    grid = [{"config": f"{name} ({s.name})", "bits": (s.k_bits + s.v_bits) / 2,
             "stored_bits_per_value": s.stored_bits_per_value(d, block_size, context_len),
             **{k: v for k, v in summarize(scores[name]).items() if k in ("ppl_increase_pct", "kl_mean")}}
            for name, s in widths.items()]
    release = summarize(scores["release"])
    return {
        "scheme": "quantized_pages",
        "spec": spec.to_dict(),
        "block_size": block_size,
        "accuracy_float_cache": float_acc["accuracy"],
        "accuracy_quantized_cache": pages_acc["accuracy"],
        "accuracy_new_quantized_cache": pages_acc["accuracy_new"],
        "accuracy_drop": float_acc["accuracy"] - pages_acc["accuracy"],
        **release,
        "stored_bits_per_value": bits,
        "bytes_per_token": bits * 2 * cfg.num_layers * cfg.num_kv_heads * d / 8,  # K and V of every layer and head
        "compression_vs_fp16": 16.0 / bits,
        "context_len": context_len,  # stored bits are for a cache this long (the longest document)
        "heldout_documents": len(documents),
        "grid": sorted(grid, key=lambda row: -row["bits"]),
    }
