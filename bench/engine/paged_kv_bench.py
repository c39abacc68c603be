"""The paged KV cache against the padded one: bytes allocated for mixed lengths, and decode speed.

Eight rows of 128, 128, 256, 256, 512, 512, 1024 and 1024 tokens, each prefilled alone and merged into
one batch as ``runtime.serve.batcher`` merges arrivals (``concat_caches``), on engines compiled from the
tiny default backbone (``bench.lib.backbones.SHAPES["tiny"]``) with a rank-8 LoRA as inputs:

  kv_allocated_over_needed   bytes the batch's cache holds / bytes its rows' tokens need (packed K and V
                             of every layer). Padded: every row is as long as the longest (today's
                             batcher); paged: each row holds ceil(length / block) blocks of the pool.
                             Shape-independent: both sides scale with bytes per token alike.
  decode tokens/s            the same eight rows decoding together, one token per row per step, paged
                             and padded interleaved in short rounds (``bench.lib.timing.interleaved``).

Engines: the shipped 4-bit GroupQueryAttention cache (``KVQuantSpec()``) and the float cache, each padded
(interface version 5 / 3) and paged (version 6, blocks of ``--block`` tokens).

    python -m bench.engine.paged_kv_bench [--out bench/results/paged_kv_bench.json] [--iters 200] [--block 16]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from bench.lib.backbones import RANK, SHAPES, TARGETS, make_backbone_and_adapter, random_kv_scales
from bench.lib.report import RESULTS, Figure, write_report
from bench.lib.tables import table
from bench.lib.timing import PerRound, interleaved
from kernels.kv_spec import KVQuantSpec

LENGTHS = (128, 128, 256, 256, 512, 512, 1024, 1024)
CACHES = {"K4c/V4c GQA op": KVQuantSpec().to_dict(), "float32": None}  # name -> kv_spec


def merged_batch(engine, vocab: int):
    """The eight rows prefilled alone and merged, as the batcher does: (cache, lengths (B,))."""
    rng = np.random.default_rng(0)
    caches = []
    for n in LENGTHS:
        ids = rng.integers(0, vocab, (1, n))
        caches.append(engine.forward(ids, np.arange(n)[None], np.ones((1, n), np.int64), None)[1])
    return engine.concat_caches(caches), np.array(LENGTHS, dtype=np.int64)


def cache_bytes(engine, cache) -> int:
    """Bytes the cache holds: the paged one's blocks, or the padded one's arrays."""
    if engine.pool is not None:
        return cache.allocated_bytes()
    arrays = engine.cache_to_numpy(cache)
    return sum(a.nbytes for a in (arrays.values() if isinstance(arrays, dict) else arrays) if a.dtype != np.int64)


def needed_bytes(engine) -> int:
    """Bytes the rows' tokens need: per token, K and V of every layer at the stored width and dtype."""
    iface = engine.interface
    per_token = sum(int(np.prod([d for d in t.shape[1:] if isinstance(d, int)])) * np.dtype(t.dtype).itemsize
                    for t in iface.inputs if t.name.startswith("past_") and t.name != "past_positions")
    return per_token * sum(LENGTHS)


def decode_rounds(engine, vocab: int) -> PerRound:
    """One step: every row decodes one token (the cache grows); each round starts from a fresh merge."""

    @contextmanager
    def open_round():
        cache, lengths = merged_batch(engine, vocab)
        state = {"cache": cache, "lengths": lengths}
        token = np.full((len(LENGTHS), 1), 7, dtype=np.int64)

        def step():
            lengths = state["lengths"]
            W = int(lengths.max())
            mask = (np.arange(W + 1)[None, :] >= (W - lengths)[:, None]).astype(np.int64)  # the batcher's left padding
            _, state["cache"] = engine.forward(token, lengths[:, None], mask, state["cache"])
            state["lengths"] = lengths + 1

        yield step
        del state["cache"]

    return PerRound(open_round)


