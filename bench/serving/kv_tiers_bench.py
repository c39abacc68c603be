"""KV memory tiers on the device (issue 42): prefix pages shared between requests, and rows swapped to local storage
instead of refused, each measured against the same server with the feature off.

    python -m bench.serving.kv_tiers_bench [--shape 0.5b|tiny] [--parts prefix,swap] [--clients 8]
        [--system-tokens 512] [--question-tokens 64] [--answer-tokens 16] [--rounds 3] [--prefix-fits 2] [--swap-clients 16]
        [--swap-context 2048] [--swap-answer 32] [--swap-fits 8] [--swap-wait 30] [--threads 2] [--prefill-chunk 128]
        [--batch-invariant] [--workdir DIR] [--out bench/results/kv_tiers_bench.json]

Not in CI nor in ``make bench`` (the 0.5B world takes minutes to build). The model is
``bench.serving.device_memory_bench``'s (``bench.lib.worlds.build_int4_world``: Qwen2-0.5B's shape with random
weights, int4, the 4-bit quantized pages; ``tiny`` for a quick look), served by ``python -m runtime serve``. Requests
go through the official ``openai`` SDK, greedy.

**Prefix** (sharing off and on, two servers started before any request, each measured while the other idles, the
order alternating by round): ``--clients`` prompts that share a system turn of ``--system-tokens`` and differ in a
question of ``--question-tokens`` (inspection rows cut to exact lengths by our tokenizer), sent at once. Each server
first answers one prompt of the same system turn and another question (a device that has served the system turn
before; the pages it leaves are idle until the round).

* time to first token: each request of a round asks for one token (``max_tokens: 1``), so its latency is the wait for
  admission, the prefill and the first token (a stream would not do: the random backbone's ids above the tokenizer's
  vocabulary decode to no text, and a stream carries a token only once it decodes to text); p50 over clients and
  rounds, and ``prefix_ttft_speedup`` = off's p50 over on's;
* KV bytes allocated: ``adapter_kv_cache_bytes`` (the blocks rows hold, a shared page once) sampled from ``/metrics``
  every ``--sample-s`` while the round's requests run with ``--answer-tokens`` each; ``prefix_kv_ratio`` = on's peak
  over off's;
* ``prefix_wall_speedup``: off's wall time of the second pass over on's (p50 over rounds), with the rows decoded
  per step (``adapter_decode_batch_rows``) beside it;
* answers: the texts and token counts of that second pass, equal between the two servers
  (``prefix_outputs_identical``), with how many carry any text (random weights: few); then each prompt alone on each
  server (``outputs_identical_alone``), and whether sharing off answers the same together and alone
  (``off_together_equals_off_alone``: the batch's own rounding, which sharing does not cause).

**Swap** (one server at a time): ``--swap-clients`` prompts of ``--swap-context`` tokens with their answers, sent at
once to a server whose KV budget holds them all (``unbudgeted``), to one whose budget holds ``--swap-fits`` of them
(``budget``: the others wait ``--swap-wait`` seconds, then 503) and to that budget with a spill file
(``budget+swap``). ``swap_refused`` and ``swap_failed`` count the 503s and other errors with swap,
``swap_tokens_per_s_ratio`` is its generated tokens per wall second over the unbudgeted server's, and
``swap_outputs_identical`` compares the answers.

Then the same again (``prefix_budgeted``) with both servers under a KV budget that holds ``--prefix-fits`` of the
clients' whole worst cases (prompt and answer; 0 skips it): without sharing at most that many run at once and the rest
wait; with it a shared page is counted once, so more are admitted together.

``outputs_identical`` is both comparisons together.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from bench.lib.report import RESULTS, Figure, progress, write_report
from bench.lib.servers import our_server
from bench.lib.tables import table
from bench.lib.worlds import build_int4_world, prompt_text
from runtime.engine.tokenizer import DeviceTokenizer
from runtime.serve.residents import CHAMPION

SHAPES = ("0.5b", "tiny")
MODES = {"off": {"kv_prefix_sharing": False}, "on": {"kv_prefix_sharing": True}}
REQUEST_TIMEOUT_S = 1800.0


def metric_values(port: int) -> dict[str, float]:
    """Every sample of our server's ``/metrics``, read with ``prometheus_client``'s parser."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


