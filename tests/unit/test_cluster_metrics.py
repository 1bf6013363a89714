"""Tier 1: the cluster ingress's /metrics (kvserve/cluster/metrics.py) from real replica
renderings (two ``ServerMetrics`` fed engine stats and requests): every replica's series
with its ``replica`` label, the ``kvserve_cluster_`` sums, the router's decisions and
prefix-hit tokens, breaker states and the degradation rung."""
import pytest

from kvserve.cluster.breaker import ReplicaBreakers
from kvserve.cluster.ladder import Rung
from kvserve.cluster.metrics import ClusterMetrics, parse_families
from kvserve.engine.stats import EngineStats
from kvserve.server.metrics import ServerMetrics, parse_metrics


def _replica_text(running: int, ttfts: list[float], hit_rate: float, finished: int) -> str:
    metrics = ServerMetrics()
    metrics.update_engine(EngineStats(num_running_seqs=running, kv_blocks_total=100, kv_blocks_used=10 * running,
                                      prefix_cache_hit_rate=hit_rate, prefix_cache_hit_tokens=64 * running))
    for seconds in ttfts:
        metrics.ttft.observe(seconds)
    metrics.finished.inc(finished, reason="stop")
    metrics.tenants.observe_request("acme", 200, None, 10, 5)
    return metrics.render()


@pytest.fixture
def rendered():
    scrapes = {"r1": _replica_text(3, [0.05, 0.3], 0.5, 4), "r2": _replica_text(1, [0.07], 0.25, 2)}
    return ClusterMetrics().render(scrapes, ["r1", "r2", "r3"])


def test_each_replica_series_carries_its_replica_label(rendered):
    samples = parse_metrics(rendered)
    assert samples['kvserve_num_requests_running{replica="r1"}'] == 3
    assert samples['kvserve_num_requests_running{replica="r2"}'] == 1
    assert samples['kvserve_requests_finished_total{replica="r1",reason="stop"}'] == 4
    assert samples['kvserve_time_to_first_token_seconds_count{replica="r1"}'] == 2
    assert samples['kvserve_time_to_first_token_seconds_bucket{replica="r2",le="0.08"}'] == 1
    assert samples['kvserve_prefix_cache_hit_rate{replica="r2"}'] == 0.25
    assert samples['kvserve_tenant_requests_total{replica="r2",code="",status="200",tenant="acme"}'] == 1
    assert not any(name.startswith("kvserve_num_requests_running ") for name in rendered.splitlines())


def test_aggregates_sum_counters_histograms_and_additive_gauges_only(rendered):
    samples = parse_metrics(rendered)
    assert samples["kvserve_cluster_num_requests_running"] == 4
    assert samples["kvserve_cluster_kv_blocks_used"] == 40 and samples["kvserve_cluster_kv_blocks_total"] == 200
    assert samples["kvserve_cluster_prefix_cache_hit_tokens_total"] == 256
    assert samples['kvserve_cluster_requests_finished_total{reason="stop"}'] == 6
    assert samples["kvserve_cluster_time_to_first_token_seconds_count"] == 3
    assert samples["kvserve_cluster_time_to_first_token_seconds_sum"] == pytest.approx(0.42)
    assert samples['kvserve_cluster_time_to_first_token_seconds_bucket{le="0.06"}'] == 1
    assert samples['kvserve_cluster_time_to_first_token_seconds_bucket{le="+Inf"}'] == 3
    assert samples['kvserve_cluster_tenant_tokens_total{kind="prompt",tenant="acme"}'] == 20
    for ratio in ("prefix_cache_hit_rate", "step_time_fixed_seconds", "spec_mean_accepted_length"):
        assert not any(name.startswith(f"kvserve_cluster_{ratio}") for name in samples), ratio
    assert samples['kvserve_cluster_replicas{replica="r3"}'] == 0        # seen by the router, not scraped
    assert samples['kvserve_cluster_replicas{replica="r1"}'] == 1


def test_every_family_is_declared_once_and_prometheus_parses_it(rendered):
    families = parse_families(rendered)
    names = [f.name for f in families]
    assert len(names) == len(set(names))
    assert all(f.kind in ("counter", "gauge", "histogram") and f.samples for f in families)
    parser = pytest.importorskip("prometheus_client.parser")
    parsed = {f.name: f for f in parser.text_string_to_metric_families(rendered)}
    assert parsed["kvserve_time_to_first_token_seconds"].type == "histogram"
    assert {s.labels.get("replica") for s in parsed["kvserve_num_requests_running"].samples} == {"r1", "r2"}


