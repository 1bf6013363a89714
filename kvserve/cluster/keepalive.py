"""A replica's word that it still works on a request, and the ingress's bound on silence.

A forwarded request's answer comes back as a stream of items (the head, then body chunks), and
a non-streamed answer's head only once its whole generation is done, so the ingress cannot
bound the wait for an item by the answer's length. Instead the replica says it is still there:
while its app produces nothing for ``BEAT_S`` it yields a keep-alive item (``with_keepalives``),
and the ingress, which skips those (``next_item``), gives a request up once it heard nothing
for ``IDLE_S`` after the router routed it: before the first byte it is retried elsewhere, mid-
stream an SSE stream ends with an error event (``ingress.py``).

Why: a reply can be lost between a replica and the ingress. Once (CI, a replica replaced after
its engine was killed) a request was routed to the surviving replica, which ran it and logged
its call as OK, and the ingress never received an item and waited until its client left, 120 s
later. With keep-alives such a request ends after ``IDLE_S`` and is retried.
"""
from __future__ import annotations

import asyncio
from typing import AsyncIterator

BEAT_S = 2.0                 # a replica's silence before it yields a keep-alive
IDLE_S = 30.0                # the ingress's bound on a routed request's silence (15 missed beats)
KEEPALIVE = {"keepalive": True}


def is_keepalive(item) -> bool:
    """Whether ``item`` is a replica's keep-alive (not the head, not a body chunk)."""
    return isinstance(item, dict) and item.get("keepalive") is True


class ReplyLost(Exception):
    """Nothing came from the replica for ``idle_s`` seconds: its reply is taken as lost."""

    def __init__(self, idle_s: float):
        super().__init__(f"no word from the replica for {idle_s:g} s")
        self.idle_s = idle_s


async def with_keepalives(items: AsyncIterator, beat_s: float = BEAT_S) -> AsyncIterator:
    """``items`` as they come, with ``KEEPALIVE`` yielded first (the replica has the request)
    and after every ``beat_s`` without an item. The pending item is never cancelled by a
    beat; if the consumer stops, it is, and ``items`` is closed."""
    yield KEEPALIVE
    iterator = items.__aiter__()
    pending = None
    try:
        while True:
            pending = asyncio.ensure_future(iterator.__anext__())
            while not (await asyncio.wait({pending}, timeout=beat_s))[0]:
                yield KEEPALIVE
            try:
                item = pending.result()
            except StopAsyncIteration:
                return
            pending = None
            yield item
    finally:
        if pending is not None and not pending.done():
            pending.cancel()
            await asyncio.gather(pending, return_exceptions=True)    # let the item's own cleanup run
        aclose = getattr(iterator, "aclose", None)
        if aclose is not None:
            await aclose()


async def next_item(stream, idle_s: float = IDLE_S):
    """The stream's next item that is not a keep-alive; ``ReplyLost`` (the stream cancelled)
    after ``idle_s`` without any item; ``StopAsyncIteration`` at its end."""
    while True:
        try:
            item = await asyncio.wait_for(stream.__anext__(), idle_s)    # a cancelled caller cancels it too
        except asyncio.TimeoutError:
            stream.cancel()
            raise ReplyLost(idle_s) from None
        if not is_keepalive(item):
            return item


async def wait_cancelling(futures: set, timeout: float | None):
    """``asyncio.wait(futures, timeout=timeout)``, except that if the caller is cancelled, the
    futures are too (as awaiting one directly would do): a client that leaves cancels the
    stream's pending item, not only the wait for it."""
    try:
        return await asyncio.wait(futures, timeout=timeout)
    except asyncio.CancelledError:
        for future in futures:
            future.cancel()
        raise


async def items(stream, idle_s: float = IDLE_S) -> AsyncIterator:
    """The stream's items without its keep-alives, each within ``idle_s`` (``next_item``)."""
    while True:
        try:
            item = await next_item(stream, idle_s)
        except StopAsyncIteration:
            return
        yield item