def send_together(port: int, prompts: list[str], max_tokens: int) -> list[dict]:
    """Every prompt at once, one thread each, through the openai SDK: per prompt its latency, text and tokens."""
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="kv-tiers-bench", max_retries=0,
                           timeout=REQUEST_TIMEOUT_S)
    out: list[dict] = [{} for _ in prompts]
    go = threading.Barrier(len(prompts))

    def one(i: int) -> None:
        go.wait()
        t0 = time.perf_counter()
        try:
            answer = client.completions.create(model=CHAMPION, prompt=prompts[i], max_tokens=max_tokens, temperature=0)
            out[i] = {"latency_s": time.perf_counter() - t0, "text": answer.choices[0].text,
                      "tokens": answer.usage.completion_tokens, "error": None}
        except (openai.OpenAIError, OSError) as err:
            out[i] = {"latency_s": time.perf_counter() - t0, "text": None, "tokens": 0,
                      "error": f"{type(err).__name__}: {err}"[:300]}

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    client.close()
    return out


def kv_peak_while(port: int, work, interval: float) -> tuple[object, float]:
    """``work()``'s result and the largest ``adapter_kv_cache_bytes`` sampled while it ran."""
    peak, done = [0.0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            try:
                peak[0] = max(peak[0], metric_values(port)["adapter_kv_cache_bytes"])
            except (OSError, KeyError):
                pass
            done.wait(interval)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        result = work()
    finally:
        done.set()
        sampler.join()
    return result, peak[0]


def prompts_for(tokenizer: DeviceTokenizer, args) -> tuple[list[str], str, int]:
    """(the clients' prompts, the warm-up prompt, the tokens every prompt starts with)."""
    system = prompt_text(tokenizer, args.system_tokens, 0)
    questions = [prompt_text(tokenizer, args.question_tokens, row) for row in range(1, args.clients + 2)]
    prompts = [f"{system}\n{q}" for q in questions]
    ids = [tokenizer.encode(p) for p in prompts]
    common = min(next((i for i, (a, b) in enumerate(zip(ids[0], x)) if a != b), min(len(ids[0]), len(x)))
                 for x in ids[1:])
    return prompts[1:], prompts[0], common


def server_options(args) -> dict:
    """The device config keys every server of the run takes."""
    return {"prefill_chunk": args.prefill_chunk, "batch_invariant": args.batch_invariant}


def measure_prefix(world: dict, args, work: Path, fits: int = 0) -> dict:
    """Sharing off against on; with ``fits``, both under a KV budget that holds that many whole worst cases."""
    tokenizer = DeviceTokenizer(world["tokenizer"])
    prompts, warm_up, common = prompts_for(tokenizer, args)
    progress(f"{len(prompts)} prompts of {args.system_tokens} + {args.question_tokens} tokens, {common} in common")
    options = server_options(args)
    contexts = (args.system_tokens + args.question_tokens + args.answer_tokens + 8,)
    if fits:
        worst = max(len(tokenizer.encode(p)) for p in prompts) + args.answer_tokens
        options["kv_budget_mb"] = budget_for_rows(world, worst, fits) / (1 << 20)
        options["kv_wait_s"] = REQUEST_TIMEOUT_S
        progress(f"a KV budget of {options['kv_budget_mb']:.1f} MiB: {fits} whole worst cases of {worst} tokens")
    servers = {}
    for mode, extra in MODES.items():
        (work / mode).mkdir(exist_ok=True)
        servers[mode] = our_server(world, contexts, args.answer_tokens, args.threads, work / mode, f"ours {mode}",
                                   options | extra)
    runs: dict[str, list] = {mode: [] for mode in MODES}
    try:
        for server in servers.values():
            send_together(server.port, [warm_up], 1)
        for r in range(args.rounds):
            order = list(MODES) if r % 2 == 0 else list(MODES)[::-1]
            for mode in order:
                port = servers[mode].port
                first = send_together(port, prompts, 1)
                before, t0 = metric_values(port), time.perf_counter()
                answers, kv_peak = kv_peak_while(port, lambda p=port: send_together(p, prompts, args.answer_tokens),
                                                 args.sample_s)
                wall, after = time.perf_counter() - t0, metric_values(port)
                steps = {k: after[f"adapter_decode_batch_rows_{k}"] - before[f"adapter_decode_batch_rows_{k}"]
                         for k in ("sum", "count")}
                runs[mode].append({"ttft_s": [a["latency_s"] for a in first], "kv_peak_bytes": kv_peak, "wall_s": wall,
                                   "rows_per_step": steps["sum"] / max(steps["count"], 1), "answers": answers,
                                   "errors": sum(a["error"] is not None for a in first + answers)})
                progress(f"round {r + 1}/{args.rounds} {mode}: TTFT p50 "
                         f"{statistics.median(runs[mode][-1]['ttft_s']) * 1e3:.0f} ms, KV peak {kv_peak / 1e6:.2f} MB")
        alone = {mode: [send_together(s.port, [p], args.answer_tokens)[0] for p in prompts] for mode, s in servers.items()}
        counters = {mode: {k.removeprefix("adapter_kv_prefix_"): v for k, v in metric_values(s.port).items()
                           if k.startswith("adapter_kv_prefix_")} for mode, s in servers.items()}
    finally:
        for server in servers.values():
            server.stop()
    return summarize(runs, alone, counters, common) | ({"prefix_fits": fits, "prefix_budget_mb": options["kv_budget_mb"]}
                                                        if fits else {})


def summarize(runs: dict, alone: dict, counters: dict, common: int) -> dict:
    ttft = {mode: statistics.median([t for run in rs for t in run["ttft_s"]]) for mode, rs in runs.items()}
    kv = {mode: statistics.median([run["kv_peak_bytes"] for run in rs]) for mode, rs in runs.items()}
    wall = {mode: statistics.median([run["wall_s"] for run in rs]) for mode, rs in runs.items()}
    rows = {mode: statistics.mean([run["rows_per_step"] for run in rs]) for mode, rs in runs.items()}
    texts = {mode: [answer_pairs(run["answers"]) for run in rs] for mode, rs in runs.items()}
    return {
        "common_prompt_tokens": common,
        "ttft_p50_s": ttft, "kv_peak_bytes": kv, "wall_p50_s": wall, "prefix_wall_speedup": wall["off"] / wall["on"],
        "rows_per_step": rows,
        "ttft_by_round_s": {m: [statistics.median(run["ttft_s"]) for run in rs] for m, rs in runs.items()},
        "errors": {mode: sum(run["errors"] for run in rs) for mode, rs in runs.items()},
        "answers_with_text": sum(bool(t) for run in texts["on"] for t, _ in run),
        "answers": sum(len(run) for run in texts["on"]),
        "prefix_counters": counters,
        "prefix_ttft_speedup": ttft["off"] / ttft["on"],
        "prefix_kv_ratio": kv["on"] / kv["off"] if kv["off"] else None,
        "prefix_outputs_identical": texts["on"] == texts["off"],
        "prefix_answers_differing": sum(a != b for on, off in zip(texts["on"], texts["off"]) for a, b in zip(on, off)),
        "off_together_differing_from_alone": sum(a != b for run in texts["off"]
                                                 for a, b in zip(run, answer_pairs(alone["off"]))),
        "outputs_identical_alone": answer_pairs(alone["on"]) == answer_pairs(alone["off"]),
        "off_together_equals_off_alone": all(run == answer_pairs(alone["off"]) for run in texts["off"]),
    }


def budget_for_rows(world: dict, context: int, rows: int) -> int:
    """A KV budget that holds ``rows`` rows of ``context`` tokens at their worst case (the scheduler's count)."""
    from runtime.engine.backends.onnxruntime import OrtEngine

    pool = OrtEngine(world["engine"], threads=1, kv_budget_bytes=1 << 30).pool
    return rows * pool.row_bytes(context - 1) + pool.sealed.block_bytes


def measure_swap(world: dict, args, work: Path) -> dict:
    """``--swap-clients`` prompts of ``--swap-context`` tokens (answer included) sent at once to: a server whose KV
    budget holds them all, one whose budget holds ``--swap-fits`` of them (the others wait ``kv_wait_s``, then 503),
    and the same budget with a spill file. Each server alone, one after the other."""
    tokenizer = DeviceTokenizer(world["tokenizer"])
    prompts = [prompt_text(tokenizer, args.swap_context - args.swap_answer, row) for row in range(args.swap_clients)]
    budget_mb = budget_for_rows(world, args.swap_context, args.swap_fits) / (1 << 20)
    (work / "spill").mkdir(exist_ok=True)
    modes = {"unbudgeted": {}, "budget": {"kv_budget_mb": budget_mb, "kv_wait_s": args.swap_wait},
             "budget+swap": {"kv_budget_mb": budget_mb, "kv_wait_s": args.swap_wait, "kv_swap_dir": str(work / "spill"),
                             "kv_swap_mb": 4 * budget_mb}}
    out = {}
    for mode, extra in modes.items():
        (work / mode).mkdir(exist_ok=True)
        server = our_server(world, (args.swap_context,), args.swap_answer, args.threads, work / mode, f"ours {mode}",
                            server_options(args) | extra)
        try:
            send_together(server.port, [prompt_text(tokenizer, 16, len(prompts))], 1)  # the session's first run
            t0 = time.perf_counter()
            answers = send_together(server.port, prompts, args.swap_answer)
            wall = time.perf_counter() - t0
            metrics = metric_values(server.port)
        finally:
            server.stop()
        refused = sum(a["error"] is not None and "503" in a["error"] for a in answers)
        out[mode] = {"wall_s": wall, "tokens": sum(a["tokens"] for a in answers),
                     "tokens_per_s": sum(a["tokens"] for a in answers) / wall, "refused": refused,
                     "failed": sum(a["error"] is not None for a in answers) - refused,
                     "preemptions": metrics.get("adapter_kv_preemptions_total", 0.0),
                     "pages_swapped_out": metrics.get("adapter_kv_pages_swapped_out_total", 0.0),
                     "answers": answer_pairs(answers), "errors": [a["error"] for a in answers if a["error"]][:3]}
        progress(f"swap, {mode}: {wall:.0f} s, {out[mode]['tokens_per_s']:.1f} tokens/s, {refused} refused, "
                 f"{out[mode]['failed']} failed, {out[mode]['preemptions']:.0f} preemptions")
    swap, whole = out["budget+swap"], out["unbudgeted"]
    return {"swap_runs": out, "swap_budget_mb": budget_mb, "swap_refused": swap["refused"], "swap_failed": swap["failed"],
            "swap_tokens_per_s_ratio": swap["tokens_per_s"] / whole["tokens_per_s"],
            "swap_outputs_identical": swap["answers"] == whole["answers"]}


def answer_pairs(answers: list[dict]) -> list[tuple]:
    return [(a["text"], a["tokens"]) for a in answers]


def kv_ratio(q: dict) -> str:
    """The KV peak ratio, or why there is none (no sample caught a row of the pass without sharing)."""
    return "none sampled" if q["prefix_kv_ratio"] is None else f"{q['prefix_kv_ratio']:.3f}x"


def print_results(p: dict) -> None:
    for name, q in (("", p), ("under a KV budget: ", p.get("prefix_budgeted"))):
        if q is None or "prefix_ttft_speedup" not in q:
            continue
        rows = [[name + mode, f"{q['ttft_p50_s'][mode] * 1e3:.0f}",
                 " ".join(f"{t * 1e3:.0f}" for t in q["ttft_by_round_s"][mode]), f"{q['kv_peak_bytes'][mode] / 1e6:.2f}",
                 f"{q['wall_p50_s'][mode]:.1f}", f"{q['rows_per_step'][mode]:.2f}", q["errors"][mode]] for mode in MODES]
        print(table(["sharing", "TTFT p50 ms", "by round", "KV peak MB", "answers wall s", "rows per step", "errors"], rows))
        print(f"{name}prefix_ttft_speedup={q['prefix_ttft_speedup']:.2f} prefix_kv_ratio={kv_ratio(q)} "
              f"prefix_wall_speedup={q['prefix_wall_speedup']:.2f} "
              f"prefix_outputs_identical={q['prefix_outputs_identical']} ({q['prefix_answers_differing']} differ; "
              f"{q['answers_with_text']}/{q['answers']} "
              f"answers with text; each prompt alone: {q['outputs_identical_alone']}; sharing off, together = alone: "
              f"{q['off_together_equals_off_alone']})")
    if "swap_runs" in p:
        rows = [[mode, f"{r['wall_s']:.0f}", f"{r['tokens_per_s']:.1f}", r["refused"], r["failed"], f"{r['preemptions']:.0f}",
                 f"{r['pages_swapped_out']:.0f}"] for mode, r in p["swap_runs"].items()]
        print(table(["server", "wall s", "tokens/s", "refused", "failed", "preemptions", "pages out"], rows))
        print(f"swap_refused={p['swap_refused']} swap_failed={p['swap_failed']} "
              f"swap_tokens_per_s_ratio={p['swap_tokens_per_s_ratio']:.2f} swap_outputs_identical={p['swap_outputs_identical']}")


def figures(p: dict) -> list[Figure]:
    rows = []
    paired = ", rows paired (serve --batch-invariant)" if p.get("batch_invariant") else ""
    for q in (p, p.get("prefix_budgeted")):
        if q is None or "prefix_ttft_speedup" not in q:
            continue
        budget = (f", a KV budget that holds {q['prefix_fits']} whole ({q['prefix_budget_mb']:.1f} MiB)"
                  if q.get("prefix_fits") else "")
        load = (f"{p['clients']} clients, {p['system_tokens']}-token system turn + {p['question_tokens']}-token question "
                f"({q['common_prompt_tokens']} tokens in common), {p['shape']} shape, int4, 4-bit KV pages{budget}{paired}")
        rows += [
            Figure(f"{load}: time to first token p50, sharing off / on", q["prefix_ttft_speedup"],
                   f"{q['prefix_ttft_speedup']:.2f}x ({q['ttft_p50_s']['off'] * 1e3:.0f} ms / "
                   f"{q['ttft_p50_s']['on'] * 1e3:.0f} ms)"),
            Figure(f"{load}: KV bytes allocated, sharing on / off (peak)", q["prefix_kv_ratio"],
                   f"{kv_ratio(q)} ({q['kv_peak_bytes']['on'] / 1e6:.2f} MB / "
                   f"{q['kv_peak_bytes']['off'] / 1e6:.2f} MB)"),
            Figure(f"{load}: wall time of {p['answer_tokens']}-token answers, sharing off / on", q["prefix_wall_speedup"],
                   f"{q['prefix_wall_speedup']:.2f}x ({q['wall_p50_s']['off']:.1f} s / {q['wall_p50_s']['on']:.1f} s; "
                   f"rows per decode step {q['rows_per_step']['off']:.2f} / {q['rows_per_step']['on']:.2f})"),
            Figure(f"{load}: answers identical ({q['answers_with_text']}/{q['answers']} with text)", None,
                   f"together: {q['prefix_outputs_identical']} ({q['prefix_answers_differing']} of {q['answers']} "
                   f"differ); each prompt alone: {q['outputs_identical_alone']} (sharing off, together against alone: "
                   f"{q['off_together_differing_from_alone']} of {q['answers']} differ)"),
        ]
    if "swap_runs" in p:
        load = (f"{p['swap_clients']} clients of {p['swap_context']} tokens at once, a KV budget that holds "
                f"{p['swap_fits']} ({p['swap_budget_mb']:.1f} MiB), {p['shape']} shape{paired}")
        runs = p["swap_runs"]
        rows += [
            Figure(f"{load}: refused / failed with swap", p["swap_refused"] + p["swap_failed"],
                   f"{p['swap_refused']} refused, {p['swap_failed']} failed (without swap: {runs['budget']['refused']} "
                   f"refused)"),
            Figure(f"{load}: tokens/s with swap over the unbudgeted server's", p["swap_tokens_per_s_ratio"],
                   f"{p['swap_tokens_per_s_ratio']:.2f}x ({runs['budget+swap']['tokens_per_s']:.1f} / "
                   f"{runs['unbudgeted']['tokens_per_s']:.1f})"),
            Figure(f"{load}: answers identical to the unbudgeted server's", None, str(p["swap_outputs_identical"])),
        ]
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=SHAPES, default="0.5b")
    ap.add_argument("--parts", default="prefix,swap", help="prefix, swap, or both")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--system-tokens", type=int, default=512)
    ap.add_argument("--question-tokens", type=int, default=64)
    ap.add_argument("--answer-tokens", type=int, default=16, help="tokens each answer of the second pass generates")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prefix-fits", type=int, default=2, help="measure the prefix part again under a KV budget that "
                    "holds this many of the clients' whole worst cases (0: not)")
    ap.add_argument("--swap-clients", type=int, default=16)
    ap.add_argument("--swap-context", type=int, default=2048, help="each swap client's prompt and answer, in tokens")
    ap.add_argument("--swap-answer", type=int, default=32, help="tokens each swap client generates")
    ap.add_argument("--swap-fits", type=int, default=8, help="swap clients the budgeted servers' KV budget holds")
    ap.add_argument("--swap-wait", type=float, default=30.0, help="the budgeted servers' kv_wait_s")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefill-chunk", type=int, default=128, help="every server's prefill_chunk (a shared prefix on "
                    "quantized pages is a multiple of it)")
    ap.add_argument("--batch-invariant", action="store_true", help="every server pairs its rows (serve "
                    "--batch-invariant): a request's tokens do not depend on its company")
    ap.add_argument("--sample-s", type=float, default=0.05, help="seconds between KV gauge samples")
    ap.add_argument("--workdir", type=Path, default=None, help="where the model is built and kept (default: a "
                    "temporary directory, removed at the end)")
    ap.add_argument("--out", type=Path, default=RESULTS / "kv_tiers_bench.json")
    args = ap.parse_args(argv)
    parts = set(args.parts.split(","))
    if unknown := sorted(parts - {"prefix", "swap"}):
        ap.error(f"--parts: unknown {unknown}; prefix, swap")
    before = os.getloadavg()[0]
    result = {"loadavg_1m_before": before, "shape": args.shape, "threads": args.threads,
              "prefill_chunk": args.prefill_chunk, "batch_invariant": args.batch_invariant}
    with tempfile.TemporaryDirectory(prefix="kv-tiers-") as tmp:
        work = args.workdir or Path(tmp)
        world = build_int4_world(args.shape, work / f"{args.shape}-quantized_pages", args.threads)
        if "prefix" in parts:
            result |= {"clients": args.clients, "system_tokens": args.system_tokens,
                       "question_tokens": args.question_tokens, "answer_tokens": args.answer_tokens,
                       "rounds": args.rounds} | measure_prefix(world, args, work)
            if args.prefix_fits:
                (work / "budgeted").mkdir(exist_ok=True)
                result["prefix_budgeted"] = measure_prefix(world, args, work / "budgeted", args.prefix_fits)
        if "swap" in parts:
            result |= {"swap_clients": args.swap_clients, "swap_context": args.swap_context,
                       "swap_answer": args.swap_answer, "swap_fits": args.swap_fits,
                       "swap_wait_s": args.swap_wait} | measure_swap(world, args, work)
    result["outputs_identical"] = all(result.get(k, True) for k in ("prefix_outputs_identical", "swap_outputs_identical"))
    result["loadavg_1m_after"] = os.getloadavg()[0]
    print_results(result)
    write_report(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
