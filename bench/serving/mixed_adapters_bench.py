"""Mixed-adapter batches (issue 27, item 2): 8 clients over 4 adapters against the same load on one adapter.

    python -m bench.serving.mixed_adapters_bench [--shape tiny|0.5b] [--rounds 6] [--clients 8] [--adapters 4]
        [--prompt-tokens 64] [--max-tokens 32] [--threads 2] [--workdir DIR] [--out bench/results/mixed_adapters_bench.json]

The world is ``bench.lib.worlds.build_int4_world``'s (the default serving engine: int4 weights, 4-bit quantized
pages, adapters stacked, interface version 9; a rank-8 adapter and its signed release), plus the one-adapter form of
the same engine (``tasks.stages.compile.compile_engine(stacked=False)``, then int4 like the other): today's engine
before mixed batches. The release is verified against each engine (``runtime.release.verify.verify_release``: it
binds to both by the same contract) and bound to ``--adapters`` resident releases, release i with its LoRA B times
(1 + i / 4) so that no two compute alike.

A load is ``--clients`` requests submitted together to the real scheduler (``runtime.serve.batcher.Batcher``, as
``serve`` runs it, minus HTTP), each a greedy completion of ``--max-tokens`` tokens (no stop token: every row runs
to the end) after a prompt of ``--prompt-tokens`` tokens; aggregate tokens/s = all generated tokens over the wall
time from the first submit to the last answer. Loads, interleaved in ``--rounds`` rounds (the order rotating):

* ``stacked_one``: every client on release 0, stacked engine (one slot);
* ``stacked_mixed``: client c on release c % adapters, stacked engine: one batch, each row on its release's slot;
* ``today_one`` / ``today_mixed``: the same on today's engine (mixed: one batch per release, decoded in turn).

Headline ``mixed_adapters_vs_one`` = median stacked_mixed / median stacked_one (issue 27's target >= 0.9);
``mixed_vs_today_one`` = stacked_mixed over today's engine on one adapter; ``stacked_one_vs_today_one`` = what the
stacked graph costs one adapter (the mask multiply that gives each row its slot's LoRA).
Each ratio also per CPU second of this process (``time.process_time``: the scheduler and ONNX Runtime's threads),
which the other jobs on shared cores disturb less than the wall clock.
Writes ``bench/results/mixed_adapters_bench.json`` (and the ``mixed_adapters_vs_one`` field of
``device_memory_bench.json`` is read from it by nobody: quote this file).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path

from bench.lib.report import RESULTS, Figure, progress, write_report
from bench.lib.tables import table
from bench.lib.worlds import build_int4_world, int4_serving_engine, prompt_text

LOADS = ("stacked_one", "stacked_mixed", "today_one", "today_mixed")


def one_adapter_engine(world: dict, root: Path, threads: int) -> Path:
    """The world's serving engine (the default form: paged cache, stacked adapters) in its one-adapter form: the same
    cache, one adapter per batch (today's engine before interface version 7), int4 like it; reused when built."""
    return int4_serving_engine(world["base"], root / "engine-kv-one", root / "engine-one", threads, stacked=False)


def releases(world: dict, engine_dir: Path, count: int, threads: int) -> list:
    """``count`` resident releases on ``engine_dir``: the world's release verified against it, its LoRA B scaled per
    release; each an ``ActiveRelease`` with its own bound handle, as ``AdapterServer.load`` makes them."""
    from runtime.engine.backends.onnxruntime import OrtEngine
    from runtime.release.verify import load_trusted_keys, verify_release
    from runtime.serve.active_release import ActiveRelease

    engine = OrtEngine(engine_dir, threads=threads)
    verified = verify_release(world["release"], load_trusted_keys([world["trusted_key"]]), engine.interface)
    out = []
    for i in range(count):
        handle = engine.fork()
        lora = {n: v * (1 + i / 4) if n.startswith("lora_B.") else v for n, v in verified.lora.items()}
        handle.set_adapter(lora)
        out.append(ActiveRelease(f"{verified.release_id}-{i}", i + 1, verified.manifest, handle, time.time()))
    return out


def run_load(batcher, tokenizer, rels: list, prompts: list[list[int]], max_tokens: int) -> tuple[float, float, int]:
    """(wall seconds, this process's CPU seconds, tokens generated) of one request per prompt, request c on
    ``rels[c % len(rels)]``, all at once."""
    from runtime.engine.sampling import greedy
    from runtime.serve.batcher import BatchedGeneration
    from runtime.serve.generation import StopText

    async def consume(g) -> int:
        while await g.next_choices() is not None:
            pass
        return g.completion_tokens

    async def together() -> list[int]:
        gens = [BatchedGeneration(batcher, rels[c % len(rels)], [p], greedy, [StopText(tokenizer, [])], max_tokens)
                for c, p in enumerate(prompts)]
        return await asyncio.gather(*(consume(g) for g in gens))

    t0, c0 = time.perf_counter(), time.process_time()
    tokens = asyncio.run(together())
    return time.perf_counter() - t0, time.process_time() - c0, sum(tokens)


def measure(world: dict, one_adapter_dir: Path, args) -> dict:
    from runtime.engine.tokenizer import DeviceTokenizer
    from runtime.serve.batcher import Batcher
    from runtime.serve.metrics import ServerMetrics

    tokenizer = DeviceTokenizer(world["tokenizer"])
    prompts = [tokenizer.encode(prompt_text(tokenizer, args.prompt_tokens, c)) for c in range(args.clients)]
    engines = {"stacked": releases(world, world["engine"], args.adapters, args.threads),
               "today": releases(world, one_adapter_dir, args.adapters, args.threads)}
    loads = {name: (engines[name.split("_")[0]], name.endswith("mixed")) for name in LOADS}
    per_load: dict[str, list[float]] = {name: [] for name in LOADS}
    per_cpu: dict[str, list[float]] = {name: [] for name in LOADS}  # tokens per CPU second: the shared cores' noise out
    batchers = {}
    for name, (rels, _) in loads.items():  # no stop ids: every row generates max_tokens
        metrics = ServerMetrics()
        batchers[name] = (Batcher((), tokenizer.pad_id, metrics, stacked=rels[0].handle.interface.stacked), metrics)
    for name, (rels, mixed) in loads.items():  # warm-up: each engine's first runs allocate
        run_load(batchers[name][0], tokenizer, rels if mixed else rels[:1], prompts, 4)
    for r in range(args.rounds):
        for name in LOADS[r % len(LOADS):] + LOADS[: r % len(LOADS)]:
            rels, mixed = loads[name]
            seconds, cpu, tokens = run_load(batchers[name][0], tokenizer, rels if mixed else rels[:1], prompts,
                                            args.max_tokens)
            assert tokens == args.clients * args.max_tokens, (name, tokens)
            per_load[name].append(tokens / seconds)
            per_cpu[name].append(tokens / cpu)
        progress(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{n} {v[-1]:.0f} tok/s" for n, v in per_load.items()))
    median = {name: statistics.median(v) for name, v in per_load.items()}
    cpu = {name: statistics.median(v) for name, v in per_cpu.items()}
    steps = {name: releases_per_step(m) for name, (_, m) in batchers.items()}
    return {"tokens_per_s": per_load, "median_tokens_per_s": median, "tokens_per_cpu_s": per_cpu,
            "median_tokens_per_cpu_s": cpu, "releases_per_decode_step": steps,
            "mixed_adapters_vs_one": median["stacked_mixed"] / median["stacked_one"],
            "mixed_adapters_vs_one_per_cpu_s": cpu["stacked_mixed"] / cpu["stacked_one"],
            "stacked_one_vs_today_one_per_cpu_s": cpu["stacked_one"] / cpu["today_one"],
            "mixed_vs_today_one": median["stacked_mixed"] / median["today_one"],
            "today_mixed_vs_today_one": median["today_mixed"] / median["today_one"],
            "stacked_one_vs_today_one": median["stacked_one"] / median["today_one"]}


def releases_per_step(metrics) -> float:
    """Mean of ``adapter_decode_batch_releases``: releases whose rows shared a decode step."""
    samples = {s.name: s.value for s in metrics.batch_releases.collect()[0].samples}
    return samples["adapter_decode_batch_releases_sum"] / max(1.0, samples["adapter_decode_batch_releases_count"])


RATIOS = ("mixed_adapters_vs_one", "mixed_adapters_vs_one_per_cpu_s", "mixed_vs_today_one", "today_mixed_vs_today_one",
          "stacked_one_vs_today_one", "stacked_one_vs_today_one_per_cpu_s")


def print_results(result: dict) -> None:
    print()
    print(table(["load", "median tok/s", "tok/CPU s", "releases/step"],
                ([name, f"{result['median_tokens_per_s'][name]:.1f}", f"{result['median_tokens_per_cpu_s'][name]:.1f}",
                  f"{result['releases_per_decode_step'][name]:.2f}"] for name in LOADS)))
    print(", ".join(f"{k}={result[k]:.3f}" for k in RATIOS))


def figures(p: dict) -> list[Figure]:
    """Median tokens/s per load, then the ratios (issue 27's target: mixed >= 0.9x one)."""
    rows = [Figure(f"{p['shape']} shape, {p['clients']} clients, {p['max_tokens']} tokens each after {p['prompt_tokens']}: "
                   f"{load} (releases per decode step {p['releases_per_decode_step'][load]:.2f})", v,
                   f"{v:.0f} tok/s ({p['median_tokens_per_cpu_s'][load]:.0f} per CPU s)")
            for load, v in p["median_tokens_per_s"].items()]
    rows += [Figure(key, p[key], f"{p[key]:.3f}x") for key in RATIOS]
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=("tiny", "0.5b"), default="tiny")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--workdir", type=Path, default=None, help="where the world is built and kept (default: a "
                    "temporary directory); one device_memory_bench built there is reused")
    ap.add_argument("--out", type=Path, default=RESULTS / "mixed_adapters_bench.json")
    args = ap.parse_args(argv)
    before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="mixed-adapters-") as tmp:
        root = (args.workdir or Path(tmp)) / f"{args.shape}-quantized_pages"  # device_memory_bench's folder for it
        world = build_int4_world(args.shape, root, args.threads)
        progress("the one-adapter engine ...")
        result = measure(world, one_adapter_engine(world, root, args.threads), args)
    result = {"shape": args.shape, "clients": args.clients, "adapters": args.adapters, "prompt_tokens": args.prompt_tokens,
              "max_tokens": args.max_tokens, "threads": args.threads, "rounds": args.rounds,
              "loadavg_1m_before": before, **result, "loadavg_1m_after": os.getloadavg()[0],
              "acceptance": {"mixed_adapters_vs_one_ge_0.9": result["mixed_adapters_vs_one"] >= 0.9}}
    print_results(result)
    write_report(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
