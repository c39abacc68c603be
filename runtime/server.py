"""Serve generation over HTTP from one engine, and swap releases into it without a restart.

    POST /v1/generate  {"prompt": str, "max_new_tokens": int}  -> {"text", "release_id", "activation", "tokens"}
    GET  /healthz                                              -> {"status", "release_id", "activation", "weights", ...}
    POST /v1/adapters  {"path": DIR_OR_TARBALL, "allow_rollback": false}  -> {"release_id", "activation", "swap_ms", ...}
    GET  /metrics                                              -> requests, failures, swaps, swap latency (ms)

The engine (one ONNX Runtime session) is opened once. Each verified release becomes an
immutable ``ActiveRelease``: its own engine handle (``OrtEngine.fork``) with the release's LoRA
inputs and KV scales bound, plus its manifest. A request reads the active release once, when
it starts, and forks that release's handle, so it runs every step, prefill to last token, on
that release; a swap only replaces the ``active`` reference (under a lock, after verification
and binding are done), so new requests get the new release while requests in flight finish on
theirs. A release that fails verification is refused with 4xx and the JSON error of its
``PackageError`` (``reason``, ``exit_code``); the active release keeps serving.

Watch mode polls a directory for release directories or tarballs and swaps in any verified
one newer than the active release (never a rollback). Publish into it atomically (write
elsewhere, then rename), or a half-copied release is refused until its next change.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from runtime.contract import MANIFEST, release_order
from runtime.generate import greedy_generate
from runtime.latency import percentile
from runtime.package import (
    DEFAULT_MAX_PACKAGE_BYTES,
    PackageError,
    RollbackRefused,
    bind_release,
    unpacked_release,
    verify_release,
)

log = logging.getLogger(__name__)
MAX_BODY_BYTES = 1 << 20
MAX_NEW_TOKENS = 256


class NoActiveRelease(RuntimeError):
    """Generation asked for before any release was loaded."""


@dataclass(frozen=True)
class ActiveRelease:
    release_id: str
    activation: int  # 1 for the first release loaded, +1 per swap
    manifest: dict
    handle: object  # an engine handle with this release bound; forked per request, never rebound
    loaded_at: float


@dataclass
class ServerMetrics:
    requests: int = 0
    failures: int = 0
    in_flight: int = 0
    swaps: int = 0
    swaps_refused: int = 0
    swap_ms: list = field(default_factory=list)  # verify + bind + activate, per accepted swap
    activate_ms: list = field(default_factory=list)  # the reference flip alone, lock included
    by_release: dict = field(default_factory=dict)
    refusals: dict = field(default_factory=dict)  # reason -> count
    lock: threading.Lock = field(default_factory=threading.Lock)

    def snapshot(self) -> dict:
        with self.lock:
            swap, act = list(self.swap_ms), list(self.activate_ms)
            return {
                "requests": self.requests, "failures": self.failures, "in_flight": self.in_flight,
                "swaps": self.swaps, "swaps_refused": self.swaps_refused, "refusals": dict(self.refusals),
                "requests_by_release": dict(self.by_release),
                "swap_ms": {"count": len(swap), "last": swap[-1] if swap else None, "p50": percentile(swap, 50),
                            "p99": percentile(swap, 99), "max": max(swap) if swap else None},
                "activate_ms": {"p50": percentile(act, 50), "p99": percentile(act, 99), "max": max(act) if act else None},
            }


class AdapterServer:
    """The engine, the tokenizer, the trusted keys and the active release; thread-safe."""

    def __init__(self, engine, tokenizer, trusted_keys: dict, max_bytes: int = DEFAULT_MAX_PACKAGE_BYTES):
        if not hasattr(engine, "fork"):
            raise ValueError(f"{type(engine).__name__} cannot be shared between requests; serve runs the onnxruntime backend")
        self.engine, self.tokenizer, self.trusted_keys, self.max_bytes = engine, tokenizer, trusted_keys, max_bytes
        self.metrics = ServerMetrics()
        self._active: ActiveRelease | None = None
        self._swap_lock = threading.Lock()

    @property
    def active(self) -> ActiveRelease | None:
        return self._active

    def load(self, path: str | Path, allow_rollback: bool = False) -> dict:
        """Verify the release at ``path``, bind it to a new handle, make it active; raise PackageError."""
        start = time.perf_counter()
        current = self._active
        try:
            with unpacked_release(path, self.max_bytes) as d:
                verified = verify_release(
                    d, self.trusted_keys, self.engine.interface,
                    active_release=current.release_id if current else None, allow_rollback=allow_rollback,
                    max_bytes=self.max_bytes, tokenizer_sha256=self.tokenizer.sha256,
                    stop_token_ids=self.tokenizer.stop_ids,
                )
            handle = self.engine.fork()
            bind_release(handle, verified)  # the arrays are copied into ORT values: the files may go
            flip = time.perf_counter()
            with self._swap_lock:
                now_active = self._active  # another swap may have won while this one verified
                if now_active is not None and not allow_rollback and verified.order < release_order(now_active.release_id):
                    raise RollbackRefused(f"{path}: release {verified.release_id} is older than {now_active.release_id}, "
                                          "activated while this one was being verified")
                activation = (now_active.activation if now_active else 0) + 1
                self._active = ActiveRelease(verified.release_id, activation, verified.manifest, handle, time.time())
            done = time.perf_counter()
        except PackageError as err:
            with self.metrics.lock:
                self.metrics.swaps_refused += 1
                self.metrics.refusals[err.reason] = self.metrics.refusals.get(err.reason, 0) + 1
            raise
        swap_ms, activate_ms = (done - start) * 1e3, (done - flip) * 1e3
        with self.metrics.lock:
            self.metrics.swaps += 1
            self.metrics.swap_ms.append(swap_ms)
            self.metrics.activate_ms.append(activate_ms)
        log.info("active release %s (activation %d) in %.1f ms", verified.release_id, activation, swap_ms)
        return {"release_id": verified.release_id, "activation": activation, "previous": current.release_id if current else None,
                "swap_ms": round(swap_ms, 3), "activate_ms": round(activate_ms, 4), "checks": verified.checks}

    def generate(self, prompt: str, max_new_tokens: int) -> dict:
        release = self._active  # one read: this request runs on this release to its last token
        if release is None:
            raise NoActiveRelease("no release loaded yet: POST /v1/adapters or start with --package")
        ids = self.tokenizer.encode(prompt)
        if not ids:
            raise ValueError("prompt encodes to no tokens")
        handle = release.handle.fork()
        tokens = greedy_generate(handle, [ids], max_new_tokens, self.tokenizer.stop_ids, self.tokenizer.pad_id)[0]
        with self.metrics.lock:
            self.metrics.by_release[release.release_id] = self.metrics.by_release.get(release.release_id, 0) + 1
        return {"text": self.tokenizer.decode(tokens), "release_id": release.release_id,
                "activation": release.activation, "tokens": len(tokens)}

    def health(self) -> dict:
        release = self._active
        return {"status": "ok" if release else "no_release", "release_id": release.release_id if release else None,
                "activation": release.activation if release else 0,
                "month": release.manifest["month"] if release else None,
                "expires_at": release.manifest["expires_at"] if release else None,
                "weights": self.engine.interface.weight_precision}


class _Handler(BaseHTTPRequestHandler):
    server_version = "adapter-runtime/1"
    protocol_version = "HTTP/1.1"  # keep-alive: load-test clients reuse their connection

    def log_message(self, fmt, *args):  # one line per request at debug level, not on stderr
        log.debug("%s " + fmt, self.address_string(), *args)

    @property
    def app(self) -> AdapterServer:
        return self.server.app

    def _send(self, status: int, payload: dict) -> None:
        body = (json.dumps(payload, sort_keys=True) + "\n").encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _body(self) -> dict:
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY_BYTES:
            raise ValueError(f"request body of {length} bytes is over {MAX_BODY_BYTES}")
        data = json.loads(self.rfile.read(length) or b"{}")
        if not isinstance(data, dict):
            raise ValueError("request body must be a JSON object")
        return data

    def do_GET(self):
        if self.path == "/healthz":
            self._send(200, self.app.health())
        elif self.path == "/metrics":
            self._send(200, self.app.metrics.snapshot() | {"active_release": self.app.health()["release_id"]})
        else:
            self._send(404, {"error": f"no route GET {self.path}"})

    def do_POST(self):
        if self.path == "/v1/generate":
            self._generate()
        elif self.path == "/v1/adapters":
            self._swap()
        else:
            self._send(404, {"error": f"no route POST {self.path}"})

    def _generate(self):
        app = self.app
        with app.metrics.lock:
            app.metrics.requests += 1
            app.metrics.in_flight += 1
        status, payload = 200, None
        try:
            body = self._body()
            prompt, n = body.get("prompt"), body.get("max_new_tokens", 16)
            if not isinstance(prompt, str) or not prompt:
                status, payload = 400, {"error": "prompt: a non-empty string is required"}
            elif not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_NEW_TOKENS:
                status, payload = 400, {"error": f"max_new_tokens: an integer in 1..{MAX_NEW_TOKENS} is required"}
            else:
                payload = app.generate(prompt, n)
        except (ValueError, json.JSONDecodeError) as err:
            status, payload = 400, {"error": str(err)}
        except NoActiveRelease as err:
            status, payload = 503, {"error": str(err)}
        except Exception as err:  # a bug: count it, answer 500, keep serving
            log.exception("generation failed")
            status, payload = 500, {"error": f"{type(err).__name__}: {err}"}
        with app.metrics.lock:
            app.metrics.in_flight -= 1
            app.metrics.failures += status != 200
        self._send(status, payload)

    def _swap(self):
        try:
            body = self._body()
            path = body.get("path")
            if not isinstance(path, str) or not path:
                return self._send(400, {"error": "path: the release directory or tarball to load is required"})
            result = self.app.load(path, allow_rollback=bool(body.get("allow_rollback", False)))
        except PackageError as err:
            status = HTTPStatus.CONFLICT if isinstance(err, RollbackRefused) else HTTPStatus.UNPROCESSABLE_ENTITY
            return self._send(status, {"error": str(err), "reason": err.reason, "exit_code": err.exit_code,
                                       "active_release": self.app.health()["release_id"]})
        except (ValueError, json.JSONDecodeError) as err:
            return self._send(400, {"error": str(err)})
        self._send(200, result)


class RuntimeHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address, app: AdapterServer):
        super().__init__(address, _Handler)
        self.app = app


def make_server(app: AdapterServer, host: str = "127.0.0.1", port: int = 0) -> RuntimeHTTPServer:
    """A bound server (port 0 picks a free one: ``server.server_address[1]``); call serve_forever()."""
    return RuntimeHTTPServer((host, port), app)


class Watcher(threading.Thread):
    """Polls ``directory`` and swaps in any verified release newer than the active one."""

    def __init__(self, app: AdapterServer, directory: Path, interval: float = 2.0):
        super().__init__(daemon=True, name="release-watcher")
        self.app, self.directory, self.interval = app, Path(directory), interval
        self.seen: dict[str, tuple] = {}  # path -> (mtime_ns, size) last tried
        self.stop = threading.Event()

    def candidates(self) -> list[Path]:
        if not self.directory.is_dir():
            return []
        out = []
        for entry in sorted(self.directory.iterdir()):
            if entry.name.startswith("."):
                continue  # being written (publish by rename)
            if (entry.is_dir() and (entry / MANIFEST).is_file()) or entry.name.endswith((".tar.gz", ".tgz")):
                st = entry.stat()
                key = (st.st_mtime_ns, st.st_size)
                if self.seen.get(str(entry)) != key:
                    out.append(entry)
                    self.seen[str(entry)] = key
        return out

    def poll_once(self) -> list[dict]:
        results = []
        for path in self.candidates():
            try:
                results.append(self.app.load(path, allow_rollback=False) | {"path": str(path)})
            except PackageError as err:
                log.warning("watch: refused %s: %s", path, err)
                results.append({"path": str(path), "refused": err.reason, "error": str(err)})
        return results

    def run(self):
        while not self.stop.wait(self.interval):
            self.poll_once()


def serve(app: AdapterServer, host: str, port: int, watch: Path | None = None, interval: float = 2.0) -> None:
    server = make_server(app, host, port)
    watcher = None
    if watch is not None:
        watcher = Watcher(app, watch, interval)
        watcher.poll_once()
        watcher.start()
    print(json.dumps({"listening": f"http://{host}:{server.server_address[1]}", "pid": os.getpid()} | app.health()),
          flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        if watcher is not None:
            watcher.stop.set()
        server.server_close()
