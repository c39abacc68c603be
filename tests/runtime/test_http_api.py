"""The device's HTTP API as clients see it: the official openai SDK, raw sockets, httpx, a Prometheus parse.

Every server is the real app under uvicorn on a free loopback port (``server_testkit.running_server``).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import threading
import time

import httpx
import openai
import pytest
from release_testkit import copy_release, resign, world
from server_testkit import ADMIN_TOKEN, PROMPT, call, complete, manifest_id, running_server, sample, scrape, summed

from runtime.serve.metrics import RETAINED_UNLOADED

OTHER_PROMPT = "inspect board=PCB-1201 line=L2 part=C7 temp_c=244 defect=lifted lift_um=40 verdict:"
LONG = 1024  # tokens: the tiny world's greedy answer never reaches eos, so a LONG request decodes LONG steps


@pytest.fixture(scope="module")
def w(tmp_path_factory):
    return world(tmp_path_factory)


@pytest.fixture(scope="module")
def served(w):
    """One server with release B active, shared by the tests that do not change its state."""
    with running_server(w, release_dirs=(w["root"],)) as (app, background):
        app.load(w["b"])
        yield app, background


def sdk(background) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{background.url}/v1", api_key="unused-by-the-device", max_retries=0, timeout=60)


def read_until_closed(sock: socket.socket, timeout: float = 5.0) -> bytes:
    """Everything the server sends until it closes the connection (a timeout fails the test)."""
    sock.settimeout(timeout)
    out = b""
    while chunk := sock.recv(65536):
        out += chunk
    sock.close()
    return out


def raw_exchange(port: int, data: bytes) -> tuple[bytes, float]:
    """Send ``data`` on a fresh socket; (everything read until the server closes, seconds it took)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    t0 = time.perf_counter()
    sock.sendall(data)
    return read_until_closed(sock), time.perf_counter() - t0


# ---------------------------------------------------------------- the OpenAI API through the SDK

