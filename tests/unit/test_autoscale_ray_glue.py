"""Tier 1: the cluster's autoscaling glue (kvserve/cluster/autoscaling.py, ray_autoscale.py)
without a cluster: a replica's real ServerMetrics -> its autoscaling stats -> Ray Serve's own
samples and AutoscalingContext -> the pure policy -> the replica count, and Ray's own wrapper
around a custom policy (its cold-start path, its delays at 0: the stabilisation applied once)."""
from __future__ import annotations

import pytest

pytest.importorskip("ray.serve")

from ray.serve._private.common import DeploymentID, ReplicaID, TimeStampedValue  # noqa: E402
from ray.serve.autoscaling_policy import _apply_autoscaling_config  # noqa: E402
from ray.serve.config import AutoscalingContext  # noqa: E402

from kvserve.autoscale import AutoscaleInputError  # noqa: E402
from kvserve.cluster import policy_board  # noqa: E402
from kvserve.cluster.autoscaling import (STATE_KEY, WINDOW_LOG, AutoscaleSettings, StepInputs,  # noqa: E402
                                         autoscale_step, log_window, replica_autoscaling_stats, scrape_from_raw)
from kvserve.cluster.ray_autoscale import KVServeAutoscalingPolicy, autoscaling_config  # noqa: E402
from kvserve.server.metrics import ServerMetrics  # noqa: E402

DEPLOYMENT = DeploymentID("engine", "kvserve")
COLD = AutoscaleSettings(mode="tokens", tier="cold", min_replicas=0, max_replicas=4, prefill_tokens_per_s=800.0,
                         decode_tokens_per_s=80.0, demand_window_s=10.0, downscale_window_s=60.0)


def _replica(name: str) -> ReplicaID:
    return ReplicaID(name, DEPLOYMENT)


def _raw(samples: dict[str, list[tuple[float, dict[str, float]]]]) -> dict:
    """Ray Serve's raw_metrics layout (metric -> ReplicaID -> [TimeStampedValue]) from each
    replica's (time, stats) reports."""
    raw: dict = {}
    for name, reports in samples.items():
        for t, stats in reports:
            for metric, value in stats.items():
                raw.setdefault(metric, {}).setdefault(_replica(name), []).append(TimeStampedValue(t, value))
    return raw


def _stats(prompt: float, generated: float, hits: float = 0.0, running: int = 0,
           queued_tokens: float = 0.0) -> dict[str, float]:
    metrics = ServerMetrics()                       # the replica's own metrics, as its engine client fills them
    metrics.prompt_tokens.inc(prompt)
    metrics.generation_tokens.inc(generated)
    metrics.prefix_hit_tokens.set_total(hits)
    metrics.running.set(running)
    metrics.queued_prompt_tokens.set(queued_tokens)
    return replica_autoscaling_stats(metrics)


def _ctx(state: dict, now: float, current: int, target: int, raw=None, queued: float = 0.0,
         total: float = 0.0, settings: AutoscaleSettings = COLD) -> AutoscalingContext:
    """Ray Serve's own context object, filled as its controller fills it."""
    running = [_replica(f"r{i}") for i in range(current)]
    return AutoscalingContext(deployment_id=DEPLOYMENT, deployment_name="engine", app_name="kvserve",
                              current_num_replicas=current, target_num_replicas=target, running_replicas=running,
                              total_num_requests=total, total_queued_requests=queued, aggregated_metrics={},
                              raw_metrics=raw or {}, capacity_adjusted_min_replicas=settings.min_replicas,
                              capacity_adjusted_max_replicas=settings.max_replicas, policy_state=state,
                              last_scale_up_time=None, last_scale_down_time=None, current_time=now,
                              config=autoscaling_config(settings))


# --- what a replica reports, and how the policy reads it --------------------------------------

def test_replica_stats_are_its_metrics_counters_summed_over_labels():
    metrics = ServerMetrics()
    metrics.prompt_tokens.inc(100)
    metrics.generation_tokens.inc(7)
    metrics.generation_tokens.inc(3)
    metrics.prefix_hit_tokens.set_total(40)
    metrics.waiting.set(2)
    assert replica_autoscaling_stats(metrics) == {
        "kvserve_prompt_tokens_total": 100.0, "kvserve_prefix_cache_hit_tokens_total": 40.0,
        "kvserve_generation_tokens_total": 10.0, "kvserve_num_requests_running": 0.0,
        "kvserve_num_requests_waiting": 2.0, "kvserve_num_queued_prompt_tokens": 0.0}


