"""The device's HTTP API: an ASGI app (Starlette) over ``runtime.serve.server.AdapterServer``.

    POST /v1/completions        OpenAI completions: prompt (string or list), max_tokens, stop, temperature,
                                top_p, seed, stream (server-sent events ending in ``data: [DONE]``)
    POST /v1/chat/completions   the same for messages, when the tokenizer has a chat template (else 400)
    GET  /v1/models             every resident release: id = release id, month, product, channel, owned_by
    GET  /healthz               liveness: always 200, with the champion (or none), the candidate and, with a
                                state directory, the device state (``runtime.serve.health.ReleaseGate.summary``); with
                                an update channel, its state (``runtime.serve.channel_watch.ChannelWatcher.summary``)
    GET  /ready                 200 once a champion is loaded, 503 before: the same body. A stale or refused
                                update channel never makes it 503: the champion still answers correctly
    GET  /metrics               Prometheus text format (``runtime.serve.metrics``)
    POST /v1/adapters           admin: verify, bind and load a release {"path", "channel": "champion" (default,
                                a swap) or "candidate"}
    POST /v1/adapters/promote   admin: {"product"} (default: the device's default product): its candidate becomes
                                its champion, the champion goes to standby
    POST /v1/adapters/unload    admin: {"model"}: forget a resident release that is not the champion

A request's ``model`` picks a resident release (``runtime.serve.residents``): a product (its champion),
``<product>:candidate``, a release id, a month, or a channel, ``champion`` or ``candidate`` (the default
product's); an unknown one is 404 ``model_not_found``, with the resident list, a month of several products
400 ``ambiguous_model``. Without ``model`` a request gets the default product's champion, or its candidate
for the ``canary_share`` of such requests (``runtime.serve.residents.CanarySplit``: an exact, even split, no
coin flip).

Every answer other than 2xx is OpenAI's error object ``{"error": {"message", "type", "param", "code"}}``.
Generation is CPU-bound and runs off the event loop, which stays free to answer health checks, metrics
and refusals: by default (``decode="batched"``) the requests on one release are decoded together by
one scheduler thread (``runtime.serve.batcher``), each step's choices handed to the loop; with
``decode="fork"`` each request decodes alone, one step per worker-thread call. At most
``max_concurrent`` generations run at once, ``max_queue`` more wait; beyond that a request gets 503
with ``Retry-After`` at once. On a paged engine with a KV budget, a request whose KV cache the budget
cannot hold (ever, or within the batcher's wait) gets 503 ``kv_budget_exceeded`` with ``Retry-After``
(in the stream, as its error event, once the stream has started). A client that leaves (streamed or not) ends its decode at the next step.
The admin API is off (404) unless a token is configured; paths must lie in a configured release
directory (403), and a rollback is never accepted from the network (403): it is a local act.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import anyio.to_thread
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from runtime.engine.kv_blocks import KVBudgetExceeded
from runtime.engine.sampling import make_sampler
from runtime.engine.tokenizer import NoChatTemplate
from runtime.engine.tracing import MAX_SEQ
from runtime.release.verify import PackageError, RollbackRefused
from runtime.serve.generation import Generation
from runtime.serve.openai_api import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    chunk_body,
    completion_body,
    model_card,
    new_id,
    parse_request,
    usage,
    usage_chunk,
)
from runtime.serve.residents import CHAMPION, CHANNELS, CanarySplit, ResidencyError
from runtime.serve.server import AdapterServer

log = logging.getLogger(__name__)
REQUEST_ID = "x-request-id"
CLOSE = {"Connection": "close"}
DECODE_MODES = ("batched", "fork")
# Generations decoding at once, by decode mode. Batched: requests sharing their release's batch; a step
# of 16 rows costs little more than one of 1 on CPU, since the weights are read once per step. Fork: one
# per core of the session's threads, since each fork's steps contend for the same threads.
DEFAULT_MAX_CONCURRENT = {"batched": 16, "fork": 2}
GENERATION_ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
# Prompts of at most this many characters in all are encoded on the event loop (~0.2 ms on the tiny
# tokenizer, 2 shared cores); a worker-thread hop per request cost the loop more than that. Longer ones
# (up to the body limit) go to a worker thread, so the loop stays free for other requests.
INLINE_ENCODE_CHARS = 512
ENDPOINTS = (*GENERATION_ENDPOINTS, "/v1/models", "/v1/adapters", "/v1/adapters/promote",
             "/v1/adapters/unload", "/healthz", "/ready", "/metrics")


@dataclass(frozen=True)
class ServeSettings:
    """What ``python -m runtime serve`` takes from its flags; the defaults are its defaults."""

    max_body_bytes: int = 1 << 20  # a prompt of 1 MiB is far past any context this engine decodes
    max_tokens: int = 256  # cap on max_tokens; a request above it gets 400 (not clamped: the client asked for more)
    # prompt + max_tokens, per prompt: the traced sequence bound, which the quantized cache's key table covers
    max_context_tokens: int = MAX_SEQ
    decode: str = "batched"  # DECODE_MODES: continuous batching per release, or a fork of the engine per request
    max_concurrent: int | None = None  # generations decoding at once; None: DEFAULT_MAX_CONCURRENT[decode]
    max_queue: int = 16  # generations waiting for a slot; beyond them, 503
    retry_after_s: int = 1
    header_timeout_s: float = 10.0  # request line + headers must arrive within this (runtime.serve.http_server)
    body_timeout_s: float = 10.0  # the body must arrive within this once the headers have
    keep_alive_s: int = 5  # an idle keep-alive connection is closed after this
    graceful_shutdown_s: int = 30  # on SIGTERM, requests in flight get this long to finish
    admin_token: str | None = None  # None: the admin API is off
    release_dirs: tuple[Path, ...] = field(default_factory=tuple)  # resolved; admin paths must lie inside one
    canary_share: float = 0.0  # of the requests without model, this fraction goes to the candidate (when one is loaded)

    def __post_init__(self):
        if self.decode not in DECODE_MODES:
            raise ValueError(f"decode={self.decode!r}: expected one of {', '.join(DECODE_MODES)}")
        if self.max_concurrent is None:
            object.__setattr__(self, "max_concurrent", DEFAULT_MAX_CONCURRENT[self.decode])


class Admission:
    """A bounded queue in front of ``max_concurrent`` generation slots; all on the event loop's thread."""

    def __init__(self, settings: ServeSettings, metrics):
        self.capacity = settings.max_concurrent + settings.max_queue
        self.retry_after = settings.retry_after_s
        self.slots = anyio.CapacityLimiter(settings.max_concurrent)
        self.metrics = metrics
        self.admitted = 0  # running + waiting

    def admit(self) -> None:
        """Count a request in, or refuse it with 503 when every slot and queue place is taken."""
        if self.admitted >= self.capacity:
            raise APIError(503, f"the device is busy: {self.capacity} generations running or queued; retry later",
                           "server_error", code="overloaded", headers={"Retry-After": str(self.retry_after)})
        self.admitted += 1
        self._update()

    def leave(self) -> None:
        self.admitted -= 1
        self._update()

    @asynccontextmanager
    async def running(self):
        """Wait in the queue for a slot; hold it while the generation decodes."""
        async with self.slots:
            self._update()
            yield
        self._update()

    def _update(self) -> None:
        self.metrics.in_flight.set(self.slots.borrowed_tokens)
        self.metrics.queue_depth.set(self.admitted - self.slots.borrowed_tokens)


