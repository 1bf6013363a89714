"""A request's bounded wait for a replica (scale from zero, docs/cluster.md).

Ray Serve 2.60 queues a request for a deployment with no running replica in the caller's
handle (here the ingress): the handle pushes its queue to the controller at once, the
autoscaler's scale-from-zero path starts a replica, and the request is routed once the replica
runs. Nothing refuses it for "no replica", but nothing bounds the wait either: the ingress
does. The router writes its decision into the request's ``route`` when it routes it
(``ray_router.py``), so "no decision yet" means "still queued, no replica took it": past
``wait_s`` the ingress cancels the request (Ray drops it from the handle's queue) and answers
503 with ``Retry-After``. Once routed, the answer takes as long as it takes (a long generation
is not a cold start), as long as the replica says it works on it (``keepalive.py``)."""
from __future__ import annotations

import asyncio
import math
import time

from starlette.responses import JSONResponse

from kvserve.cluster.keepalive import IDLE_S, ReplyLost, is_keepalive, wait_cancelling

POLL_S = 0.1                 # how often a queued request checks whether it was routed
RETRY_AFTER_S = 10           # a replica start on this machine: ~20-45 s; clients retry sooner


class NotRouted(Exception):
    """No replica took the request within the wait (it is cancelled)."""

    def __init__(self, waited_s: float):
        super().__init__(f"no replica took the request within {waited_s:.1f} s")
        self.waited_s = waited_s


async def first_item(stream, route: dict, wait_s: float | None, idle_s: float = IDLE_S):
    """The stream's first item that is not a keep-alive (the replica's head). With ``wait_s``,
    raises ``NotRouted`` (after cancelling the request) when the router has not routed it
    within ``wait_s``; once routed, raises ``ReplyLost`` (cancelled too) after ``idle_s``
    without a word from the replica (``keepalive.py``)."""
    deadline = None if wait_s is None else time.monotonic() + wait_s
    heard = None                        # when the router routed it, or the replica last spoke
    head = asyncio.ensure_future(stream.__anext__())
    while True:
        timeout = POLL_S if heard is None else max(0.0, heard + idle_s - time.monotonic())
        done, _ = await wait_cancelling({head}, timeout)
        now = time.monotonic()
        if done:
            item = head.result()
            if not is_keepalive(item):
                return item
            heard = now
            head = asyncio.ensure_future(stream.__anext__())
        elif "decision" not in route:
            if deadline is not None and now >= deadline:
                _give_up(head, stream)
                raise NotRouted(wait_s)
        elif heard is None:
            heard = now
        elif now - heard >= idle_s:
            _give_up(head, stream)
            raise ReplyLost(idle_s)


def _give_up(head: asyncio.Future, stream) -> None:
    head.cancel()
    stream.cancel()


def not_routed_response(exc: NotRouted, deployment: str) -> JSONResponse:
    """503 + Retry-After in the API's error shape: no replica of ``deployment`` took the
    request in time (none running and none started within the wait, or all full)."""
    message = (f"no replica of the {deployment} deployment took the request within {exc.waited_s:g} s "
               "(it may be starting from zero); retry later")
    error = {"message": message, "type": "server_error", "param": None, "code": "no_replica_available"}
    retry = max(1, math.ceil(min(RETRY_AFTER_S, exc.waited_s)))
    return JSONResponse({"error": error}, status_code=503, headers={"Retry-After": str(retry)})
