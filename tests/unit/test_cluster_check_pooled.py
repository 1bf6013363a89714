"""Tier 1: the simulator-vs-cluster check's pooled latencies (``cluster_check.pooled_latency``):
the requests of several runs taken together, so a p99 is read off a sample, not one request."""
from __future__ import annotations

import numpy as np
import pytest

from kvserve.fleetsim.cluster_check import pooled_latency
from kvserve.fleetsim.log import RequestLog


def _served(ttfts: list[float], tpot: float = 0.05) -> RequestLog:
    n = len(ttfts)
    log = RequestLog([0.0] * n, [0] * n, [0] * n, [16] * n, [11] * n)
    for i, ttft in enumerate(ttfts):
        log.first_token(i, ttft)
        log.finish(i, ttft + 10 * tpot)
    return log


def test_the_runs_requests_are_pooled_before_the_percentiles():
    rng = np.random.default_rng(0)
    measured = [_served(list(rng.uniform(0.2, 1.0, 50))) for _ in range(3)]
    simulated = [_served([t * 0.9 for t in m.first_token_s]) for m in measured]
    simulated[1].reject(7, 1.0)                          # not served: left out of the percentiles
    pooled = pooled_latency(measured, simulated)
    every = np.concatenate([m.first_token_s for m in measured])
    assert pooled["measured"]["requests"] == 150
    assert pooled["measured"]["p99_ttft_s"] == pytest.approx(np.percentile(every, 99))
    assert pooled["ratio"]["p50_ttft_s"] == pytest.approx(0.9, abs=0.02)
    assert pooled["ratio"]["p50_tpot_s"] == pytest.approx(1.0)
    one = pooled_latency(measured[:1], simulated[:1])
    assert one["measured"]["p99_ttft_s"] != pooled["measured"]["p99_ttft_s"]
