"""``Ingress``: the cluster's HTTP entry (behind Ray Serve's proxy). For each request it
works out what the router needs — the prompt's token ids as the replica's engine will see
them, the caller's prefix-cache salt (from its key, as the replica's auth derives it) and
the session key (``prompt_cache_key``) — and forwards the request unchanged to the replica
the router picks, streaming the answer back. Before routing, a generation request passes the
tenants file's rate limits for the whole fleet (``limits.py``: 429 as the single server
answers) and, when the fleet's slots are all taken, waits for one in class order
(``admission.py``: 503 + Retry-After past the wait bound). The replica's front end does
everything else (auth, its own limits as a backstop, validation, errors, metrics).

Faults: a replica that fails before its first byte is retried once (the router then sees
its death or avoids it); one that fails mid-stream ends an SSE stream with an error event
and ``[DONE]`` (a non-streamed body is cut: the client sees a broken response). A routed
request's replica says every 2 s that it still works on it; 30 s of silence counts as a
failure at that point (``keepalive.py``: a lost reply is retried, not waited for forever). Each failure
counts against the replica's circuit breaker (``breaker.py``), and so do 5xx answers and a
replica reporting an unhealthy engine (which opens it at once); while a breaker is not
closed the router skips that replica, and once ``open_s`` passed the ingress sends it one
``/ready`` probe pinned to it: 200 closes the breaker, anything else opens it again.

Rung 4 of the degradation ladder, ``overflow_chat``, sends chat requests beyond what the
fleet takes to the fallback deployment when one is configured (``overflow.py``); every
forwarded answer says which served it (``x-kvserve-served-by: fleet|fallback``).

``GET /metrics`` is answered here: every replica's ``/metrics`` (scraped with the caller's
headers, pinned to each replica the router knows, so the replicas' own auth applies),
relabelled and summed, the fallback model's replicas' too (labelled ``deployment="fallback"``,
not in the sums), plus the ingress's series (``metrics.py``)."""
from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass

from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from kvserve.cluster.admission import ClassQueue, QueueTimeout
from kvserve.cluster.assign_wait import NotRouted, first_item, not_routed_response
from kvserve.cluster import serve_status
from kvserve.cluster.breaker import ReplicaBreakers
from kvserve.cluster.keepalive import ReplyLost, items, next_item
from kvserve.cluster.degrade import HEADER, DegradationController
from kvserve.cluster.ladder import LadderSettings
from kvserve.cluster.limits import FleetLimits, UsageTail
from kvserve.cluster.metrics import ClusterMetrics
from kvserve.cluster.overflow import SERVED_BY_HEADER, FallbackTarget, InFlight, for_fallback, overflows
from kvserve.cluster.route_view import route_for, sse_error
from kvserve.errors import KVServeError
from kvserve.server.tenants import TenantLimits

logger = logging.getLogger("kvserve.cluster")
FAULT_STATUSES = frozenset({500, 502, 504})     # a replica's own failure (503 is a refusal: overload, draining)
SCRAPE_TIMEOUT_S = 10.0                          # per replica, for /metrics scrapes and /ready probes


def _json_or_none(body: bytes) -> dict | None:
    """A body's JSON object (None when it is not one: the replica refuses it)."""
    try:
        values = json.loads(body)
    except ValueError:
        return None
    return values if isinstance(values, dict) else None


class _Ending:
    """What ends with a request at the ingress, once however it ends: the fleet slot and
    in-flight count it holds (``add``) and its tenant's rate-limit ticket, settled with the
    answer's status and the usage at the end of its body (``limits.py``)."""

    def __init__(self, limits: FleetLimits | None, ticket):
        self.limits, self.ticket = limits, ticket
        self.releases: list = []
        self.status = 500               # the answer's, once its head is in
        self.tail = UsageTail()
        self.ended = False

    def add(self, release) -> None:
        """Run ``release`` (no arguments) when the request ends."""
        self.releases.append(release)

    def __call__(self, status: int | None = None) -> None:
        """The request is over (``status``: its answer's, None: the relayed head's); once."""
        if self.ended:
            return
        self.ended = True
        for release in self.releases:
            release()
        if self.ticket is not None:
            self.limits.settle(self.ticket, self.status if status is None else status, self.tail.data)


