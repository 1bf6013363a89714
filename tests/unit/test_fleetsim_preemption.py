"""Tier 1: the coalesced replica preempts as the engine's scheduler does when its KV pool runs
out (``fleetsim/replica.py``): recompute of the newest admitted request, its prompt + generated
output computed again, the pool's accounting exact, and the same day as ``SchedulerReplica``
(the engine's real scheduler and block pool) within 20% where the pool is small enough to
preempt hundreds of times."""
from __future__ import annotations

from dataclasses import replace

import pytest

from benchmarks.fleet_sim_preemption import SCENARIO, one_run
from kvserve.fleetsim.cached_replica import BLOCK_SIZE, PrefixCachingReplica
from kvserve.fleetsim.log import DONE, RequestLog
from kvserve.fleetsim.replica import BatchReplica
from kvserve.fleetsim.run import prepare
from kvserve.fleetsim.sched_replica import SchedulerReplica
from tests.support.replica_driver import cached_pool_holds, drive


def _two_long_requests() -> RequestLog:
    return RequestLog([0.0, 0.001], [0, 0], [0, 0], [400, 400], [300, 300])


def test_the_newest_request_is_preempted_recomputed_and_every_token_returns():
    """Two 400 + 300-token requests in a 1,000-token pool: both run until the pool is full, the
    second is preempted (back to the queue with its ~100 generated tokens), the first finishes,
    the second computes its prompt and those tokens again and finishes: one first token each,
    every output token generated once, the pool empty at the end."""
    sizing = replace(prepare(SCENARIO).sizings[0], kv_tokens=1000, max_num_seqs=4)
    log = _two_long_requests()
    replica = BatchReplica("r", sizing, log)

    def within_pool(r):
        assert 0 <= r.reserved <= r.kv_tokens and r.ctx_sum <= r.reserved

    drive(replica, log, within_pool)
    assert replica.preemptions_total == 1
    assert log.status == [DONE, DONE] and log.finish_s[0] < log.finish_s[1]
    assert log.first_token_s[1] < log.finish_s[0]             # it had started before the preemption
    assert replica.generation_tokens_total == 600
    recomputed = replica.prompt_tokens_total - 800           # its prompt + the output it had made
    assert 400 < recomputed < 400 + 300 and (recomputed - 400) == pytest.approx(100, abs=2)
    assert replica.reserved == 0 and replica.ctx_sum == 0 and not replica.recomputed and not replica.order


def test_the_two_requests_preempt_alike_on_the_engines_scheduler():
    """The same two requests on ``SchedulerReplica`` (the engine's scheduler, a pool of 62
    16-token blocks): one preemption, the same order, the finishes within 5%."""
    sizing = replace(prepare(SCENARIO).sizings[0], kv_tokens=1000, max_num_seqs=4)
    fast_log, real_log = _two_long_requests(), _two_long_requests()
    fast, real = BatchReplica("r", sizing, fast_log), SchedulerReplica("r", sizing, real_log)
    drive(fast, fast_log)
    drive(real, real_log)
    assert real.sched.num_preemptions == fast.preemptions_total == 1
    for request in (0, 1):
        assert fast_log.finish_s[request] == pytest.approx(real_log.finish_s[request], rel=0.05)
        assert fast_log.first_token_s[request] == pytest.approx(real_log.first_token_s[request], rel=0.05)


def test_a_preempted_request_recomputes_past_its_own_cached_blocks():
    """Three 200-token prompts fill a 1,000-token pool; the newest is preempted just before the
    first finishes and frees room. With a prefix cache its full blocks stay cached (the engine
    keeps them): its recompute reads them and computes only what followed its last whole
    block; without one it computes its prompt and output again."""
    sizing = replace(prepare(SCENARIO).sizings[0], kv_tokens=1000, max_num_seqs=4)

    def three() -> RequestLog:
        return RequestLog([0.0, 0.001, 0.002], [0] * 3, [0] * 3, [200] * 3, [140, 300, 300])

    log, plain_log = three(), three()
    cached, plain = PrefixCachingReplica("r", sizing, log), BatchReplica("r", sizing, plain_log)
    drive(cached, log, cached_pool_holds)
    drive(plain, plain_log)
    assert cached.preemptions_total == plain.preemptions_total == 1
    assert log.status == [DONE] * 3 and cached.generation_tokens_total == 740
    context = plain.prompt_tokens_total - 600                  # the victim's prompt + its output so far
    assert 200 < context < 500
    assert cached.prompt_tokens_total - 600 == context - (context - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert log.cached_tokens == [0, 0, 0]                      # a recompute's hit is not a cache hit
    assert cached.reserved == 0 and cached.cache.pinned_tokens == 0
    assert log.finish_s[2] < plain_log.finish_s[2]             # less to compute again


def test_a_small_pool_gives_the_engine_schedulers_day_within_20_percent():
    """``benchmarks/fleet_sim_preemption.py``'s day with a 20,000-token pool (an 8B model, ~13
    requests/s of 512 + 256 tokens): both replicas preempt hundreds of times; TTFT p50 / p99 and
    TPOT p50 within 20% (reserving each request's whole output, as the coalesced replica did
    before it preempted, gave a TTFT p50 113x the scheduler's)."""
    prepared = prepare(SCENARIO)
    prepared.sizings[0] = replace(prepared.sizings[0], kv_tokens=20_000)
    real, fast = one_run(prepared, SchedulerReplica), one_run(prepared, BatchReplica)
    assert fast["requests"] == real["requests"] > 1000
    assert fast["preemptions"] > 100 and real["preemptions"] > 100
    assert fast["preemptions"] == pytest.approx(real["preemptions"], rel=0.2)
    for key in ("p50_ttft_s", "p99_ttft_s", "p50_tpot_s"):
        assert fast[key] == pytest.approx(real[key], rel=0.2), key
