"""Drive one simulated replica (``fleetsim``'s ``BatchReplica`` family or ``SchedulerReplica``)
through a request log without a fleet around it."""
from __future__ import annotations

from collections.abc import Callable


def drive(replica, log, check: Callable | None = None) -> None:
    """Submit ``log``'s requests at their arrival times and run ``replica`` until it is idle;
    ``check(replica)`` after every event."""
    pending = sorted(range(len(log)), key=lambda r: log.arrival[r])
    next_event = None
    while pending or next_event is not None:
        if pending and (next_event is None or log.arrival[pending[0]] <= next_event):
            request = pending.pop(0)
            submitted = replica.submit(request, log.arrival[request])
            next_event = submitted if submitted is not None else next_event
        else:
            next_event = replica.complete(next_event)
        if check is not None:
            check(replica)


def cached_pool_holds(replica) -> None:
    """A ``PrefixCachingReplica``'s pool: its requests' KV and its cache within its size."""
    assert 0 <= replica.reserved and replica.reserved + replica.cache.held_tokens <= replica.kv_tokens