def test_the_openai_sdk_lists_the_release_completes_and_streams(w, served):
    app, background = served
    client = sdk(background)
    release_id = manifest_id(w["b"])

    models = client.models.list().data
    assert [(m.id, m.owned_by, m.month) for m in models] == [(release_id, "adapter-release", "2026-11")]

    done = client.completions.create(model=release_id, prompt=PROMPT, max_tokens=6, temperature=0)
    assert done.model == release_id and done.choices[0].finish_reason == "length"
    assert done.usage.completion_tokens == 6 and done.usage.prompt_tokens == len(app.tokenizer.encode(PROMPT))
    assert done.choices[0].text == complete(background.port)["text"]  # the SDK reads what the device answers

    chunks = list(client.completions.create(model=release_id, prompt=PROMPT, max_tokens=6, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == done.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 6

    both = client.completions.create(model="2026-11", prompt=[PROMPT, OTHER_PROMPT], max_tokens=6, temperature=0)
    assert [c.index for c in both.choices] == [0, 1] and both.choices[0].text == done.choices[0].text
    assert both.choices[1].text == complete(background.port, OTHER_PROMPT)["text"]
    assert both.usage.completion_tokens == 12


def test_a_stream_is_server_sent_events_ending_in_done(served):
    app, background = served
    with httpx.stream("POST", f"{background.url}/v1/completions", timeout=60,
                      json={"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "stream": True}) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        events = [line for line in resp.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "length"


def test_sampling_repeats_with_a_seed_and_a_stop_sequence_cuts_the_text(served):
    app, background = served
    client = sdk(background)

    def text(**kw):
        out = client.completions.create(model=None, prompt=PROMPT, **({"max_tokens": 12} | kw)).choices[0]
        return out.text, out.finish_reason

    assert text(temperature=1.0, top_p=0.9, seed=7) == text(temperature=1.0, top_p=0.9, seed=7)
    assert len({text(temperature=1.5, seed=s)[0] for s in range(4)}) > 1  # seeds draw differently
    greedy, _ = text(temperature=0)
    stop = greedy[3:5]
    assert text(temperature=0, stop=stop) == (greedy[: greedy.find(stop)], "stop")
    streamed = client.completions.create(model=None, prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop, "\x00"],
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed) == greedy[: greedy.find(stop)]


def test_chat_needs_a_chat_template(w, served, tmp_path):
    app, background = served
    with pytest.raises(openai.BadRequestError) as err:
        sdk(background).chat.completions.create(model="2026-11", messages=[{"role": "user", "content": PROMPT}])
    assert err.value.status_code == 400 and err.value.code == "no_chat_template"

    # The same tokenizer.json (the release's tokenizer hash holds) with a template beside it.
    tokenizer = shutil.copytree(w["tokenizer"], tmp_path / "with-template")
    config = json.loads((tokenizer / "tokenizer_config.json").read_text())
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
    (tokenizer / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": template}))
    with running_server(w, tokenizer=tokenizer) as (chat_app, chat_background):
        chat_app.load(w["b"])
        client = sdk(chat_background)
        out = client.chat.completions.create(model="2026-11", messages=[{"role": "user", "content": "hi"}],
                                             max_tokens=5, temperature=0)
        rendered = complete(chat_background.port, "user: hi\nassistant:", max_tokens=5)
        streamed = list(client.chat.completions.create(model="2026-11", messages=[{"role": "user", "content": "hi"}],
                                                       max_tokens=5, temperature=0, stream=True))
    assert out.choices[0].message.role == "assistant" and out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == len(chat_app.tokenizer.encode_chat([{"role": "user", "content": "hi"}]))
    assert out.choices[0].message.content == rendered["text"]  # the embedded default adds no special tokens
    assert streamed[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == rendered["text"]


def test_every_error_is_an_openai_error_object(served):
    app, background = served
    port = background.port
    cases = [
        ("POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 257}, 400, "max_tokens_too_large"),
        ("POST", "/v1/completions", {"prompt": PROMPT, "logprobs": 3}, 400, "invalid_value"),
        ("POST", "/v1/completions", {"prompt": ""}, 400, "invalid_value"),
        ("POST", "/v1/completions", {"prompt": [PROMPT] * 17}, 400, "invalid_value"),
        ("POST", "/v1/completions", {"prompt": "0" * 4096, "max_tokens": 1}, 400, "context_length_exceeded"),
        ("POST", "/v1/completions", {"prompt": PROMPT, "model": "2025-01"}, 404, "model_not_found"),
        ("GET", "/v1/nothing", None, 404, None),
        ("GET", "/v1/completions", None, 405, None),
    ]
    for method, path, payload, status, code in cases:
        got, body = call(port, method, path, payload)
        assert (got, body["error"]["code"]) == (status, code), (path, payload, body)
        assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["message"]
    assert call(port, "POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 257})[1]["error"]["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError):  # the SDK raises its own error from our error object
        sdk(background).completions.create(model=None, prompt=PROMPT, max_tokens=257)


def test_out_of_range_or_mistyped_request_fields_get_400_naming_the_field(served):
    app, background = served
    port = background.port
    before = scrape(port)
    with pytest.raises(openai.BadRequestError) as err:  # numpy's default_rng(-1) raised at sampling: a 500
        sdk(background).completions.create(model=None, prompt=PROMPT, max_tokens=2, temperature=1.0, seed=-1)
    assert err.value.status_code == 400 and err.value.param == "seed" and "9223372036854775807" in err.value.message
    cases = [
        ("seed", 2**64), ("seed", True), ("seed", "7"), ("seed", 7.0),
        ("temperature", True), ("temperature", "0.5"), ("top_p", "1"),
        ("max_tokens", True), ("max_tokens", "16"), ("max_tokens", 16.5), ("n", True), ("stream", "yes"),
        ("stream", 1), ("stream_options", {"include_usage": "yes"}), ("stream_options", {"include_logprobs": True}),
        ("stop", ["x" * 100_000]), ("stop", ["a", "b", "c", "d", "e"]), ("user", 5),
    ]
    for field, value in cases:
        status, body = call(port, "POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, field: value})
        assert (status, body["error"]["param"].split(".")[0]) == (400, field), (field, value, body)
    chat = {"messages": [{"role": "user", "content": PROMPT}], "max_completion_tokens": "2", "seed": -5}
    status, body = call(port, "POST", "/v1/chat/completions", chat)
    assert status == 400 and body["error"]["param"] in ("max_completion_tokens", "seed"), body
    after = scrape(port)
    assert summed(after, "adapter_generation_errors_total") == summed(before, "adapter_generation_errors_total")
    assert summed(after, "adapter_requests_total", status="500") == summed(before, "adapter_requests_total", status="500")
    assert summed(after, "adapter_release_requests_total") == summed(before, "adapter_release_requests_total")
    seeded = {"prompt": PROMPT, "max_tokens": 4, "temperature": 1.0, "seed": 2**63 - 1}  # the range's ends are served
    assert call(port, "POST", "/v1/completions", seeded)[0] == 200
    assert call(port, "POST", "/v1/completions", seeded | {"seed": 0, "stop": ["x" * 256]})[0] == 200


def test_healthz_is_liveness_and_ready_waits_for_a_release(w):
    with running_server(w) as (app, background):
        assert call(background.port, "GET", "/healthz")[:1] == (200,)
        assert call(background.port, "GET", "/healthz")[1]["status"] == "no_release"
        status, body = call(background.port, "GET", "/ready")
        assert status == 503 and body["error"]["code"] == "no_active_release"
        assert call(background.port, "GET", "/v1/models")[1]["data"] == []
        app.load(w["a"])
        assert call(background.port, "GET", "/ready")[0] == 200


def test_a_request_id_is_echoed_or_made(served):
    app, background = served
    given = httpx.get(f"{background.url}/healthz", headers={"X-Request-Id": "trace-42"})
    made = httpx.get(f"{background.url}/healthz")
    assert given.headers["x-request-id"] == "trace-42"
    assert len(made.headers["x-request-id"]) == 32 and made.headers["x-request-id"] != "trace-42"


def test_keep_alive_requests_do_not_wait_for_a_delayed_ack(served):
    """Responses go out with TCP_NODELAY: without it each keep-alive answer waits ~40 ms for the client's ACK."""
    app, background = served
    with httpx.Client(base_url=background.url) as client:
        client.get("/healthz")
        seconds = []
        for _ in range(9):
            t0 = time.perf_counter()
            assert client.get("/healthz").status_code == 200
            seconds.append(time.perf_counter() - t0)
    assert sorted(seconds)[4] < 0.02, seconds


# ---------------------------------------------------------------- HTTP hardening

def test_malformed_http_gets_400_within_a_second(served):
    app, background = served
    for request in (b"POST /v1/completions HTTP/1.1\r\nHost: device\r\nContent-Length: -1\r\n\r\n",
                    b"POST /v1/completions HTTP/1.1\r\nHost: device\r\nContent-Length: 12abc\r\n\r\n",
                    b"NOT HTTP AT ALL\r\n\r\n"):
        out, seconds = raw_exchange(background.port, request)
        head, _, body = out.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 400") and seconds < 1.0, (request, out, seconds)
        assert json.loads(body)["error"]["code"] == "malformed_http"


def test_a_body_over_the_limit_gets_413(w):
    with running_server(w, max_body_bytes=1000) as (app, background):
        declared, seconds = raw_exchange(background.port, b"POST /v1/completions HTTP/1.1\r\nHost: d\r\n"
                                         b"Content-Type: application/json\r\nContent-Length: 5000\r\n\r\n")
        chunked = httpx.post(f"{background.url}/v1/completions", content=iter([b'{"prompt": "', b"x" * 2000, b'"}']))
    assert declared.startswith(b"HTTP/1.1 413") and seconds < 1.0  # refused before the body is sent
    assert chunked.status_code == 413 and chunked.json()["error"]["code"] == "body_too_large"


def test_half_open_connections_do_not_hold_the_server_and_are_dropped(w):
    with running_server(w, header_timeout_s=1.0, body_timeout_s=1.0) as (app, background):
        app.load(w["b"])
        half_headers = [socket.create_connection(("127.0.0.1", background.port)) for _ in range(64)]
        for sock in half_headers:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: device\r\nContent-Le")
        half_body = socket.create_connection(("127.0.0.1", background.port))
        half_body.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: d\r\nContent-Length: 100\r\n\r\n{\"prompt\"")
        t0 = time.perf_counter()
        answered = httpx.post(f"{background.url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 4}, timeout=5)
        served_in = time.perf_counter() - t0
        endings = [read_until_closed(sock) for sock in half_headers]  # the server closes them: EOF
        body_ending = read_until_closed(half_body)
        dropped_in = time.perf_counter() - t0
    assert answered.status_code == 200 and served_in < 1.0, served_in
    assert all(e.startswith(b"HTTP/1.1 408") for e in endings) and dropped_in < 3.0, dropped_in
    assert body_ending.startswith(b"HTTP/1.1 408") and b"body_timeout" in body_ending


def test_beyond_the_queue_clients_get_503_with_retry_after(w):
    with running_server(w, max_concurrent=1, max_queue=1, max_tokens=LONG) as (app, background):
        app.load(w["b"])
        results = []

        def client():
            resp = httpx.post(f"{background.url}/v1/completions", timeout=60,
                              json={"prompt": PROMPT, "max_tokens": LONG, "temperature": 0})
            results.append((resp.status_code, resp.headers.get("retry-after"), resp.json()))

        threads = [threading.Thread(target=client) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        after = scrape(background.port)
    statuses = sorted(s for s, _, _ in results)
    assert statuses.count(200) >= 2 and 503 in statuses, statuses
    assert all(r == "1" and b["error"]["code"] == "overloaded" for s, r, b in results if s == 503)
    assert all(b["usage"]["completion_tokens"] == LONG for s, _, b in results if s == 200)
    assert sample(after, "adapter_generations_in_flight") == 0 and sample(after, "adapter_generation_queue_depth") == 0


# ---------------------------------------------------------------- the admin API

def test_the_admin_api_needs_the_token_a_release_dir_and_never_rolls_back(w, tmp_path):
    with running_server(w, admin_token=None) as (app, background):
        status, body = call(background.port, "POST", "/v1/adapters", {"path": str(w["b"])})
        assert (status, body["error"]["code"]) == (404, "admin_api_off") and app.active is None

    outside = shutil.copytree(w["b"], tmp_path / "outside" / "release")
    inside = tmp_path / "releases"
    inside.mkdir()
    os.symlink(outside, inside / "link-to-outside")
    with running_server(w, release_dirs=(w["root"], inside)) as (app, background):
        port = background.port
        assert call(port, "POST", "/v1/adapters", {"path": str(w["b"])}, token=None)[0] == 401
        status, body = call(port, "POST", "/v1/adapters", {"path": str(w["b"])}, token=ADMIN_TOKEN + "x")
        assert (status, body["error"]["type"]) == (401, "authentication_error") and app.active is None
        for path in (outside, inside / "link-to-outside", inside / ".." / "outside" / "release"):
            status, body = call(port, "POST", "/v1/adapters", {"path": str(path)})
            assert (status, body["error"]["code"]) == (403, "path_not_allowed"), path
        assert app.active is None

        assert call(port, "POST", "/v1/adapters", {"path": str(w["b"])})[0] == 200
        before = complete(port)
        status, body = call(port, "POST", "/v1/adapters", {"path": str(w["a"]), "allow_rollback": True})
        assert (status, body["error"]["code"]) == (403, "rollback_is_local")
        status, body = call(port, "POST", "/v1/adapters", {"path": str(w["a"])})
        assert (status, body["reason"]) == (409, "rollback")
        assert complete(port) == before and app.active.release_id == manifest_id(w["b"])


# ---------------------------------------------------------------- metrics

def test_metrics_parse_as_prometheus_and_follow_the_active_release(w):
    with running_server(w, release_dirs=(w["root"],)) as (app, background):
        app.load(w["a"])
        complete(background.port, max_tokens=5)
        list(sdk(background).completions.create(model=None, prompt=PROMPT, max_tokens=3, temperature=0, stream=True))
        first = scrape(background.port)
        assert call(background.port, "POST", "/v1/adapters", {"path": str(w["b"])})[0] == 200
        second = scrape(background.port)
    a, b = manifest_id(w["a"]), manifest_id(w["b"])
    assert sample(first, "adapter_generated_tokens_total") == 8
    assert sample(first, "adapter_time_to_first_token_seconds_count") == 2
    assert sample(first, "adapter_request_duration_seconds_count", endpoint="/v1/completions") == 2
    assert sample(first, "adapter_requests_total", endpoint="/v1/completions", status="200") == 2
    assert sample(first, "adapter_release_requests_total", release_id=a, channel="champion", product="default") == 2
    assert sample(first, "adapter_release_info", release_id=a, month="2026-10", channel="champion", product="default") == 1
    assert 0 < sample(first, "adapter_release_expires_in_seconds", release_id=a, channel="champion",
                      product="default") <= 121 * 86400
    assert sample(first, "adapter_generations_in_flight") == 0 and sample(first, "adapter_generation_queue_depth") == 0
    info = {(dict(labels)["release_id"], dict(labels)["channel"]) for (name, labels) in second
            if name == "adapter_release_info"}
    assert info == {(b, "champion"), (a, "standby")} and sample(second, "adapter_swaps_total") == 2
    assert sample(second, "adapter_swap_duration_seconds_count") == 2


def test_per_release_series_stay_bounded_however_many_releases_come_and_go(w, tmp_path):
    stamp, resident = manifest_id(w["b"]).partition("+")[2], 2
    months = [f"2027-{m:02d}" for m in range(1, 13)] + ["2028-01", "2028-02"]
    assert len(months) > resident + RETAINED_UNLOADED
    per_release = ("adapter_release_requests_total", "adapter_generation_errors_total")
    with running_server(w, release_dirs=(tmp_path,), max_resident=resident) as (app, background):
        port, counted = background.port, []
        for month in months:
            release = copy_release(w["b"], tmp_path / month)
            resign(release, w["key"], month=month, release_id=f"{month}+{stamp}")
            assert call(port, "POST", "/v1/adapters", {"path": str(release)})[0] == 200
            complete(port)
            samples = scrape(port)
            counted.append({dict(labels)["release_id"] for (name, labels) in samples if name in per_release})
        first, last = f"{months[0]}+{stamp}", f"{months[-1]}+{stamp}"
        assert first in counted[resident]  # unloaded (lru) by the load before this scrape: its count still reads
        assert call(port, "POST", "/v1/adapters/unload", {"model": months[-2]})[0] == 200
        after_unload = scrape(port)
    assert [len(ids) for ids in counted] == [min(n, resident + RETAINED_UNLOADED) for n in range(1, len(months) + 1)]
    assert first not in counted[-1] and sample(samples, "adapter_release_requests_total", release_id=last,
                                               channel="champion", product="default") == 1
    assert sample(after_unload, "adapter_release_requests_total", release_id=f"{months[-2]}+{stamp}",
                  channel="champion", product="default") == 1  # an admin unload keeps it among the retained too


def test_a_client_that_leaves_a_stream_stops_its_decode_and_frees_its_slot(w):
    with running_server(w, max_tokens=LONG) as (app, background):
        app.load(w["b"])
        with httpx.stream("POST", f"{background.url}/v1/completions", timeout=60,
                          json={"prompt": PROMPT, "max_tokens": LONG, "temperature": 0, "stream": True}) as resp:
            next(resp.iter_lines())  # the first token is out: the decode runs; then the client hangs up
        deadline = time.monotonic() + 10
        while sample(samples := scrape(background.port), "adapter_generations_in_flight") != 0:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(0.2)
        tokens = sample(scrape(background.port), "adapter_generated_tokens_total")
    assert sample(samples, "adapter_generation_queue_depth") == 0
    assert 1 <= tokens < LONG  # it stopped early, and stays stopped
