"""The device server under faults: SIGTERM with 8 clients in flight, and 64 slow (half-open) connections.

    python -m bench.serving.serve_faults_bench [--runs sigterm,slow] [--clients 8] [--max-tokens 64] [--tiny]
        [--out bench/results/serve_faults_bench.json]

The server is ``python -m runtime serve`` in a subprocess (its default limits),
on the last release of ``make release``, else the tiny world of ``bench.lib.worlds``.

**sigterm**: ``--clients`` clients (half streaming, half not) send greedy ``/v1/completions`` (the
row starts of ``bench.lib.worlds``) one after another on keep-alive connections; after ``--before``
s the server gets SIGTERM, and the clients go on sending until the server refuses them. Every
request carries an ``X-Request-Id``, which the server's JSON log lines name. Each request sent is
exactly one of:

* *complete*: 200 and the whole answer (every choice finished; streamed, ``data: [DONE]``);
* *refused*: never accepted for generation, so the client knows to retry elsewhere: either a 503
  answer (an explicit refusal: nothing was generated), or no byte of an answer at all **and** no
  log line of the server for its request id (the app never saw it: the connection was refused
  after the listener closed, or a kept-alive connection was closed before the server read it);
* *lost*: anything else: an error or a cut answer after the server took the request, or no
  answer for a request the server's log shows it received. Must be 0.

Reported: requests sent / complete / refused (by kind) / lost, requests in flight at the SIGTERM,
the exit code (must be 0) and the drain time (SIGTERM to exit; and to the last answer).

**slow**: ``--slow 64`` slow connections held open while ``--clients`` clients are served: half
send a request line and part of the headers and stop, half send whole headers and trickle the body
a byte every 0.5 s. The server closes them at its header / body deadline (408, 10 s by default);
each one closed is opened again, so ``--slow`` stay open throughout. The clients (not streamed,
``--slow-max-tokens``) run ``--seconds`` s without and with the slow connections, ``--rounds``
times, the order swapped every round; reported: their latency p50/p99/max, requests and errors, with
and without. Writes ``bench/results/serve_faults_bench.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.lib.report import RESULTS, Figure, write_report
from bench.lib.serve_client import Answer, Client, summary_ms
from bench.lib.servers import ServerProcess
from bench.lib.tables import table
from bench.lib.worlds import ROW_STARTS, serving_world


def serve_command(world: dict, *flags: str) -> list[str]:
    return [sys.executable, "-m", "runtime", "serve", "--engine", str(world["engine"]), "--tokenizer",
            str(world["tokenizer"]), "--package", str(world["release"]), "--trusted-key", str(world["trusted_key"]),
            "--port", "0", *flags]


def logged_request_ids(log: Path) -> set[str]:
    """Request ids of the server's ``request`` log lines (one per request the app handled)."""
    ids = set()
    for line in log.read_text().splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue
        if entry.get("message") == "request":
            ids.add(entry["request_id"])
    return ids


def classify(answer: Answer, logged: set[str]) -> str:
    if answer.complete:
        return "complete"
    if answer.status == 503:
        return "refused_503"
    if not answer.responded and answer.request_id not in logged:
        return "refused_connection" if "ConnectionRefused" in (answer.error or "") else "refused_unread"
    return "lost"


# ---------------------------------------------------------------- SIGTERM under load

def sigterm_run(world: dict, clients: int, before: float, max_tokens: int, work: Path) -> dict:
    log = work / "serve-sigterm.log"
    server = ServerProcess("serve", serve_command(world), log)
    stop_sending = threading.Event()
    answers: list[Answer] = []
    lock = threading.Lock()
    sigterm_at = [float("inf")]

    def client(i: int) -> None:
        conn, stream = Client(server.port, timeout=120), i % 2 == 0
        j = 0
        while not stop_sending.is_set():
            a = conn.complete({"prompt": ROW_STARTS[(i + j) % len(ROW_STARTS)], "max_tokens": max_tokens, "temperature": 0},
                              stream=stream)
            j += 1
            with lock:
                answers.append(a)
            if a.sent > sigterm_at[0] and a.error and "ConnectionRefused" in a.error:
                return  # the listener is closed: this client is done
        conn.close()

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    time.sleep(before)
    sigterm_at[0] = time.perf_counter()
    server.proc.send_signal(signal.SIGTERM)
    exit_code = server.proc.wait(timeout=120)
    exited = time.perf_counter()
    time.sleep(0.5)  # clients see the listener gone
    stop_sending.set()
    for t in threads:
        t.join(timeout=120)
    logged = logged_request_ids(log)
    kinds = {a.request_id: classify(a, logged) for a in answers}
    counts = {k: sum(v == k for v in kinds.values()) for k in
              ("complete", "refused_503", "refused_connection", "refused_unread", "lost")}
    in_flight = [a for a in answers if a.sent < sigterm_at[0] < a.done]
    answered_after = [a.done for a in answers if a.complete and a.done > sigterm_at[0]]
    return {
        "clients": clients, "streaming_clients": (clients + 1) // 2, "max_tokens": max_tokens, "before_s": before,
        "sent": len(answers), **counts, "refused": counts["refused_503"] + counts["refused_connection"] + counts["refused_unread"],
        "in_flight_at_sigterm": len(in_flight), "in_flight_completed": sum(a.complete for a in in_flight),
        "exit_code": exit_code, "drain_s": round(exited - sigterm_at[0], 3),
        "last_answer_after_sigterm_s": round(max(answered_after) - sigterm_at[0], 3) if answered_after else None,
        "server_log_requests": len(logged),
        "lost_examples": [{"request_id": a.request_id, "status": a.status, "error": a.error}
                          for a in answers if kinds[a.request_id] == "lost"][:5],
        "refused_unread_errors": sorted({a.error for a in answers if kinds[a.request_id] == "refused_unread"}),
        "acceptance": {"zero_lost": counts["lost"] == 0, "exit_0": exit_code == 0,
                       "in_flight_all_completed": all(a.complete for a in in_flight) and bool(in_flight)},
    }