def run(iters: int, threads: int, block: int, work: Path) -> dict:
    from runtime.engine.adapter import load_adapter
    from runtime.engine.backends.onnxruntime import OrtEngine
    from runtime.engine.model import read_config
    from tasks.stages.compile import compile_engine

    dims = SHAPES["tiny"]
    model_dir, adapter_dir = make_backbone_and_adapter(work, dims)
    vocab = read_config(model_dir).vocab_size
    rows, ratios = {}, {}
    for name, spec in CACHES.items():
        engines = {}
        for layout, block_size in (("padded", None), ("paged", block)):
            engine_dir = work / f"engine-{len(rows)}-{layout}"
            compile_engine(model_dir, engine_dir, RANK, TARGETS, ort_threads=threads, kv_spec=spec,
                           kv_attention="gqa" if spec else "standard", kv_block_size=block_size)
            engine = OrtEngine(engine_dir, threads=threads)
            lora = load_adapter(adapter_dir, engine.interface)
            if spec is None:
                engine.set_adapter(lora)
            else:
                engine.set_adapter(lora, kv_scales=random_kv_scales(model_dir, lora, KVQuantSpec(**spec)))
            engines[layout] = engine
        stats = interleaved({layout: decode_rounds(e, vocab) for layout, e in engines.items()}, iters, rounds=20)
        for layout, engine in engines.items():
            cache, _ = merged_batch(engine, vocab)
            allocated, needed = cache_bytes(engine, cache), needed_bytes(engines["padded"])
            del cache
            rows[f"{name} {layout}"] = {
                "kv_bytes_allocated": allocated, "kv_bytes_needed": needed, "kv_allocated_over_needed": allocated / needed,
                "decode_step_ms": stats[layout]["median"], "decode_step_p10_ms": stats[layout]["p10"],
                "decode_tokens_per_s": len(LENGTHS) / stats[layout]["median"] * 1e3}
        paged, padded = rows[f"{name} paged"], rows[f"{name} padded"]
        ratios[name] = {"paged_over_padded_tokens_per_s": paged["decode_tokens_per_s"] / padded["decode_tokens_per_s"],
                        "paged_over_padded_allocated": paged["kv_bytes_allocated"] / padded["kv_bytes_allocated"]}
    return {"dims": dims, "rows": rows, "ratios": ratios, "loadavg_1m_after": os.getloadavg()[0]}


def print_results(res: dict) -> None:
    print(f"\n== tiny {res['dims']}, rows {list(LENGTHS)}  (1-min load average after: {res['loadavg_1m_after']:.2f})")
    cols = ("kv_bytes_allocated", "kv_bytes_needed", "kv_allocated_over_needed", "decode_step_ms", "decode_tokens_per_s")
    print(table(["cache", *cols], ([name, *(f"{row[c]:.3f}" for c in cols)] for name, row in res["rows"].items())))
    for name, r in res["ratios"].items():
        print(f"  {name}: paged / padded decode tokens/s {r['paged_over_padded_tokens_per_s']:.3f}x, "
              f"allocated {r['paged_over_padded_allocated']:.3f}x")


def figures(p: dict) -> list[Figure]:
    """KV bytes allocated over needed of every cache, and paged over padded decode tokens/s."""
    rows = []
    for name, row in p["results"]["rows"].items():
        v = row["kv_allocated_over_needed"]
        rows.append(Figure(f"KV bytes allocated / needed, 8 rows of 128-1024 tokens, {name}", v, f"{v:.3f}"))
    for name, r in p["results"]["ratios"].items():
        v = r["paged_over_padded_tokens_per_s"]
        rows.append(Figure(f"paged / padded decode tokens/s, 8 rows, {name}", v, f"{v:.2f}x"))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="paged vs padded KV cache: bytes allocated for mixed lengths, decode speed")
    ap.add_argument("--out", type=Path, default=RESULTS / "paged_kv_bench.json")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--block", type=int, default=16, help="tokens per block of the paged engines")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as work:
        res = run(args.iters, args.threads, args.block, Path(work))
    print_results(res)
    import onnxruntime

    payload = {"lengths": list(LENGTHS), "block_size": args.block, "threads": args.threads, "iters": args.iters,
               "lora_rank": RANK, "versions": {"torch": torch.__version__, "onnxruntime": onnxruntime.__version__},
               "cpus": os.cpu_count(), "loadavg_1m_before": load_before, "results": res,
               "kv_allocated_over_needed": res["rows"]["K4c/V4c GQA op paged"]["kv_allocated_over_needed"],
               "kv_allocated_over_needed_padded": res["rows"]["K4c/V4c GQA op padded"]["kv_allocated_over_needed"]}
    write_report(args.out, payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
