"""Timed HTTP clients of the serving benchmarks (``bench.serving.hotswap_bench``, ``serve_faults_bench``,
``serve_bench``): one OpenAI ``/v1/completions`` request, streamed or not, on a keep-alive
connection, with the times a latency summary needs, and those summaries.

Times are ``time.perf_counter()``. A streamed request's *first token* is the arrival of its first
event that carries a choice (text or a finish reason); its *inter-token gaps* are the times between
consecutive such events. Tokens are the answer's ``usage.completion_tokens`` (streams ask for it with
``stream_options.include_usage``). A request is *complete* when it got 200 and its whole answer: every
choice with a ``finish_reason`` and, streamed, the closing ``data: [DONE]``.
"""

from __future__ import annotations

import http.client
import json
import time
import uuid
from dataclasses import dataclass, field

from runtime.engine.latency import percentile

COMPLETIONS = "/v1/completions"
REQUEST_ID = "X-Request-Id"  # echoed by the device; its log lines carry it (runtime.serve.http_app.RequestLog)


@dataclass
class Answer:
    request_id: str
    sent: float  # the request written (its connection opened if it had none)
    done: float = 0.0  # the answer read to its end, or the failure seen
    status: int = 0  # HTTP status; 0 when no status line arrived
    responded: bool = False  # a status line arrived: the server took the request
    complete: bool = False
    first: float | None = None  # first token (not streamed: the whole answer)
    events: list[float] = field(default_factory=list)  # arrival of each streamed event carrying a choice
    tokens: int = 0  # usage.completion_tokens
    prompt_tokens: int = 0
    text: str = ""  # choice 0's whole text
    model: str | None = None
    activation: int | None = None  # the device's activation number of the release that answered
    error: str | None = None

    @property
    def latency(self) -> float:
        return self.done - self.sent

    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.events, self.events[1:])]


class Client:
    """One keep-alive connection to ``host:port``, opened again after a failure."""

    def __init__(self, port: int, host: str = "127.0.0.1", timeout: float = 120.0):
        self.host, self.port, self.timeout = host, port, timeout
        self.conn: http.client.HTTPConnection | None = None

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    def complete(self, payload: dict, stream: bool = False, request_id: str | None = None) -> Answer:
        """POST ``payload`` to /v1/completions and read the answer to its end; never raises for a
        failure of the server or the connection (the Answer says what happened).

        A kept-alive connection the server closed while it was idle (after its keep-alive timeout) fails
        when it is next written to or read from, before any byte of an answer: then the request is sent once
        more on a fresh connection, as urllib3 and httpx do. A failure on a fresh connection is the answer."""
        body = dict(payload, stream=stream) | ({"stream_options": {"include_usage": True}} if stream else {})
        answer = Answer(request_id or uuid.uuid4().hex, time.perf_counter())
        try:
            resp = self._send(body, answer.request_id)
            answer.status, answer.responded = resp.status, True
            if resp.status != 200:
                answer.error = resp.read().decode("utf-8", "replace")[:500]
            elif stream:
                read_stream(resp, answer)
            else:
                read_whole(json.loads(resp.read()), answer)
            if resp.will_close:
                self.close()
        except (OSError, http.client.HTTPException, ValueError) as err:
            answer.error = f"{type(err).__name__}: {err}"
            self.close()
        answer.done = time.perf_counter()
        return answer

    def _send(self, body: dict, request_id: str) -> http.client.HTTPResponse:
        if self.conn is not None:
            try:
                return self._post(body, request_id)
            except (BrokenPipeError, ConnectionResetError, http.client.RemoteDisconnected):
                self.close()  # closed by the server while idle: once more, on a fresh connection
        self.conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        return self._post(body, request_id)

    def _post(self, body: dict, request_id: str) -> http.client.HTTPResponse:
        self.conn.request("POST", COMPLETIONS, json.dumps(body), {"Content-Type": "application/json", REQUEST_ID: request_id})
        return self.conn.getresponse()


def read_whole(body: dict, answer: Answer) -> None:
    answer.first = time.perf_counter()
    choices = body["choices"]
    answer.text = choices[0]["text"]
    answer.model, answer.activation = body.get("model"), body.get("activation")
    answer.tokens = body["usage"]["completion_tokens"]
    answer.prompt_tokens = body["usage"]["prompt_tokens"]
    answer.complete = all(c.get("finish_reason") for c in choices)


def read_stream(resp: http.client.HTTPResponse, answer: Answer) -> None:
    finished: dict[int, str] = {}
    pieces: list[str] = []
    while line := resp.readline():
        line = line.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            answer.complete = bool(finished) and not answer.error
            resp.read()  # the end of the chunked body: the connection is ready for the next request
            return
        event = json.loads(data)
        if "error" in event:
            answer.error = json.dumps(event["error"])[:500]
            continue
        if event.get("usage"):
            answer.tokens = event["usage"]["completion_tokens"]
            answer.prompt_tokens = event["usage"]["prompt_tokens"]
        if not event.get("choices"):
            continue
        now = time.perf_counter()
        answer.first = answer.first or now
        answer.events.append(now)
        answer.model, answer.activation = event.get("model"), event.get("activation", answer.activation)
        for choice in event["choices"]:
            if choice.get("index", 0) == 0:
                pieces.append(choice.get("text") or "")
            if choice.get("finish_reason"):
                finished[choice.get("index", 0)] = choice["finish_reason"]
        answer.text = "".join(pieces)
    answer.error = answer.error or "the stream ended without data: [DONE]"


def summary_ms(values_s: list[float]) -> dict:
    """p50/p95/p99 and max of times in seconds, as milliseconds (None without values)."""
    ms = [v * 1e3 for v in values_s]
    return {"n": len(ms), **{f"p{q}_ms": percentile(ms, q) for q in (50, 95, 99)}, "max_ms": max(ms) if ms else None}