@dataclass
class Pool:
    """One deployment the ingress forwards to (``fleet`` or ``fallback``): its streaming
    handle and its replicas' circuit breakers."""

    name: str
    deployment: object               # the DeploymentHandle (stream=True)
    breakers: ReplicaBreakers


class Ingress:
    """Ray Serve deployment: ``replicas`` is the handle on the ``EngineReplica`` deployment;
    ``fallback`` (with ``overflow``) the one on the fallback model's, if configured;
    ``assign_wait_s`` bounds a request's wait for a fleet replica (``assign_wait.py``; None:
    unbounded, the fixed-size fleet's behaviour); ``tenant_limits`` the tenants file's limits,
    enforced here for the whole fleet with the replicas' server-wide ``caps``
    (default_max_tokens, max_tokens_limit) (``limits.py``); ``fleet_slots`` (None: no queue
    here, Ray Serve's FIFO) the fleet's decode slots, for which generation requests wait in
    class order at most ``queue_wait_s`` (``admission.py``); ``breakers`` each replica's circuit
    breaker's (failures that open it, seconds open before a probe) (``breaker.py``)."""

    def __init__(self, replicas, model_path: str, keys: dict, ladder: LadderSettings | None = None,
                 fallback=None, overflow: FallbackTarget | None = None, assign_wait_s: float | None = None,
                 tenant_limits: dict[str, TenantLimits] | None = None, caps: tuple = (2048, None),
                 fleet_slots: int | None = None, queue_wait_s: float | None = None,
                 breakers: tuple[int, float] = (3, 5.0)):
        from kvserve.tokenizer import Tokenizer
        from kvserve.cluster.ray_runtime import pin_replica_grpc_to_loopback
        pin_replica_grpc_to_loopback()
        self.fleet = Pool("fleet", replicas.options(stream=True), ReplicaBreakers(*breakers))
        self.fallback = Pool("fallback", fallback.options(stream=True), ReplicaBreakers(*breakers)) \
            if fallback is not None and overflow is not None else None
        self.overflow = overflow if self.fallback is not None else None
        self.assign_wait_s = assign_wait_s
        self.in_flight = InFlight()                 # generation requests on the fleet (overflow's measure)
        self.limits = FleetLimits.enforced(tenant_limits or {}, *caps)      # fleet-wide (limits.py); None: no limits
        self.admission = ClassQueue(fleet_slots, queue_wait_s) if fleet_slots else None   # class order (admission.py)
        self.tokenizer = Tokenizer.load(model_path)
        self.keys = keys
        self.degradation = DegradationController(ladder) if ladder is not None else None
        self.metrics = ClusterMetrics()
        self._probes: set[asyncio.Task] = set()     # /ready probes in flight (held so they are not collected)

    async def __call__(self, request: Request) -> Response:
        body = await request.body()
        path, headers = request.url.path, list(request.headers.items())
        self._start_probes()
        if path == "/metrics" and request.method == "GET":
            return await self._scrape(request.url.query, headers)
        if path == serve_status.PATH and request.method == "GET":
            return await self._status(request.headers.get("authorization", "").encode() or None)
        route = await asyncio.to_thread(route_for, path, body, request.headers.get("authorization", "").encode()
                                        or None, self.tokenizer, self.keys)
        service_class, model = route.pop("service_class"), route.pop("model")
        if self.degradation is not None and service_class is not None:
            body, refusal = self.degradation.apply(body, service_class, route["tenant"])
            if refusal is not None:
                return self._stamp(self._refuse(refusal), route["tenant"])
        ticket = None
        if self.limits is not None and service_class is not None:    # the fleet-wide tenant limits (limits.py)
            try:
                ticket = self.limits.admit(route["tenant"], path, _json_or_none(body), len(route["tokens"]))
            except KVServeError as err:
                self.metrics.limited.inc(tenant=route["tenant"] or "", status=str(err.http_status))
                return self.limits.refusal(err, route["tenant"])
        end = _Ending(self.limits, ticket)
        try:
            response = await self._dispatch(request, path, headers, body, route, service_class, model, end)
        except BaseException:
            end(500)
            raise
        return self._stamp(response, route["tenant"])

    def _stamp(self, response: Response, tenant: str | None) -> Response:
        """An answer the ingress made itself (a refusal) with the tenant's fleet-wide
        ``x-ratelimit-*`` headers, as the single server puts on every answer; a relayed one
        has them already (``FleetLimits.with_headers``)."""
        if self.limits is not None and not isinstance(response, StreamingResponse):
            for name, value in self.limits.headers(tenant).items():
                response.headers[name] = value
        return response

    async def _dispatch(self, request: Request, path: str, headers: list, body: bytes, route: dict,
                        service_class, model, end: "_Ending") -> Response:
        """Pick the pool, wait for a fleet slot in class order (``admission.py``), forward,
        and relay the answer; ``end`` runs once when the request is over."""
        pool = self._pool_for(service_class, model)
        if pool is self.fallback:
            body = for_fallback(body, self.overflow)
            self.metrics.overflowed.inc()
        started = time.monotonic()
        if pool is self.fleet and service_class is not None:
            if self.admission is not None:
                try:
                    end.add(await self.admission.acquire(service_class))
                except QueueTimeout as exc:
                    return self._queue_timeout(exc, service_class, time.monotonic() - started, end)
                self.metrics.queue_wait.observe(time.monotonic() - started, **{"class": service_class.value})
            end.add(self.in_flight.ticket())
        opened = await self._forward(pool, request.method, path, request.url.query, headers, body, route,
                                     generation=service_class is not None)
        if isinstance(opened, Response):         # no replica took it: the request is over
            end(opened.status_code)
            return opened
        stream, head = opened
        head_headers = {k: v for k, v in head["headers"] if k.lower() != "content-length"}
        head_headers["x-kvserve-replica"] = head.get("replica", "")
        head_headers[SERVED_BY_HEADER] = pool.name
        if self.limits is not None:
            head_headers = self.limits.with_headers(route["tenant"], head_headers)
        on_first = None
        if self.degradation is not None:
            head_headers[HEADER] = self.degradation.current().header
            if service_class is not None and pool is self.fleet:     # the ladder measures the fleet: its TTFT
                def on_first():
                    self.degradation.record(service_class, head["status"], time.monotonic() - started)
        is_sse = head_headers.get("content-type", "").startswith("text/event-stream")
        end.status = head["status"]
        return StreamingResponse(self._relay(pool, stream, is_sse, head.get("replica", ""), on_first, end),
                                 status_code=head["status"], headers=head_headers, background=BackgroundTask(end))

    def _queue_timeout(self, exc: QueueTimeout, service_class, waited_s: float, end: "_Ending") -> Response:
        """A request that found no fleet slot within ``--queue-wait-s``: 503 + Retry-After."""
        end(503)
        self.metrics.not_routed.inc()
        self.metrics.queue_timeouts.inc(**{"class": service_class.value})
        if self.degradation is not None:
            self.degradation.record(service_class, 503, waited_s)
        error = {"message": str(exc), "type": "server_error", "param": None, "code": "fleet_busy"}
        return JSONResponse({"error": error}, status_code=503, headers={"Retry-After": str(exc.retry_after_s)})

    async def _status(self, authorization: bytes | None) -> Response:
        """``GET /cluster/status``: Ray Serve's view of this application (``serve_status.py``);
        with API keys configured, only for a caller with a valid key."""
        from kvserve.server.auth import match_key
        if self.keys and match_key(self.keys, authorization) is None:
            return serve_status.unauthorized()
        from ray import serve
        app_name = serve.get_replica_context().app_name
        return JSONResponse(await asyncio.to_thread(serve_status.application_status, app_name))

    def _pool_for(self, service_class, model) -> Pool:
        """The fallback for a request the ``overflow_chat`` rung sends there, else the fleet."""
        if self.fallback is not None and self.degradation is not None and overflows(
                self.degradation.current(), service_class, model, self.in_flight.count, self.overflow):
            return self.fallback
        return self.fleet

    async def _forward(self, pool: Pool, method: str, path: str, query: str, headers: list, body: bytes,
                       route: dict, generation: bool):
        """Send the request to the replica ``pool``'s router picks and wait for its head:
        ``(stream, head)``; a failure before the first byte is retried once elsewhere, then a
        503 ``Response``."""
        for attempt in (1, 2):
            sent = {**route, "blocked": pool.breakers.blocked()}     # the router writes its decision here
            stream = pool.deployment.handle.remote(method, path, query, headers, body, route=sent)
            try:
                head = await first_item(stream, sent, self.assign_wait_s if pool is self.fleet else None)
            except NotRouted as exc:
                logger.warning("%s: %s", pool.name, exc)
                self.metrics.not_routed.inc()
                return not_routed_response(exc, pool.name)
            except Exception as exc:     # the replica died or failed before its first byte
                failed = self._observe_decision(pool, sent, generation) or \
                    getattr(getattr(exc, "cause", None), "replica_id", None)
                if isinstance(exc, ReplyLost) and not sent.get("accepted"):
                    failed = None        # no replica accepted it (all full, or the reply lost): none to blame
                logger.warning("%s replica %s failed before the first byte (attempt %d): %r", pool.name, failed,
                               attempt, exc)
                if failed:
                    self._replica_failed(pool, failed, "reply_lost" if isinstance(exc, ReplyLost)
                                         else "before_first_byte")
                    route = {**route, "avoid": [*route.get("avoid", ()), failed]}
                if attempt == 1:
                    self.metrics.retries.inc()
                continue
            self._observe_decision(pool, sent, generation)
            replica = head.get("replica", "")
            if head["status"] in FAULT_STATUSES:
                self._replica_failed(pool, replica, "status_5xx")
            else:
                pool.breakers.on_success(replica)
            return stream, head
        return JSONResponse({"error": {"message": "no replica could take the request", "type": "server_error",
                                       "param": None, "code": "replica_failed"}}, status_code=503,
                            headers={"Retry-After": "1"})

    def _observe_decision(self, pool: Pool, route: dict, generation: bool | None) -> str | None:
        """Read the router's decision off ``route`` (``ray_router.py``): for the fleet count it
        (unless ``generation`` is None: the ingress's own scrapes and probes) and hand the
        ladder the fullest replica's KV use; keep a breaker for each running replica of the
        pool, open those reporting an unhealthy engine; the chosen replica."""
        decision = route.get("decision")
        if not decision:
            return None
        if pool is self.fleet:
            if generation is not None:
                self.metrics.observe_decision(decision, generation)
            if self.degradation is not None and "kv_usage" in decision:
                self.degradation.observe_kv(decision["kv_usage"])
        pool.breakers.retain(decision["replicas"])
        for replica in decision["unhealthy"]:
            pool.breakers.trip(replica)
        return decision["replica"]

    def _replica_failed(self, pool: Pool, replica: str, stage: str) -> None:
        pool.breakers.on_failure(replica)
        self.metrics.failures.inc(replica=replica, stage=stage)

    def _refuse(self, message: str) -> Response:
        """A request the current rung sheds: 503 + Retry-After, in the API's error shape."""
        error = {"message": message, "type": "server_error", "param": None, "code": "server_degraded"}
        return JSONResponse({"error": error}, status_code=503,
                            headers={"Retry-After": "5", HEADER: self.degradation.current().header})

    async def _relay(self, pool: Pool, stream, is_sse: bool, replica: str, on_first=None, end=None):
        """The replica's body chunks; ``on_first`` after the first; ``end`` (an ``_Ending``)
        sees every chunk's end of the body and runs once it ends (however it ends)."""
        try:
            async for chunk in items(stream):             # a silent replica raises ReplyLost (keepalive.py)
                if on_first is not None:
                    on_first()
                    on_first = None
                if end is not None:
                    end.tail.add(chunk)
                yield chunk
        except Exception as exc:
            logger.warning("replica %s failed mid-stream: %r", replica, exc)
            self._replica_failed(pool, replica, "mid_stream")
            if is_sse:
                yield sse_error("the replica serving this stream failed")
            else:
                raise
        finally:
            if end is not None:
                end()

    async def _fetch(self, pool: Pool, path: str, query: str, headers: list,
                     pin: str | None) -> tuple[dict, bytes, dict]:
        """One whole GET through ``pool``'s router, to replica ``pin`` (None: the policy's
        choice): the replica's head, its body and the router's decision."""
        route = {"tokens": [], "replica": pin, "blocked": pool.breakers.blocked()}

        async def exchange():
            stream = pool.deployment.handle.remote("GET", path, query, headers, b"", route=route)
            head = await next_item(stream)
            return head, b"".join([chunk async for chunk in items(stream)])
        head, body = await asyncio.wait_for(exchange(), SCRAPE_TIMEOUT_S)
        self._observe_decision(pool, route, None)
        return head, body, route.get("decision") or {}

    async def _scrape(self, query: str, headers: list) -> Response:
        """``GET /metrics``: the fleet's replicas and the fallback model's (``_scrape_pool``),
        relabelled and summed (``metrics.py``), then the ingress's own series. Both deployments
        are scraped at once; a fallback that fails leaves the fleet's series answering."""
        results = await asyncio.gather(*(self._scrape_pool(pool, query, headers) for pool in self._pools()),
                                       return_exceptions=True)
        if isinstance(results[0], BaseException):
            logger.warning("metrics scrape failed: %r", results[0])
            return JSONResponse({"error": {"message": "no replica answered the metrics scrape", "type":
                                           "server_error", "param": None, "code": "replica_failed"}}, status_code=503)
        head, body, scrapes, seen = results[0]
        if head["status"] != 200:                # the replicas' auth: /metrics is an admin route with admin keys
            return Response(body, status_code=head["status"],
                            headers={k: v for k, v in head["headers"] if k.lower() != "content-length"})
        fallback, fallback_seen = {}, []
        if len(results) > 1 and isinstance(results[1], BaseException):
            logger.warning("fallback metrics scrape failed: %r", results[1])
        elif len(results) > 1:
            fallback, fallback_seen = results[1][2], results[1][3]
        self.metrics.update_breakers(*(pool.breakers for pool in self._pools()))
        if self.admission is not None:
            self.metrics.update_admission(self.admission)
        if self.degradation is not None:
            self.metrics.update_ladder(self.degradation)
        text = self.metrics.render(scrapes, seen, fallback, fallback_seen)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    async def _scrape_pool(self, pool: Pool, query: str, headers: list) -> tuple[dict, bytes, dict, list]:
        """One replica of ``pool`` through its router (which names them all), then each other
        one pinned: (the first answer's head and body, replica -> /metrics text of those that
        answered 200, the replicas the router knows). A replica that does not answer is left
        out (``kvserve_cluster_replicas``); the first failing raises."""
        head, body, decision = await self._fetch(pool, "/metrics", query, headers, None)
        if head["status"] != 200:
            return head, body, {}, []
        scrapes = {head.get("replica", ""): body.decode()}
        others = [r for r in decision.get("replicas", ()) if r not in scrapes]
        results = await asyncio.gather(*(self._fetch(pool, "/metrics", query, headers, r) for r in others),
                                       return_exceptions=True)
        for replica, result in zip(others, results):
            if not isinstance(result, BaseException) and result[0]["status"] == 200 \
                    and result[0].get("replica") == replica:
                scrapes[replica] = result[1].decode()
        return head, body, scrapes, list(decision.get("replicas", scrapes))

    def _pools(self) -> list[Pool]:
        return [self.fleet] if self.fallback is None else [self.fleet, self.fallback]

    def _start_probes(self) -> None:
        """Send each half-open replica its ``/ready`` probe (in the background)."""
        for pool in self._pools():
            for replica in pool.breakers.due_probes():
                task = asyncio.create_task(self._probe(pool, replica))
                self._probes.add(task)
                task.add_done_callback(self._probes.discard)

    async def _probe(self, pool: Pool, replica: str) -> None:
        """``/ready`` pinned to ``replica``: 200 closes its breaker; an error or another status
        opens it again; an answer from another replica means it is gone (forgotten)."""
        try:
            head, _body, _decision = await self._fetch(pool, "/ready", "", [], replica)
        except Exception as exc:
            logger.warning("probe of replica %s failed: %r", replica, exc)
            self._replica_failed(pool, replica, "probe")
            return
        if head.get("replica") != replica:
            pool.breakers.forget(replica)
        elif head["status"] == 200:
            logger.info("replica %s passed its probe: back in routing", replica)
            pool.breakers.on_success(replica)
        else:
            self._replica_failed(pool, replica, "probe")
