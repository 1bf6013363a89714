"""``Ingress``: the cluster's HTTP entry (behind Ray Serve's proxy). For each request it
works out what the router needs — the prompt's token ids as the replica's engine will see
them, the caller's prefix-cache salt (from its key, as the replica's auth derives it) and
the session key (``prompt_cache_key``) — and forwards the request unchanged to the replica
the router picks, streaming the answer back. The replica's front end does everything else
(auth, limits, validation, errors, metrics).

Faults: a replica that fails before its first byte is retried once (the router then sees
its death or avoids it); one that fails mid-stream ends an SSE stream with an error event
and ``[DONE]`` (a non-streamed body is cut: the client sees a broken response)."""
from __future__ import annotations

import asyncio
import json
import logging
import time

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from kvserve.cluster.degrade import HEADER, DegradationController, request_class
from kvserve.cluster.ladder import LadderSettings
from kvserve.server.auth import cache_salt, match_key

logger = logging.getLogger("kvserve.cluster")
GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions")


def route_for(path: str, body: bytes, authorization: bytes | None, tokenizer, keys: dict) -> dict:
    """The router's view of a request: ``tokens`` (the first prompt's ids; empty when the
    body is not a generation request the server would accept), ``cache_salt``, ``session``;
    and for the ladder ``tenant`` and ``service_class`` (None: not a generation request)."""
    from kvserve.server import protocol
    from kvserve.server.tool_prompt import render_chat_prompt
    grant = match_key(keys, authorization) if keys else None
    route = {"tokens": [], "cache_salt": cache_salt(grant.tenant if grant else None), "session": None,
             "tenant": grant.tenant if grant else None, "service_class": None}
    if path not in GENERATION_PATHS:
        return route
    try:
        values = json.loads(body)
        route["session"] = values.get("prompt_cache_key")
        route["service_class"] = request_class(values, grant.service_class if grant else None)
        if path == "/v1/chat/completions":
            spec = protocol.parse_chat(values)
            route["tokens"] = tokenizer.encode(render_chat_prompt(tokenizer, spec.messages, spec.tools),
                                               add_special_tokens=False)
        elif not values.get("suffix"):
            first = protocol.parse_completion(values).prompts[0]
            route["tokens"] = list(first.token_ids) if first.token_ids is not None else tokenizer.encode(first.text)
    except Exception:               # the replica refuses it with the right error; route it anywhere
        route["tokens"] = []
    return route


def _sse_error(message: str) -> bytes:
    body = {"error": {"message": message, "type": "server_error", "code": "replica_failed"}}
    return f"data: {json.dumps(body)}\n\ndata: [DONE]\n\n".encode()


class Ingress:
    """Ray Serve deployment: ``replicas`` is the handle on the ``EngineReplica`` deployment."""

    def __init__(self, replicas, model_path: str, keys: dict, ladder: LadderSettings | None = None):
        from kvserve.tokenizer import Tokenizer
        from kvserve.cluster.ray_runtime import pin_replica_grpc_to_loopback
        pin_replica_grpc_to_loopback()
        self.replicas = replicas.options(stream=True)
        self.tokenizer = Tokenizer.load(model_path)
        self.keys = keys
        self.degradation = DegradationController(ladder) if ladder is not None else None

    async def __call__(self, request: Request) -> Response:
        body = await request.body()
        path, headers = request.url.path, list(request.headers.items())
        route = await asyncio.to_thread(route_for, path, body, request.headers.get("authorization", "").encode()
                                        or None, self.tokenizer, self.keys)
        service_class = route.pop("service_class")
        if self.degradation is not None and service_class is not None:
            body, refusal = self.degradation.apply(body, service_class, route["tenant"])
            if refusal is not None:
                return self._refuse(refusal)
        started = time.monotonic()
        for attempt in (1, 2):
            stream = self.replicas.handle.remote(request.method, path, request.url.query, headers, body, route=route)
            try:
                head = await stream.__anext__()
                break
            except Exception as exc:     # the replica died or failed before its first byte
                logger.warning("replica failed before the first byte (attempt %d): %r", attempt, exc)
                failed = getattr(getattr(exc, "cause", None), "replica_id", None)
                route = {**route, "avoid": [failed]} if failed else route
                if attempt == 2:
                    return JSONResponse({"error": {"message": "no replica could take the request", "type":
                                                   "server_error", "code": "replica_failed"}}, status_code=503,
                                        headers={"Retry-After": "1"})
        head_headers = {k: v for k, v in head["headers"] if k.lower() != "content-length"}
        head_headers["x-kvserve-replica"] = head.get("replica", "")
        on_first = None
        if self.degradation is not None:
            head_headers[HEADER] = self.degradation.current().header
            if service_class is not None:        # the ladder's signal: time to the first body byte (TTFT)
                def on_first():
                    self.degradation.record(service_class, head["status"], time.monotonic() - started)
        is_sse = head_headers.get("content-type", "").startswith("text/event-stream")
        return StreamingResponse(self._relay(stream, is_sse, on_first), status_code=head["status"],
                                 headers=head_headers)

    def _refuse(self, message: str) -> Response:
        """A request the current rung sheds: 503 + Retry-After, in the API's error shape."""
        error = {"message": message, "type": "server_error", "param": None, "code": "server_degraded"}
        return JSONResponse({"error": error}, status_code=503,
                            headers={"Retry-After": "5", HEADER: self.degradation.current().header})

    @staticmethod
    async def _relay(stream, is_sse: bool, on_first=None):
        try:
            async for chunk in stream:
                if on_first is not None:
                    on_first()
                    on_first = None
                yield chunk
        except Exception as exc:
            logger.warning("replica failed mid-stream: %r", exc)
            if is_sse:
                yield _sse_error("the replica serving this stream failed")
            else:
                raise
