"""Serving throughput: our device server (fork-per-request and batched decode) against llama.cpp's
``llama-server`` (continuous batching) on the same model, at 1, 4, 8 and 16 concurrent streaming clients.

    make bench-peer-server    # builds llama-server from the `peer` sdist's vendored llama.cpp (once), runs this
    python -m bench.serving.serve_bench [--clients 1,4,8,16] [--rounds 3] [--requests 4] [--max-tokens 64] [--threads 2]
        [--servers fork,batched,llama] [--llama-server PATH] [--tiny] [--out bench/results/serve_bench.json]

Not part of CI nor of ``make bench``. The model: the last release of ``make release`` when there is
one (the serving engine ``engine/kv-paged16``, ``models/base``, ``artifacts/<month>/package/release``), else
the tiny world of ``bench.lib.worlds`` (a random Qwen2 with its first release).

Servers, each its own process, all on ``--threads`` threads:

* ``fork``: ours, ``ServeSettings(decode="fork")``: each request decodes on its own fork of the engine
  (the path before batching).
* ``batched``: ours, ``ServeSettings(decode="batched")``: continuous batching (the default).
* ``llama``: ``llama-server -np N -cb`` with the base converted to GGUF F32 and the release's PEFT
  adapter converted to a GGUF LoRA (F32) and applied with ``--lora``, by the converters the
  llama-cpp-python sdist vendors (``bench.lib.llama_cpp_peer``). Our serving engine's weights are fp32
  too; its KV cache is the release's 4-bit one, llama.cpp's F16 (its default).

Concurrency as each ships: ours at its mode's default ``max_concurrent`` (batched: 16 requests in the
batch; fork: 2 decoding, one per core, since forks contend for the same threads; the rest of the N
clients queue, ``max_queue`` at least N), llama-server with ``-np N`` slots. Per client
count the three servers are started fresh, warmed (N requests each, untimed), then timed in
``--rounds`` rounds, each round A B C (fork, batched, llama), so load from other processes hits them
alike. A round: N client threads, each sending ``--requests`` streamed greedy requests one after
another (the next when the last answer ended, each on a new connection), prompts rotating over the
same list for every server (``bench.lib.worlds.ROW_STARTS``: the start of an inspection row, which the model
completes),
``max_tokens`` the same. Our servers get the prompt text, llama-server the token ids our tokenizer
makes of it (the same tokens on both sides; ``cache_prompt: false``, since our server keeps no
prompt cache and each request should prefill). Both stop at the model's end-of-sequence token; the
texts can differ in a few digits, from the 4-bit against the F16 KV cache (our float-cache engine
writes what llama.cpp writes).

Reported per server and client count, pooled over the rounds: aggregate generated tokens/s (the
tokens of ``usage.completion_tokens`` over the round's wall time, first send to last answer),
time to first token p50/p99 (from the request's send to its first streamed event with a choice),
inter-token latency p50/p99 (gaps between consecutive streamed events), errors, and the server
process's CPU (user + system, every thread) per generated token: on a machine shared with other work
tokens/s swing with the load, CPU per token much less (spin-waiting threads, ONNX Runtime's and
llama.cpp's, count as busy). The reference is our
own batch-1 sequential rate: one client, one request at a time, on our servers (the better of fork
and batched at 1 client); beside it, as information, the engine's bare batch-1 rate (the same
prompts through ``runtime.engine.generate.decode_steps`` on a fork of the release, in this process, no
HTTP: the fork path's decode loop). Targets (issue 17, at 8 clients): tokens/s at least 3x the batch-1 sequential rate and at least llama-server's, p99 time to
first token no worse than llama-server's. Writes ``bench/results/serve_bench.json``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.lib.llama_cpp_peer import convert_adapter_to_gguf, convert_to_gguf, converter_dir, llama_server_binary
from bench.lib.report import RESULTS, Figure, write_report
from bench.lib.serve_client import Answer, Client, summary_ms
from bench.lib.servers import ServerProcess, free_port
from bench.lib.tables import table
from bench.lib.worlds import ROW_STARTS, serving_world
from runtime.serve.http_app import DECODE_MODES

SERVERS = ("fork", "batched", "llama")  # the order of a round; fork and batched: ServeSettings(decode=...)
SLOT_CONTEXT = 512  # llama-server's context per slot (-c is shared by the -np slots)
TARGET_CLIENTS = 8


def convert_for_llama(world: dict, work: Path, src: str | None) -> tuple[Path, Path]:
    """The base as GGUF F32 and the release's adapter as a GGUF LoRA, by the sdist's converters."""
    llama_dir = converter_dir(src)
    model = convert_to_gguf(llama_dir, world["base"], work / "model-f32.gguf", "f32")
    lora = convert_adapter_to_gguf(llama_dir, world["adapter"], world["base"], work / "adapter-f32.gguf")
    return model, lora


# ---------------------------------------------------------------- the servers

def serve_child(argv: list[str]) -> int:
    """``python -m bench.serving.serve_bench serve DECODE SLOTS MAX_TOKENS THREADS ENGINE TOKENIZER KEY RELEASE``:
    our device server as ``python -m runtime serve`` runs it, with ``ServeSettings(decode=DECODE)``."""
    from runtime.engine.engine import open_engine
    from runtime.engine.tokenizer import DeviceTokenizer
    from runtime.release.verify import load_trusted_keys
    from runtime.serve.http_app import ServeSettings
    from runtime.serve.http_server import configure_json_logging, serve
    from runtime.serve.server import AdapterServer

    decode, slots, max_tokens, threads, engine, tokenizer, key, release = argv
    configure_json_logging()
    app = AdapterServer(open_engine(engine, "onnxruntime", threads=int(threads)), DeviceTokenizer(tokenizer),
                        load_trusted_keys([key]))
    app.load(release)
    # each mode's own number decoding at once (batched 16, fork 2); the rest of the N clients queue
    settings = ServeSettings(decode=decode, max_queue=max(int(slots), ServeSettings.max_queue),
                             max_tokens=max(int(max_tokens), ServeSettings.max_tokens))
    return serve(app, settings, "127.0.0.1", 0)


def start_servers(names: list[str], world: dict, slots: int, max_tokens: int, threads: int, gguf, binary,
                  logs: Path) -> dict[str, ServerProcess]:
    servers = {}
    for name in names:
        log = logs / f"{name}-{slots}.log"
        if name in DECODE_MODES:
            cmd = [sys.executable, "-m", "bench.serving.serve_bench", "serve", name, str(slots), str(max_tokens),
                   str(threads), *map(str, (world["engine"], world["tokenizer"], world["trusted_key"], world["release"]))]
            servers[name] = ServerProcess(name, cmd, log)
        else:
            port = free_port()
            model, lora = gguf
            cmd = [str(binary), "-m", str(model), "--lora", str(lora), "-np", str(slots), "-cb",
                   "-c", str(SLOT_CONTEXT * slots), "-t", str(threads), "-tb", str(threads),
                   "--host", "127.0.0.1", "--port", str(port), "--no-webui"]
            servers[name] = ServerProcess(name, cmd, log, port=port, ready="/health")
    return servers


# ---------------------------------------------------------------- the load

def payloads(name: str, prompts: list[str], prompt_ids: list[list[int]], max_tokens: int) -> list[dict]:
    common = {"max_tokens": max_tokens, "temperature": 0}
    if name == "llama":  # the same tokens as ours; llama-server would otherwise reuse a slot's cached prompt
        return [common | {"prompt": ids, "cache_prompt": False} for ids in prompt_ids]
    return [common | {"prompt": p} for p in prompts]


def run_round(port: int, bodies: list[dict], clients: int, requests: int) -> tuple[list[Answer], float]:
    """``clients`` threads, each ``requests`` streamed requests back to back; (answers, wall seconds)."""
    answers: list[list[Answer]] = [[] for _ in range(clients)]
    start = threading.Barrier(clients + 1)

    def client(i: int) -> None:
        start.wait()
        for j in range(requests):  # a connection per request: llama-server closes one after a stream
            conn = Client(port)
            answers[i].append(conn.complete(bodies[(i + j) % len(bodies)], stream=True))
            conn.close()

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    start.wait()
    for t in threads:
        t.join()
    flat = [a for per in answers for a in per]
    return flat, max(a.done for a in flat) - min(a.sent for a in flat)


def pooled(rounds: list[tuple[list[Answer], float, float]]) -> dict:
    """The rounds' (answers, wall seconds, server CPU seconds) as one result."""
    answers = [a for r, _, _ in rounds for a in r]
    ok = [a for a in answers if a.complete]
    tokens, wall, cpu = sum(a.tokens for a in ok), sum(w for _, w, _ in rounds), sum(c for _, _, c in rounds)
    return {"requests": len(answers), "complete": len(ok), "errors": len(answers) - len(ok),
            "error_examples": [a.error or f"status {a.status}" for a in answers if not a.complete][:3],
            "tokens": tokens, "wall_s": round(wall, 3), "tokens_per_s": tokens / wall if wall else 0.0,
            "server_cpu_s": round(cpu, 3), "server_cpu_us_per_token": cpu / tokens * 1e6 if tokens else None,
            "mean_completion_tokens": tokens / len(ok) if ok else 0.0,
            "mean_prompt_tokens": sum(a.prompt_tokens for a in ok) / len(ok) if ok else 0.0,
            "ttft": summary_ms([a.first - a.sent for a in ok if a.first is not None]),
            "itl": summary_ms([g for a in ok for g in a.gaps()]),
            "texts": sorted({a.text for a in ok})[:8]}


