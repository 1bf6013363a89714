"""Tier 1: the degradation ladder at the ingress (kvserve/cluster/degrade.py, overflow.py):
the fleet's KV use drives the rung like any other signal, the ``overflow_chat`` rung sends
only chat requests, only while engaged, only with a fallback configured and only beyond the
fleet's decode slots, and the ladder's state is on the ingress's /metrics. Hand-moved clock."""
import json

import pytest

from kvserve.cluster.degrade import DegradationController
from kvserve.cluster.ladder import LadderSettings, Rung, effects
from kvserve.cluster.metrics import ClusterMetrics
from kvserve.cluster.overflow import FallbackTarget, InFlight, for_fallback, overflows
from kvserve.engine.service_class import ServiceClass
from kvserve.server.metrics import parse_metrics

FAST = 0.01                                      # chat first byte far under the SLO: only KV can press
TARGET = FallbackTarget("small-model", frozenset({"big-model", "HuggingFaceTB/big-model"}), fleet_slots=8)


def _controller(**kw):
    clock = [0.0]
    settings = LadderSettings(chat_ttft_slo_s=1.0, engage_dwell_s=1.0, release_dwell_s=3.0, **kw)
    return DegradationController(settings, window_s=5.0, clock=lambda: clock[0]), clock


def _run(controller, clock, seconds: int, kv: float | None) -> list[Rung]:
    """One fast chat answer a second for ``seconds``, the fleet's KV read before each."""
    rungs = []
    for _ in range(seconds):
        if kv is not None:
            controller.observe_kv(kv)
        rungs.append(controller.record(ServiceClass.CHAT, 200, FAST).rung)
        clock[0] += 1.0
    return rungs


def test_the_fleets_kv_use_drives_the_rung_up_and_down():
    full, clock = _controller(fallback_model="small-model")
    up = _run(full, clock, 6, kv=0.99)           # 0.99 / kv_high 0.95 = 1.04: pressure >= 1
    assert up[:5] == [Rung.NORMAL, Rung.SPECULATION_OFF, Rung.CAP_BATCH_TOKENS, Rung.SHED_BATCH, Rung.OVERFLOW_CHAT]
    assert full.signal().kv_usage == 0.99 and full.signal().chat_queue_wait_s == FAST
    ratios = full.pressure_components()
    assert ratios["kv_usage"] == pytest.approx(0.99 / 0.95) and ratios["chat_queue_wait"] == pytest.approx(FAST)
    assert full.engagements == {Rung.SPECULATION_OFF: 1, Rung.CAP_BATCH_TOKENS: 1, Rung.SHED_BATCH: 1,
                                Rung.OVERFLOW_CHAT: 1}
    held = _run(full, clock, 10, kv=0.8)         # 0.84: in the hysteresis band, the ladder holds
    assert set(held) == {Rung.OVERFLOW_CHAT}
    down = _run(full, clock, 4, kv=0.3)          # 0.32 <= 0.6 for a release dwell (3 s): one rung down
    assert down[-1] is Rung.SHED_BATCH

    calm, clock = _controller()
    assert set(_run(calm, clock, 10, kv=None)) == {Rung.NORMAL}    # no KV reading: the same answers do nothing
    assert calm.signal().kv_usage == 0.0


def test_a_stale_kv_reading_counts_as_zero():
    controller, clock = _controller()
    controller.observe_kv(0.99)
    assert controller.signal().kv_usage == 0.99
    clock[0] = 5.0                               # the window's age: still read
    assert controller.signal().kv_usage == 0.99
    clock[0] = 5.5                               # older than the window: the fleet is not known to be full
    assert controller.signal().kv_usage == 0.0