# ---------------------------------------------------------------- slow clients

class SlowConnections(threading.Thread):
    """``count`` half-open connections kept open: half stop inside the headers, half trickle a body."""

    HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"

    def __init__(self, port: int, count: int, tick: float = 0.5):
        super().__init__(daemon=True)
        self.port, self.count, self.tick = port, count, tick
        self.stop, self.opened, self.socks = threading.Event(), threading.Event(), {}
        self.closed_by_server, self.answers = 0, {}

    def open(self, i: int) -> None:
        s = socket.create_connection(("127.0.0.1", self.port), timeout=5)
        s.setblocking(False)
        s.sendall(self.HEAD if i % 2 == 0 else self.HEAD + b"Content-Length: 100000\r\n\r\n{\"prompt\": \"")
        self.socks[i] = s

    def run(self) -> None:
        for i in range(self.count):
            self.open(i)
        self.opened.set()
        while not self.stop.wait(self.tick):
            for i, s in list(self.socks.items()):
                try:
                    if i % 2:
                        s.send(b"a")
                    if select.select([s], [], [], 0)[0]:
                        data = s.recv(4096)
                        if data:
                            status = data.split(b" ", 2)[1].decode() if data.startswith(b"HTTP/") else "?"
                            self.answers[status] = self.answers.get(status, 0) + 1
                        raise ConnectionResetError("closed by the server")
                except OSError:
                    s.close()
                    self.closed_by_server += 1
                    self.open(i)

    def close(self) -> int:
        self.stop.set()
        self.join()
        still = len(self.socks)
        for s in self.socks.values():
            s.close()
        return still


def closed_loop(port: int, clients: int, seconds: float, max_tokens: int) -> list[Answer]:
    answers: list[Answer] = []
    lock = threading.Lock()
    end = time.perf_counter() + seconds

    def client(i: int) -> None:
        conn, j = Client(port, timeout=60), 0
        while time.perf_counter() < end:
            a = conn.complete({"prompt": ROW_STARTS[(i + j) % len(ROW_STARTS)], "max_tokens": max_tokens, "temperature": 0})
            j += 1
            with lock:
                answers.append(a)
        conn.close()

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return answers


def slow_run(world: dict, clients: int, slow: int, seconds: float, rounds: int, max_tokens: int, work: Path) -> dict:
    server = ServerProcess("serve", serve_command(world), work / "serve-slow.log")
    runs = {"without": [], "with": []}
    held, closed, statuses = [], 0, {}
    try:
        closed_loop(server.port, clients, 1.0, max_tokens)  # warm-up, untimed
        for r in range(rounds):
            for phase in ("without", "with") if r % 2 == 0 else ("with", "without"):  # neither always first
                if phase == "without":
                    runs["without"] += closed_loop(server.port, clients, seconds, max_tokens)
                    continue
                conns = SlowConnections(server.port, slow)
                conns.start()
                if not conns.opened.wait(60):
                    raise RuntimeError(f"could not open {slow} slow connections")
                runs["with"] += closed_loop(server.port, clients, seconds, max_tokens)
                closed += conns.closed_by_server
                for k, v in conns.answers.items():
                    statuses[k] = statuses.get(k, 0) + v
                held.append(conns.close())
    finally:
        exit_code = server.stop()

    def side(answers: list[Answer]) -> dict:
        ok = [a for a in answers if a.complete]
        return {"requests": len(answers), "ok": len(ok), "errors": len(answers) - len(ok),
                "error_examples": [a.error or f"status {a.status}" for a in answers if not a.complete][:3],
                "latency": summary_ms([a.latency for a in ok])}

    out = {name: side(a) for name, a in runs.items()}
    return {"clients": clients, "slow_connections": slow, "seconds_per_run": seconds, "rounds": rounds,
            "max_tokens": max_tokens, **out, "slow_held_open_at_end": held, "slow_closed_by_server": closed,
            "slow_answers_by_status": statuses, "exit_code": exit_code,
            "acceptance": {"zero_errors_with_slow": out["with"]["errors"] == 0,
                           "max_latency_with_slow_le_1s": (out["with"]["latency"]["max_ms"] or 1e9) <= 1000.0,
                           "slow_held_open": all(h == slow for h in held)}}


