"""The ingress's admission queue by service class, in front of the fleet (docs/cluster.md).

Ray Serve queues a deployment's requests FIFO in the caller's handle, so a burst of batch
requests delays the interactive ones behind it. ``ClassQueue`` keeps that queue at the
ingress instead, ordered by class: the fleet decodes at most ``slots`` = replicas x
``--max-num-seqs`` requests at once (as ``overflow.py`` counts them); while fewer are in
flight a request goes straight on, and once the fleet is full it waits here, and each slot
that frees goes to the first waiter of the highest class waiting (interactive, then chat,
then batch; within a class first come, first served). A request that has waited
``max_wait_s`` without a slot is refused (``QueueTimeout``: the ingress answers 503 +
Retry-After). One event loop only (the ingress's): no locks, no threads.
"""
from __future__ import annotations

import asyncio
import heapq
import itertools
import math
import time
from typing import Callable

from kvserve.engine.service_class import ServiceClass

CLASS_ORDER = {ServiceClass.INTERACTIVE: 0, ServiceClass.CHAT: 1, ServiceClass.BATCH: 2}


def fleet_slots(max_replicas: int, max_num_seqs: int, queue_wait_s: float | None) -> int | None:
    """The queue's fleet slots: the most replicas the fleet runs x ``max_num_seqs``; None (no
    queue at the ingress: Ray Serve's FIFO) when the wait bound is unset or 0."""
    return max_replicas * max_num_seqs if queue_wait_s and queue_wait_s > 0 else None


class QueueTimeout(Exception):
    """No fleet slot freed within the wait; ``retry_after_s`` is a whole number of seconds."""

    def __init__(self, service_class: ServiceClass, waited_s: float, num_waiting: int):
        super().__init__(f"the fleet is full: this {service_class.value} request waited {waited_s:.1f} s "
                         f"for a slot behind {num_waiting} others; retry later")
        self.retry_after_s = max(1, math.ceil(min(waited_s, 10.0)))


class ClassQueue:
    """``slots`` fleet slots shared by the ingress's generation requests; ``max_wait_s`` the
    most a request waits for one (None: unbounded)."""

    def __init__(self, slots: int, max_wait_s: float | None, clock: Callable[[], float] = time.monotonic):
        assert slots >= 1, slots
        self.slots = slots
        self.max_wait_s = max_wait_s
        self.clock = clock
        self.num_in_flight = 0
        self._waiting: list[tuple[int, int, asyncio.Future]] = []      # heap of (class rank, arrival, future)
        self._arrivals = itertools.count()

    @property
    def num_waiting(self) -> int:
        """Requests waiting for a slot now."""
        return sum(1 for *_, fut in self._waiting if not fut.done())

    def waiting_by_class(self) -> dict[str, int]:
        """Waiting requests per class name."""
        names = {rank: cls.value for cls, rank in CLASS_ORDER.items()}
        counts = {name: 0 for name in names.values()}
        for rank, _, fut in self._waiting:
            if not fut.done():
                counts[names[rank]] += 1
        return counts

    async def acquire(self, service_class: ServiceClass) -> Callable[[], None]:
        """Wait for a slot; returns the function that frees it (once, however often it is
        called). Raises ``QueueTimeout`` past ``max_wait_s``; a cancelled wait takes no slot."""
        if self.num_in_flight < self.slots and self.num_waiting == 0:
            self.num_in_flight += 1
            return self._release_once()
        fut = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiting, (CLASS_ORDER.get(service_class, 1), next(self._arrivals), fut))
        started = self.clock()
        try:
            await asyncio.wait({fut}, timeout=self.max_wait_s)
        except BaseException:                  # cancelled while waiting
            self._abandon(fut)
            raise
        if fut.done():
            return self._release_once()        # the releaser counted this request in
        self._abandon(fut)
        raise QueueTimeout(service_class, self.clock() - started, self.num_waiting)

    def _abandon(self, fut: asyncio.Future) -> None:
        """A waiter leaves: if a slot was handed to it meanwhile, pass the slot on."""
        if fut.done() and not fut.cancelled():
            self._free()
        else:
            fut.cancel()

    def _release_once(self) -> Callable[[], None]:
        done = False

        def release() -> None:
            nonlocal done
            if not done:
                done = True
                self._free()
        return release

    def _free(self) -> None:
        """One slot freed: hand it to the best waiter still waiting, else count it free."""
        while self._waiting:
            _rank, _arrival, fut = heapq.heappop(self._waiting)
            if not fut.done():
                fut.set_result(True)           # the slot moves to it: num_in_flight unchanged
                return
        self.num_in_flight -= 1
