"""The FastAPI application: routes, body checks and the error mapping.

Order of checks for a generation request (all before any response header):
auth (middleware) -> content type (415) -> body size (413) -> UTF-8 / JSON (400)
-> fields (400, naming the field) -> model: the base or a LoRA adapter (404), one the
tenant may use (403) -> starting / draining (503) -> the tenant's concurrency and
requests per minute (429) -> input guards (400 content_policy_violation, or redacted)
-> prompt size in characters, then tokenise in a worker thread, context length (400)
-> generation length: the tenant's or the server's default and limit (400) -> the
tenant's prompt-token limit (400) -> tokens per minute reserved (429) -> queue bound
(503 + Retry-After) -> engine. Every generation request leaves one audit line when it
ends (``audit.py``); a limited tenant's responses carry ``x-ratelimit-*`` headers
(``tenancy.RateLimitHeaders``).

Every generation response carries ``Server-Timing`` (``timing.py``): a whole body all
four phases; a stream sends its headers once its first token is in (queue, prefill,
ttft) and ends with a ``: server-timing total;dur=...`` comment before ``[DONE]``.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from kvserve.errors import KVServeError
from kvserve.server import json_body, lora, openapi, protocol
from kvserve.server.audit import AuditRecord
from kvserve.server.auth import AuthMiddleware, KeyGrant
from kvserve.server.console import add_console_routes
from kvserve.server.classes import choose_class
from kvserve.server.errors import (BodyTooLargeError, InternalServerError, NotFoundError, ServiceUnavailableError,
                                   UnsupportedMediaTypeError)
from kvserve.server.guarding import guard_input
from kvserve.server.metrics import ServerMetrics
from kvserve.server.responses import TokenSpeller
from kvserve.server.serving import (Generation, apply_generation_length, check_prompt_size, new_request_id,
                                    prepare_prompts, token_reservation)
from kvserve.server.state import ServerState
from kvserve.server.tenancy import RateLimitHeaders, RequestAccount, Tenancy
from kvserve.server.weights_routes import add_weight_routes
from kvserve.server.timing import HEADER as SERVER_TIMING

logger = logging.getLogger("kvserve.server")


@dataclass
class ServingContext:
    """Everything the routes share; one per server process."""

    tokenizer: object
    model_name: str
    model_aliases: frozenset[str]
    state: ServerState
    metrics: ServerMetrics
    max_body_bytes: int = 4 * 2**20
    default_deadline_s: float | None = None
    default_max_tokens: int | None = 2048          # a chat request without max_tokens (not to the context's end)
    max_tokens_limit: int | None = None            # the most max_tokens a request may ask (None: the context)
    api_keys: dict[str, KeyGrant | str] = field(default_factory=dict)   # key -> grant (or bare tenant)
    admin_keys: tuple[str, ...] = ()               # --admin-api-key / tenants file: the admin routes need one
    tenancy: Tenancy = field(default_factory=Tenancy)   # the tenants file's limits, guards and audit log
    client: object = None                          # EngineClient once started
    start_drain: Callable[[], None] | None = None  # set by the launcher: POST /admin/drain calls it
    active: set = field(default_factory=set)       # Generations in flight
    disaggregated: bool = False                    # --disaggregate: GET /admin/disagg is served
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self):
        self.speller = TokenSpeller(self.tokenizer)


# ------------------------------------------------------------------- errors
def error_response(err: KVServeError, headers: dict[str, str] | None = None) -> JSONResponse:
    headers = dict(headers or {})
    retry_after_s = getattr(err, "retry_after_s", None)          # 503 and 429
    if retry_after_s is not None:
        headers["Retry-After"] = str(retry_after_s)
    return JSONResponse(err.to_dict(), status_code=err.http_status, headers=headers)


def rejection(ctx: ServingContext, err: KVServeError, headers: dict[str, str] | None = None) -> JSONResponse:
    """A typed error's response, counted in ``kvserve_requests_rejected_total``."""
    ctx.metrics.rejected.inc(status=str(err.http_status), code=str(err.code))
    return error_response(err, headers)


