"""The HTTP server: generation, atomic hot swap under concurrent requests, refusals that keep the old adapter."""

from __future__ import annotations

import datetime as dt
import http.client
import io
import json
import shutil
import subprocess
import sys
import tarfile
import threading
from pathlib import Path

import pytest
from release_testkit import copy_release, resign, world

from runtime.backends.onnxruntime import OrtEngine
from runtime.contract import parse_time
from runtime.package import load_trusted_keys
from runtime.server import AdapterServer, Watcher, make_server
from runtime.signing import generate_key
from runtime.tokenizer import DeviceTokenizer

REPO = Path(__file__).resolve().parents[2]
PROMPT = "inspect board=PCB-3310 line=L1 part=R12 temp_c=251 defect=void void_pct=18 verdict:"


@pytest.fixture(scope="module")
def w(tmp_path_factory):
    return world(tmp_path_factory)


@pytest.fixture()
def server(w):
    app = AdapterServer(OrtEngine(w["engine"], threads=1), DeviceTokenizer(w["tokenizer"]),
                        load_trusted_keys([w["trusted_key"]]))
    httpd = make_server(app)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield app, httpd.server_address[1]
    httpd.shutdown()
    httpd.server_close()


def call(port: int, method: str, path: str, payload: dict | None = None) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request(method, path, json.dumps(payload) if payload is not None else None, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    out = resp.status, json.loads(resp.read())
    conn.close()
    return out


def generate(port: int, prompt: str = PROMPT) -> dict:
    status, out = call(port, "POST", "/v1/generate", {"prompt": prompt, "max_new_tokens": 6})
    assert status == 200, out
    return out


def manifest_id(release: Path) -> str:
    return json.loads((release / "manifest.json").read_text())["release_id"]


def test_generate_health_and_metrics(w, server):
    app, port = server
    assert call(port, "POST", "/v1/generate", {"prompt": PROMPT})[0] == 503  # nothing loaded yet
    status, swap = call(port, "POST", "/v1/adapters", {"path": str(w["b"])})
    assert status == 200 and swap["release_id"] == manifest_id(w["b"]) and swap["activation"] == 1
    out = generate(port)
    assert out["release_id"] == manifest_id(w["b"]) and out["tokens"] == 6 and isinstance(out["text"], str)
    health = call(port, "GET", "/healthz")[1]
    assert health["release_id"] == manifest_id(w["b"]) and health["weights"] == "fp32"
    assert call(port, "POST", "/v1/generate", {"prompt": PROMPT, "max_new_tokens": 0})[0] == 400
    metrics = call(port, "GET", "/metrics")[1]
    assert metrics["requests"] == 3 and metrics["failures"] == 2 and metrics["swaps"] == 1
    assert metrics["swap_ms"]["count"] == 1 and metrics["swap_ms"]["p99"] > 0


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
    before = generate(port)

    got, body = call(port, "POST", "/v1/adapters", {"path": str(make(w, tmp_path))})

    assert (got, body["reason"]) == (status, reason), body
    assert body["active_release"] == manifest_id(w["b"]) and body["exit_code"] >= 10
    after = generate(port)
    assert after == before  # same release, same activation, same text
    assert call(port, "GET", "/metrics")[1]["refusals"] == {reason: 1}
    assert not (tmp_path.parent / "escaped.json").exists()


def test_hot_swap_under_concurrent_requests_keeps_every_request_on_its_release(w, server):
    app, port = server
    ids = {manifest_id(w["a"]): None, manifest_id(w["b"]): None}
    for release in (w["a"], w["b"]):
        assert call(port, "POST", "/v1/adapters", {"path": str(release)})[0] == 200
        ids[manifest_id(release)] = generate(port)["text"]
    assert ids[manifest_id(w["a"])] != ids[manifest_id(w["b"])]  # the two adapters answer differently

    stop, results = threading.Event(), []

    def client():
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        while not stop.is_set():
            conn.request("POST", "/v1/generate", json.dumps({"prompt": PROMPT, "max_new_tokens": 6}))
            resp = conn.getresponse()
            results.append((resp.status, json.loads(resp.read())))
        conn.close()

    threads = [threading.Thread(target=client) for _ in range(4)]
    for t in threads:
        t.start()
    swaps = []
    for i in range(6):
        release = (w["a"], w["b"])[i % 2]
        status, swap = call(port, "POST", "/v1/adapters", {"path": str(release), "allow_rollback": True})
        swaps.append((status, swap["release_id"]))
        threading.Event().wait(0.15)
    stop.set()
    for t in threads:
        t.join()

    assert [s for s, _ in swaps] == [200] * 6
    assert len(results) >= 20 and {s for s, _ in results} == {200}
    assert {r["release_id"] for _, r in results} == set(ids)  # both releases served
    assert all(r["text"] == ids[r["release_id"]] for _, r in results)  # each ran wholly on its release
    metrics = call(port, "GET", "/metrics")[1]
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


def test_serve_command_starts_and_answers(w):
    proc = subprocess.Popen(
        [sys.executable, "-m", "runtime", "serve", "--engine", str(w["engine"]), "--tokenizer", str(w["tokenizer"]),
         "--package", str(w["b"]), "--trusted-key", str(w["trusted_key"]), "--port", "0"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        ready = json.loads(proc.stdout.readline())
        port = int(ready["listening"].rsplit(":", 1)[1])
        assert ready["release_id"] == manifest_id(w["b"])
        assert generate(port)["release_id"] == manifest_id(w["b"])
    finally:
        proc.terminate()
        proc.wait(timeout=30)
