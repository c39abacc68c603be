"""Open-loop load test: requests at fixed rates against the server while releases are swapped in and out.

    .venv/bin/python -m bench.serving.hotswap_bench [--rates 20,50,100] [--arrivals poisson|fixed] [--before 3]
        [--during 8] [--after 3] [--swap-every 1] [--client-pool 64]

Uses two packaged releases under ``artifacts/*/package/release`` when there are at least two
(with the engine, tokenizer and public key of ``params.yaml``); otherwise builds a tiny world
(``bench.lib.worlds``) in a temporary directory: a random Qwen2 with a trained tokenizer, its compiled
engine, two signed releases (months 2026-10 and 2026-11, different adapters).

The server runs in this process (the device's app under uvicorn on a free port, its default
settings: batched decode, 16 in the batch, 16 queued, 503 beyond). The load is open-loop: per rate,
send times are drawn in advance (exponential gaps, seeded: ``poisson``; or equal gaps: ``fixed``) and each
request is released at its time to a pool of keep-alive clients, whether or not earlier answers
came back, so a slow server makes requests queue rather than the load slow down. Latency is
measured from the *scheduled* send time (queueing in the client pool and in the server counts);
the service time from the actual send and the send lag (scheduled to sent) are reported beside it.
Per rate, phases: ``before`` (release A only), ``during`` (A and B swapped every ``swap_every`` s,
rollback explicitly allowed: A is older), ``after`` (no swaps); the next rate starts once every
request of the last one is answered. Swaps are ``AdapterServer.load`` calls in this process, since a
rollback is a local act the network never gets. Reported: per rate, requests sent / ok / failed
(503 refusals counted apart too) and latency p50/p95/p99 (all phases, and while swapping); swap
latency p50/p99 (server side: verify + bind + activate, and the activation alone; and as the
swapping caller saw it, the swap lock included); and per response whether the release it names is
consistent with what was active when it was sent: its activation number is not older than the last
swap completed before it was sent, maps to the release it names, and its text is exactly that
release's answer to the prompt (so no step ran on another adapter).
Writes ``bench/results/hotswap_bench.json``.
"""

from __future__ import annotations

import argparse
import json
import queue
import random
import tempfile
import threading
import time
from pathlib import Path

from bench.lib.report import RESULTS, Figure, write_report
from bench.lib.serve_client import Client, summary_ms
from bench.lib.tables import table
from bench.lib.worlds import INSPECTION_PROMPTS, TINY_HEAD_DIM, build_tiny_world, engine_form, existing_world
from runtime.release.contract import MANIFEST

# ---------------------------------------------------------------- the load test

def arrival_times(rate: float, seconds: float, arrivals: str, rng: random.Random) -> list[float]:
    """Send times in [0, seconds) at ``rate`` per second: exponential gaps (``poisson``) or equal ones (``fixed``)."""
    times, t = [], 0.0
    while True:
        t += rng.expovariate(rate) if arrivals == "poisson" else 1.0 / rate
        if t >= seconds:
            return times
        times.append(t)


class OpenLoop:
    """Requests sent at scheduled times, whatever the answers: a dispatcher releases each at its time
    to a pool of ``workers`` keep-alive clients (a request waits for a free one, on the clock)."""

    def __init__(self, port: int, known: list, max_new_tokens: int, workers: int):
        self.port, self.known, self.n = port, known, max_new_tokens
        self.jobs: queue.Queue = queue.Queue()
        self.records: list[dict] = []
        self.lock = threading.Lock()
        self.pool = [threading.Thread(target=self.work, daemon=True) for _ in range(workers)]
        for t in self.pool:
            t.start()

    def run(self, t0: float, schedule: list[float], prompts: list[str]) -> None:
        """Release request i at ``t0 + schedule[i]`` (blocks until the last is released)."""
        for at, prompt in zip(schedule, prompts):
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            self.jobs.put((t0 + at, prompt))

    def work(self) -> None:
        client = Client(self.port, timeout=60)
        while (job := self.jobs.get()) is not None:
            scheduled, prompt = job
            known = self.known[0]  # activation of the last swap completed before this request was sent
            a = client.complete({"prompt": prompt, "max_tokens": self.n, "temperature": 0})
            with self.lock:
                self.records.append({"scheduled": scheduled, "sent": a.sent, "done": a.done, "status": a.status,
                                     "complete": a.complete, "error": a.error, "prompt": prompt,
                                     "known_activation": known, "release_id": a.model, "activation": a.activation,
                                     "text": a.text})
        client.close()

    def close(self) -> None:
        for _ in self.pool:
            self.jobs.put(None)
        for t in self.pool:
            t.join()


