"""The device server: generation, atomic hot swap under concurrent requests, refusals that keep the old adapter.

The server is the real app under uvicorn (``server_testkit.running_server``); releases are swapped in
through the admin API, except the rollbacks of the hot-swap test, which are a local act by design
(the network never gets ``allow_rollback``), so that test rolls back with ``AdapterServer.load``."""

from __future__ import annotations

import datetime as dt
import http.client
import io
import json
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

import pytest
from release_testkit import copy_release, resign, world
from server_testkit import (
    PROMPT,
    as_generation,
    call,
    complete,
    manifest_id,
    refusals,
    running_server,
    sample,
    scrape,
    summed,
)

from runtime.release.contract import parse_time
from runtime.release.signing import generate_key
from runtime.serve.server import Watcher

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def w(tmp_path_factory):
    return world(tmp_path_factory)


@pytest.fixture()
def server(w, tmp_path):
    with running_server(w, release_dirs=(w["root"], tmp_path)) as (app, background):
        yield app, background.port


def completion_metrics(port: int) -> dict:
    """The numbers the old JSON /metrics gave, from the Prometheus scrape."""
    samples = scrape(port)
    return {"requests": summed(samples, "adapter_requests_total", endpoint="/v1/completions"),
            "failures": summed(samples, "adapter_requests_total", endpoint="/v1/completions")
            - summed(samples, "adapter_requests_total", endpoint="/v1/completions", status="200"),
            "swaps": sample(samples, "adapter_swaps_total"), "refusals": refusals(samples),
            "swap_count": sample(samples, "adapter_swap_duration_seconds_count"),
            "swap_seconds": sample(samples, "adapter_swap_duration_seconds_sum")}


