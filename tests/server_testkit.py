"""Device server test kit: the real app under uvicorn in this process, HTTP calls, and a Prometheus scrape.

``running_server`` starts ``runtime.serve.http_server.BackgroundServer`` (uvicorn in a thread, a free loopback
port) on the tiny world's engine (or ``engine``, a paged one with ``kv_budget_bytes``), tokenizer and key, with
the admin API on (``ADMIN_TOKEN``), the given release directories and at most ``max_resident`` resident releases,
serving ``products`` (the first the default); with ``state_dir``, the device state and health-gated commit of
``runtime.serve.health`` (``health_window`` seconds) of each product, resumed from that directory. ``scrape``
reads ``/metrics`` with ``prometheus_client``'s own parser.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from runtime.engine.backends.onnxruntime import OrtEngine
from runtime.engine.tokenizer import DeviceTokenizer
from runtime.release.contract import DEFAULT_PRODUCT
from runtime.release.device_state import DeviceState
from runtime.release.verify import load_trusted_keys
from runtime.serve.batcher import DEFAULT_PREFILL_CHUNK, KV_WAIT_S
from runtime.serve.health import ReleaseGate
from runtime.serve.http_app import ServeSettings
from runtime.serve.http_server import BackgroundServer
from runtime.serve.residents import DEFAULT_MAX_RESIDENT
from runtime.serve.server import AdapterServer

REPO = Path(__file__).resolve().parents[1]

ADMIN_TOKEN = "test-admin-token-0123456789"
PROMPT = "inspect board=PCB-3310 line=L1 part=R12 temp_c=251 defect=void void_pct=18 verdict:"


@contextlib.contextmanager
def running_server(w, release_dirs=(), tokenizer=None, max_resident=DEFAULT_MAX_RESIDENT, state_dir=None,
                   health_window=0.0, products=(DEFAULT_PRODUCT,), engine=None, kv_budget_bytes=None, kv_wait_s=KV_WAIT_S,
                   prefill_chunk=DEFAULT_PREFILL_CHUNK, share_prefixes=True, kv_swap_dir=None, kv_swap_bytes=0, **settings):
    budget = {} if kv_budget_bytes is None else {"kv_budget_bytes": kv_budget_bytes}
    app = AdapterServer(OrtEngine(engine or w["engine"], threads=1, **budget), DeviceTokenizer(tokenizer or w["tokenizer"]),
                        load_trusted_keys([w["trusted_key"]]), max_resident=max_resident, products=products,
                        kv_wait_s=kv_wait_s, prefill_chunk=prefill_chunk, share_prefixes=share_prefixes,
                        kv_swap_dir=kv_swap_dir, kv_swap_bytes=kv_swap_bytes)
    state = DeviceState(state_dir) if state_dir is not None else None
    config = ServeSettings(**({"admin_token": ADMIN_TOKEN,
                               "release_dirs": tuple(Path(d).resolve() for d in release_dirs)} | settings))
    try:
        if state is not None:
            for product in products:
                ReleaseGate(app, state.for_product(product), health_window, config.decode, product).resume()
        with BackgroundServer(app, config) as background:
            yield app, background
    finally:
        if state is not None:
            for gate in app.gates.values():
                gate.stop()  # a trial still running would write the state: it ends before the lock goes
            state.close()


def call(port: int, method: str, path: str, payload: dict | None = None, token: str | None = ADMIN_TOKEN,
         headers: dict | None = None) -> tuple[int, dict]:
    """One request on a fresh connection: (status, JSON body)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    sent = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {token}"} if token else {}) | (headers or {})
    conn.request(method, path, json.dumps(payload) if payload is not None else None, sent)
    resp = conn.getresponse()
    out = resp.status, json.loads(resp.read())
    conn.close()
    return out


def as_generation(body: dict) -> dict:
    """What the old /v1/generate answered, read from a /v1/completions answer: the release (``model``), its
    activation, the text and its token count."""
    return {"text": body["choices"][0]["text"], "release_id": body["model"], "activation": body["activation"],
            "tokens": body["usage"]["completion_tokens"]}


def complete(port: int, prompt: str = PROMPT, max_tokens: int = 6) -> dict:
    status, out = call(port, "POST", "/v1/completions", {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    assert status == 200, out
    return as_generation(out)


def scrape(port: int) -> dict:
    """Every sample of /metrics, parsed by prometheus_client: {(name, sorted label items): value}."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("GET", "/metrics")
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("Content-Type").startswith("text/plain")
    text = resp.read().decode()
    conn.close()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def sample(samples: dict, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def summed(samples: dict, name: str, **where) -> float:
    """The sum of ``name`` over every label set that matches ``where``."""
    return sum(v for (n, labels), v in samples.items() if n == name and where.items() <= dict(labels).items())


def refusals(samples: dict) -> dict:
    return {dict(labels)["reason"]: int(v) for (n, labels), v in samples.items() if n == "adapter_refusals_total"}


def manifest_id(release: Path) -> str:
    return json.loads((release / "manifest.json").read_text())["release_id"]


@contextlib.contextmanager
def serve_process(command: list[str], log: Path) -> Iterator[tuple[subprocess.Popen, int]]:
    """``python -m runtime serve`` (``command``, with ``--port 0``) run from the repository, and its port; its
    stderr appended to ``log``; killed at the end if still running."""
    with open(log, "a") as err:
        proc = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        yield proc, int(json.loads(proc.stdout.readline())["listening"].rsplit(":", 1)[1])
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
