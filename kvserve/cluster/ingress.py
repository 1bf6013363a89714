"""``Ingress``: the cluster's HTTP entry (behind Ray Serve's proxy). For each request it
works out what the router needs — the prompt's token ids as the replica's engine will see
them, the caller's prefix-cache salt (from its key, as the replica's auth derives it) and
the session key (``prompt_cache_key``) — and forwards the request unchanged to the replica
the router picks, streaming the answer back. The replica's front end does everything else
(auth, limits, validation, errors, metrics).

Faults: a replica that fails before its first byte is retried once (the router then sees
its death or avoids it); one that fails mid-stream ends an SSE stream with an error event
and ``[DONE]`` (a non-streamed body is cut: the client sees a broken response). Each failure
counts against the replica's circuit breaker (``breaker.py``), and so do 5xx answers and a
replica reporting an unhealthy engine (which opens it at once); while a breaker is not
closed the router skips that replica, and once ``open_s`` passed the ingress sends it one
``/ready`` probe pinned to it: 200 closes the breaker, anything else opens it again.

``GET /metrics`` is answered here: every replica's ``/metrics`` (scraped with the caller's
headers, pinned to each replica the router knows, so the replicas' own auth applies),
relabelled and summed, plus the ingress's series (``metrics.py``)."""
from __future__ import annotations

import asyncio
import json
import logging
import time

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from kvserve.cluster.breaker import ReplicaBreakers
from kvserve.cluster.degrade import HEADER, DegradationController, request_class
from kvserve.cluster.ladder import LadderSettings
from kvserve.cluster.metrics import ClusterMetrics
from kvserve.server.auth import cache_salt, match_key