@pytest.mark.parametrize("rung", list(Rung))
def test_overflow_only_for_chat_only_while_engaged_only_with_a_fallback(rung):
    settings = LadderSettings(fallback_model="small-model", priority_tenants=frozenset({"gold"}))
    at = effects(rung, settings)
    engaged = rung >= Rung.OVERFLOW_CHAT
    assert overflows(at, ServiceClass.CHAT, "big-model", 8, TARGET) is engaged
    assert overflows(at, ServiceClass.CHAT, None, 9, TARGET) is engaged         # no model named: the base
    for other in (ServiceClass.INTERACTIVE, ServiceClass.BATCH, None):           # None: not a generation request
        assert not overflows(at, other, "big-model", 8, TARGET)
    assert not overflows(at, ServiceClass.CHAT, "big-model", 7, TARGET)         # a fleet slot is free
    assert not overflows(at, ServiceClass.CHAT, "big-model:adapter", 8, TARGET)   # not the fleet's base model
    assert not overflows(at, ServiceClass.CHAT, ["big-model"], 8, TARGET)       # malformed: the replica says so
    assert not overflows(at, ServiceClass.CHAT, "big-model", 8, None)           # no fallback deployment
    unconfigured = effects(rung, LadderSettings(priority_tenants=frozenset({"gold"})))
    assert unconfigured.overflow_chat_to is None
    assert not overflows(unconfigured, ServiceClass.CHAT, "big-model", 8, TARGET)


def test_the_overflow_rung_is_skipped_without_a_fallback_and_engages_with_one():
    without, clock = _controller()
    assert _run(without, clock, 10, kv=0.99)[-1] is Rung.SHED_BATCH
    assert Rung.OVERFLOW_CHAT not in without.engagements
    with_fallback, clock = _controller(fallback_model="small-model")
    assert _run(with_fallback, clock, 10, kv=0.99)[-1] is Rung.OVERFLOW_CHAT
    assert with_fallback.current().overflow_chat_to == "small-model"


def test_the_fallback_body_names_the_fallback_model_and_nothing_else_changes():
    body = json.dumps({"model": "big-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5})
    forwarded = json.loads(for_fallback(body.encode(), TARGET))
    assert forwarded == {**json.loads(body), "model": "small-model"}


def test_in_flight_tickets_leave_once():
    fleet = InFlight()
    first, second = fleet.ticket(), fleet.ticket()
    assert fleet.count == 2
    first()
    first()                                      # the relay's end and the response's background both call it
    assert fleet.count == 1
    second()
    assert fleet.count == 0


def test_the_ladder_is_on_the_ingress_metrics():
    controller, clock = _controller(fallback_model="small-model")
    _run(controller, clock, 6, kv=0.99)
    metrics = ClusterMetrics()
    metrics.update_ladder(controller)
    metrics.overflowed.inc()
    samples = parse_metrics(metrics.render({}, []))
    assert samples['kvserve_degradation_rung{name="overflow_chat"}'] == 4
    for name in ("speculation_off", "cap_batch_tokens", "shed_batch", "overflow_chat"):
        assert samples[f'kvserve_degradation_engagements_total{{name="{name}"}}'] == 1
    assert 'kvserve_degradation_engagements_total{name="priority_only"}' not in samples    # not configured
    assert samples['kvserve_degradation_pressure{signal="kv_usage"}'] == pytest.approx(0.99 / 0.95, abs=1e-5)
    assert samples['kvserve_degradation_pressure{signal="rejection_rate"}'] == 0
    assert samples["kvserve_degradation_overflowed_total"] == 1


def test_cluster_options_configure_the_fallback():
    pytest.importorskip("ray")
    import argparse

    from kvserve.cli import build_parser
    from kvserve.cluster.app import fallback_args, fallback_target, ladder_settings
    from kvserve.loader import resolve_model_path
    parser = build_parser()
    args = parser.parse_args(["cluster", "serve", "--replicas", "3", "--max-num-seqs", "4", "--kv-cache-gib", "0.5",
                              "--fallback-model", "default", "--fallback-kv-cache-gib", "0.1",
                              "--speculative", "ngram"])
    target = fallback_target(args, resolve_model_path(None))
    assert target.fleet_slots == 12 and target.model_name == "SmolLM2-135M-Instruct"
    assert "SmolLM2-135M-Instruct" in target.fleet_models
    assert ladder_settings(args, target).fallback_model == "SmolLM2-135M-Instruct"
    small = fallback_args(args)
    assert isinstance(small, argparse.Namespace) and small.model == "default" and small.kv_cache_gib == 0.1
    assert small.speculative is None and args.speculative == "ngram" and small.replicas == 3
    plain = parser.parse_args(["cluster", "serve"])
    assert plain.fallback_replicas == 1 and fallback_target(plain, resolve_model_path(None)) is None
    assert ladder_settings(plain).fallback_model is None
    off = parser.parse_args(["cluster", "serve", "--fallback-model", "default", "--no-ladder"])
    assert fallback_target(off, resolve_model_path(None)) is None