def test_scrape_takes_each_replicas_newest_sample():
    raw = _raw({"a": [(10.0, _stats(100, 10)), (12.0, _stats(300, 30, hits=50, running=2, queued_tokens=64))],
                "b": [(11.0, _stats(40, 4))]})
    scrape = scrape_from_raw(raw, now_s=99.0, queued_requests=3)
    assert scrape.time_s == 12.0 and scrape.queued_requests == 3
    assert scrape.replicas["a"].prompt_tokens_computed_total == 250 and scrape.replicas["a"].requests_running == 2
    assert scrape.replicas["a"].queued_prompt_tokens == 64 and scrape.replicas["b"].queued_prompt_tokens == 0
    assert scrape.replicas["b"].generation_tokens_total == 4
    assert scrape_from_raw({}, now_s=99.0).time_s == 99.0          # no replica: the tick's time


# --- metric extraction -> demand -> desired count ---------------------------------------------

def _tick(state, now, target, raw=None, queued=0.0, total=0.0, settings=COLD):
    return autoscale_step(settings, state, StepInputs(now, target, raw, queued, total))


def test_token_demand_over_the_window_gives_the_desired_count():
    # one replica; in 10 s its counters grow by 4,000 prompt tokens (1,000 from the cache) and 1,600 output
    state = {"ray_internal": 1}
    n, state, _ = _tick(state, 100.0, 1, _raw({"a": [(100.0, _stats(1_000, 100, hits=0))]}))
    assert n == 1                                     # no window closed yet: no demand, hold (window 60 s)
    later = _raw({"a": [(110.0, _stats(5_000, 1_700, hits=1_000))]})
    n, state, why = _tick(state, 110.0, 1, later)
    # prefill 3,000 / 10 s = 300 / 800 = 0.375 + decode 1,600 / 10 s = 160 / 80 = 2.0 -> 2.375 x 1.25 = 2.97 -> 3
    assert n == 3, why
    assert "prefill 300.0 / 800.0" in why and "decode 160.0 / 80.0" in why and "ceil 3" in why
    assert state["ray_internal"] == 1 and tuple(state[STATE_KEY]["demand"]) == (300.0, 160.0)
    n, state, _ = _tick(state, 112.0, 3, later)       # inside the next window: the same demand, at target
    assert n == 3


def test_each_closed_window_counts_the_age_of_the_sample_that_closed_it():
    n, state, _ = _tick({}, 100.5, 1, _raw({"a": [(100.0, _stats(1_000, 100))]}))
    n, state, _ = _tick(state, 105.5, 1, _raw({"a": [(105.0, _stats(1_000, 100))]}))   # inside the 10 s window
    assert "sample_age" not in state[STATE_KEY]
    n, state, _ = _tick(state, 111.5, 1, _raw({"a": [(110.0, _stats(1_000, 100))]}))   # closes it, 1.5 s old
    n, state, _ = _tick(state, 112.0, 1, _raw({"a": [(110.0, _stats(1_000, 100))]}))   # the next one is open
    n, state, _ = _tick(state, 120.5, 1, _raw({"a": [(120.0, _stats(1_000, 100))]}))
    assert state[STATE_KEY]["sample_age"] == {"count": 2, "sum_s": pytest.approx(2.0)}
    # each closed window logged: its closing sample's time, the tick's, the tokens/s it measured
    assert state[STATE_KEY]["windows"] == [[110.0, 111.5, 0.0, 0.0], [120.0, 120.5, 0.0, 0.0]]


def test_the_window_log_keeps_the_last_windows_oldest_first():
    logged = None
    for k in range(WINDOW_LOG + 5):
        logged = log_window(logged, 10.0 * k, 10.0 * k + 1.5, (100.0 + k, 5.0))
    assert len(logged) == WINDOW_LOG
    assert logged[0] == [50.0, 51.5, 105.0, 5.0] and logged[-1][0] == 10.0 * (WINDOW_LOG + 4)