def run_load_test(world: dict, rates: list[float], before: float, during: float, after: float, swap_every: float,
                  max_new_tokens: int, threads: int, arrivals: str = "poisson", workers: int = 64) -> dict:
    from runtime.engine.backends.onnxruntime import OrtEngine
    from runtime.engine.latency import percentile
    from runtime.engine.tokenizer import DeviceTokenizer
    from runtime.release.verify import PackageError, load_trusted_keys
    from runtime.serve.http_server import BackgroundServer
    from runtime.serve.server import AdapterServer

    engine = OrtEngine(world["engine"], threads=threads)
    app = AdapterServer(engine, DeviceTokenizer(world["tokenizer"]), load_trusted_keys([world["trusted_key"]]))
    server = BackgroundServer(app).start()
    port = server.port
    release_a, release_b = (str(p) for p in world["releases"][-2:])

    # Each release's answer to every prompt, from the same server with only that release active.
    expected, activation_release = {}, {}
    probe = Client(port)
    for path in (release_b, release_a):  # ends on A (older), the release the load starts with
        swap = app.load(path, allow_rollback=True)
        activation_release[swap["activation"]] = swap["release_id"]
        for prompt in INSPECTION_PROMPTS:
            a = probe.complete({"prompt": prompt, "max_tokens": max_new_tokens, "temperature": 0})
            assert a.complete, a.error
            expected[(swap["release_id"], prompt)] = a.text
    probe.close()
    distinct = len({v for v in expected.values()})
    known = [app.active.activation]

    rng = random.Random(0)
    swaps, targets, per_rate = [], [release_b, release_a], {}
    load = OpenLoop(port, known, max_new_tokens, workers)
    for rate in rates:
        total = before + during + after
        schedule = arrival_times(rate, total, arrivals, rng)
        t0 = time.perf_counter()
        sender = threading.Thread(target=load.run, args=(t0, schedule, [rng.choice(INSPECTION_PROMPTS) for _ in schedule]))
        sender.start()
        time.sleep(before)
        t_during = time.perf_counter()
        first_swap = len(swaps)
        while time.perf_counter() - t_during < during:
            path = targets[len(swaps) % 2]
            s0 = time.perf_counter()
            try:
                status, swap = 200, app.load(path, allow_rollback=True)
            except PackageError as err:
                status, swap = 422, {"reason": err.reason, "error": str(err)}
            client_ms = (time.perf_counter() - s0) * 1e3
            if status == 200:
                activation_release[swap["activation"]] = swap["release_id"]
                known[0] = swap["activation"]
            swaps.append({"status": status, "client_ms": client_ms, "rate": rate, **swap})
            time.sleep(max(0.0, swap_every - client_ms / 1e3))
        t_after = time.perf_counter()
        sender.join()
        while len(load.records) < sum(len(r["schedule"]) for r in per_rate.values()) + len(schedule):
            time.sleep(0.05)  # every request of this rate answered (or failed) before the next rate starts
        per_rate[rate] = {"schedule": schedule, "t0": t0, "t_during": t_during, "t_after": t_after,
                          "t_end": t0 + total, "swaps": len(swaps) - first_swap}
    load.close()
    metrics = {"requests_by_release": app.metrics.requests_by_release(),
               "swaps": app.metrics.value("adapter_swaps_total")}
    server.stop()

    def consistent(r):
        return (activation_release.get(r["activation"]) == r["release_id"] and r["activation"] >= r["known_activation"]
                and expected.get((r["release_id"], r["prompt"])) == r["text"])

    def latency(records):
        return summary_ms([r["done"] - r["scheduled"] for r in records])

    records = load.records
    by_rate = {}
    for rate, w in per_rate.items():
        mine = [r for r in records if w["t0"] <= r["scheduled"] < w["t_end"] + 1e-9]
        ok = [r for r in mine if r["complete"]]
        by_rate[str(rate)] = {
            "rate_per_s": rate, "sent": len(mine), "ok": len(ok), "failed": len(mine) - len(ok),
            "refused_503": sum(r["status"] == 503 for r in mine),
            "answered_per_s": round(len(ok) / (w["t_end"] - w["t0"]), 2),
            "latency_from_schedule": latency(ok),
            "latency_during_swaps": latency([r for r in ok if w["t_during"] <= r["scheduled"] < w["t_after"]]),
            "service_time": summary_ms([r["done"] - r["sent"] for r in ok]),  # from the actual send: no queueing
            "send_lag": summary_ms([r["sent"] - r["scheduled"] for r in mine]),  # waiting for a free client
            "swaps": w["swaps"]}
    ok = [r for r in records if r["complete"]]
    failed = [r for r in records if not r["complete"]]
    accepted = [s for s in swaps if s["status"] == 200]
    server_ms = [s["swap_ms"] for s in accepted]
    return {
        "source": world["source"], "engine": engine_form(world["engine"]), "rates": rates, "arrivals": arrivals, "client_pool": workers,
        "phases_s": {"before": before, "during": during, "after": after}, "max_new_tokens": max_new_tokens,
        "ort_threads": threads, "swap_every_s": swap_every, "releases": [Path(p).parent.parent.name + "/" + json.loads(
            (Path(p) / MANIFEST).read_text())["release_id"] for p in (release_a, release_b)],
        "distinct_answers": distinct,
        "swaps": {"count": len(swaps), "accepted": len(accepted),
                  "server_ms_p50": percentile(server_ms, 50), "server_ms_p99": percentile(server_ms, 99),
                  "server_ms_max": max(server_ms) if server_ms else None,
                  "activate_ms_p99": percentile([s["activate_ms"] for s in accepted], 99),
                  "client_ms_p50": percentile([s["client_ms"] for s in accepted], 50),
                  "client_ms_p99": percentile([s["client_ms"] for s in accepted], 99)},
        "requests": {"total": len(records), "ok": len(ok), "failed": len(failed),
                     "failed_examples": [r["error"] or f"status {r['status']}" for r in failed[:5]],
                     "release_consistent": sum(consistent(r) for r in ok),
                     "release_inconsistent": sum(not consistent(r) for r in ok),
                     "raced_a_swap": sum(r["activation"] > r["known_activation"] for r in ok),
                     "by_release": metrics["requests_by_release"]},
        "by_rate": by_rate,
        "server_metrics": metrics,
        "acceptance": {"swap_p99_le_50ms": bool(server_ms) and percentile(server_ms, 99) <= 50.0,
                       "zero_failed_requests": not failed,
                       "every_response_on_its_release": all(consistent(r) for r in ok), "no_restart": True},
    }