def engine_batch1(world: dict, prompt_ids: list[list[int]], max_tokens: int, threads: int, repeats: int) -> dict:
    """Tokens/s of the bare engine, batch 1, one prompt after another (no HTTP), the release bound."""
    from runtime.engine.engine import open_engine
    from runtime.engine.generate import decode_steps
    from runtime.engine.tokenizer import DeviceTokenizer
    from runtime.release.verify import load_trusted_keys
    from runtime.serve.server import AdapterServer

    tokenizer = DeviceTokenizer(world["tokenizer"])
    app = AdapterServer(open_engine(world["engine"], "onnxruntime", threads=threads), tokenizer,
                        load_trusted_keys([world["trusted_key"]]))
    app.load(world["release"])

    def generate(ids: list[int]) -> int:
        return sum(1 for _ in decode_steps(app.active.handle.fork(), [ids], max_tokens, tokenizer.stop_ids,
                                           tokenizer.pad_id))

    generate(prompt_ids[0])  # warm-up: ONNX Runtime's first runs allocate
    tokens, t0 = 0, time.perf_counter()
    for _ in range(repeats):
        tokens += sum(generate(ids) for ids in prompt_ids)
    wall = time.perf_counter() - t0
    return {"tokens": tokens, "wall_s": round(wall, 3), "tokens_per_s": tokens / wall}


