"""The web console's status payload (kvserve/server/console.py) without an engine: its
numbers agree with /metrics (both read EngineStats), requests are counted per class, the
rate history is derived from counter differences, and the static page is served."""
from __future__ import annotations

import asyncio

from starlette.testclient import TestClient

from kvserve.engine.service_class import ServiceClass
from kvserve.engine.stats import EngineStats, PrefixSubtree
from kvserve.ipc.codec import EngineReady
from kvserve.server.app import ServingContext, build_app
from kvserve.server.console import STATIC_FILES, ConsoleHistory, HistoryPoint, build_status
from kvserve.server.engine_client import TrackedRequest
from kvserve.server.metrics import ServerMetrics, parse_metrics
from kvserve.server.state import AdmissionLimits, ServerState


def _stats() -> EngineStats:
    return EngineStats(num_running_seqs=3, num_waiting_seqs=2, kv_blocks_used=17, kv_blocks_cached=5,
                       kv_blocks_total=64, kv_cache_dtype="float32", num_steps=41, prefix_cache_enabled=True,
                       prefix_cache_queries=4, prefix_cache_query_tokens=100, prefix_cache_hit_tokens=25,
                       prefix_cache_hit_rate=0.25, prefix_cache_blocks=9)


def _tracked(rid: str, cls: ServiceClass, started: bool, finished: bool = False) -> TrackedRequest:
    return TrackedRequest(rid, asyncio.Queue(), 0, 10, 0.0, started=started, service_class=cls,
                          finish_time=1.0 if finished else None)


def test_status_agrees_with_metrics():
    stats, metrics = _stats(), ServerMetrics()
    metrics.update_engine(stats)
    metrics.generation_tokens.inc(7)
    metrics.ttft.observe(0.2)
    metrics.ttft.observe(0.4)
    info = EngineReady(max_model_len=2048, vocab_size=49152, num_blocks=64, block_size=16, kv_max_tokens=1024,
                       eos_token_ids=[2], kv_explanation="KV: 18432 B/token x 1024 tokens", pid=1)
    status = build_status(stats, info, [], metrics, model_name="m", max_num_seqs=8)
    samples = parse_metrics(metrics.render())
    kv = status["kv"]
    assert kv["blocks_used"] == samples["kvserve_kv_blocks_used"] == 17
    assert kv["blocks_cached"] == samples["kvserve_kv_blocks_cached"] == 5
    assert kv["blocks_total"] == samples["kvserve_kv_blocks_total"] == 64
    assert kv["blocks_free"] == 64 - 17 - 5
    assert kv["explanation"] == info.kv_explanation and kv["block_size"] == 16
    assert status["engine"]["running"] == samples["kvserve_num_requests_running"] == 3
    assert status["decode_slots"] == {"used": 3, "total": 8}
    assert status["engine"]["waiting"] == samples["kvserve_num_requests_waiting"] == 2
    assert status["prefix_cache"]["hit_rate"] == samples["kvserve_prefix_cache_hit_rate"] == 0.25
    assert status["tokens"]["generated_total"] == samples["kvserve_generation_tokens_total"] == 7
    assert abs(status["latency"]["ttft"]["mean_s"] - 0.3) < 1e-9 and status["latency"]["ttft"]["count"] == 2


def test_classes_count_live_requests_only():
    requests = [_tracked("a", ServiceClass.CHAT, True), _tracked("b", ServiceClass.CHAT, False),
                _tracked("c", ServiceClass.BATCH, False), _tracked("d", ServiceClass.BATCH, True, finished=True)]
    classes = build_status(EngineStats(), None, requests, ServerMetrics())["classes"]
    assert classes[ServiceClass.CHAT.value] == {"running": 1, "waiting": 1}
    assert classes[ServiceClass.BATCH.value] == {"running": 0, "waiting": 1}
    assert set(classes) >= {c.value for c in ServiceClass}


def test_history_rates_and_latencies_from_counter_differences():
    history = ConsoleHistory()
    history.record(HistoryPoint(10.0, 0, 0))
    history.record(HistoryPoint(10.2, 5, 1))           # under half a second later: ignored
    history.record(HistoryPoint(11.0, 50, 10, ttft=(0.6, 2), itl=(0.5, 10)))
    history.record(HistoryPoint(13.0, 70, 30, ttft=(0.6, 2), itl=(0.9, 30)))
    series = history.series()
    assert [p["tokens_per_s"] for p in series] == [50.0, 10.0]
    assert [p["steps_per_s"] for p in series] == [10.0, 10.0]
    assert [p["age_s"] for p in series] == [2.0, 0.0]
    assert [p["ttft_mean_s"] for p in series] == [0.3, None]      # no first token in the second interval
    assert [p["tpot_mean_s"] for p in series] == [0.05, 0.02]


def test_largest_subtrees_reach_the_status_through_the_codec():
    branch = PrefixSubtree(adapter_id=None, cache_salt="tenant:alice", num_blocks=12, num_leaves=3,
                           num_locked_blocks=4)
    stats = EngineStats.from_dict(EngineStats(prefix_cache_subtrees=[branch]).to_dict())
    assert stats.prefix_cache_subtrees == [branch]
    status = build_status(stats, None, [], ServerMetrics())
    assert status["prefix_cache"]["largest_subtrees"] == [
        {"adapter": None, "namespace": "tenant:alice", "blocks": 12, "leaves": 3, "locked_blocks": 4}]


def test_page_and_assets_served_and_status_route():
    ctx = ServingContext(tokenizer=None, model_name="m", model_aliases=frozenset({"m"}),
                         state=ServerState(AdmissionLimits()), metrics=ServerMetrics())
    with TestClient(build_app(ctx)) as client:
        page = client.get("/")
        assert page.status_code == 200 and 'src="/console/app.js"' in page.text
        for name, media in STATIC_FILES.items():
            r = client.get(f"/console/{name}")
            assert r.status_code == 200 and r.headers["content-type"] == media and r.content
        assert client.get("/console/../app.py").status_code == 404
        assert client.get("/console/secret.txt").status_code == 404
        status = client.get("/v1/console/status").json()
        assert status["model"] == "m" and status["kv"]["blocks_total"] == 0
        events = client.get("/v1/console/events")      # no engine: one snapshot, then the stream ends
        assert events.text.startswith("data: {") and events.text.count("data: ") == 1
