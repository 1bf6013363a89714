"""Tier 1: re-tiering inside the cluster (``cluster/live_tier.py``): a planned warm or cold model
goes hot on a window's load at ``promote_load``, keeps hot between the two thresholds, and returns
to its planned tier below ``demote_load``; a planned hot model stays hot; windows integrate load
over time."""
from __future__ import annotations

import pytest

from kvserve.autoscale import AutoscaleInputError
from kvserve.autoscale.residency import RetierConfig
from kvserve.cluster.autoscaling import AutoscaleSettings
from kvserve.autoscale import ReplicaCapacity
from kvserve.cluster.live_tier import step_tier

CONFIG = RetierConfig(0.5, 0.25)


def _windows(planned: str, loads: list[float], window_s: float = 10.0) -> list[str]:
    """The tier after each window, ticking every second at each window's load."""
    state, now, tiers = None, 0.0, []
    state = step_tier(state, planned, 0.0, now, window_s, CONFIG)
    for load in loads:
        for _ in range(int(window_s)):
            now += 1.0
            state = step_tier(state, planned, load, now, window_s, CONFIG)
        tiers.append(state["tier"])
        assert state["mean_load"] == pytest.approx(load)
    return tiers


@pytest.mark.parametrize("planned", ["cold", "warm"])
def test_load_promotes_a_model_to_hot_and_hysteresis_keeps_it_until_it_falls_below_demote(planned):
    assert _windows(planned, [0.1, 0.6, 0.3, 0.3, 0.1, 0.4, 0.5]) == [planned, "hot", "hot", "hot", planned, planned,
                                                                       "hot"]


def test_a_planned_hot_model_stays_hot_without_load():
    assert _windows("hot", [0.0, 0.0]) == ["hot", "hot"]


def test_a_window_is_the_time_average_of_its_load_and_closes_on_the_first_tick_after_it():
    state = step_tier(None, "cold", 0.0, 0.0, 10.0, CONFIG)
    state = step_tier(state, "cold", 2.0, 2.0, 10.0, CONFIG)       # 2 s at load 2.0
    state = step_tier(state, "cold", 0.0, 9.0, 10.0, CONFIG)       # 7 s at 0: window still open
    assert state["tier"] == "cold" and state["mean_load"] is None
    state = step_tier(state, "cold", 0.0, 12.0, 10.0, CONFIG)      # closes at 12 s: 4 / 12
    assert state["mean_load"] == pytest.approx(4.0 / 12.0) and state["tier"] == "cold"


def test_replica_load_sums_each_phase_over_its_capacity():
    assert ReplicaCapacity(800.0, 80.0).load(400.0, 40.0) == pytest.approx(1.0)


def test_settings_bound_a_promoted_model_to_one_replica_and_refuse_retiering_by_request_count():
    cold = AutoscaleSettings(mode="tokens", tier="cold", min_replicas=0, max_replicas=3, retier_window_s=30.0)
    assert cold.bounds().min_replicas == 0 and cold.bounds("hot").min_replicas == 1
    warm = AutoscaleSettings(mode="tokens", tier="warm", min_replicas=0, max_replicas=3, retier_window_s=30.0)
    assert warm.bounds("hot").host_weights_resident and not cold.bounds("hot").host_weights_resident
    with pytest.raises(AutoscaleInputError):
        AutoscaleSettings(mode="requests", tier="cold", min_replicas=0, max_replicas=3, retier_window_s=30.0)
    with pytest.raises(AutoscaleInputError):
        AutoscaleSettings(mode="tokens", tier="cold", min_replicas=0, max_replicas=3, promote_load=0.2,
                          demote_load=0.4)
