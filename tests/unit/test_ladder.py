"""Tier 1: the degradation ladder and the circuit breaker (kvserve/cluster/), driven by
synthetic load signals and a hand-moved clock."""
import pytest

from kvserve.cluster.breaker import BreakerState, CircuitBreaker
from kvserve.cluster.ladder import Ladder, LadderSettings, LoadSignal, Rung, effects, pressure
from kvserve.engine.service_class import ServiceClass

HOT = LoadSignal(chat_queue_wait_s=1.5)          # queue wait 1.5x the chat SLO
WARM = LoadSignal(chat_queue_wait_s=0.8)         # between release (0.6) and engage (1.0)
CALM = LoadSignal(chat_queue_wait_s=0.1)


def _drive(ladder: Ladder, signal: LoadSignal, start: float, seconds: float, step: float = 1.0) -> list[Rung]:
    """Observe ``signal`` every ``step`` s for ``seconds``; the rungs seen after each."""
    seen, t = [], start
    while t <= start + seconds:
        seen.append(ladder.observe(signal, t).rung)
        t += step
    return seen


def _changes(rungs: list[Rung]) -> list[Rung]:
    return [r for i, r in enumerate(rungs) if i == 0 or r != rungs[i - 1]]


def test_pressure_is_the_largest_ratio():
    s = LadderSettings(chat_ttft_slo_s=2.0, kv_high=0.9, rejection_high=0.1)
    assert pressure(LoadSignal(chat_queue_wait_s=1.0, kv_usage=0.45, rejection_rate=0.02), s) == 0.5
    assert pressure(LoadSignal(kv_usage=0.9), s) == pytest.approx(1.0)
    assert pressure(LoadSignal(rejection_rate=0.3), s) == pytest.approx(3.0)


def test_rungs_engage_in_order_and_release_in_reverse():
    ladder = Ladder(LadderSettings(fallback_model="small", priority_tenants=frozenset({"gold"})))
    up = _drive(ladder, HOT, 0, 60)
    assert _changes(up) == [Rung.NORMAL, Rung.SPECULATION_OFF, Rung.CAP_BATCH_TOKENS, Rung.SHED_BATCH,
                            Rung.OVERFLOW_CHAT, Rung.PRIORITY_ONLY]
    assert up.index(Rung.SPECULATION_OFF) == 10 and up.index(Rung.CAP_BATCH_TOKENS) == 20   # one per dwell
    down = _drive(ladder, CALM, 61, 200)
    assert _changes(down) == [Rung.PRIORITY_ONLY, Rung.OVERFLOW_CHAT, Rung.SHED_BATCH, Rung.CAP_BATCH_TOKENS,
                              Rung.SPECULATION_OFF, Rung.NORMAL]
    assert down.index(Rung.OVERFLOW_CHAT) == 30                                             # slower way down


def test_between_the_thresholds_the_ladder_holds_and_short_spikes_do_nothing():
    ladder = Ladder()
    _drive(ladder, HOT, 0, 25)
    assert ladder.rung is Rung.CAP_BATCH_TOKENS
    assert set(_drive(ladder, WARM, 26, 300)) == {Rung.CAP_BATCH_TOKENS}      # hysteresis band
    fresh = Ladder()
    for t in range(0, 100, 20):                  # 9 s spikes, each followed by calm
        _drive(fresh, HOT, t, 8)
        _drive(fresh, CALM, t + 9, 10)
    assert fresh.rung is Rung.NORMAL


def test_rungs_without_their_configuration_are_skipped():
    ladder = Ladder(LadderSettings())            # no fallback model, no priority tenants
    assert _changes(_drive(ladder, HOT, 0, 200)) == [Rung.NORMAL, Rung.SPECULATION_OFF, Rung.CAP_BATCH_TOKENS,
                                                     Rung.SHED_BATCH]
    with pytest.raises(ValueError, match="hysteresis"):
        LadderSettings(release_at=1.0, engage_at=1.0)