def test_the_policy_publishes_each_closed_window_and_logs_only_changes(monkeypatch):
    published = []
    monkeypatch.setattr(policy_board, "publish", lambda app, name, record: published.append(record))
    policy = KVServeAutoscalingPolicy(**COLD.to_kwargs())
    _, state = policy(_ctx({}, 100.0, 1, 1, _raw({"r0": [(100.0, _stats(0, 0))]})))
    for t in (110.0, 111.0, 120.0, 130.0):          # idle: the demand stays 0, windows close at 110, 120, 130
        _, state = policy(_ctx(state, t + 0.5, 1, 1, _raw({"r0": [(t, _stats(0, 0))]})))
    assert [r["windows_closed"] for r in published] == [0, 1, 2, 3]
    assert [w[0] for w in published[-1]["windows"]] == [110.0, 120.0, 130.0]


def test_a_new_replica_counts_from_zero_and_the_state_is_never_mutated():
    first = {STATE_KEY: {}}
    n, state, _ = _tick(first, 0.0, 1, _raw({"a": [(0.0, _stats(0, 0))]}))
    assert first == {STATE_KEY: {}}
    raw = _raw({"a": [(10.0, _stats(0, 0))], "b": [(10.0, _stats(0, 800))]})     # b started in the window
    n, _, why = _tick(state, 10.0, 1, raw)
    assert "decode 80.0 / 80.0" in why and n == 2     # 1.0 x 1.25 -> 2


def test_queued_requests_scale_a_cold_model_from_zero_and_it_returns_to_zero():
    n, state, why = _tick({}, 0.0, 0, queued=1)
    assert n == 1 and "1 queued requests -> 1" in why
    n, state, _ = _tick(state, 5.0, 1, _raw({"a": [(5.0, _stats(10, 2))]}))
    assert n == 1
    counts = []
    for t in range(15, 200, 10):                       # idle: the counters stop moving
        n, state, _ = _tick(state, float(t), n, _raw({"a": [(float(t), _stats(10, 2))]}))
        counts.append(n)
    assert counts[0] == 1 and counts[-1] == 0          # down after the 60 s window, to zero (cold)
    assert counts.index(0) >= 5


def test_hot_tier_never_goes_below_one_and_refuses_min_zero():
    hot = AutoscaleSettings(mode="tokens", tier="hot", min_replicas=1, max_replicas=2, downscale_window_s=0.0)
    n, state, _ = _tick({}, 0.0, 2, settings=hot)
    n, state, _ = _tick(state, 1.0, n, settings=hot)
    assert n == 1
    assert _tick(state, 500.0, 1, settings=hot)[0] == 1
    with pytest.raises(AutoscaleInputError):
        AutoscaleSettings(mode="tokens", tier="hot", min_replicas=0, max_replicas=2)
    with pytest.raises(AutoscaleInputError):
        AutoscaleSettings(mode="queue", tier="cold", min_replicas=0, max_replicas=2)


def test_request_mode_uses_rays_own_request_count():
    settings = AutoscaleSettings(mode="requests", tier="warm", min_replicas=0, max_replicas=8,
                                 target_ongoing_requests=2.0)
    n, _, why = _tick({}, 0.0, 1, total=5.0, settings=settings)
    assert n == 3 and "ceil(5 ongoing requests / target 2) = 3" in why


# --- through Ray Serve's own context and wrapper ----------------------------------------------

def test_the_ray_policy_reads_the_context_and_rays_wrapper_adds_no_delay():
    policy = _apply_autoscaling_config(KVServeAutoscalingPolicy(**COLD.to_kwargs()))   # as the controller does
    n, state = policy(_ctx({}, 100.0, 1, 1, _raw({"r0": [(100.0, _stats(0, 0))]})))
    assert n == 1
    n, state = policy(_ctx(state, 110.0, 1, 1, _raw({"r0": [(110.0, _stats(8_000, 1_000))]})))
    # 800 / 800 = 1.0 + 100 / 80 = 1.25 -> 2.25 x 1.25 = 2.81 -> 3, at once: Ray's upscale delay is 0
    assert n == 3
    n, state = policy(_ctx(state, 111.0, 3, 3, _raw({"r0": [(110.0, _stats(8_000, 1_000))]})))
    assert n == 3