def _install_error_handlers(app: FastAPI, ctx: ServingContext) -> None:
    @app.exception_handler(KVServeError)
    async def _typed(request: Request, err: KVServeError):
        return rejection(ctx, err)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        return error_response(NotFoundError(f"{request.method} {request.url.path}: {exc.detail}",
                                            status=exc.status_code if exc.status_code == 405 else 404))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        logger.exception("unhandled error on %s", request.url.path)
        ctx.metrics.rejected.inc(status="500", code="internal_error")
        return error_response(InternalServerError("internal server error"))


# --------------------------------------------------------------------- body
async def read_json(request: Request, ctx: ServingContext) -> dict:
    """The request's JSON object, after the content-type and size checks."""
    content_type = request.headers.get("content-type")
    if content_type is not None and content_type.split(";")[0].strip().lower() != "application/json":
        raise UnsupportedMediaTypeError(f"Content-Type must be application/json, got {content_type!r}")
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > ctx.max_body_bytes:
        raise BodyTooLargeError(f"the body has {length} bytes; the limit is {ctx.max_body_bytes}")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > ctx.max_body_bytes:
                raise BodyTooLargeError(f"the body exceeds the limit of {ctx.max_body_bytes} bytes")
            chunks.append(chunk)
    except ClientDisconnect as exc:
        raise protocol.InvalidRequestError("the client disconnected while sending the body",
                                           code="client_disconnected") from exc
    return json_body.parse_json_body(b"".join(chunks))


def select_adapter(ctx: ServingContext, model: str | None) -> str | None:
    """The LoRA adapter a request's ``model`` names (None: the base model); 404 if it names
    neither the base model nor a loaded adapter (``server/lora.py``)."""
    adapters = ctx.client.adapters if ctx.client is not None else {}
    return lora.select_adapter(model, ctx.model_name, ctx.model_aliases, adapters)


# -------------------------------------------------------------- generation
async def _watch_disconnect(receive, generation: Generation) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            generation.control("disconnect")
            return


