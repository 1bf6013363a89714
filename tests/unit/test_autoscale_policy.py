"""Tier 1: the autoscaling policies (kvserve/autoscale/) as pure functions, driven by hand-made
demand and a hand-moved time: step up, step down after the window only, no flapping, bounds
per residency tier, and token vs request-count signals on a long-prompt mix."""
from __future__ import annotations

import pytest

from kvserve.autoscale import (AutoscaleInputError, FleetScrape, ReplicaBounds, ReplicaCapacity, ReplicaCounters,
                               RequestCountPolicy, ResidencyTier, ScaleState, StabilizerConfig, TokenDemand,
                               TokenPolicy, bounds_for_tier, ongoing_requests, request_desired_replicas, stabilize,
                               token_demand, token_desired_replicas)

CAPACITY = ReplicaCapacity(prefill_tokens_per_s=32_000.0, decode_tokens_per_s=2_000.0)
WINDOW = StabilizerConfig(downscale_window_s=300.0)
BOUNDS = ReplicaBounds(0, 16)


def _run(desired_by_time: list[tuple[float, int]], start: int, bounds: ReplicaBounds = BOUNDS,
         config: StabilizerConfig = WINDOW) -> list[int]:
    """Feed (time, desired) ticks through ``stabilize``; the replica count after each."""
    state, seen = ScaleState(start), []
    for now, desired in desired_by_time:
        _, state = stabilize(state, now, desired, bounds, config)
        seen.append(state.replicas)
    return seen