def test_rays_default_delays_would_stabilise_twice():
    slow = autoscaling_config(COLD).model_copy(update={"upscale_delay_s": 30.0})
    policy = _apply_autoscaling_config(KVServeAutoscalingPolicy(**COLD.to_kwargs()))
    ctx = _ctx({}, 100.0, 1, 1, _raw({"r0": [(100.0, _stats(0, 0))]}))
    _, state = policy(ctx)
    ctx = _ctx(state, 110.0, 1, 1, _raw({"r0": [(110.0, _stats(8_000, 1_000))]}))
    ctx.config = slow
    n, _ = policy(ctx)
    assert n == 1                # Ray held our "up to 3" for its own 30 s: why app.py sets its delays to 0


def test_rays_cold_start_path_precedes_the_policy():
    policy = _apply_autoscaling_config(KVServeAutoscalingPolicy(**COLD.to_kwargs()))
    n, _ = policy(_ctx({}, 0.0, 0, 0, total=1.0, queued=1.0))
    assert n == 1
    n, _ = policy(_ctx({}, 0.0, 0, 0))                   # nothing queued: a cold model stays at zero
    assert n == 0


def test_autoscaling_config_bounds_and_delays():
    config = autoscaling_config(COLD)
    assert (config.min_replicas, config.initial_replicas, config.max_replicas) == (0, 0, 4)
    assert config.upscale_delay_s == config.downscale_delay_s == config.downscale_to_zero_delay_s == 0
    assert config.policy.policy_kwargs == COLD.to_kwargs()


def _busy_then_idle(settings):
    """Scale from zero, 120 s at ~1.25 replicas (prefill 400 / 800 + decode 60 / 80), 360 s idle,
    a tick every 10 s: {time: (replicas, re-tiering state)}."""
    n, state, _ = _tick({}, 0.0, 0, queued=1, settings=settings)
    assert n == 1
    prompt, generated, seen = 0.0, 0.0, {}
    for step in range(1, 49):
        t, busy = 10.0 * step, step <= 12
        prompt, generated = prompt + (4_000 if busy else 0), generated + (600 if busy else 0)
        n, state, _ = _tick(state, t, n, _raw({"a": [(t, _stats(prompt, generated))]}), settings=settings)
        seen[t] = (n, state[STATE_KEY].get("retier"))
    return seen


def test_a_cold_model_promoted_by_its_load_keeps_a_replica_until_the_load_falls_below_demote():
    from dataclasses import replace
    plain = _busy_then_idle(COLD)
    assert plain[250.0][0] == 0                                      # 2 -> 1 -> 0, a 60 s window each
    retiered = _busy_then_idle(replace(COLD, retier_window_s=120.0))
    assert retiered[120.0][1]["tier"] == "hot" and retiered[120.0][1]["mean_load"] == pytest.approx(1.25)
    assert all(retiered[t][0] >= 1 for t in range(130, 300, 10))    # hot: its floor is one replica
    assert retiered[240.0][1]["tier"] == "cold"                      # a window below demote: planned tier
    assert retiered[300.0][0] == 0                                   # then to zero after the down window


def test_the_backlog_gauge_counts_the_unscheduled_requests_prompt_past_the_cache():
    from kvserve.server.engine_client import EngineClient, TrackedRequest
    metrics = ServerMetrics()
    client = EngineClient(None, metrics, {})
    client.requests = {"a": TrackedRequest("a", None, 0, 300, 0.0, num_uncached_tokens=200),
                       "b": TrackedRequest("b", None, 1, 500, 0.0, num_uncached_tokens=500, started=True)}
    client.refresh_queue_gauges()                  # what /metrics and record_autoscaling_stats call first
    stats = replica_autoscaling_stats(metrics)
    assert stats["kvserve_num_queued_prompt_tokens"] == 200.0        # "b" is scheduled; "a" less its cached 100
    assert "kvserve_num_queued_prompt_tokens 200" in metrics.render()