logger = logging.getLogger("kvserve.cluster")
GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions")
FAULT_STATUSES = frozenset({500, 502, 504})     # a replica's own failure (503 is a refusal: overload, draining)
SCRAPE_TIMEOUT_S = 10.0                          # per replica, for /metrics scrapes and /ready probes


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
        self.breakers = ReplicaBreakers()
        self.metrics = ClusterMetrics()
        self._probes: set[asyncio.Task] = set()     # /ready probes in flight (held so they are not collected)

    async def __call__(self, request: Request) -> Response:
        body = await request.body()
        path, headers = request.url.path, list(request.headers.items())
        self._start_probes()
        if path == "/metrics" and request.method == "GET":
            return await self._scrape(request.url.query, headers)
        route = await asyncio.to_thread(route_for, path, body, request.headers.get("authorization", "").encode()
                                        or None, self.tokenizer, self.keys)
        service_class = route.pop("service_class")
        if self.degradation is not None and service_class is not None:
            body, refusal = self.degradation.apply(body, service_class, route["tenant"])
            if refusal is not None:
                return self._refuse(refusal)
        started = time.monotonic()
        opened = await self._forward(request.method, path, request.url.query, headers, body, route,
                                     generation=service_class is not None)
        if isinstance(opened, Response):
            return opened
        stream, head = opened
        head_headers = {k: v for k, v in head["headers"] if k.lower() != "content-length"}
        head_headers["x-kvserve-replica"] = head.get("replica", "")
        on_first = None
        if self.degradation is not None:
            head_headers[HEADER] = self.degradation.current().header
            if service_class is not None:        # the ladder's signal: time to the first body byte (TTFT)
                def on_first():
                    self.degradation.record(service_class, head["status"], time.monotonic() - started)
        is_sse = head_headers.get("content-type", "").startswith("text/event-stream")
        return StreamingResponse(self._relay(stream, is_sse, head.get("replica", ""), on_first),
                                 status_code=head["status"], headers=head_headers)

    async def _forward(self, method: str, path: str, query: str, headers: list, body: bytes, route: dict,
                       generation: bool):
        """Send the request to the router's replica and wait for its head: ``(stream, head)``;
        a failure before the first byte is retried once elsewhere, then a 503 ``Response``."""
        for attempt in (1, 2):
            sent = {**route, "blocked": self.breakers.blocked()}     # the router writes its decision here
            stream = self.replicas.handle.remote(method, path, query, headers, body, route=sent)
            try:
                head = await stream.__anext__()
            except Exception as exc:     # the replica died or failed before its first byte
                failed = self._observe_decision(sent, generation) or \
                    getattr(getattr(exc, "cause", None), "replica_id", None)
                logger.warning("replica %s failed before the first byte (attempt %d): %r", failed, attempt, exc)
                if failed:
                    self._replica_failed(failed, "before_first_byte")
                    route = {**route, "avoid": [*route.get("avoid", ()), failed]}
                if attempt == 1:
                    self.metrics.retries.inc()
                continue
            self._observe_decision(sent, generation)
            replica = head.get("replica", "")
            if head["status"] in FAULT_STATUSES:
                self._replica_failed(replica, "status_5xx")
            else:
                self.breakers.on_success(replica)
            return stream, head
        return JSONResponse({"error": {"message": "no replica could take the request", "type": "server_error",
                                       "param": None, "code": "replica_failed"}}, status_code=503,
                            headers={"Retry-After": "1"})

    def _observe_decision(self, route: dict, generation: bool | None) -> str | None:
        """Read the router's decision off ``route`` (``ray_router.py``): count it (unless
        ``generation`` is None: the ingress's own scrapes and probes), keep a breaker for
        each running replica, open those reporting an unhealthy engine; the chosen replica."""
        decision = route.get("decision")
        if not decision:
            return None
        if generation is not None:
            self.metrics.observe_decision(decision, generation)
        self.breakers.retain(decision["replicas"])
        for replica in decision["unhealthy"]:
            self.breakers.trip(replica)
        return decision["replica"]

    def _replica_failed(self, replica: str, stage: str) -> None:
        self.breakers.on_failure(replica)
        self.metrics.failures.inc(replica=replica, stage=stage)

    def _refuse(self, message: str) -> Response:
        """A request the current rung sheds: 503 + Retry-After, in the API's error shape."""
        error = {"message": message, "type": "server_error", "param": None, "code": "server_degraded"}
        return JSONResponse({"error": error}, status_code=503,
                            headers={"Retry-After": "5", HEADER: self.degradation.current().header})

    async def _relay(self, stream, is_sse: bool, replica: str, on_first=None):
        try:
            async for chunk in stream:
                if on_first is not None:
                    on_first()
                    on_first = None
                yield chunk
        except Exception as exc:
            logger.warning("replica %s failed mid-stream: %r", replica, exc)
            self._replica_failed(replica, "mid_stream")
            if is_sse:
                yield _sse_error("the replica serving this stream failed")
            else:
                raise

    async def _fetch(self, path: str, query: str, headers: list, pin: str | None) -> tuple[dict, bytes, dict]:
        """One whole GET through the router, to replica ``pin`` (None: the policy's choice):
        the replica's head, its body and the router's decision."""
        route = {"tokens": [], "replica": pin, "blocked": self.breakers.blocked()}

        async def exchange():
            stream = self.replicas.handle.remote("GET", path, query, headers, b"", route=route)
            head = await stream.__anext__()
            return head, b"".join([chunk async for chunk in stream])
        head, body = await asyncio.wait_for(exchange(), SCRAPE_TIMEOUT_S)
        self._observe_decision(route, None)
        return head, body, route.get("decision") or {}

    async def _scrape(self, query: str, headers: list) -> Response:
        """``GET /metrics``: one replica through the router (which names them all), then each
        other one pinned; a replica that does not answer is left out (``kvserve_cluster_replicas``)."""
        try:
            head, body, decision = await self._fetch("/metrics", query, headers, None)
        except Exception as exc:
            logger.warning("metrics scrape failed: %r", exc)
            return JSONResponse({"error": {"message": "no replica answered the metrics scrape", "type":
                                           "server_error", "param": None, "code": "replica_failed"}}, status_code=503)
        if head["status"] != 200:                # the replicas' auth: /metrics is an admin route with admin keys
            return Response(body, status_code=head["status"],
                            headers={k: v for k, v in head["headers"] if k.lower() != "content-length"})
        scrapes = {head.get("replica", ""): body.decode()}
        others = [r for r in decision.get("replicas", ()) if r not in scrapes]
        results = await asyncio.gather(*(self._fetch("/metrics", query, headers, r) for r in others),
                                       return_exceptions=True)
        for replica, result in zip(others, results):
            if not isinstance(result, BaseException) and result[0]["status"] == 200 \
                    and result[0].get("replica") == replica:
                scrapes[replica] = result[1].decode()
        self.metrics.update_breakers(self.breakers)
        if self.degradation is not None:
            self.metrics.update_rung(self.degradation.current().rung)
        text = self.metrics.render(scrapes, list(decision.get("replicas", scrapes)))
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    def _start_probes(self) -> None:
        """Send each half-open replica its ``/ready`` probe (in the background)."""
        for replica in self.breakers.due_probes():
            task = asyncio.create_task(self._probe(replica))
            self._probes.add(task)
            task.add_done_callback(self._probes.discard)

    async def _probe(self, replica: str) -> None:
        """``/ready`` pinned to ``replica``: 200 closes its breaker; an error or another status
        opens it again; an answer from another replica means it is gone (forgotten)."""
        try:
            head, _body, _decision = await self._fetch("/ready", "", [], replica)
        except Exception as exc:
            logger.warning("probe of replica %s failed: %r", replica, exc)
            self._replica_failed(replica, "probe")
            return
        if head.get("replica") != replica:
            self.breakers.forget(replica)
        elif head["status"] == 200:
            logger.info("replica %s passed its probe: back in routing", replica)
            self.breakers.on_success(replica)
        else:
            self._replica_failed(replica, "probe")