class AdmittedStream(StreamingResponse):
    """A streamed answer that leaves the admission count when it is done, sent or not."""

    def __init__(self, content, admission: Admission, **kwargs):
        super().__init__(content, **kwargs)
        self.admission = admission

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.admission.leave()


async def until_disconnected(request: Request) -> None:
    """Return once the client has closed the connection (its body was read: the server says nothing else)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), err.status, headers=err.headers)


def sse(data) -> bytes:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()


class DeviceAPI:
    def __init__(self, server: AdapterServer, settings: ServeSettings):
        self.server, self.settings = server, settings
        self.metrics = server.metrics
        self.admission = Admission(settings, self.metrics)
        self.canary = CanarySplit(settings.canary_share)
        if settings.decode == "batched" and server.batcher is None:
            log.warning("this engine's backend cannot merge KV caches into batches: "
                        "each request decodes alone on a fork of its release's engine")

    # ------------------------------------------------------------------ plumbing

    async def read_json(self, request: Request) -> dict:
        """The JSON object of the body, within the size limit (413) and the body timeout (408)."""
        limit = self.settings.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise APIError(413, f"request body of {declared} bytes is over the limit of {limit}", code="body_too_large",
                           headers=CLOSE)  # the body is never read: the connection cannot carry another request
        body = bytearray()
        try:
            with anyio.fail_after(self.settings.body_timeout_s):
                async for chunk in request.stream():
                    body += chunk
                    if len(body) > limit:
                        raise APIError(413, f"request body is over the limit of {limit} bytes", code="body_too_large",
                                       headers=CLOSE)
        except TimeoutError:
            raise APIError(408, f"request body not received within {self.settings.body_timeout_s} s",
                           code="body_timeout", headers=CLOSE) from None
        try:
            data = json.loads(body or b"{}")
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise APIError(400, f"request body is not JSON: {err}", code="invalid_json") from None
        if not isinstance(data, dict):
            raise APIError(400, "request body must be a JSON object", code="invalid_json")
        return data

    def pick_release(self, model: str | None):
        """The resident release ``model`` names; without ``model``, the champion or (the canary share) the candidate."""
        residents = self.server.residents
        champion = self.champion()
        if model is not None:
            try:
                release = residents.find(model)
            except ResidencyError as err:
                raise residency_error(err, "model") from None
            if release is None:
                listed = ", ".join(f"{r.release_id} ({channel}"
                                   + ("" if r.product == residents.default_product else f" of {r.product}") + ")"
                                   for r, channel in residents.listing())
                raise APIError(404, f"model {model!r} is not resident here; resident: {listed} (GET /v1/models)",
                               "invalid_request_error", param="model", code="model_not_found")
            return release
        candidate = residents.candidate
        if candidate is not None and self.canary.to_candidate(candidate.release_id):
            return candidate
        return champion

    def champion(self):
        """The champion, or 503 while none is loaded."""
        release = self.server.active
        if release is None:
            raise APIError(503, "no release loaded yet", "server_error", code="no_active_release",
                           headers={"Retry-After": str(self.settings.retry_after_s)})
        return release

    # ------------------------------------------------------------------ public endpoints

    async def healthz(self, request: Request) -> Response:
        return JSONResponse(self.health())

    async def ready(self, request: Request) -> Response:
        self.champion()
        return JSONResponse(self.health())

    def health(self) -> dict:
        return self.server.health() | {"canary_share": float(self.canary.share)}

    async def metrics_text(self, request: Request) -> Response:
        body, content_type = self.metrics.exposition()
        return Response(body, media_type=content_type)

    async def models(self, request: Request) -> Response:
        data = [model_card(r.release_id, r.manifest["month"], int(r.loaded_at)) | {"product": r.product, "channel": channel}
                for r, channel in self.server.residents.listing()]
        return JSONResponse({"object": "list", "data": data})

    async def completions(self, request: Request) -> Response:
        body = parse_request(CompletionRequest, await self.read_json(request))
        encode = self.server.tokenizer.encode
        if sum(map(len, body.prompts)) <= INLINE_ENCODE_CHARS:  # on the loop: sooner than the hop to a worker
            prompts = [encode(p) for p in body.prompts]
        else:
            prompts = await anyio.to_thread.run_sync(lambda: [encode(p) for p in body.prompts])  # up to a MiB of text
        if any(not ids for ids in prompts):
            raise APIError(400, "a prompt encodes to no tokens", param="prompt")
        return await self.generate(request, body, prompts, body.max_tokens, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        body = parse_request(ChatCompletionRequest, await self.read_json(request))
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        try:
            ids = await anyio.to_thread.run_sync(self.server.tokenizer.encode_chat, messages)
        except NoChatTemplate as err:
            raise APIError(400, str(err), param="messages", code="no_chat_template") from None
        except Exception as err:  # jinja2's TemplateError and whatever the template raises on these messages
            raise APIError(400, f"the chat template refused these messages: {err}", param="messages",
                           code="chat_template_error") from None
        limit = body.token_limit if body.token_limit is not None else self.settings.max_tokens
        return await self.generate(request, body, [ids], limit, chat=True)

    # ------------------------------------------------------------------ generation

    async def generate(self, request: Request, body, prompts: list[list[int]], max_tokens: int, chat: bool) -> Response:
        if max_tokens > self.settings.max_tokens:
            raise APIError(400, f"max_tokens {max_tokens} is over this device's cap of {self.settings.max_tokens}",
                           param="max_tokens", code="max_tokens_too_large")
        longest = max(len(p) for p in prompts)
        if longest + max_tokens > self.settings.max_context_tokens:
            raise APIError(400, f"a prompt of {longest} tokens plus max_tokens {max_tokens} is over this device's "
                           f"context of {self.settings.max_context_tokens} tokens", param="prompt",
                           code="context_length_exceeded")
        release = self.pick_release(body.model)
        request.state.release_id, request.state.product = release.release_id, release.product
        self.admission.admit()
        try:
            generation = self.server.start_generation(release, prompts, max_tokens,
                                                      make_sampler(body.temperature, body.top_p, body.seed), body.stops,
                                                      self.settings.decode)
        except BaseException:
            self.admission.leave()
            raise
        prompt_tokens = sum(len(p) for p in prompts)
        started = request.state.started
        if body.stream:
            return AdmittedStream(self.stream(generation, body, prompt_tokens, started, chat), self.admission,
                                  media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        reasons: list[str | None] = [None] * len(prompts)

        async def collect():
            async for choices in self.decode(generation, started):
                for c in choices:
                    reasons[c.index] = c.finish_reason or reasons[c.index]

        collecting, leaving = asyncio.ensure_future(collect()), asyncio.ensure_future(until_disconnected(request))
        try:
            await asyncio.wait((collecting, leaving), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (leaving, collecting):  # a client that left ends its decode at the next step
                task.cancel()
            await asyncio.gather(collecting, leaving, return_exceptions=True)
            self.admission.leave()
        if not collecting.cancelled():
            collecting.result()  # raises what the generation raised
        if None in reasons:
            return error_response(APIError(499, "the client closed the connection", code="client_disconnected"))
        # The whole text decoded at once (cut at a stop sequence), not the sum of the streamed pieces.
        choices = [{"index": i, "text": t.text, "finish_reason": r} for i, (t, r) in enumerate(zip(generation.texts, reasons))]
        out = completion_body(new_id("chatcmpl" if chat else "cmpl"), release.release_id, choices,
                              usage(prompt_tokens, generation.completion_tokens), chat)
        return JSONResponse(out | {"activation": release.activation})

    async def decode(self, generation: Generation, started: float):
        """Each decode step's choices, once a slot is free."""
        async with self.admission.running():
            counted, first = 0, True
            try:
                while (choices := await generation.next_choices()) is not None:
                    if first:
                        self.metrics.first_token_seconds.observe(time.perf_counter() - started)
                        first = False
                    self.metrics.tokens.inc(generation.completion_tokens - counted)
                    counted = generation.completion_tokens
                    yield choices
            finally:
                generation.close()

    async def stream(self, generation: Generation, body, prompt_tokens: int, started: float, chat: bool):
        request_id, model = new_id("chatcmpl" if chat else "cmpl"), generation.release.release_id
        extra = {"activation": generation.release.activation}
        if chat:  # OpenAI's first chat chunk carries the role alone
            yield sse(chunk_body(request_id, model, 0, "", None, chat, first=True) | extra)
        try:
            async for choices in self.decode(generation, started):
                for c in choices:
                    yield sse(chunk_body(request_id, model, c.index, c.text, c.finish_reason, chat) | extra)
        except KVBudgetExceeded as err:  # not a failure of the release: the device is full
            yield sse(self.kv_budget_error(err).body())
        except Exception as err:  # the status line is sent: say it in the stream, as OpenAI does
            log.exception("generation failed mid-stream")
            # a 200 was sent: the request log cannot count it
            self.metrics.generation_errors.labels(model, generation.release.product).inc()
            yield sse(APIError(500, f"{type(err).__name__}: {err}", "server_error").body())
        else:
            if body.include_usage:
                yield sse(usage_chunk(request_id, model, usage(prompt_tokens, generation.completion_tokens), chat))
        yield sse("[DONE]")

    def kv_budget_error(self, err: KVBudgetExceeded) -> APIError:
        return APIError(503, str(err), "server_error", code="kv_budget_exceeded",
                        headers={"Retry-After": str(self.settings.retry_after_s)})

    # ------------------------------------------------------------------ admin

    def authorize(self, request: Request) -> None:
        token = self.settings.admin_token
        if token is None:
            raise APIError(404, "the admin API is off: start serve with --admin-token-file", "not_found_error",
                           code="admin_api_off")
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), token.encode()):
            raise APIError(401, "the admin API needs Authorization: Bearer <admin token>", "authentication_error",
                           code="invalid_admin_token", headers={"WWW-Authenticate": "Bearer"})

    def allowed_path(self, path: str) -> Path:
        resolved = Path(path).resolve()  # symlinks followed: a link in a release dir to elsewhere is elsewhere
        if not any(resolved == d or d in resolved.parents for d in self.settings.release_dirs):
            dirs = ", ".join(str(d) for d in self.settings.release_dirs) or "none configured (--release-dir)"
            raise APIError(403, f"{path}: not inside a release directory of this device ({dirs})", "permission_error",
                           param="path", code="path_not_allowed")
        return resolved

    async def admin_body(self, request: Request, known: tuple[str, ...]) -> dict:
        """The JSON body of an authorized admin call, with no field but ``known``."""
        self.authorize(request)
        body = await self.read_json(request)
        unknown = sorted(set(body) - set(known))
        if unknown:
            raise APIError(400, f"unknown field(s) {unknown}; known: {', '.join(known) or 'none'}", param=unknown[0],
                           code="unknown_field")
        return body

    async def adapters(self, request: Request) -> Response:
        body = await self.admin_body(request, ("path", "channel", "allow_rollback"))
        if body.get("allow_rollback"):
            raise APIError(403, "allow_rollback is never accepted over the network: a rollback is a local act "
                           "(python -m runtime pull --allow-rollback, then restart serve with --package)",
                           "permission_error", param="allow_rollback", code="rollback_is_local")
        path, channel = body.get("path"), body.get("channel", CHAMPION)
        if not isinstance(path, str) or not path:
            raise APIError(400, "path: the release directory or tarball to load is required", param="path")
        if channel not in CHANNELS:
            raise APIError(400, f"channel {channel!r}: one of {', '.join(CHANNELS)}", param="channel")
        resolved = self.allowed_path(path)
        try:  # hashing is CPU and disk work: a worker thread
            result = await anyio.to_thread.run_sync(lambda: self.server.load(resolved, channel=channel))
        except PackageError as err:
            status = 409 if isinstance(err, RollbackRefused) else 422
            active = self.server.active
            return JSONResponse(APIError(status, str(err), "release_refused", param="path", code=err.reason).body()
                                | {"reason": err.reason, "exit_code": err.exit_code,
                                   "active_release": active.release_id if active else None}, status)
        except ResidencyError as err:
            raise residency_error(err, "channel") from None
        return JSONResponse(result)

    async def promote(self, request: Request) -> Response:
        product = (await self.admin_body(request, ("product",))).get("product")
        if product is not None and product not in self.server.residents.products:
            raise APIError(400, f"product {product!r}: one of {', '.join(self.server.residents.products)}",
                           param="product", code="unknown_product")
        try:
            return JSONResponse(self.server.promote(product))
        except (ResidencyError, RollbackRefused) as err:
            raise residency_error(err, None) from None

    async def unload(self, request: Request) -> Response:
        model = (await self.admin_body(request, ("model",))).get("model")
        if not isinstance(model, str) or not model:
            raise APIError(400, "model: the release id, month or channel to unload is required", param="model")
        try:
            return JSONResponse(self.server.unload(model))
        except ResidencyError as err:
            raise residency_error(err, "model") from None


