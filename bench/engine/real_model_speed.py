"""Decode speed on a real checkpoint: our served engines against llama.cpp, same model, one interleaved run (issue 25, item 6).

    python -m bench.engine.real_model_speed --params PROFILE.yaml [--pasts 512,2048] [--prefill 512] [--iters 100]
        [--out bench/results/real_model_speed.json] [--work bench/results/real_model]

Not in CI nor in ``make bench``. One decoded token after a past of P, batch 1, ``--threads`` threads:
* ours: the compile stage's serving engine with quantized pages (the shipped 4-bit cache, ``kv`` section;
  ``tasks.config.EngineConfig.cache_engine_dir``) at fp32 weights and its int8 / int4 copies (the serving recipe
  of ``tasks.weights.engines.ensure_quantized_engine``, as ``engine.weights`` would build them: GPTQ, int4 mixed under
  ``engine.weight_mixed_bits``, each cached in ``--work``), no adapter bound
  (``bench.lib.real_checkpoint.served_engine``: the LoRA inputs are zeros, the same compute as with an adapter);
* llama.cpp (the ``peer`` extra): F16, Q8_0 and Q4_0 (``bench.lib.llama_cpp_peer.checkpoint_ggufs``), each
  with a q4_0 and an f16 KV cache, flash attention on. One llama.cpp context is loaded at a time: each
  case's context is loaded, takes its past and is closed within each of its rounds (``llama_case``), and
  its extra buffer types are off (``load_llama``: its AMX matmul of Q8_0/Q4_0 weights dies of a general
  protection fault in this VM; this also turns off its repacking of Q4_0 weights for AVX2).
Every engine is timed in one ``bench.lib.timing.interleaved`` call per past (A B C ..., A B C ...), on the
same token ids (``engine_steps`` / ``llama_steps``: the past is restored after every call), and in one more for a
prefill of ``--prefill`` tokens into an empty cache (one call each: ours one forward, llama.cpp batches of 512;
both compute the logits of the last position only, as a server's prefill does: at every position, SmolLM2's LM head
(576 x 49,152) took a fifth of ours, 573 -> 466 ms at fp32 weights, and 7-21% of llama.cpp's). Median, p10 and p95 per case; ours / llama.cpp's median at the same
weight precision, against each of its KV caches.

Target (issue 25): each of our precisions no slower than llama.cpp's counterpart. (The release's decode gate is a
ratio to the float engine's step, ``gates.max_decode_step_ratio``, not these milliseconds.)
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

from bench.lib.llama_cpp_peer import checkpoint_ggufs, converter_dir, llama_steps, load_llama, require_llama_cpp
from bench.lib.real_checkpoint import served_engine
from bench.lib.report import RESULTS, Figure, write_report
from bench.lib.tables import format_ms, table
from bench.lib.timing import PerRound, engine_steps, interleaved

OUR_WEIGHTS = ("fp32", "int8", "int4")
PEERS = {"fp32": "f16", "int8": "q8_0", "int4": "q4_0"}  # our weight precision -> llama.cpp's counterpart
LLAMA_KV = ("q4_0", "f16")


def llama_case(llama_cpp, path: Path, kv: str, threads: int, vocab_size: int, P: int | None, prefill: int) -> PerRound:
    """llama.cpp's decode step after a past of P (None: a prefill of ``prefill`` tokens into an empty cache) with
    ``kv`` (a ``GGML_TYPE_*`` name) for K and V, its context loaded for each round and closed after it, so one
    context at a time is held. The past is evaluated in the first round only; later rounds restore its KV cells
    (a 2,048-token prefill each round took longer than the decode calls it framed on the shared 2 cores)."""
    saved_past: dict = {}

    @contextmanager
    def opened():
        llm = load_llama(llama_cpp, path, (prefill if P is None else P) + 1, threads, True,
                         kv_type=getattr(llama_cpp, f"GGML_TYPE_{kv.upper()}"), extra_bufts=False,
                         logits_all=P is not None)  # a prefill's logits: its last token's, as a server's
        try:
            yield llama_steps(llm, vocab_size, P, prefill, saved_past=saved_past)
        finally:
            llm.close()

    return PerRound(opened)


def case_keys(pasts: list[int], prefill: int) -> list[str]:
    """The timed cases of a run: ``decode_{P}`` per past, then ``prefill_{N}`` when ``prefill`` (0: none)."""
    return [f"decode_{P}" for P in pasts] + ([f"prefill_{prefill}"] if prefill else [])


def parse_case(key: str) -> tuple[str, int]:
    """A case key of ``case_keys`` -> (``"decode"`` or ``"prefill"``, its past or its prefill's tokens)."""
    kind, n = key.split("_")
    return kind, int(n)


def case_label(key: str) -> str:
    kind, n = parse_case(key)
    return f"decode after {n}" if kind == "decode" else f"prefill of {n}"


def compare(rows: dict, keys: list[str]) -> list[dict]:
    """Ours over llama.cpp's median at the same weight precision, per llama.cpp KV cache and case; <= 1 passes."""
    out = []
    for weights, peer in PEERS.items():
        for kv in LLAMA_KV:
            for key in keys:
                a, b = rows.get(f"ours_{weights}_kv4", {}).get(key), rows.get(f"llama_{peer}_kv_{kv}", {}).get(key)
                if a is None or b is None:
                    continue
                out.append({"ours": f"ours_{weights}_kv4", "peer": f"llama_{peer}_kv_{kv}", "case": key,
                            "ours_ms": a["median"], "peer_ms": b["median"], "ratio": a["median"] / b["median"],
                            "pass": a["median"] <= b["median"]})
    return out


def print_results(rows: dict, comparisons: list[dict], keys: list[str]) -> None:
    print()
    print(table(["engine", *(f"{case_label(k)} median [p10, p95] ms" for k in keys)],
                ([name, *(f"{s['median']:.2f} [{s['p10']:.2f}, {s['p95']:.2f}]" for s in (row[k] for k in keys))]
                 for name, row in rows.items())))
    print("\nours / llama.cpp at the same weight precision (median; <= 1.00: ours no slower):")
    print(table(["ours", "llama.cpp", "case", "ours ms", "llama.cpp ms", "ratio", ""],
                ([c["ours"], c["peer"], case_label(c["case"]), f"{c['ours_ms']:.2f}", f"{c['peer_ms']:.2f}",
                  f"{c['ratio']:.2f}x", "PASS" if c["pass"] else "FAIL"] for c in comparisons), align="<<<>>><"))


def figures(p: dict) -> list[Figure]:
    """Decode ms per token (and prefill tokens/s) of every case, then ours over llama.cpp's counterpart."""
    rows = []
    for name, row in p["rows"].items():
        for key, s in row.items():
            kind, n = parse_case(key)
            if kind == "decode":
                rows.append(Figure(f"real model: {name} decode ms/token, past {n}, batch 1", s["median"],
                                   f"{format_ms(s['median'])} (p10 {format_ms(s['p10'])}, p95 {format_ms(s['p95'])})"))
            else:
                rate = n / (s["median"] / 1000.0)
                rows.append(Figure(f"real model: {name} prefill of {n} tokens, tokens/s (the last position's logits)",
                                   rate, f"{rate:.0f} tokens/s ({format_ms(s['median'])})"))
    for c in p["comparisons"]:
        rows.append(Figure(f"real model: {c['ours']} / {c['peer']} {case_label(c['case'])} "
                           "median time", c["ratio"], f"{c['ratio']:.2f}x ({'no slower' if c['pass'] else 'slower'})"))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Decode ms per token on a real checkpoint: our served engines vs llama.cpp.")
    ap.add_argument("--params", type=Path, required=True, help="the real-model profile (base_model.path: the checkpoint)")
    ap.add_argument("--out", type=Path, default=RESULTS / "real_model_speed.json")
    ap.add_argument("--work", type=Path, default=RESULTS / "real_model", help="as bench.quality.real_model_quality's")
    ap.add_argument("--pasts", default="512,2048")
    ap.add_argument("--prefill", type=int, default=512,
                    help="also time a prefill of this many tokens into an empty cache, its last logits only (0: not)")
    ap.add_argument("--iters", type=int, default=100, help="timed decode calls per engine and past, in --rounds rounds")
    ap.add_argument("--rounds", type=int, default=10,
                    help="rounds per past (A B C ..., A B C ...); each llama.cpp case loads its context and fills its past in each")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llama-cpp-src", default=None, help="llama-cpp-python sdist or llama.cpp directory (the converter)")
    args = ap.parse_args(argv)
    import torch

    from runtime.engine.model import read_config
    from tasks.config import load_config
    from tasks.stages.compile import compile_profile_engines, weight_calibration_ids
    from tasks.weights.engines import ensure_quantized_engine

    cfg = load_config(args.params)
    if cfg.engine.kv_cache != "quantized_pages":
        raise SystemExit(f"error: {args.params}: engine.kv_cache is {cfg.engine.kv_cache}; the bench times the served "
                         "quantized pages")
    llama_cpp = require_llama_cpp()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]
    pasts = [int(p) for p in args.pasts.split(",")]
    model_dir, work = Path(cfg.base_model.path), Path(args.work)
    backbone_cfg = read_config(model_dir)
    compile_profile_engines(cfg)
    pages_dir = cfg.engine.cache_engine_dir
    dirs = {"fp32": pages_dir}
    for weights in OUR_WEIGHTS[1:]:
        block = cfg.engine.weight_block(weights)
        dirs[weights] = work / f"{pages_dir.name}-{weights}-b{block}"
        ensure_quantized_engine(pages_dir, dirs[weights], weights, block, cfg.engine.weights_format(),
                                weight_calibration_ids(cfg), threads=args.threads, mixed_bits=cfg.engine.weight_mixed_bits,
                                model_dir=model_dir)
    ours = {f"ours_{w}_kv4": served_engine(d, args.threads) for w, d in dirs.items()}
    ggufs = checkpoint_ggufs(llama_cpp, converter_dir(args.llama_cpp_src), model_dir, work / "gguf", args.threads)
    peers = {f"llama_{t}_kv_{kv}": (ggufs[t], kv) for t in PEERS.values() for kv in LLAMA_KV}
    vocab = SimpleNamespace(vocab_size=backbone_cfg.vocab_size)
    rows: dict[str, dict] = {name: {} for name in [*ours, *peers]}
    keys = case_keys(pasts, args.prefill)
    for key in keys:
        t0 = time.perf_counter()
        kind, n = parse_case(key)
        P = n if kind == "decode" else None
        steps = {name: engine_steps(e, vocab, P, args.prefill, last_logits=True) for name, e in ours.items()}
        steps |= {name: llama_case(llama_cpp, path, kv, args.threads, vocab.vocab_size, P, args.prefill)
                  for name, (path, kv) in peers.items()}
        calls = args.iters if P is not None else max(args.rounds, args.iters // 10)
        for name, s in interleaved(steps, calls, rounds=args.rounds).items():
            rows[name][key] = s
        print(f"{case_label(key)} done in {time.perf_counter() - t0:.0f} s (1-min load average {os.getloadavg()[0]:.2f})",
              flush=True)
    comparisons = compare(rows, keys)
    print_results(rows, comparisons, keys)
    served = f"ours_{cfg.engine.weights}_kv4"
    p95 = {P: rows[served][f"decode_{P}"]["p95"] for P in pasts}
    print(f"\nserved engine ({served}) p95: " + ", ".join(f"past {P}: {v:.1f} ms" for P, v in p95.items())
          + f"; the profile's gate is a ratio to the float engine's step, gates.max_decode_step_ratio "
            f"{cfg.gates.max_decode_step_ratio}")
    import onnxruntime

    write_report(args.out, {
        "model": cfg.base_model.path, "batch": 1, "threads": args.threads, "iters": args.iters, "rounds": args.rounds, "pasts": pasts, "prefill": args.prefill,
        "kv_pages": cfg.kv.page_spec(backbone_cfg.head_dim).to_dict(), "kv_block_size": cfg.engine.kv_block_size,
        "weight_block_size": {w: cfg.engine.weight_block(w) for w in OUR_WEIGHTS[1:]}, "flash_attn": True,
        "rows": rows, "comparisons": comparisons, "served_engine": served, "served_p95_ms": p95,
        "gguf_files": {t: str(p) for t, p in ggufs.items()},
        "versions": {"llama_cpp_python": llama_cpp.__version__, "torch": torch.__version__,
                     "onnxruntime": onnxruntime.__version__},
        "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
        "loadavg_1m_before": load_before, "loadavg_1m_after": os.getloadavg()[0],
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