def print_results(result: dict) -> None:
    print(f"\nmodel: {result['source']}")
    if "sigterm" in result:
        r = result["sigterm"]
        print(f"SIGTERM with {r['clients']} clients ({r['streaming_clients']} streaming), max_tokens {r['max_tokens']}:")
        print(f"  sent {r['sent']}, complete {r['complete']}, refused {r['refused']} (503: {r['refused_503']}, "
              f"connection refused: {r['refused_connection']}, closed unread: {r['refused_unread']}), lost {r['lost']}")
        print(f"  in flight at SIGTERM {r['in_flight_at_sigterm']} (completed {r['in_flight_completed']}), exit code "
              f"{r['exit_code']}, drain {r['drain_s']:.2f} s (last answer {r['last_answer_after_sigterm_s']} s after)")
        print("  acceptance: " + ", ".join(f"{k}={v}" for k, v in r["acceptance"].items()))
    if "slow" in result:
        r = result["slow"]
        print(f"{r['clients']} clients, with and without {r['slow_connections']} slow connections "
              f"({r['rounds']} x {r['seconds_per_run']} s each; max_tokens {r['max_tokens']}):")
        print(table(["slow connections", "requests", "errors", "p50 ms", "p99 ms", "max ms"],
                    ([name, r[name]["requests"], r[name]["errors"],
                      *(f"{r[name]['latency'][k] or 0:.1f}" for k in ("p50_ms", "p99_ms", "max_ms"))]
                     for name in ("without", "with"))))
        print(f"  slow connections held open at the end of each run {r['slow_held_open_at_end']}, closed by the server "
              f"{r['slow_closed_by_server']} ({r['slow_answers_by_status']}), exit code {r['exit_code']}")
        print("  acceptance: " + ", ".join(f"{k}={v}" for k, v in r["acceptance"].items()))


def figures(p: dict) -> list[Figure]:
    """SIGTERM: requests lost, exit code and drain time; slow connections: the clients' latency without and with."""
    rows = []
    if "sigterm" in p:
        r = p["sigterm"]
        rows.append(Figure(f"SIGTERM under {r['clients']} clients: requests lost", r["lost"],
                           f"{r['lost']} of {r['sent']} (complete {r['complete']}, refused {r['refused']})"))
        rows.append(Figure("SIGTERM: drain time to exit", r["drain_s"], f"{r['drain_s']:.2f} s, exit code {r['exit_code']}"))
    if "slow" in p:
        r = p["slow"]
        for side in ("without", "with"):
            lat = r[side]["latency"]
            rows.append(Figure(f"{r['clients']} clients {side} {r['slow_connections']} slow connections: latency p99 / max",
                               lat["p99_ms"], f"{lat['p99_ms'] or 0:.1f} / {lat['max_ms'] or 0:.1f} ms "
                                              f"({r[side]['errors']} errors of {r[side]['requests']})"))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", default="sigterm,slow")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64, help="max_tokens of the SIGTERM run's requests")
    ap.add_argument("--before", type=float, default=3.0, help="seconds of load before the SIGTERM")
    ap.add_argument("--slow", type=int, default=64, help="slow connections of the slow run")
    ap.add_argument("--seconds", type=float, default=5.0, help="seconds of each slow-run phase")
    ap.add_argument("--rounds", type=int, default=4, help="slow run: rounds of without + with (order swapped each round)")
    ap.add_argument("--slow-max-tokens", type=int, default=16)
    ap.add_argument("--tiny", action="store_true", help="the tiny world even if `make release` artifacts exist")
    ap.add_argument("--out", type=Path, default=RESULTS / "serve_faults_bench.json")
    args = ap.parse_args(argv)
    runs = args.runs.split(",")
    if set(runs) - {"sigterm", "slow"}:
        ap.error(f"--runs: sigterm and/or slow, not {runs}")
    with tempfile.TemporaryDirectory(prefix="serve-faults-") as tmp:
        work = Path(tmp)
        world = serving_world(work / "world", args.tiny)
        result = {"source": world["source"], "loadavg_1m_before": os.getloadavg()[0]}
        if "sigterm" in runs:
            result["sigterm"] = sigterm_run(world, args.clients, args.before, args.max_tokens, work)
        if "slow" in runs:
            result["slow"] = slow_run(world, args.clients, args.slow, args.seconds, args.rounds, args.slow_max_tokens, work)
    print_results(result)
    write_report(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
