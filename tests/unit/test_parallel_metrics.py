"""Tier 1: the engine's ParallelCounters on /metrics (rendered only once there are ranks or
experts) and across the codec."""
from __future__ import annotations

from kvserve.engine.stats import EngineStats, ParallelCounters
from kvserve.server.metrics import ServerMetrics, parse_metrics


def test_dense_single_rank_engine_renders_no_parallel_series():
    metrics = ServerMetrics()
    metrics.update_engine(EngineStats())
    assert "kvserve_tensor_parallel_size" not in metrics.render()


def test_ranks_and_experts_are_rendered():
    metrics = ServerMetrics()
    counters = ParallelCounters(tensor_parallel_size=2, collective_seconds=1.5, expert_tokens=[3, 0, 5, 8],
                                expert_imbalance=2.0, sparse_collective_p50_s=0.001, sparse_collective_p99_s=0.02)
    metrics.update_engine(EngineStats(parallel=counters))
    values = parse_metrics(metrics.render())
    assert values["kvserve_tensor_parallel_size"] == 2 and values["kvserve_collective_seconds_total"] == 1.5
    assert values['kvserve_expert_tokens_total{expert="3"}'] == 8
    assert values['kvserve_sparse_layer_collective_seconds{quantile="0.99"}'] == 0.02
    assert values["kvserve_expert_load_imbalance"] == 2.0


def test_parallel_counters_cross_the_codec():
    from kvserve.ipc import codec
    stats = EngineStats(parallel=ParallelCounters(tensor_parallel_size=3, expert_tokens=[1, 2]))
    message = codec.EngineStatsUpdate(stats)
    assert codec.FrameBuffer().feed(codec.encode(message)) == [message]