def measure(world: dict, names: list[str], clients: list[int], rounds: int, requests: int, max_tokens: int,
            threads: int, gguf, binary, logs: Path) -> dict:
    from runtime.engine.tokenizer import DeviceTokenizer

    tokenizer = DeviceTokenizer(world["tokenizer"])
    prompt_ids = [tokenizer.encode(p) for p in ROW_STARTS]
    bodies = {name: payloads(name, ROW_STARTS, prompt_ids, max_tokens) for name in names}
    out = {"engine_batch1": engine_batch1(world, prompt_ids, max_tokens, threads, repeats=rounds), "by_clients": {}}
    for n in clients:
        servers = start_servers(names, world, n, max_tokens, threads, gguf, binary, logs)
        try:
            for name, server in servers.items():  # warm-up: every slot once, untimed
                run_round(server.port, bodies[name], n, 1)
            timed: dict[str, list] = {name: [] for name in names}
            for r in range(rounds):
                for name, server in servers.items():
                    cpu = server.cpu_seconds()
                    answers, wall = run_round(server.port, bodies[name], n, requests)
                    timed[name].append((answers, wall, server.cpu_seconds() - cpu))
                print(f"[{n} clients] round {r + 1}/{rounds} done (1-min load average {os.getloadavg()[0]:.2f})",
                      flush=True)
        finally:
            exits = {name: server.stop() for name, server in servers.items()}
        out["by_clients"][str(n)] = {name: pooled(timed[name]) | {"exit_code": exits[name]} for name in names}
    return out


def judge(result: dict) -> dict:
    """Issue 17's targets at 8 clients, from the numbers as measured."""
    by = result["by_clients"]
    one = by.get("1", {})
    batch1 = max((one[m]["tokens_per_s"] for m in DECODE_MODES if m in one), default=None)
    at8 = by.get(str(TARGET_CLIENTS), {})
    ours = at8.get("batched")
    out = {"batch1_sequential_tokens_per_s": batch1, "engine_batch1_tokens_per_s": result["engine_batch1"]["tokens_per_s"]}
    if ours is None:
        return out
    out["batched_8_tokens_per_s"] = ours["tokens_per_s"]
    if batch1:
        out["x_batch1_sequential"] = ours["tokens_per_s"] / batch1
        out["ge_3x_batch1_sequential"] = out["x_batch1_sequential"] >= 3.0
    out["x_engine_batch1"] = ours["tokens_per_s"] / result["engine_batch1"]["tokens_per_s"]
    if "llama" in at8:
        peer = at8["llama"]
        out["x_llama_server"] = ours["tokens_per_s"] / peer["tokens_per_s"] if peer["tokens_per_s"] else None
        out["ge_1x_llama_server"] = bool(out["x_llama_server"]) and out["x_llama_server"] >= 1.0
        out["ttft_p99_ms"] = {"batched": ours["ttft"]["p99_ms"], "llama": peer["ttft"]["p99_ms"]}
        out["ttft_p99_no_worse_than_llama"] = ours["ttft"]["p99_ms"] <= peer["ttft"]["p99_ms"]
    return out