def print_results(r: dict) -> None:
    s, q = r["swaps"], r["requests"]
    print(table(["hot-swap load test", ""], [
        ("source", r["source"]),
        ("engine", ", ".join(f"{k} {v}" for k, v in r["engine"].items() if k != "dir")),
        ("arrivals / swaps accepted", f"{r['arrivals']} at {', '.join(map(str, r['rates']))} req/s / "
                                      f"{s['accepted']} of {s['count']}"),
        ("swap ms p50 / p99 / max (verify+bind+activate)", f"{s['server_ms_p50']:.2f} / {s['server_ms_p99']:.2f} / {s['server_ms_max']:.2f}"),
        ("activation alone ms p99", f"{s['activate_ms_p99']:.4f}"),
        ("swap ms as the swapping caller saw it p50 / p99", f"{s['client_ms_p50']:.2f} / {s['client_ms_p99']:.2f}"),
        ("requests ok / failed", f"{q['ok']} / {q['failed']}"),
        ("responses on the release active at start", f"{q['release_consistent']} of {q['ok']} ({q['raced_a_swap']} raced a swap)"),
        ("acceptance", ", ".join(f"{k}={v}" for k, v in r["acceptance"].items())),
    ], align="<<"))
    print("\nms, latency from the scheduled send:")
    rows = []
    for b in r["by_rate"].values():
        lat, sw = b["latency_from_schedule"], b["latency_during_swaps"]
        rows.append([f"{b['rate_per_s']:g}", b["sent"], b["ok"], b["failed"], b["refused_503"], f"{b['answered_per_s']:.1f}",
                     *(f"{lat[k] or 0:.1f}" for k in ("p50_ms", "p95_ms", "p99_ms")), f"{sw['p99_ms'] or 0:.1f}",
                     f"{b['send_lag']['max_ms'] or 0:.1f}"])
    print(table(["req/s", "sent", "ok", "failed", "503", "answered/s", "p50", "p95", "p99", "p99 swapping", "max send lag"],
                rows, align=">" * 11))