def _ticks(desired: int, start_s: float, seconds: float, every_s: float = 10.0) -> list[tuple[float, int]]:
    n = int(seconds // every_s)
    return [(start_s + i * every_s, desired) for i in range(n)]


def _changes(counts: list[int]) -> int:
    return sum(1 for a, b in zip(counts, counts[1:]) if a != b)


# --- the arithmetic ---------------------------------------------------------------------------

def test_token_desired_adds_prefill_and_decode_fractions():
    # 48,000 / 32,000 = 1.5 replica-equivalents of prefill + 1,000 / 2,000 = 0.5 of decode = 2.0
    fig = token_desired_replicas(TokenDemand(48_000.0, 1_000.0), CAPACITY, 1.0)
    assert fig.value == 2
    assert token_desired_replicas(TokenDemand(48_000.0, 1_000.0), CAPACITY, 1.25).value == 3   # 2.5 -> 3
    assert token_desired_replicas(TokenDemand(48_000.0, 1_001.0), CAPACITY, 1.0).value == 3    # just over 2
    assert "load 2.000" in fig.arithmetic and "ceil 2" in fig.arithmetic


def test_token_desired_zero_without_demand_but_one_while_queued():
    assert token_desired_replicas(TokenDemand(0.0, 0.0), CAPACITY, 1.25).value == 0
    assert token_desired_replicas(TokenDemand(0.0, 0.0, queued_requests=1), CAPACITY, 1.25).value == 1


def test_request_count_rule_is_ray_serves():
    assert request_desired_replicas(0, 2).value == 0
    assert request_desired_replicas(1, 2).value == 1
    assert request_desired_replicas(4, 2).value == 2
    assert request_desired_replicas(5, 2).value == 3


@pytest.mark.parametrize("bad", [0.5, float("nan"), float("inf")])
def test_headroom_below_one_is_refused(bad):
    with pytest.raises(AutoscaleInputError):
        token_desired_replicas(TokenDemand(1.0, 1.0), CAPACITY, bad)


def test_inputs_that_cannot_be_used_are_refused():
    with pytest.raises(AutoscaleInputError):
        ReplicaCapacity(0.0, 1.0)
    with pytest.raises(AutoscaleInputError):
        ReplicaBounds(3, 2)
    with pytest.raises(AutoscaleInputError):
        StabilizerConfig(downscale_window_s=-1)
    with pytest.raises(AutoscaleInputError):
        bounds_for_tier("hot", 4, hot_min_replicas=0)
    _, state = stabilize(ScaleState(1), 100.0, 1, BOUNDS, WINDOW)
    with pytest.raises(AutoscaleInputError):
        stabilize(state, 99.0, 1, BOUNDS, WINDOW)          # time went back


# --- up fast, down slowly -----------------------------------------------------------------------

def test_step_up_is_immediate():
    counts = _run([(0.0, 1), (10.0, 6)], start=1)
    assert counts == [1, 6]


def test_step_up_bounded_by_max_step_up():
    config = StabilizerConfig(downscale_window_s=300.0, max_step_up=2)
    assert _run([(0.0, 7), (10.0, 7), (20.0, 7)], start=1, config=config) == [3, 5, 7]


def test_step_down_only_after_the_window_one_step_at_a_time():
    ticks = _ticks(2, 0.0, 1_000.0)               # desired 2 from t=0, every 10 s
    counts = _run(ticks, start=5)
    times = [t for t, _ in ticks]
    assert all(c == 5 for t, c in zip(times, counts) if t < 300.0)        # nothing before the window
    assert counts[times.index(300.0)] == 4                                # one step at the window
    assert all(c >= 4 for t, c in zip(times, counts) if t < 600.0)        # the next after one more
    assert counts[times.index(600.0)] == 3
    assert counts[times.index(900.0)] == 2
    assert counts[-1] == 2                                                # never below the desired
    assert all(b >= a - 1 for a, b in zip(counts, counts[1:]))            # never more than one step


def test_step_interval_can_be_shorter_than_the_window():
    config = StabilizerConfig(downscale_window_s=300.0, downscale_step_interval_s=60.0)
    counts = _run(_ticks(1, 0.0, 600.0), start=5, config=config)
    by_time = dict(zip([t for t, _ in _ticks(1, 0.0, 600.0)], counts))
    assert [by_time[t] for t in (290.0, 300.0, 350.0, 360.0, 420.0, 480.0, 590.0)] == [5, 4, 4, 3, 2, 1, 1]


def test_a_higher_tick_restarts_the_window():
    ticks = _ticks(2, 0.0, 250.0) + [(250.0, 5)] + _ticks(2, 260.0, 400.0)
    counts = _run(ticks, start=5)
    by_time = dict(zip([t for t, _ in ticks], counts))
    assert by_time[550.0] == 5                    # 290 s below since 260: not yet
    assert by_time[560.0] == 4                    # 300 s below since 260


def test_no_flapping_under_oscillating_load():
    # load alternates 6 and 2 replicas' worth every 2 minutes for 4 hours
    ticks = [(t, 6 if (t // 120) % 2 == 0 else 2) for t in range(0, 4 * 3600, 10)]
    held = [2] + _run(ticks, start=2)
    assert _changes(held) == 1 and held[-1] == 6  # up once, then held through every dip
    naive = [2] + _run(ticks, start=2, config=StabilizerConfig(downscale_window_s=0.0))
    assert _changes(naive) > 100                  # the same load without a window flaps


def test_down_step_never_below_the_highest_recent_desire():
    config = StabilizerConfig(downscale_window_s=300.0, max_step_down=10)
    ticks = _ticks(1, 0.0, 200.0) + _ticks(4, 200.0, 200.0)
    assert _run(ticks, start=8, config=config)[-1] == 4     # the 4 seen in the window holds it at 4


def test_same_inputs_same_decisions():
    ticks = [(t, (t * 7919) % 9) for t in range(0, 20_000, 15)]
    assert _run(ticks, start=3) == _run(ticks, start=3)


# --- bounds per tier ----------------------------------------------------------------------------

def test_tier_bounds():
    assert bounds_for_tier(ResidencyTier.HOT, 8) == ReplicaBounds(1, 8, ResidencyTier.HOT)
    warm = bounds_for_tier("warm", 8)
    assert warm.min_replicas == 0 and warm.host_weights_resident
    cold = bounds_for_tier("cold", 8)
    assert cold.min_replicas == 0 and not cold.host_weights_resident
    assert bounds_for_tier("hot", 8, hot_min_replicas=2).min_replicas == 2


def test_hot_never_below_one():
    hot = bounds_for_tier("hot", 8)
    counts = _run(_ticks(0, 0.0, 6 * 3600.0), start=4, bounds=hot)
    assert min(counts) == 1 and counts[-1] == 1
    assert _run([(0.0, 0)], start=0, bounds=hot) == [1]       # started below the bound: up at once


@pytest.mark.parametrize("tier", ["cold", "warm"])
def test_cold_and_warm_reach_zero(tier):
    counts = _run(_ticks(0, 0.0, 3600.0), start=3, bounds=bounds_for_tier(tier, 8))
    assert counts[-1] == 0
    assert counts[29] == 3                                    # t=290 s: still within the window


def test_max_replicas_is_a_hard_bound():
    assert _run([(0.0, 50)], start=1, bounds=bounds_for_tier("cold", 8)) == [8]
    assert _run([(0.0, 50)], start=12, bounds=bounds_for_tier("cold", 8)) == [8]   # bound lowered


def test_scale_from_zero_on_a_queued_request():
    policy = TokenPolicy(CAPACITY)
    decision, state, _ = policy.decide(ScaleState(0), 0.0, TokenDemand(0.0, 0.0, queued_requests=1),
                                       bounds_for_tier("cold", 4))
    assert decision.action == "up" and state.replicas == 1


# --- token vs request-count on a long-prompt mix -------------------------------------------------

def _scrapes(rps: float, prompt: int, output: int, in_flight: int, replicas: int,
             seconds: float, every_s: float = 15.0) -> list[FleetScrape]:
    """Counters a fleet of ``replicas`` would export serving ``rps`` requests/s of ``prompt`` +
    ``output`` tokens, the load spread evenly, with ``in_flight`` requests ongoing at each scrape."""
    out = []
    for i in range(int(seconds // every_s) + 1):
        t = i * every_s
        per = {f"r{k}": ReplicaCounters(prompt_tokens_total=rps * t * prompt / replicas,
                                        generation_tokens_total=rps * t * output / replicas,
                                        requests_running=in_flight // replicas + (k < in_flight % replicas))
               for k in range(replicas)}
        out.append(FleetScrape(t, per))
    return out


def _drive_both(scrapes: list[FleetScrape], target_ongoing: float) -> tuple[int, int, float]:
    """Both policies on the same scrapes: (token replicas, request-count replicas, token load)."""
    bounds = bounds_for_tier("hot", 16)
    token, count = TokenPolicy(CAPACITY), RequestCountPolicy(target_ongoing_requests=target_ongoing)
    t_state, c_state = ScaleState(1), ScaleState(1)
    load = 0.0
    for earlier, later in zip(scrapes, scrapes[1:]):
        demand = token_demand(earlier, later)
        _, t_state, fig = token.decide(t_state, later.time_s, demand, bounds)
        _, c_state, _ = count.decide(c_state, later.time_s, ongoing_requests(later), bounds)
        load = demand.prefill_tokens_per_s / CAPACITY.prefill_tokens_per_s \
            + demand.decode_tokens_per_s / CAPACITY.decode_tokens_per_s
    return t_state.replicas, c_state.replicas, load


def test_signals_agree_on_a_chat_mix():
    # 20 req/s of 500 prompt + 200 output tokens: prefill 10,000/32,000 = 0.3125, decode 4,000/2,000 = 2.0,
    # load 2.3125 x 1.25 = 2.89 -> 3. Little's law: 20 req/s x ~6 s (200 tokens x 30 ms) = 120 ongoing;
    # a target of 48 per replica (tuned on this mix) -> ceil(120 / 48) = 3.
    tokens, requests, load = _drive_both(_scrapes(20.0, 500, 200, in_flight=120, replicas=3, seconds=600.0), 48)
    assert load == pytest.approx(2.3125)
    assert tokens == requests == 3


def test_token_policy_follows_the_work_on_long_prompts():
    # 10 req/s of 8,000-token prompts and 50-token answers: prefill 80,000/32,000 = 2.5, decode 500/2,000 =
    # 0.25, load 2.75 x 1.25 = 3.44 -> 4 replicas. Only ~18 requests are in flight (0.25 s prefill + 50 x
    # 30 ms), so the same target of 48 says ceil(18 / 48) = 1: the request count under-provisions 2.75x.
    tokens, requests, load = _drive_both(_scrapes(10.0, 8_000, 50, in_flight=18, replicas=1, seconds=600.0), 48)
    assert load == pytest.approx(2.75)
    assert requests == 1
    assert tokens == 4
    assert tokens >= load > requests            # the token policy covers the work; the count does not


# --- the backlog: a saturated replica slower than planned ----------------------------------------

def test_a_standing_queue_counts_as_demand_so_a_saturated_slow_replica_scales_up():
    # One replica 30% slower than its planned 32,000 prefill tokens/s, saturated on 2,000-token prompts:
    # it takes only what it serves, 24,615 tokens/s = 0.77 of the plan x 1.25 = 0.96 -> 1 replica,
    # while 16 requests (32,000 tokens) stand in its engine's queue at every scrape. The backlog adds
    # 32,000 / 10 s = 3,200 tokens/s each window: 27,815 / 32,000 = 0.87 x 1.25 = 1.09 -> 2.
    served = 32_000.0 / 1.3
    scrapes = [FleetScrape(t, {"r0": ReplicaCounters(prompt_tokens_total=served * t, requests_waiting=16,
                                                     queued_prompt_tokens=32_000.0)})
               for t in (0.0, 10.0, 20.0)]
    policy, state = TokenPolicy(CAPACITY), ScaleState(1)
    for earlier, later in zip(scrapes, scrapes[1:]):
        demand = token_demand(earlier, later)
        assert demand.prefill_tokens_per_s == pytest.approx(served + 3_200.0)
        decision, state, fig = policy.decide(state, later.time_s, demand, bounds_for_tier("hot", 4))
    assert state.replicas == 2, fig.arithmetic
    # without the queue the same served tokens read 0.96 and hold one replica
    bare = [FleetScrape(s.time_s, {"r0": ReplicaCounters(prompt_tokens_total=served * s.time_s)}) for s in scrapes]
    assert token_desired_replicas(token_demand(bare[0], bare[1]), CAPACITY, 1.25).value == 1


def test_the_backlog_is_read_at_the_windows_end_only():
    earlier = FleetScrape(0.0, {"r0": ReplicaCounters(0.0, queued_prompt_tokens=5_000.0)})
    drained = FleetScrape(5.0, {"r0": ReplicaCounters(5_000.0)})
    assert token_demand(earlier, drained).prefill_tokens_per_s == pytest.approx(1_000.0)   # served once, not twice
