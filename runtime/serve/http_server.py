"""Serving the device's ASGI app (``runtime.serve.http_app``) with uvicorn, hardened for an open port.

uvicorn's h11 protocol already answers malformed HTTP (a bad request line, ``Content-Length: -1``)
with 400 at once, closes idle keep-alive connections after ``timeout_keep_alive``, and on SIGTERM
stops accepting, lets requests in flight finish within ``timeout_graceful_shutdown`` and returns.
What it lacks is a deadline on the request line and headers: a client that opens a connection and
sends half a request holds it forever. ``HeaderDeadlineH11Protocol`` adds it (408, then close);
the body has its own deadline in the app (``ServeSettings.body_timeout_s``).

Log lines are JSON, one object per line (``JsonLogFormatter``), request lines carry the request id.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import sys
import threading
import time

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from runtime.serve.http_app import ServeSettings, build_app
from runtime.serve.openai_api import APIError
from runtime.serve.server import AdapterServer

log = logging.getLogger(__name__)


def error_bytes(status: int, message: str, code: str) -> tuple[list[tuple[bytes, bytes]], bytes]:
    """Headers and body of an OpenAI error object for an answer the protocol sends before the app sees a request."""
    body = json.dumps(APIError(status, message, code=code).body()).encode() + b"\n"
    return [(b"content-type", b"application/json"), (b"connection", b"close"),
            (b"content-length", str(len(body)).encode())], body


class HeaderDeadlineH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on each request's line and headers, from the moment the
    connection opens or the previous response ends until the headers are in."""

    header_timeout: float = 10.0

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._deadline: asyncio.TimerHandle | None = None
        self._arm_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_deadline()

    def handle_events(self) -> None:
        super().handle_events()
        if self.conn.their_state is not h11.IDLE:  # the request line and headers are in
            self._cancel_deadline()

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a request h11 cannot parse, with OpenAI's error object instead of plain text."""
        headers, body = error_bytes(400, f"malformed HTTP request: {msg}", "malformed_http")
        for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"), h11.Data(data=body),
                      h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()

    def connection_lost(self, exc) -> None:
        self._cancel_deadline()
        super().connection_lost(exc)

    def _arm_deadline(self) -> None:
        self._cancel_deadline()
        self._deadline = self.loop.call_later(self.header_timeout, self._headers_late)

    def _cancel_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _headers_late(self) -> None:
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            headers, body = error_bytes(408, f"request headers not received within {self.header_timeout} s",
                                        "header_timeout")
            # h11 cannot answer a request it has not seen: the status line and headers are written here.
            head = b"".join(b"%s: %s\r\n" % kv for kv in headers)
            self.transport.write(b"HTTP/1.1 408 Request Timeout\r\n" + head + b"\r\n" + body)
            self.transport.close()


def uvicorn_config(app, settings: ServeSettings, host: str = "127.0.0.1", port: int = 0) -> uvicorn.Config:
    protocol = type("HeaderDeadline", (HeaderDeadlineH11Protocol,), {"header_timeout": settings.header_timeout_s})
    return uvicorn.Config(app, host=host, port=port, http=protocol, lifespan="off", log_config=None, access_log=False,
                          timeout_keep_alive=settings.keep_alive_s,
                          timeout_graceful_shutdown=settings.graceful_shutdown_s,
                          h11_max_incomplete_event_size=64 * 1024)  # request line + headers; the body has its own limit


def listening_socket(host: str, port: int) -> socket.socket:
    """A bound, listening socket: its port is known (port 0 picks one) before uvicorn runs.

    Made with proto IPPROTO_TCP, not 0 (``socket.create_server``'s): asyncio sets TCP_NODELAY only on
    accepted sockets whose proto says TCP, and without it a response written as headers then body
    waits out the client's delayed ACK, 40 ms per keep-alive request."""
    family, _, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)[0]
    sock = socket.socket(family, socket.SOCK_STREAM, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(address)
    sock.listen(2048)
    return sock


class BackgroundServer:
    """The app under uvicorn in a thread of this process, on a free loopback port (tests, benchmarks)."""

    def __init__(self, server: AdapterServer, settings: ServeSettings = ServeSettings(), host: str = "127.0.0.1"):
        self.sock = listening_socket(host, 0)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        self.uvicorn = uvicorn.Server(uvicorn_config(build_app(server, settings), settings, host, self.port))
        self.thread = threading.Thread(target=self.uvicorn.run, kwargs={"sockets": [self.sock]}, daemon=True,
                                       name="uvicorn")

    def __enter__(self) -> "BackgroundServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> "BackgroundServer":
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.uvicorn.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        """uvicorn's graceful shutdown, as on SIGTERM."""
        self.uvicorn.should_exit = True
        self.thread.join(timeout=60)
        self.sock.close()


class JsonLogFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, and the ``fields`` a caller passed in ``extra``."""

    converter = time.gmtime  # the "Z" of the timestamp

    def format(self, record: logging.LogRecord) -> str:
        line = {"ts": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}Z",
                "level": record.levelname.lower(), "logger": record.name, "message": record.getMessage()}
        line |= getattr(record, "fields", {})
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


class StderrHandler(logging.StreamHandler):
    """Writes each record to ``sys.stderr`` as it is at that record, not as it was when logging was configured: a
    server run in-process (tests, ``bench.serving.serve_bench``) outlives the stream a test runner swapped in and then closed,
    and every line its threads logged after that was lost with a "Logging error" on the console."""

    def __init__(self):
        super().__init__(sys.stderr)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _stream) -> None:  # StreamHandler.__init__ and setStream assign it: always sys.stderr
        pass


def configure_json_logging(level: int = logging.INFO) -> None:
    handler = StderrHandler()
    handler.setFormatter(JsonLogFormatter())
    logging.basicConfig(level=level, handlers=[handler], force=True)


def serve(server: AdapterServer, settings: ServeSettings, host: str, port: int, watchers=()) -> int:
    """Serve until SIGTERM or SIGINT, then shut down gracefully; 0 once every request in flight finished
    (or the graceful deadline cut the rest, which the log says). ``watchers``: threads that load releases
    (``runtime.serve.server.Watcher``, ``runtime.serve.channel_watch.ChannelWatcher``), started here, stopped at the end."""
    sock = listening_socket(host, port)
    for watcher in watchers:
        watcher.start()
    # uvicorn re-raises the signal it shut down on once it has restored the handlers it found: with
    # these installed, that re-raise is a no-op and the process exits 0 instead of dying of SIGTERM.
    stopped_by = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stopped_by.append(signum))
    print(json.dumps({"listening": f"http://{host}:{sock.getsockname()[1]}", "pid": os.getpid()} | server.health()),
          flush=True)
    try:
        uvicorn.Server(uvicorn_config(build_app(server, settings), settings, host, port)).run(sockets=[sock])
    finally:
        for watcher in watchers:
            watcher.stop.set()
        sock.close()
    log.info("stopped", extra={"fields": {"signal": [signal.Signals(s).name for s in stopped_by]}})
    return 0

