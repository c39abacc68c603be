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

Engines: the float cache, padded (interface version 3) and paged (version 6, blocks of ``--block`` tokens); the
quantized pages are always paged, so they are measured against the float paged cache (``--pages``, below).

    python -m bench.engine.paged_kv_bench [--out bench/results/paged_kv_bench.json] [--iters 200] [--block 16]

``--pages``: quantized pages (interface version 9, K4/V4, values in groups of 64, ``kernels.kv_spec.PageQuantSpec()``)
against the float paged cache (version 6), both in blocks of ``--block`` tokens (issue 39's target: a decode step
<= 1.15x the float paged one's at the Qwen2-0.5B shape, past 2,048, batch 1 and 8). The ms of one decode step (every
row one token) after a past of ``--past`` tokens, at each of ``--batches``, the two engines interleaved in
``--rounds`` rounds; each round starts from a fresh cache of that past. The past is random K/V written through the
engine's own cache (``append``: the float pages as given, the full pages sealed as the runtime seals them), not a
prefill: at the 0.5B shape a prefill of 8 x 2,048 tokens takes minutes on 2 cores, and what a step costs does not
depend on the values. ``--shape 0.5b``: Qwen2-0.5B's config with random weights (``bench.lib.backbones.QWEN2_05B``:
24 layers, vocabulary 151,936), ``--weights int4`` the serving weights (``engine.weights: int4``, the default) or
``fp32``; ``0.5b-width``: its layers' widths, 4 layers and 512 tokens of vocabulary (per-layer costs, built in a
fraction of the time); ``tiny``: ``SHAPES["tiny"]``. ``--workdir`` keeps the backbone and engines for the next run (an engine is
rebuilt only when its graph's sources changed).

    python -m bench.engine.paged_kv_bench --pages [--shape 0.5b] [--weights int4] [--past 2048] [--batches 1,8]
        [--rounds 6] [--iters 48] [--workdir DIR] [--paired] [--out bench/results/paged_kv_bench_pages.json]

``--paired``: the pages engine again with its rows paired (``serve --batch-invariant``), interleaved with the others:
what a batch-invariant device pays per step (an odd batch runs one row more; an even one nothing).
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

from bench.lib.backbones import QWEN2_05B, RANK, SHAPES, TARGETS, make_backbone_and_adapter
from bench.lib.report import RESULTS, Figure, progress, write_report
from bench.lib.tables import format_ms, table
from bench.lib.timing import PerRound, interleaved
from kernels.kv_spec import PageQuantSpec

LENGTHS = (128, 128, 256, 256, 512, 512, 1024, 1024)
CACHE = "float32"  # the cache of the padded and paged engines: their rows are "float32 padded" and "float32 paged"
# --pages: the backbones (make_backbone_and_adapter gives every one 4,096 positions: enough for these pasts) and the
# two caches, name -> kv_pages (None: the float paged cache)
PAGES_SHAPES = {"0.5b": {k: v for k, v in QWEN2_05B.items() if k != "max_position_embeddings"},
                "0.5b-width": SHAPES["0.5b-width"], "tiny": SHAPES["tiny"]}
PAGES_CACHES = {"float paged": None, "K4/V4 pages": PageQuantSpec(k_bits=4, v_bits=4).to_dict()}


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
    engines = {}
    for layout, block_size in (("padded", None), ("paged", block)):
        engine_dir = work / f"engine-{layout}"
        compile_engine(model_dir, engine_dir, RANK, TARGETS, ort_threads=threads, kv_block_size=block_size)
        engine = OrtEngine(engine_dir, threads=threads)
        engine.set_adapter(load_adapter(adapter_dir, engine.interface))
        engines[layout] = engine
    stats = interleaved({layout: decode_rounds(e, vocab) for layout, e in engines.items()}, iters, rounds=20)
    rows = {}
    for layout, engine in engines.items():
        cache, _ = merged_batch(engine, vocab)
        allocated, needed = cache_bytes(engine, cache), needed_bytes(engines["padded"])
        del cache
        rows[f"{CACHE} {layout}"] = {
            "kv_bytes_allocated": allocated, "kv_bytes_needed": needed, "kv_allocated_over_needed": allocated / needed,
            "decode_step_ms": stats[layout]["median"], "decode_step_p10_ms": stats[layout]["p10"],
            "decode_tokens_per_s": len(LENGTHS) / stats[layout]["median"] * 1e3}
    paged, padded = rows[f"{CACHE} paged"], rows[f"{CACHE} padded"]
    ratios = {CACHE: {"paged_over_padded_tokens_per_s": paged["decode_tokens_per_s"] / padded["decode_tokens_per_s"],
                      "paged_over_padded_allocated": paged["kv_bytes_allocated"] / padded["kv_bytes_allocated"]}}
    return {"dims": dims, "rows": rows, "ratios": ratios, "loadavg_1m_after": os.getloadavg()[0]}


# ---------------------------------------------------------------- --pages: quantized pages against the float paged cache

PAIRED = "K4/V4 pages, rows paired"


def pages_engines(shape: str, weights: str, block: int, threads: int, root: Path, paired: bool = False) -> dict:
    """{cache name: OrtEngine} for ``PAGES_CACHES`` on a random backbone of ``shape`` in ``root`` (reused when there),
    its rank-8 adapter bound; with ``weights`` int4 each copied with the serving weights, as the compile stage does.
    ``paired``: also ``PAIRED``, the pages engine opened with ``paired_rows`` (``serve --batch-invariant``)."""
    from runtime.engine.adapter import load_adapter
    from runtime.engine.backends.onnxruntime import OrtEngine
    from tasks.config import EngineConfig
    from tasks.stages.compile import compile_engine
    from tasks.weights.engines import ensure_quantized_engine

    model_dir, adapter_dir = root / "base", root / "adapter"
    if not (adapter_dir / "adapter_config.json").is_file():
        progress(f"[{shape}] a random backbone and adapter ...")
        model_dir, adapter_dir = make_backbone_and_adapter(root, PAGES_SHAPES[shape])
    engine_cfg = EngineConfig(weights=weights)
    engines = {}
    for i, (name, pages) in enumerate(PAGES_CACHES.items()):
        progress(f"[{shape}] the {name} engine ({weights} weights; reused when built) ...")
        engine_dir = root / f"engine-{i}"
        compile_engine(model_dir, engine_dir, RANK, TARGETS, ort_threads=threads, kv_block_size=block, kv_pages=pages)
        if weights != "fp32":
            engine_dir = Path(ensure_quantized_engine(engine_dir, root / f"engine-{i}-{weights}", weights,
                                                      engine_cfg.weight_block(weights), engine_cfg.weights_format())["weights_dir"])
        forms = [(name, False)]
        if paired and pages is not None:  # pairing rows needs the pages engine
            forms.append((PAIRED, True))
        for label, paired_rows in forms:
            engine = OrtEngine(engine_dir, threads=threads, paired_rows=paired_rows)
            engine.set_adapter(load_adapter(adapter_dir, engine.interface))
            engines[label] = engine
    return engines


def random_past(engine, batch: int, past: int) -> dict[str, np.ndarray]:
    """{float pool name: (batch, nkv, past, d) float32}: what a prefill of ``past`` tokens hands the cache (random,
    the same for every engine of the backbone)."""
    iface = engine.interface
    rng = np.random.default_rng(0)
    return {"pool_" + t.name[len("new_"):]: rng.standard_normal((batch, iface.num_kv_heads, past, iface.head_dim),
                                                                 dtype=np.float32)
            for t in iface.outputs[1:]}  # new_key.i, new_value.i


def pages_decode_rounds(engine, kv: dict[str, np.ndarray]) -> PerRound:
    """One step: every row decodes one token; each round starts from a fresh cache holding ``kv``."""
    batch, past = next(iter(kv.values())).shape[0], next(iter(kv.values())).shape[2]

    @contextmanager
    def open_round():
        cache = engine.empty_cache(batch)
        cache.append(kv, np.ones((batch, past), dtype=bool))
        state = {"cache": cache}
        token = np.full((batch, 1), 7, dtype=np.int64)

        def step():
            lengths = state["cache"].lengths
            mask = np.ones((batch, int(lengths.max()) + 1), dtype=np.int64)  # every row as long as the others
            engine.forward(token, lengths[:, None].copy(), mask, state["cache"])

        yield step
        del state["cache"]  # its blocks go back to the pool before the other engine's round

    return PerRound(open_round)


def run_pages(shape: str, weights: str, past: int, batches: list[int], iters: int, rounds: int, threads: int, block: int,
              root: Path, paired: bool = False) -> dict:
    engines = pages_engines(shape, weights, block, threads, root, paired)
    rows = []
    for batch in batches:
        progress(f"[{shape}] batch {batch}, past {past}: {rounds} rounds ...")
        kv = random_past(engines["float paged"], batch, past)
        stats = interleaved({name: pages_decode_rounds(e, kv) for name, e in engines.items()}, iters, rounds=rounds)
        float_paged, pages = stats["float paged"], stats["K4/V4 pages"]
        rows.append({"batch": batch, "past": past, "steps": stats,
                     "pages_over_float_paged": pages["median"] / float_paged["median"],
                     "pages_over_float_paged_p10": pages["p10"] / float_paged["p10"]}
                    | ({"paired_over_pages": stats[PAIRED]["median"] / pages["median"]} if paired else {}))
    dims = {k: v for k, v in PAGES_SHAPES[shape].items() if isinstance(v, int)}
    return {"shape": shape, "dims": dims, "weights": weights, "caches": PAGES_CACHES, "rows": rows,
            "loadavg_1m_after": os.getloadavg()[0]}


def print_pages(res: dict) -> None:
    print(f"\n== {res['shape']} {res['dims']}, {res['weights']} weights  "
          f"(1-min load average after: {res['loadavg_1m_after']:.2f})")
    paired = "paired_over_pages" in res["rows"][0]
    header = ["batch", "past", "float paged ms", "K4/V4 pages ms", "pages / float paged", "p10 ratio",
              *(["rows paired ms", "paired / pages"] if paired else [])]
    print(table(header, ([r["batch"], r["past"], format_ms(r["steps"]["float paged"]["median"]),
                          format_ms(r["steps"]["K4/V4 pages"]["median"]), f"{r['pages_over_float_paged']:.2f}x",
                          f"{r['pages_over_float_paged_p10']:.2f}x",
                          *([format_ms(r["steps"][PAIRED]["median"]), f"{r['paired_over_pages']:.2f}x"] if paired else [])]
                         for r in res["rows"])))


def pages_figures(res: dict) -> list[Figure]:
    """Per batch: the decode step of quantized pages over the float paged cache's, with both medians."""
    out = []
    for r in res["rows"]:
        v = r["pages_over_float_paged"]
        steps = r["steps"]
        out.append(Figure(f"K4/V4 pages / float paged decode step, {res['shape']} shape ({res['weights']} weights), "
                          f"batch {r['batch']}, past {r['past']}", v,
                          f"{v:.2f}x ({format_ms(steps['K4/V4 pages']['median'])} vs "
                          f"{format_ms(steps['float paged']['median'])})"))
        if "paired_over_pages" in r:
            v = r["paired_over_pages"]
            out.append(Figure(f"K4/V4 pages, rows paired (serve --batch-invariant) / unpaired decode step, {res['shape']} "
                              f"shape ({res['weights']} weights), batch {r['batch']}, past {r['past']}", v,
                              f"{v:.2f}x ({format_ms(steps[PAIRED]['median'])} vs "
                              f"{format_ms(steps['K4/V4 pages']['median'])})"))
    return out


def print_results(res: dict) -> None:
    print(f"\n== tiny {res['dims']}, rows {list(LENGTHS)}  (1-min load average after: {res['loadavg_1m_after']:.2f})")
    cols = ("kv_bytes_allocated", "kv_bytes_needed", "kv_allocated_over_needed", "decode_step_ms", "decode_tokens_per_s")
    print(table(["cache", *cols], ([name, *(f"{row[c]:.3f}" for c in cols)] for name, row in res["rows"].items())))
    for name, r in res["ratios"].items():
        print(f"  {name}: paged / padded decode tokens/s {r['paged_over_padded_tokens_per_s']:.3f}x, "
              f"allocated {r['paged_over_padded_allocated']:.3f}x")


def figures(p: dict) -> list[Figure]:
    """KV bytes allocated over needed of every cache, and paged over padded decode tokens/s; of a ``--pages`` run,
    quantized pages over the float paged cache's decode step."""
    if "pages" in p:
        return pages_figures(p["pages"])
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
    ap.add_argument("--out", type=Path, default=None,
                    help="default bench/results/paged_kv_bench.json (--pages: paged_kv_bench_pages.json)")
    ap.add_argument("--iters", type=int, default=None, help="timed steps per engine (default 200; --pages 48)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--block", type=int, default=16, help="tokens per block of the paged engines")
    ap.add_argument("--pages", action="store_true", help="quantized pages against the float paged cache instead")
    ap.add_argument("--shape", choices=tuple(PAGES_SHAPES), default="0.5b", help="--pages: the backbone")
    ap.add_argument("--weights", choices=("int4", "fp32"), default="int4", help="--pages: the engines' weights")
    ap.add_argument("--past", type=int, default=2048, help="--pages: tokens of every row's past")
    ap.add_argument("--batches", default="1,8", help="--pages: the batch sizes, comma-separated")
    ap.add_argument("--rounds", type=int, default=6, help="--pages: interleaved rounds per batch size")
    ap.add_argument("--workdir", type=Path, default=None, help="--pages: where the backbone and engines are kept")
    ap.add_argument("--paired", action="store_true", help="--pages: also the pages engine with its rows paired "
                    "(serve --batch-invariant: an odd batch runs its last row twice)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]
    if args.pages:
        return pages_main(args, load_before)
    args.iters = args.iters or 200
    with tempfile.TemporaryDirectory() as work:
        res = run(args.iters, args.threads, args.block, Path(work))
    print_results(res)
    import onnxruntime

    payload = {"lengths": list(LENGTHS), "block_size": args.block, "threads": args.threads, "iters": args.iters,
               "lora_rank": RANK, "versions": {"torch": torch.__version__, "onnxruntime": onnxruntime.__version__},
               "cpus": os.cpu_count(), "loadavg_1m_before": load_before, "results": res,
               "kv_allocated_over_needed": res["rows"][f"{CACHE} paged"]["kv_allocated_over_needed"],
               "kv_allocated_over_needed_padded": res["rows"][f"{CACHE} padded"]["kv_allocated_over_needed"]}
    write_report(args.out or RESULTS / "paged_kv_bench.json", payload)
    return 0


def pages_main(args, load_before: float) -> int:
    iters, batches = args.iters or 48, [int(b) for b in args.batches.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        root = (args.workdir or Path(tmp)) / args.shape
        res = run_pages(args.shape, args.weights, args.past, batches, iters, args.rounds, args.threads, args.block, root,
                        args.paired)
    print_pages(res)
    import onnxruntime

    payload = {"block_size": args.block, "threads": args.threads, "iters": iters, "rounds": args.rounds, "lora_rank": RANK,
               "versions": {"torch": torch.__version__, "onnxruntime": onnxruntime.__version__},
               "cpus": os.cpu_count(), "loadavg_1m_before": load_before, "pages": res}
    write_report(args.out or RESULTS / "paged_kv_bench_pages.json", payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