def test_each_rung_keeps_the_effects_below_it():
    s = LadderSettings(batch_max_tokens=128, fallback_model="small", priority_tenants=frozenset({"gold"}))
    normal, spec_off, cap, shed = (effects(r, s) for r in (Rung.NORMAL, Rung.SPECULATION_OFF,
                                                            Rung.CAP_BATCH_TOKENS, Rung.SHED_BATCH))
    assert normal.speculation and normal.batch_max_tokens is None and not normal.shed_classes
    assert not spec_off.speculation and spec_off.batch_max_tokens is None
    assert cap.batch_max_tokens == 128 and not cap.shed_classes
    assert shed.shed_classes == {ServiceClass.BATCH} and shed.batch_max_tokens == 128 and not shed.speculation
    top = effects(Rung.PRIORITY_ONLY, s)
    assert top.overflow_chat_to == "small" and top.admit_only_tenants == {"gold"}
    assert top.header == "5; priority_only" and normal.header == "0; normal"


def test_breaker_opens_after_failures_probes_and_closes():
    breaker = CircuitBreaker(failure_threshold=2, open_s=5.0)
    assert breaker.routable(0)
    breaker.on_failure(0)
    assert breaker.routable(0)                   # one failure: still closed
    breaker.on_failure(1)
    assert breaker.state is BreakerState.OPEN and not breaker.routable(3)
    assert breaker.routable(6) and breaker.state is BreakerState.HALF_OPEN
    breaker.on_send()
    assert not breaker.routable(6)               # one probe at a time
    breaker.on_failure(7)                        # the probe failed: open again
    assert not breaker.routable(11) and breaker.routable(12)
    breaker.on_send()
    breaker.on_success()
    assert breaker.state is BreakerState.CLOSED and breaker.routable(12) and breaker.consecutive_failures == 0


def test_the_ingress_controller_measures_and_applies_its_rung():
    import json

    from kvserve.cluster.degrade import DegradationController, request_class
    clock = [0.0]
    settings = LadderSettings(chat_ttft_slo_s=0.5, engage_dwell_s=1.0, release_dwell_s=3.0, batch_max_tokens=32,
                              priority_tenants=frozenset({"gold"}))
    controller = DegradationController(settings, window_s=5.0, clock=lambda: clock[0])
    body = json.dumps({"messages": [], "max_tokens": 500}).encode()
    assert controller.apply(body, ServiceClass.BATCH, "bob") == (body, None)              # normal: untouched
    rungs = []
    for _ in range(8):                           # chat first bytes at 2x the SLO, one a second
        rungs.append(controller.record(ServiceClass.CHAT, 200, 1.0).rung)
        clock[0] += 1.0
    assert rungs[:4] == [Rung.NORMAL, Rung.SPECULATION_OFF, Rung.CAP_BATCH_TOKENS, Rung.SHED_BATCH]
    controller.ladder.level = 2                  # hold at cap_batch_tokens to read its effects
    capped, refusal = controller.apply(body, ServiceClass.BATCH, "bob")
    assert refusal is None and json.loads(capped) == {"messages": [], "max_tokens": 32, "num_speculative_tokens": 0}
    controller.ladder.level = 3
    assert controller.apply(body, ServiceClass.BATCH, "bob")[1].startswith("batch requests are shed")
    assert controller.apply(body, ServiceClass.CHAT, "bob")[1] is None                    # chat still admitted
    controller.ladder.level = len(controller.ladder.rungs) - 1
    assert controller.apply(body, ServiceClass.CHAT, "bob")[1].startswith("only priority tenants")
    assert controller.apply(body, ServiceClass.CHAT, "gold")[1] is None
    assert request_class({"service_tier": "flex"}, None) is ServiceClass.BATCH
    assert request_class({"service_tier": "flex"}, ServiceClass.INTERACTIVE) is ServiceClass.INTERACTIVE
    assert request_class({}, None) is ServiceClass.CHAT