class EventStreamResponse(Response):
    """SSE response that watches for the client going away while it streams, so a
    disconnect aborts the request at once, not at the next write. ``prefetched`` chunks
    (taken from ``events`` before the headers were built) go out first; ``watcher`` is
    the disconnect watcher already running, if any."""

    def __init__(self, generation: Generation, events=None, prefetched: list[bytes] = (),
                 headers: dict[str, str] | None = None, watcher: asyncio.Task | None = None):
        self.status_code = 200                          # no body, no content-length
        self.background = None
        self.raw_headers = [(b"content-type", b"text/event-stream; charset=utf-8"),
                            (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no"),
                            *((k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in (headers or {}).items())]
        self.generation = generation
        self.events = events
        self.prefetched = list(prefetched)
        self.watcher = watcher

    async def __call__(self, scope, receive, send) -> None:
        watcher = self.watcher or asyncio.create_task(_watch_disconnect(receive, self.generation))
        events = self.events if self.events is not None else self.generation.stream()
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            for chunk in self.prefetched:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            async for chunk in events:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:
            pass                                           # client gone mid-write
        finally:
            watcher.cancel()
            await events.aclose()


async def _prefetch(events, generation: Generation) -> list[bytes]:
    """The stream's chunks up to the first one sent after its first token (or all of
    them, if it ends before any token): the headers then know queue, prefill and ttft."""
    chunks = []
    while True:
        try:
            chunks.append(await events.__anext__())
        except StopAsyncIteration:
            return chunks
        if generation.first_token_seen:
            return chunks


async def _stream_response(request: Request, generation: Generation) -> EventStreamResponse:
    """The SSE response, its headers built once the first token is in."""
    watcher = asyncio.create_task(_watch_disconnect(request.receive, generation))
    events = generation.stream()
    try:
        prefetched = await _prefetch(events, generation)
    except BaseException:
        watcher.cancel()
        await events.aclose()
        raise
    headers = {SERVER_TIMING: generation.server_timing(ended=False)}
    return EventStreamResponse(generation, events, prefetched, headers, watcher)


async def generate(request: Request, ctx: ServingContext, kind: str):
    """A completions or chat request, from body to response; one audit line when it ends."""
    scope_state = request.scope.get("state", {})
    account = RequestAccount(ctx.tenancy, AuditRecord(new_request_id(kind), scope_state.get("tenant"), kind),
                             ctx.metrics)
    generation = None
    try:
        generation = await _admit_generation(request, ctx, kind, account, scope_state)
        generation.submit()
    except BaseException as exc:
        account.record.refuse(*_refusal_status(exc))
        if generation is not None:
            generation.close()                            # aborts what was submitted; ends the account
        account.end()
        raise
    if generation.spec.stream:
        return await _stream_response(request, generation)
    watcher = asyncio.create_task(_watch_disconnect(request.receive, generation))
    try:
        result = await generation.collect()
    except KVServeError as err:                           # deadline, engine refusal: whatever timing is known
        return rejection(ctx, err, {SERVER_TIMING: generation.server_timing()})
    finally:
        watcher.cancel()
    if result is None:
        return Response(status_code=499)                  # nobody is listening any more
    return JSONResponse(result, headers={SERVER_TIMING: generation.server_timing()})


def _refusal_status(exc: BaseException) -> tuple[int, str]:
    """(HTTP status, error code) the audit log records for a request that ended with ``exc``."""
    if isinstance(exc, KVServeError):
        return exc.http_status, exc.code
    if isinstance(exc, asyncio.CancelledError):
        return 499, "client_disconnected"
    return 500, "internal_error"


async def _admit_generation(request: Request, ctx: ServingContext, kind: str, account: RequestAccount,
                            scope_state: dict) -> Generation:
    """Every check before the engine, in the module docstring's order; a refusal raises
    (the caller ends the account). The size check runs before the guards see the text."""
    tenant = account.record.tenant
    body = await read_json(request, ctx)
    spec = protocol.parse_completion(body) if kind == "completion" else protocol.parse_chat(body)
    account.record.model, account.record.stream = spec.model, spec.stream
    adapter = select_adapter(ctx, spec.model)
    ctx.tenancy.check_model(tenant, adapter, ctx.model_aliases)
    ctx.state.check_accepting(ctx.client)
    account.ticket = ctx.tenancy.limiter.admit(tenant)
    check_prompt_size(spec, ctx.client.info)
    await guard_input(ctx, spec, account.record)
    prompts = await asyncio.to_thread(prepare_prompts, spec, ctx.tokenizer, ctx.client.info)   # never on the loop
    caps = ctx.tenancy.caps(tenant, ctx.default_max_tokens, ctx.max_tokens_limit)
    apply_generation_length(spec, prompts, ctx.client.info, caps.default_max_tokens, caps.max_tokens_limit)
    ctx.tenancy.check_prompt_tokens(tenant, max(len(p.token_ids) for p in prompts),
                                    "messages" if kind == "chat" else "prompt")
    ctx.tenancy.limiter.reserve_tokens(account.ticket, token_reservation(spec, prompts, ctx.client.info))
    service_class = choose_class(scope_state.get("service_class"), spec.service_class)
    ctx.state.admit(ctx.client, len(prompts), sum(len(p.token_ids) for p in prompts))
    return Generation(ctx, spec, prompts, tenant, adapter, service_class, account=account)


# ------------------------------------------------------------------ routes
def _add_routes(app: FastAPI, ctx: ServingContext) -> None:
    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, ctx, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, ctx, "chat")

    @app.get("/v1/models")
    async def models():
        """The served models: the base model and the loaded LoRA adapters."""
        return {"object": "list", "data": _model_cards(ctx)}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        """One served model (the base model, by its name or an alias, or a loaded adapter); 404 otherwise."""
        wanted = select_adapter(ctx, model_id) or ctx.model_name
        return next(card for card in _model_cards(ctx) if card["id"] == wanted)

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        pid = ctx.client.info.pid if ctx.client is not None and ctx.client.info else None
        return {"status": "ok", "engine_pid": pid}

    @app.api_route("/ready", methods=["GET", "HEAD"])
    async def ready():
        reason = ctx.state.not_ready_reason(ctx.client)
        ctx.metrics.ready.set(0 if reason else 1)
        if reason:
            return error_response(ServiceUnavailableError(reason, code="not_ready"))
        return {"status": "ready"}

    @app.get("/metrics")
    async def metrics():
        if ctx.client is not None:
            ctx.client.refresh_queue_gauges()
        ctx.metrics.ready.set(0 if ctx.state.not_ready_reason(ctx.client) else 1)
        return PlainTextResponse(ctx.metrics.render(), media_type="text/plain; version=0.0.4")

    _add_admin_routes(app, ctx)
    add_weight_routes(app, ctx, _engine, read_json)
    if ctx.disaggregated:
        _add_disagg_routes(app, ctx)
    _add_token_routes(app, ctx)
    add_console_routes(app, ctx)

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi_json():
        """The OpenAPI document (built once): request bodies derived from protocol.py's tables."""
        if app.openapi_schema is None:
            app.openapi_schema = openapi.build_document(app)
        return app.openapi_schema


def _model_cards(ctx: ServingContext) -> list[dict]:
    """``/v1/models`` entries: the base model's, then the loaded adapters'."""
    info = ctx.client.info if ctx.client is not None else None
    max_model_len = info.max_model_len if info else None
    card = {"id": ctx.model_name, "object": "model", "created": ctx.created, "owned_by": "kvserve",
            "max_model_len": max_model_len}
    adapters = ctx.client.adapters if ctx.client is not None else {}
    return [card, *lora.adapter_cards(adapters, ctx.model_name, max_model_len)]


def _add_admin_routes(app: FastAPI, ctx: ServingContext) -> None:
    @app.post("/admin/reset_prefix_cache")
    async def reset_prefix_cache():
        """Admin: drop the engine's prefix-cached blocks (behind the API key when keys are set)."""
        num_blocks = await _engine(ctx).reset_prefix_cache()
        logger.info("prefix cache reset: %d cached blocks dropped", num_blocks)
        return {"reset": True}

    @app.post("/admin/drain")
    async def drain():
        """Admin: stop taking requests and drain them, as on SIGTERM; the server exits once drained."""
        if ctx.start_drain is None:
            raise ServiceUnavailableError("this server was not started by the launcher and cannot drain",
                                          code="not_supported")
        ctx.start_drain()
        return {"draining": True}

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        """Admin (vLLM's API): load a PEFT LoRA folder under a name requests select as ``model``."""
        name, path = lora.parse_load_body(await read_json(request, ctx), ctx.model_aliases)
        adapter = await _engine(ctx).load_adapter(name, path)
        logger.info("LoRA adapter %r loaded from %s (id %s)", name, adapter["path"], adapter["id"][:12])
        return {"lora_name": name, "loaded": True, "id": adapter["id"], "path": adapter["path"],
                "rank": adapter["rank"], "target_modules": adapter["target_modules"]}

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        """Admin (vLLM's API): the name stops selecting the adapter; running requests finish."""
        name = lora.parse_unload_body(await read_json(request, ctx))
        await _engine(ctx).unload_adapter(name)
        logger.info("LoRA adapter %r unloaded", name)
        return {"lora_name": name, "unloaded": True}


def _add_disagg_routes(app: FastAPI, ctx: ServingContext) -> None:
    @app.get("/admin/disagg")
    async def disagg_status():
        """Admin (--disaggregate): both engines' block accounting checked between their steps
        (``ok``; used / free / cached-only blocks, pending exports), the staging area, the
        driver's counters, its requests per stage and the engines' pids."""
        return await _engine(ctx).status()


def _engine(ctx: ServingContext):
    """The engine client, or 503 while there is none that runs."""
    if ctx.client is None or ctx.client.dead or ctx.client.info is None:
        raise ServiceUnavailableError("the engine is not running", code="engine_unavailable")
    return ctx.client


def _add_token_routes(app: FastAPI, ctx: ServingContext) -> None:
    @app.post("/tokenize")
    async def tokenize(request: Request):
        values = protocol.parse_tokenize(await read_json(request, ctx))
        select_adapter(ctx, values.get("model"))       # adapters share the base model's tokenizer
        tokens = await asyncio.to_thread(_tokenize_values, ctx.tokenizer, values)   # never on the loop
        info = ctx.client.info if ctx.client is not None else None
        return {"tokens": tokens, "count": len(tokens), "max_model_len": info.max_model_len if info else None}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        values = protocol.parse_detokenize(await read_json(request, ctx))
        select_adapter(ctx, values.get("model"))
        bad = [t for t in values["tokens"] if t >= ctx.tokenizer.vocab_size]
        if bad:
            raise protocol.InvalidRequestError(f"token id {bad[0]} is outside the vocabulary", param="tokens")
        return {"prompt": ctx.tokenizer.decode(values["tokens"])}

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        """The tokenizer's configuration, as vLLM's ``/tokenizer_info`` serves it (lm-eval reads it)."""
        if ctx.tokenizer is None:
            raise ServiceUnavailableError("the tokenizer is not loaded", code="not_ready")
        info = ctx.client.info if ctx.client is not None else None
        return _tokenizer_info(ctx.tokenizer, info.max_model_len if info else None)


def _tokenizer_info(tokenizer, max_model_len: int | None) -> dict:
    """The tokenizer's special tokens, chat template and limits (vLLM's field names)."""
    return {"tokenizer_class": type(tokenizer).__name__, "vocab_size": tokenizer.vocab_size,
            "model_max_length": max_model_len, "bos_token": tokenizer.bos_token,
            "bos_token_id": tokenizer.bos_token_id, "eos_token": tokenizer.eos_token,
            "eos_token_id": tokenizer.eos_token_id, "eos_token_ids": sorted(tokenizer.eos_token_ids),
            "pad_token": None, "add_bos_token": tokenizer.add_bos, "add_eos_token": tokenizer.add_eos,
            "chat_template": tokenizer.chat_template}


def _tokenize_values(tokenizer, values: dict) -> list[int]:
    """The token ids of a /tokenize body's prompt or rendered messages."""
    if values.get("messages") is not None:
        text = tokenizer.apply_chat_template(values["messages"], add_generation_prompt=values.get(
            "add_generation_prompt", True) is not False)
        return tokenizer.encode(text, add_special_tokens=False)
    return tokenizer.encode(values["prompt"], add_special_tokens=values.get("add_special_tokens") is not False)


def build_app(ctx: ServingContext) -> AuthMiddleware:
    """The ASGI application: FastAPI routes behind the rate-limit headers (when a tenant is
    limited) and the API-key middleware."""
    app = FastAPI(title="kvserve", docs_url=None, redoc_url=None, openapi_url=None)
    _install_error_handlers(app, ctx)
    _add_routes(app, ctx)
    app.state.ctx = ctx
    inner = RateLimitHeaders(app, ctx.tenancy.limiter) if ctx.tenancy.limiter.has_limits else app
    return AuthMiddleware(inner, ctx.api_keys, ctx.admin_keys)
