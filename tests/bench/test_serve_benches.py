"""The serving benchmarks on the tiny world, with tiny parameters: the open-loop hot-swap load test,
SIGTERM under load, slow connections, and the throughput bench (ours; llama-server where built).
The world takes about 12 s to build, once for the module; each run below takes a few seconds."""

import random
import time

import pytest
from release_testkit import world

from bench.lib.llama_cpp_peer import llama_server_binary
from bench.lib.serve_client import Answer, Client
from bench.serving import serve_bench
from bench.serving.hotswap_bench import arrival_times, run_load_test
from bench.serving.serve_faults_bench import classify, sigterm_run, slow_run
from bench.serving.serve_faults_bench import figures as faults_figures


@pytest.fixture(scope="module")
def w(tmp_path_factory):
    w = world(tmp_path_factory)
    return w | {"release": w["b"], "adapter": w["adapters"][1]}


def test_arrivals_are_at_the_rate_whatever_the_answers():
    fixed = arrival_times(20.0, 2.0, "fixed", random.Random(0))
    assert len(fixed) == 39 and fixed[0] == pytest.approx(0.05) and fixed[-1] < 2.0  # 0.05 .. 1.95
    assert all(b - a == pytest.approx(0.05) for a, b in zip(fixed, fixed[1:]))
    poisson = arrival_times(50.0, 400.0, "poisson", random.Random(1))
    assert len(poisson) == pytest.approx(20000, rel=0.03)
    gaps = sorted(b - a for a, b in zip(poisson, poisson[1:]))
    assert gaps[len(gaps) // 2] == pytest.approx(0.02 * 0.693, rel=0.05)  # the exponential's median: ln 2 / rate


def test_open_loop_hot_swap_answers_every_request_on_its_release(w):
    r = run_load_test(w, [25.0], before=0.5, during=1.5, after=0.5, swap_every=0.5, max_new_tokens=4, threads=1,
                      arrivals="fixed", workers=8)
    rate = r["by_rate"]["25.0"]
    assert rate["sent"] == len(arrival_times(25.0, 2.5, "fixed", random.Random(0))) == 62
    assert (rate["ok"], rate["failed"], r["requests"]["failed"]) == (62, 0, 0)
    assert r["swaps"]["accepted"] >= 2 and r["requests"]["release_inconsistent"] == 0
    assert r["acceptance"]["every_response_on_its_release"] and r["distinct_answers"] > 1
    lat, service = rate["latency_from_schedule"], rate["service_time"]
    assert 0 < service["p50_ms"] <= lat["p50_ms"] and lat["p50_ms"] <= lat["p95_ms"] <= lat["p99_ms"] <= lat["max_ms"]


def test_a_connection_the_server_closed_while_idle_is_opened_again_not_counted_failed(w):
    """The device closes a keep-alive connection idle for ``keep_alive_s``; the client's next request on it is
    sent again on a fresh one (a request at 50 req/s over 64 connections found one closed: BrokenPipeError)."""
    from runtime.engine.backends.onnxruntime import OrtEngine
    from runtime.engine.tokenizer import DeviceTokenizer
    from runtime.release.verify import load_trusted_keys
    from runtime.serve.http_app import ServeSettings
    from runtime.serve.http_server import BackgroundServer
    from runtime.serve.server import AdapterServer

    app = AdapterServer(OrtEngine(w["engine"], threads=1), DeviceTokenizer(w["tokenizer"]),
                        load_trusted_keys([w["trusted_key"]]))
    with BackgroundServer(app, ServeSettings(keep_alive_s=1)) as background:
        app.load(w["release"])
        client = Client(background.port)
        first = client.complete({"prompt": "cam 3", "max_tokens": 2, "temperature": 0})
        idle = client.conn
        time.sleep(2.5)  # past the keep-alive timeout: the server has closed its end
        second = client.complete({"prompt": "cam 3", "max_tokens": 2, "temperature": 0})
        client.close()
    assert (first.status, first.error, second.status, second.error) == (200, None, 200, None)
    assert second.text == first.text and client.conn is None and idle is not None


def answer(**kw) -> Answer:
    return Answer("id-1", 0.0, **kw)


def test_a_request_is_refused_not_lost_only_if_the_server_never_took_it():
    logged = {"seen"}
    assert classify(answer(status=200, responded=True, complete=True), logged) == "complete"
    assert classify(answer(status=503, responded=True), logged) == "refused_503"
    assert classify(answer(error="ConnectionRefusedError: [Errno 111] Connection refused"), logged) == "refused_connection"
    assert classify(answer(error="ConnectionResetError: [Errno 104]"), logged) == "refused_unread"
    seen = Answer("seen", 0.0, error="ConnectionResetError: [Errno 104]")  # the server's log has it: it took it
    assert classify(seen, logged) == "lost"
    assert classify(answer(status=200, responded=True, error="the stream ended without data: [DONE]"), logged) == "lost"


def test_sigterm_under_8_clients_loses_no_request_and_exits_0(w, tmp_path):
    r = sigterm_run(w, clients=8, before=1.5, max_tokens=16, work=tmp_path)
    assert r["lost"] == 0, r["lost_examples"]
    assert r["exit_code"] == 0
    assert r["in_flight_at_sigterm"] > 0 and r["in_flight_completed"] == r["in_flight_at_sigterm"]
    assert r["complete"] > r["in_flight_at_sigterm"] and r["refused_connection"] == 8  # each client ends refused
    assert r["sent"] == r["complete"] + r["refused"] + r["lost"]
    assert r["server_log_requests"] >= r["complete"]
    assert faults_figures({"sigterm": r})[0].name == "SIGTERM under 8 clients: requests lost"


def test_clients_are_served_while_64_slow_connections_stay_open(w, tmp_path):
    r = slow_run(w, clients=8, slow=64, seconds=1.0, rounds=1, max_tokens=4, work=tmp_path)
    assert r["with"]["ok"] > 8 and r["with"]["errors"] == 0 and r["without"]["errors"] == 0
    assert r["slow_held_open_at_end"] == [64] and r["exit_code"] == 0


def run_serve_bench(w, tmp_path, names):
    gguf = binary = None
    if "llama" in names:
        binary = llama_server_binary(None)
        gguf = serve_bench.convert_for_llama(w, tmp_path, None)
    # max_tokens 24: a server may join the tokens that queued up while a client read into one event, and
    # 8 tokens of the tiny engine could all come as one (no inter-token gap to measure)
    result = serve_bench.measure(w, names, [1, 2], rounds=1, requests=2, max_tokens=24, threads=1, gguf=gguf,
                                 binary=binary, logs=tmp_path)
    for n in ("1", "2"):
        for name in names:
            r = result["by_clients"][n][name]
            assert (r["errors"], r["complete"], r["exit_code"]) == (0, 2 * int(n), 0), (n, name, r)
            assert r["tokens"] > 0 and r["tokens_per_s"] > 0 and r["ttft"]["p50_ms"] > 0 and r["itl"]["n"] > 0
            assert r["server_cpu_us_per_token"] >= 0  # the server process's CPU (in clock ticks: 0 for a short round)
    assert result["engine_batch1"]["tokens_per_s"] > 0
    return result


def test_serve_bench_measures_fork_and_batched_decode(w, tmp_path):
    result = run_serve_bench(w, tmp_path, ["fork", "batched"])
    by = result["by_clients"]["2"]
    assert by["fork"]["texts"] == by["batched"]["texts"]  # greedy: the same answers either way
    assert serve_bench.judge(result)["batch1_sequential_tokens_per_s"] > 0
    stated = serve_bench.figures(result | {"acceptance": serve_bench.judge(result)})
    assert [f.name for f in stated[1:]] == [f"{n} clients, {name}: generated tokens/s (time to first token p50 / p99)"
                                            for n in ("1", "2") for name in ("fork", "batched")]


@pytest.fixture
def llama_server():
    """Skips (before the world is built) where llama-server or the converters' sdist is absent."""
    from bench.lib.llama_cpp_peer import converter_dir

    try:
        llama_server_binary(None)
        converter_dir()
    except SystemExit as err:
        pytest.skip(f"llama-server or the peer sdist is absent (`make bench-peer-server`; never in CI): {err}")


def test_serve_bench_against_llama_server(llama_server, w, tmp_path):
    result = run_serve_bench(w, tmp_path, ["batched", "llama"])
    by = result["by_clients"]["2"]
    assert by["llama"]["mean_prompt_tokens"] == by["batched"]["mean_prompt_tokens"]  # the same tokens in
