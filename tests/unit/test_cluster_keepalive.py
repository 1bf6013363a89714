"""The replica's keep-alives and the ingress's bound on a routed request's silence
(``kvserve/cluster/keepalive.py``, ``assign_wait.first_item``): a lost reply ends in a bounded
time and the request is cancelled; a slow answer that keeps saying it works is waited for."""
from __future__ import annotations

import asyncio

import pytest

from kvserve.cluster.assign_wait import NotRouted, first_item
from kvserve.cluster.keepalive import KEEPALIVE, ReplyLost, is_keepalive, items, next_item, with_keepalives


class _Stream:
    """Stands in for Ray's DeploymentResponseGenerator: ``script`` is (seconds to wait, item)
    pairs; after them it is silent forever (a lost reply) or ends (``ends``)."""

    def __init__(self, script, ends: bool = False):
        self.script, self.ends, self.cancelled = list(script), ends, False

    async def __anext__(self):
        if not self.script:
            if self.ends:
                raise StopAsyncIteration
            await asyncio.sleep(3600)
        delay, item = self.script.pop(0)
        await asyncio.sleep(delay)
        return item

    def cancel(self):
        self.cancelled = True


async def _app(chunks):
    for delay, chunk in chunks:
        await asyncio.sleep(delay)
        yield chunk


async def _collect(agen):
    return [item async for item in agen]


def test_a_replica_beats_first_and_while_its_app_is_silent():
    got = asyncio.run(_collect(with_keepalives(_app([(0.35, {"status": 200}), (0.0, b"a"), (0.25, b"b")]),
                                               beat_s=0.1)))
    assert got[0] == KEEPALIVE                                          # the replica has the request
    assert [g for g in got if not is_keepalive(g)] == [{"status": 200}, b"a", b"b"]
    head, b = got.index({"status": 200}), got.index(b"b")
    assert head >= 3 and all(is_keepalive(g) for g in got[1:head])      # beats while the app was silent
    assert got[head + 1] == b"a" and b >= head + 3                      # none between items that came at once


def test_a_consumer_that_leaves_closes_the_app():
    closed = []

    async def app():
        try:
            yield {"status": 200}
            await asyncio.sleep(3600)
            yield b"never"
        finally:
            closed.append(True)

    async def leave_after_beats():
        agen = with_keepalives(app(), beat_s=0.05)
        seen = [await agen.__anext__() for _ in range(4)]       # beat, head, beat, beat
        await agen.aclose()
        return seen
    seen = asyncio.run(leave_after_beats())
    assert seen[1] == {"status": 200} and is_keepalive(seen[2]) and closed == [True]


def test_the_ingress_skips_keepalives_and_ends_with_the_stream():
    stream = _Stream([(0, KEEPALIVE), (0, {"status": 200}), (0, KEEPALIVE), (0, b"x")], ends=True)
    assert asyncio.run(next_item(stream, idle_s=1)) == {"status": 200}
    assert asyncio.run(_collect(items(stream, idle_s=1))) == [b"x"]


def test_a_silent_stream_is_a_lost_reply_and_is_cancelled():
    stream = _Stream([(0, {"status": 200})])
    with pytest.raises(ReplyLost):
        asyncio.run(_collect(items(stream, idle_s=0.2)))
    assert stream.cancelled


def test_a_routed_request_with_no_word_is_given_up_after_the_idle_bound():
    """The CI hang: routed, the replica ran it, nothing came back. Unbounded before (wait_s
    None: a fixed fleet), it now ends after idle_s and the ingress retries it elsewhere."""
    stream = _Stream([])
    route = {"decision": {"replica": "a"}}
    with pytest.raises(ReplyLost):
        asyncio.run(asyncio.wait_for(first_item(stream, route, wait_s=None, idle_s=0.3), 5))
    assert stream.cancelled


def test_a_slow_answer_that_beats_is_waited_for():
    beats = [(0.1, KEEPALIVE)] * 8                 # 0.8 s of beats, then the head: past the 0.3 s bound
    stream = _Stream([*beats, (0.1, {"status": 200})])
    route = {"decision": {"replica": "a"}}
    assert asyncio.run(first_item(stream, route, wait_s=0.1, idle_s=0.3)) == {"status": 200}
    assert not stream.cancelled


def test_an_unrouted_request_still_gets_not_routed_not_reply_lost():
    stream = _Stream([])
    with pytest.raises(NotRouted):
        asyncio.run(first_item(stream, {}, wait_s=0.2, idle_s=0.05))
    assert stream.cancelled


def test_a_caller_that_is_cancelled_cancels_the_pending_item():
    """A client that leaves cancels the relay's task: the stream's pending item is cancelled
    with it, as awaiting the stream directly did (Ray then cancels the request)."""
    pending = []

    class Stream(_Stream):
        def __anext__(self):
            pending.append(asyncio.ensure_future(asyncio.sleep(3600)))
            return pending[-1]

    async def leave():
        task = asyncio.ensure_future(next_item(Stream([]), idle_s=60))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0)
        return pending[0].cancelled()
    assert asyncio.run(leave())


def test_the_router_marks_a_request_its_replica_accepted():
    """Ray Serve calls ``on_request_routed`` once the replica accepted the request; the mark
    lands in the ingress's own ``route`` dict, so a silent reply is blamed on the replica only
    then (before it, every replica may just be full)."""
    pytest.importorskip("ray.serve")
    from types import SimpleNamespace

    from kvserve.cluster.ray_router import KVServeRequestRouter
    router = object.__new__(KVServeRequestRouter)        # Ray builds it; this method reads no state
    route = {"decision": {"replica": "a"}}
    router.on_request_routed(SimpleNamespace(kwargs={"route": route}), "a", None)
    assert route["accepted"] is True
    router.on_request_routed(SimpleNamespace(kwargs={}), "a", None)     # no route: nothing to mark