def print_results(result: dict) -> None:
    print(f"\nmodel: {result['source']}; {result['threads']} threads; max_tokens {result['max_tokens']}; "
          f"{result['rounds']} rounds x {result['requests']} requests per client")
    e = result["engine_batch1"]
    print(f"engine bare batch-1 (no HTTP): {e['tokens_per_s']:.1f} tokens/s   (ms; server CPU per token in us)")
    print(table(["clients", "server", "tokens/s", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99", "tok/req", "errors",
                 "cpu/tok"],
                ([n, name, f"{r['tokens_per_s']:.1f}", f"{r['ttft']['p50_ms'] or 0:.1f}", f"{r['ttft']['p99_ms'] or 0:.1f}",
                  f"{r['itl']['p50_ms'] or 0:.2f}", f"{r['itl']['p99_ms'] or 0:.2f}", f"{r['mean_completion_tokens']:.1f}",
                  r["errors"], f"{r['server_cpu_us_per_token'] or 0:.0f}"]
                 for n, row in result["by_clients"].items() for name, r in row.items()), align=">" + "<" + ">" * 8))
    print("targets at 8 clients: " + ", ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}"
                                                for k, v in result["acceptance"].items()))


def figures(p: dict) -> list[Figure]:
    """Generated tokens/s and time to first token of each server at each client count, and the targets at 8."""
    e = p["engine_batch1"]["tokens_per_s"]
    rows = [Figure("engine bare batch-1 decode, no HTTP", e, f"{e:.1f} tokens/s")]
    for n, by in p["by_clients"].items():
        for name, r in by.items():
            rows.append(Figure(f"{n} clients, {name}: generated tokens/s (time to first token p50 / p99)", r["tokens_per_s"],
                               f"{r['tokens_per_s']:.1f} tokens/s ({r['ttft']['p50_ms'] or 0:.0f} / "
                               f"{r['ttft']['p99_ms'] or 0:.0f} ms; {r['errors']} errors)"))
    for key in ("x_batch1_sequential", "x_llama_server"):
        if p["acceptance"].get(key) is not None:
            rows.append(Figure(f"{TARGET_CLIENTS} clients, batched: tokens/s {key.replace('_', ' ')}", p["acceptance"][key],
                               f"{p['acceptance'][key]:.2f}x"))
    return rows


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:
        return serve_child(argv[1:])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", default="1,4,8,16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=4, help="streamed requests per client and round, back to back")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2, help="threads of every server (ONNX Runtime intra-op; llama -t/-tb)")
    ap.add_argument("--servers", default=",".join(SERVERS))
    ap.add_argument("--llama-server", default=None, help="llama-server binary (default $LLAMA_SERVER, else the "
                    "`make bench-peer-server` build)")
    ap.add_argument("--llama-cpp-src", default=None, help="llama-cpp-python sdist or llama.cpp dir (the converters)")
    ap.add_argument("--tiny", action="store_true", help="the tiny world even if `make release` artifacts exist")
    ap.add_argument("--out", type=Path, default=RESULTS / "serve_bench.json")
    args = ap.parse_args(argv)
    names = args.servers.split(",")
    unknown = sorted(set(names) - set(SERVERS))
    if unknown:
        ap.error(f"unknown server(s) {unknown}; known: {', '.join(SERVERS)}")
    clients = [int(c) for c in args.clients.split(",")]
    binary = llama_server_binary(args.llama_server) if "llama" in names else None
    with tempfile.TemporaryDirectory(prefix="serve-bench-") as tmp:
        work = Path(tmp)
        world = serving_world(work / "world", args.tiny)
        gguf = convert_for_llama(world, work, args.llama_cpp_src) if "llama" in names else None
        result = {"source": world["source"], "release": str(world["release"]), "threads": args.threads,
                  "max_tokens": args.max_tokens, "rounds": args.rounds, "requests": args.requests,
                  "slots": "ours: the mode's default max_concurrent (batched 16, fork 2), max_queue >= N; llama-server -np N -cb",
                  "llama_server": str(binary) if binary else None, "loadavg_1m_before": os.getloadavg()[0]}
        result |= measure(world, names, clients, args.rounds, args.requests, args.max_tokens, args.threads, gguf,
                          binary, work)
    result["loadavg_1m_after"] = os.getloadavg()[0]
    result["acceptance"] = judge(result)
    print_results(result)
    write_report(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