def figures(p: dict) -> list[Figure]:
    """The releases swapped, swap latency, failed and inconsistent requests, latency at each rate."""
    s, q = p["swaps"], p["requests"]
    rows = [
        Figure("releases swapped", None, f"{' ↔ '.join(p['releases'])} ({p['source']})"),
        Figure("swap latency, server side (verify + bind + activate) p50 / p99 / max", s["server_ms_p99"],
               f"{s['server_ms_p50']:.2f} / {s['server_ms_p99']:.2f} / {s['server_ms_max']:.2f} ms"),
        Figure("swap latency as the swapping caller saw it p50 / p99", s["client_ms_p99"],
               f"{s['client_ms_p50']:.2f} / {s['client_ms_p99']:.2f} ms"),
        Figure("swaps accepted", s["accepted"], f"{s['accepted']} of {s['count']}"),
        Figure(f"requests failed (open loop, {p['arrivals']} arrivals)", q["failed"], f"{q['failed']} of {q['total']}"),
        Figure("responses not on the release active when sent", q["release_inconsistent"],
               f"{q['release_inconsistent']} of {q['ok']}"),
    ]
    for b in sorted(p["by_rate"].values(), key=lambda b: b["rate_per_s"]):
        lat = b["latency_from_schedule"]
        rows.append(Figure(f"latency from the scheduled send at {b['rate_per_s']:g} req/s p50 / p95 / p99", lat["p99_ms"],
                           f"{lat['p50_ms']:.1f} / {lat['p95_ms']:.1f} / {lat['p99_ms']:.1f} ms "
                           f"({b['failed']} of {b['sent']} failed)"))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="20,50,100", help="request rates (req/s), one run of the phases each")
    parser.add_argument("--arrivals", choices=("poisson", "fixed"), default="poisson",
                        help="gaps between sends: exponential (seeded) or equal")
    parser.add_argument("--before", type=float, default=3.0)
    parser.add_argument("--during", type=float, default=8.0)
    parser.add_argument("--after", type=float, default=3.0)
    parser.add_argument("--swap-every", type=float, default=1.0)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--client-pool", type=int, default=64, help="keep-alive client connections sending the requests")
    parser.add_argument("--threads", type=int, default=1, help="ONNX Runtime intra-op threads of the shared session")
    parser.add_argument("--tiny", action="store_true", help="build the tiny world even if packaged releases exist")
    parser.add_argument("--tiny-engine", choices=("serving", "float"), default="serving",
                        help="the tiny world's engine: the default serving form (4-bit paged cache, stacked "
                             "adapters: params.yaml's engine and kv sections' defaults) or a float padded one")
    parser.add_argument("--out", type=Path, default=RESULTS / "hotswap_bench.json")
    args = parser.parse_args(argv)
    rates = [float(x) for x in args.rates.split(",")]
    world = None if args.tiny else existing_world()
    with tempfile.TemporaryDirectory(prefix="hotswap-") as tmp:
        if world is None:
            from tasks.config import EngineConfig, KVConfig
            from tasks.stages.compile import serving_form

            print("building a tiny world (base, engine, two signed releases)...", flush=True)
            form = serving_form(EngineConfig(), KVConfig(), TINY_HEAD_DIM) if args.tiny_engine == "serving" else None
            world = build_tiny_world(Path(tmp), form)
        result = run_load_test(world, rates, args.before, args.during, args.after, args.swap_every,
                               args.max_new_tokens, args.threads, args.arrivals, args.client_pool)
    print_results(result)
    write_report(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