def test_router_decisions_and_prefix_hit_tokens_per_decision():
    metrics = ClusterMetrics()
    for reason, cached in (("prefix", 128), ("prefix", 48), ("spread", 0)):
        metrics.observe_decision({"policy": "kv_aware", "reason": reason, "cached_tokens": cached}, True)
    metrics.observe_decision({"policy": "kv_aware", "reason": "spread", "cached_tokens": 0}, False)   # GET /v1/models
    metrics.observe_decision({"policy": "kv_aware", "reason": "fallback", "cached_tokens": 0}, True)
    metrics.observe_decision(None, True)                                   # the router wrote nothing
    samples = parse_metrics(metrics.render({}, []))
    assert samples['kvserve_router_decisions_total{policy="kv_aware",reason="prefix"}'] == 2
    assert samples['kvserve_router_decisions_total{policy="kv_aware",reason="spread"}'] == 2
    assert samples['kvserve_router_decisions_total{policy="kv_aware",reason="fallback"}'] == 1
    assert samples['kvserve_router_decision_cached_tokens_count{policy="kv_aware"}'] == 3
    assert samples['kvserve_router_decision_cached_tokens_sum{policy="kv_aware"}'] == 176
    assert samples['kvserve_router_decision_cached_tokens_bucket{policy="kv_aware",le="64.0"}'] == 2


def test_the_age_of_the_stats_each_decision_read_per_replica():
    metrics = ClusterMetrics()
    metrics.observe_decision({"policy": "least_loaded", "reason": "least_loaded", "cached_tokens": 0,
                              "stats_age_s": [0.2, 0.6]}, True)
    metrics.observe_decision({"policy": "least_loaded", "reason": "least_loaded", "cached_tokens": 0,
                              "stats_age_s": [5.0]}, False)                 # a scrape: not a request's
    metrics.observe_decision({"policy": "least_loaded", "reason": "fallback", "cached_tokens": 0}, True)
    samples = parse_metrics(metrics.render({}, []))
    assert samples["kvserve_router_stats_age_seconds_count"] == 2
    assert samples["kvserve_router_stats_age_seconds_sum"] == pytest.approx(0.8)
    assert samples['kvserve_router_stats_age_seconds_bucket{le="0.5"}'] == 1


def test_breaker_states_and_the_rung_are_series():
    clock = [0.0]
    breakers = ReplicaBreakers(failure_threshold=2, open_s=5.0, clock=lambda: clock[0])
    breakers.retain(["r1", "r2"])
    breakers.on_failure("r1")
    breakers.on_failure("r1")
    metrics = ClusterMetrics()
    metrics.update_breakers(breakers)
    metrics.update_rung(Rung.SHED_BATCH)
    samples = parse_metrics(metrics.render({}, ["r1", "r2"]))
    assert samples['kvserve_replica_breaker_state{replica="r1",state="open"}'] == 1
    assert samples['kvserve_replica_breaker_state{replica="r1",state="closed"}'] == 0
    assert samples['kvserve_replica_breaker_state{replica="r2",state="closed"}'] == 1
    assert samples['kvserve_replica_breaker_opened_total{replica="r1"}'] == 1
    assert samples['kvserve_degradation_rung{name="shed_batch"}'] == 3
    clock[0] = 5.0                                      # open_s passed: half open; r2 replaced by r3
    breakers.retain(["r1", "r3"])
    metrics.update_breakers(breakers)
    samples = parse_metrics(metrics.render({}, ["r1", "r3"]))
    assert samples['kvserve_replica_breaker_state{replica="r1",state="half_open"}'] == 1
    assert not any('replica="r2"' in name for name in samples if name.startswith("kvserve_replica_breaker"))
    assert samples['kvserve_replica_breaker_state{replica="r3",state="closed"}'] == 1


def test_fallback_replicas_are_labelled_and_left_out_of_the_fleet_sums():
    scrapes = {"r1": _replica_text(3, [0.05], 0.5, 4)}
    fallback = {"f1": _replica_text(2, [0.2], 0.0, 7)}
    samples = parse_metrics(ClusterMetrics().render(scrapes, ["r1"], fallback, ["f1", "f2"]))
    assert samples['kvserve_num_requests_running{replica="f1",deployment="fallback"}'] == 2
    assert samples['kvserve_requests_finished_total{replica="f1",deployment="fallback",reason="stop"}'] == 7
    assert samples["kvserve_cluster_num_requests_running"] == 3                  # the fleet's only
    assert samples['kvserve_cluster_requests_finished_total{reason="stop"}'] == 4
    assert samples['kvserve_cluster_replicas{deployment="fallback",replica="f1"}'] == 1
    assert samples['kvserve_cluster_replicas{deployment="fallback",replica="f2"}'] == 0
