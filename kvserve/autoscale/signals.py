"""The autoscaling signals, from the replicas' own counters over a window.

Each replica exports cumulative counters on ``/metrics`` (``server/metrics.py``):
``kvserve_prompt_tokens_total`` (prompt tokens admitted), ``kvserve_prefix_cache_hit_tokens_total``
(prompt tokens the prefix cache served, not computed), ``kvserve_generation_tokens_total`` (output
tokens), and gauges ``kvserve_num_requests_running`` / ``kvserve_num_requests_waiting`` /
``kvserve_num_queued_prompt_tokens`` (prompt tokens past the prefix cache of the requests not yet
scheduled). Two scrapes of the fleet, ``earlier`` at ``t0`` and ``later`` at ``t1``, give the demand::

    prefill tokens/s = sum over replicas of [max(0, delta(prompt_tokens_total) - delta(prefix_hit_tokens_total))
                                             + later queued_prompt_tokens] / (t1 - t0)
    decode  tokens/s = sum over replicas of delta(generation_tokens_total) / (t1 - t0)

The counters count what the replicas took (a replica takes a request when it has a slot, and
the ingress holds the rest), so a saturated replica shows its own throughput, not the traffic
behind it: one slower than its planned capacity by more than the policy's headroom read under
the threshold and never scaled up (docs/autoscaling.md). The backlog term adds the prompt tokens
still waiting in the replicas' engines at the window's end. A queue that stands for several
windows counts in each, which is the point: it means the replicas are short; a request that
arrives just before a scrape counts twice (taken and queued), a small excess at light load.

Per replica and per counter, ``delta = later - earlier``; a replica that is new in ``later``, or
whose counter went down (a restart), counted from zero, so ``delta = later``. The reset rule
applies to each cumulative counter on its own, never to the difference ``prompt - prefix hits``:
that difference is not monotone (a window where hits grow faster than admitted prompt tokens
makes it go down), and reading such a dip as a restart counted the replica's whole history as
one window's demand (the simulator-vs-cluster check found it: a 25x prefill spike that started a
replica at 0.4 requests/s). A replica that left during the window
takes its tokens with it (under-counted for one window). The request-count signal is the
``later`` scrape's ``sum(running + waiting)`` plus the requests queued in front of the replicas
(at the ingress, e.g. for a model with no replica yet).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping

from kvserve.autoscale.errors import AutoscaleInputError


@dataclass(frozen=True)
class ReplicaCounters:
    """One replica's counters at one scrape (cumulative since the replica started)."""

    prompt_tokens_total: float
    prefix_hit_tokens_total: float = 0.0
    generation_tokens_total: float = 0.0
    requests_running: int = 0
    requests_waiting: int = 0
    queued_prompt_tokens: float = 0.0      # a gauge: the backlog at this scrape

    @property
    def prompt_tokens_computed_total(self) -> float:
        """Prompt tokens the replica prefilled: admitted minus served by the prefix cache."""
        return self.prompt_tokens_total - self.prefix_hit_tokens_total


@dataclass(frozen=True)
class FleetScrape:
    """One model's replicas scraped at ``time_s``, keyed by replica id; ``queued_requests`` wait in
    front of them (ingress queue, requests for a model with no replica)."""

    time_s: float
    replicas: Mapping[str, ReplicaCounters] = field(default_factory=dict)
    queued_requests: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "replicas", MappingProxyType(dict(self.replicas)))


@dataclass(frozen=True)
class TokenDemand:
    """A model's demand: prompt tokens computed per second (prefill) and output tokens per second
    (decode), and the requests queued with no replica to take them."""

    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    queued_requests: int = 0

    def __post_init__(self) -> None:
        if self.prefill_tokens_per_s < 0 or self.decode_tokens_per_s < 0 or self.queued_requests < 0:
            raise AutoscaleInputError(f"demand cannot be negative: {self}", param="demand")


def _counter_delta(earlier: float | None, later: float) -> float:
    """``later - earlier``; from zero when the series is new or was reset (went down)."""
    if earlier is None or later < earlier:
        return later
    return later - earlier


def token_demand(earlier: FleetScrape, later: FleetScrape) -> TokenDemand:
    """Prefill and decode tokens/s between two scrapes (formulas in the module docstring)."""
    window_s = later.time_s - earlier.time_s
    if not window_s > 0:
        raise AutoscaleInputError(f"the window must be positive: scrapes at {earlier.time_s} and {later.time_s}",
                                  param="time_s")
    prefill = decode = 0.0
    for replica_id, now in later.replicas.items():
        before = earlier.replicas.get(replica_id)
        computed = _counter_delta(before.prompt_tokens_total if before else None, now.prompt_tokens_total) \
            - _counter_delta(before.prefix_hit_tokens_total if before else None, now.prefix_hit_tokens_total)
        prefill += max(0.0, computed)
        prefill += now.queued_prompt_tokens
        decode += _counter_delta(before.generation_tokens_total if before else None, now.generation_tokens_total)
    return TokenDemand(prefill / window_s, decode / window_s, later.queued_requests)


def ongoing_requests(scrape: FleetScrape) -> int:
    """Ray Serve's request-count signal: ``sum over replicas (running + waiting) + queued``."""
    return sum(r.requests_running + r.requests_waiting for r in scrape.replicas.values()) + scrape.queued_requests