def residency_error(err: ResidencyError | RollbackRefused, param: str | None) -> APIError:
    """A resident-set change refused: 404 for a model not resident, 400 for a model that names releases of several
    products, 409 for any other state that forbids it."""
    code = err.code if isinstance(err, ResidencyError) else err.reason
    status = {"model_not_found": 404, "ambiguous_model": 400}.get(code, 409)
    return APIError(status, str(err), "invalid_request_error", param=param, code=code)


class RequestLog:
    """ASGI middleware: a request id (``X-Request-Id`` echoed, or made), one JSON log line and the
    request metrics per request. Pure ASGI, so streamed answers pass through unbuffered."""

    def __init__(self, app, metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        given = headers.get(REQUEST_ID.encode(), b"").decode("latin-1")
        request_id = given if given and len(given) <= 128 and given.isprintable() else uuid.uuid4().hex
        started = time.perf_counter()
        scope.setdefault("state", {}).update(request_id=request_id, started=started)
        status = 500

        async def send_with_id(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [*message.get("headers", []), (REQUEST_ID.encode(), request_id.encode())]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            seconds = time.perf_counter() - started
            endpoint = scope["path"] if scope["path"] in ENDPOINTS else "other"
            self.metrics.requests.labels(endpoint, str(status)).inc()
            self.metrics.request_seconds.labels(endpoint).observe(seconds)
            if status == 500 and endpoint in GENERATION_ENDPOINTS and scope["state"].get("release_id"):
                self.metrics.generation_errors.labels(scope["state"]["release_id"],  # a health trial watches it
                                                      scope["state"]["product"]).inc()
            log.info("request", extra={"fields": {
                "request_id": request_id, "method": scope["method"], "path": scope["path"], "status": status,
                "duration_s": round(seconds, 6), "release_id": scope["state"].get("release_id")}})


async def api_error(request: Request, err: APIError) -> Response:
    return error_response(err)


async def http_error(request: Request, err: HTTPException) -> Response:
    kind = {404: "not_found_error", 405: "invalid_request_error"}.get(err.status_code, "invalid_request_error")
    message = f"no route {request.method} {request.url.path}" if err.status_code in (404, 405) else str(err.detail)
    return error_response(APIError(err.status_code, message, kind, headers=dict(err.headers or {})))


async def kv_budget_error(request: Request, err: KVBudgetExceeded) -> Response:
    return error_response(request.app.state.api.kv_budget_error(err))


async def server_error(request: Request, err: Exception) -> Response:
    log.exception("request failed")
    return error_response(APIError(500, f"{type(err).__name__}: {err}", "server_error"))


def build_app(server: AdapterServer, settings: ServeSettings = ServeSettings()) -> Starlette:
    api = DeviceAPI(server, settings)
    routes = [
        Route("/v1/completions", api.completions, methods=["POST"]),
        Route("/v1/chat/completions", api.chat_completions, methods=["POST"]),
        Route("/v1/models", api.models, methods=["GET"]),
        Route("/v1/adapters", api.adapters, methods=["POST"]),
        Route("/v1/adapters/promote", api.promote, methods=["POST"]),
        Route("/v1/adapters/unload", api.unload, methods=["POST"]),
        Route("/healthz", api.healthz, methods=["GET"]),
        Route("/ready", api.ready, methods=["GET"]),
        Route("/metrics", api.metrics_text, methods=["GET"]),
    ]
    app = Starlette(routes=routes, exception_handlers={APIError: api_error, HTTPException: http_error,
                                                       KVBudgetExceeded: kv_budget_error, Exception: server_error})
    app.add_middleware(RequestLog, metrics=server.metrics)
    app.state.api = api
    return app