def test_generate_health_and_metrics(w, server):
    app, port = server
    assert call(port, "POST", "/v1/completions", {"prompt": PROMPT})[0] == 503  # nothing loaded yet
    status, swap = call(port, "POST", "/v1/adapters", {"path": str(w["b"])})
    assert status == 200 and swap["release_id"] == manifest_id(w["b"]) and swap["activation"] == 1
    out = complete(port)
    assert out["release_id"] == manifest_id(w["b"]) and out["tokens"] == 6 and isinstance(out["text"], str)
    health = call(port, "GET", "/healthz")[1]
    assert health["release_id"] == manifest_id(w["b"]) and health["weights"] == "fp32"
    assert call(port, "POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 0})[0] == 400
    metrics = completion_metrics(port)
    assert metrics["requests"] == 3 and metrics["failures"] == 2 and metrics["swaps"] == 1
    assert metrics["swap_count"] == 1 and metrics["swap_seconds"] > 0


def _flipped(w, tmp):
    release = copy_release(w["a"], tmp / "flipped")
    data = bytearray((release / "adapter_model.safetensors").read_bytes())
    data[-10] ^= 0xFF
    (release / "adapter_model.safetensors").write_bytes(bytes(data))
    return release


def _other_key(w, tmp):
    release = copy_release(w["b"], tmp / "other-key")
    generate_key(tmp / "other.key")
    resign(release, tmp / "other.key")
    return release


def _other_backbone(w, tmp):
    release = copy_release(w["b"], tmp / "other-backbone")
    resign(release, w["key"], base_model_hash="0" * 64)
    return release


def _other_interface(w, tmp):
    release = copy_release(w["b"], tmp / "other-interface")
    manifest = json.loads((release / "manifest.json").read_text())
    resign(release, w["key"], engine=manifest["engine"] | {"interface_hash": "1" * 64})
    return release


def _traversal_tarball(w, tmp):
    tar_path = tmp / "evil.tar.gz"
    with tarfile.open(tar_path, "w:gz") as tar:
        for p in sorted(w["b"].iterdir()):
            tar.add(p, arcname=p.name)
        info = tarfile.TarInfo("../../escaped.json")
        info.size = 2
        tar.addfile(info, io.BytesIO(b"{}"))
    return tar_path


def _older(w, tmp):
    return w["a"]


def _expired(w, tmp):
    release = copy_release(w["b"], tmp / "expired")
    manifest = json.loads((release / "manifest.json").read_text())
    created = parse_time(manifest["created_at"]) - dt.timedelta(days=200)
    stamp = created.strftime("%Y%m%dT%H%M%SZ")
    resign(release, w["key"], created_at=created.strftime("%Y-%m-%dT%H:%M:%SZ"), release_id=f"2026-11+{stamp}",
           expires_at=(created + dt.timedelta(days=120)).strftime("%Y-%m-%dT%H:%M:%SZ"))
    return release


@pytest.mark.parametrize("make,reason,status", [
    (_flipped, "checksum", 422), (_other_key, "signature", 422), (_other_backbone, "backbone_mismatch", 422),
    (_other_interface, "interface_mismatch", 422), (_traversal_tarball, "unsafe_path", 422),
    (_older, "rollback", 409), (_expired, "expired", 422),
])
def test_a_refused_package_gets_4xx_and_the_old_adapter_keeps_answering(w, server, tmp_path, make, reason, status):
    app, port = server
    assert call(port, "POST", "/v1/adapters", {"path": str(w["b"])})[0] == 200
    before = complete(port)

    got, body = call(port, "POST", "/v1/adapters", {"path": str(make(w, tmp_path))})

    assert (got, body["reason"]) == (status, reason), body
    assert body["active_release"] == manifest_id(w["b"]) and body["exit_code"] >= 10
    after = complete(port)
    assert after == before  # same release, same activation, same text
    assert completion_metrics(port)["refusals"] == {reason: 1}
    assert not (tmp_path.parent / "escaped.json").exists()


def test_hot_swap_under_concurrent_requests_keeps_every_request_on_its_release(w, server):
    app, port = server
    ids = {manifest_id(w["a"]): None, manifest_id(w["b"]): None}
    for release in (w["a"], w["b"]):
        assert call(port, "POST", "/v1/adapters", {"path": str(release)})[0] == 200
        ids[manifest_id(release)] = complete(port)["text"]
    assert ids[manifest_id(w["a"])] != ids[manifest_id(w["b"])]  # the two adapters answer differently

    stop, results = threading.Event(), []

    def client():
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        while not stop.is_set():
            conn.request("POST", "/v1/completions", json.dumps({"prompt": PROMPT, "max_tokens": 6, "temperature": 0}))
            resp = conn.getresponse()
            body = json.loads(resp.read())
            results.append((resp.status, as_generation(body) if resp.status == 200 else body))
        conn.close()

    threads = [threading.Thread(target=client) for _ in range(4)]
    for t in threads:
        t.start()
    swaps = []
    for i in range(6):
        release = (w["a"], w["b"])[i % 2]
        swap = app.load(release, allow_rollback=True)  # every other swap is a rollback: a local act
        swaps.append((200, swap["release_id"]))
        threading.Event().wait(0.15)
    stop.set()
    for t in threads:
        t.join()

    assert [s for s, _ in swaps] == [200] * 6
    assert len(results) >= 20 and {s for s, _ in results} == {200}
    assert {r["release_id"] for _, r in results} == set(ids)  # both releases served
    assert all(r["text"] == ids[r["release_id"]] for _, r in results)  # each ran wholly on its release
    metrics = completion_metrics(port)
    assert metrics["failures"] == 0 and metrics["swaps"] == 8


def test_watch_mode_swaps_in_a_newer_release_and_never_rolls_back(w, server, tmp_path):
    app, _ = server
    app.load(w["a"])
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    watcher = Watcher(app, inbox)
    shutil.copytree(w["b"], inbox / "2026-11")
    assert [r["release_id"] for r in watcher.poll_once()] == [manifest_id(w["b"])]
    shutil.copytree(w["a"], inbox / "2026-10-again")

    refused = watcher.poll_once()

    assert [(r["path"], r["refused"]) for r in refused] == [(str(inbox / "2026-10-again"), "rollback")]
    assert app.active.release_id == manifest_id(w["b"]) and watcher.poll_once() == []  # tried once, not again


def serve_command(w, *args: str) -> list[str]:
    """``python -m runtime serve`` on the tiny world with release B, on a free port."""
    return [sys.executable, "-m", "runtime", "serve", "--engine", str(w["engine"]), "--tokenizer", str(w["tokenizer"]),
            "--package", str(w["b"]), "--trusted-key", str(w["trusted_key"]), "--port", "0", *args]


def serve_process(w, *args: str, stderr=subprocess.DEVNULL) -> tuple[subprocess.Popen, dict]:
    """``serve_command`` started; (process, its ready line)."""
    proc = subprocess.Popen(serve_command(w, *args), cwd=REPO, stdout=subprocess.PIPE, stderr=stderr, text=True)
    ready = json.loads(proc.stdout.readline())
    return proc, ready | {"port": int(ready["listening"].rsplit(":", 1)[1])}


def test_serve_command_starts_and_answers(w, tmp_path):
    """The admin token and release directories from the device config, relative to its file."""
    (tmp_path / "admin.token").write_text("device-config-token-0123456789\n")
    (tmp_path / "releases").symlink_to(w["a"].parent)
    device = tmp_path / "device.json"
    device.write_text(json.dumps({"admin_token_file": "admin.token", "release_dirs": ["releases"]}))
    proc, ready = serve_process(w, "--device-config", str(device))
    try:
        port = ready["port"]
        assert ready["release_id"] == manifest_id(w["b"])
        assert complete(port)["release_id"] == manifest_id(w["b"])
        assert call(port, "POST", "/v1/adapters", {"path": str(w["b"])})[0] == 401  # the test kit's token is not this one
        status, body = call(port, "POST", "/v1/adapters", {"path": str(w["b"])}, token="device-config-token-0123456789")
        assert (status, body["error"]["code"]) == (403, "path_not_allowed")  # B is outside releases/
        status, body = call(port, "POST", "/v1/adapters", {"path": str(tmp_path / "releases" / w["a"].name)},
                            token="device-config-token-0123456789")
        assert (status, body["reason"]) == (409, "rollback")  # A, inside releases/: verified, and older than B
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0


def test_serve_loads_a_candidate_with_a_canary_share_and_refuses_an_older_one(w, tmp_path):
    """--candidate at start; canary_share and max_resident from the device config; a candidate older than the
    champion (--package) stops the start with the rollback exit code, a bad max_resident with the usage code."""
    newer = copy_release(w["b"], tmp_path / "release-2026-12")
    resign(newer, w["key"], month="2026-12", release_id="2026-12+" + manifest_id(w["b"]).partition("+")[2])
    device = tmp_path / "device.json"
    device.write_text(json.dumps({"canary_share": 0.5, "max_resident": 2}))
    proc, ready = serve_process(w, "--device-config", str(device), "--candidate", str(newer))
    try:
        assert (ready["release_id"], ready["candidate"]["release_id"]) == (manifest_id(w["b"]), manifest_id(newer))
        assert call(ready["port"], "GET", "/healthz")[1]["canary_share"] == 0.5
        assert [complete(ready["port"])["release_id"] for _ in range(4)] == [manifest_id(w["b"]), manifest_id(newer)] * 2
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0

    refused = subprocess.run(serve_command(w, "--candidate", str(w["a"])), cwd=REPO, capture_output=True, text=True,
                             timeout=120)
    assert refused.returncode == 20 and "refused (rollback)" in refused.stderr
    same = subprocess.run(serve_command(w, "--candidate", str(w["b"])), cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert same.returncode == 2 and "is the champion already" in same.stderr
    device.write_text(json.dumps({"max_resident": 1}))
    bad = subprocess.run(serve_command(w, "--device-config", str(device)), cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2 and "max_resident (--max-resident) 1: an integer of at least 2" in bad.stderr


def test_sigterm_finishes_every_request_in_flight_and_exits_0(w, tmp_path):
    """SIGTERM with 8 clients in flight (2 decoding, 6 queued): each gets its whole answer, new connections are
    refused, the process exits 0; the log is JSON lines with request ids."""
    log = tmp_path / "serve.log"
    with open(log, "w") as err:
        proc, ready = serve_process(w, "--max-concurrent", "2", "--max-tokens", "1024", "--graceful-shutdown", "60",
                                    stderr=err)
    try:
        port = ready["port"]
        results = []

        def client():
            results.append(call(port, "POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 1024, "temperature": 0}))

        threads = [threading.Thread(target=client) for _ in range(8)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while True:  # every client admitted: decoding or queued
            samples = scrape(port)
            if sample(samples, "adapter_generations_in_flight") + sample(samples, "adapter_generation_queue_depth") == 8:
                break
            assert time.monotonic() < deadline, samples
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        still_serving = proc.poll() is None
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
        for t in threads:
            t.join()
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert still_serving  # the refusal above happened while requests were still being finished
    assert sorted(status for status, _ in results) == [200] * 8
    assert all(body["usage"]["completion_tokens"] == 1024 for _, body in results)
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    served = [line for line in lines if line["message"] == "request" and line["path"] == "/v1/completions"]
    assert len(served) == 8 and all(line["status"] == 200 and len(line["request_id"]) == 32 for line in served)


# In a fresh interpreter: configuring logging replaces the root logger's handlers, pytest's among them.
_LOG_AFTER_STDERR_SWAP = """
import io, logging, sys
from runtime.serve.http_server import configure_json_logging

configure_json_logging()
first = sys.stderr = io.StringIO()  # a test runner's capture, say, swapped in and then closed
first.close()
sys.stderr = second = io.StringIO()
logging.getLogger("runtime.serve.http_app").info("request", extra={"fields": {"status": 200}})
print(second.getvalue(), end="")
"""


def test_the_json_log_goes_to_sys_stderr_as_it_is_when_a_line_is_logged():
    out = subprocess.run([sys.executable, "-c", _LOG_AFTER_STDERR_SWAP], cwd=REPO, capture_output=True, text=True,
                         check=True)
    assert "Logging error" not in out.stderr
    line = json.loads(out.stdout)
    assert (line["level"], line["logger"], line["message"], line["status"]) == ("info", "runtime.serve.http_app", "request", 200)
