"""Tier 1: the simulated router's view of the replicas (``fleetsim/router_view.py``): live, or as
Ray Serve feeds the cluster's router (stats recorded every period, seen a delay later, plus the
requests sent since), in the deployment and through the fleet loop."""
from __future__ import annotations

from dataclasses import replace

import pytest

from kvserve.autoscale.tiers import ResidencyTier
from kvserve.fleetsim.deployment import Deployment
from kvserve.fleetsim.log import RequestLog
from kvserve.fleetsim.router_view import FreshView, StaleView, delay_from_mean_age, router_view
from kvserve.fleetsim.run import prepare, run_policy
from kvserve.fleetsim.scenario import ModelTraffic, Scenario
from kvserve.router.state import ReplicaState

ONE_MODEL = Scenario(name="one", models=(ModelTraffic("a", "llama-3-8b"),), peak_users=100, think_s=60,
                     duration_s=60, budget_usd_month=1e6)


class FakeReplica:
    """A replica whose counts the test sets; a submitted request waits on it."""

    def __init__(self, name, sizing=None, log=None):
        self.name, self.owner = name, -1
        self.num_running, self.num_waiting, self.kv_usage, self.queued_tokens = 0, 0, 0.0, 0

    def submit(self, request, now, ids=None):
        self.num_waiting += 1
        return None


def _state(view, replica, now) -> tuple[int, int, float, int]:
    state = ReplicaState(replica.name, max_num_seqs=4)
    view.fill(state, replica, now)
    return state.num_running, state.num_waiting, state.kv_usage, state.queued_tokens


def test_a_stale_view_counts_finished_requests_until_the_next_record_and_adds_what_was_sent_since():
    view, a = StaleView(period_s=0.5, delay_s=0.1), FakeReplica("a")
    a.num_running, a.kv_usage, a.queued_tokens = 3, 0.5, 40
    view.snapshot([a], 0.0)
    assert _state(view, a, 0.05) == (0, 0, 0.0, 0)          # recorded, not seen yet
    assert _state(view, a, 0.2) == (3, 0, 0.5, 40)
    a.num_running, a.kv_usage, a.queued_tokens = 0, 0.0, 0   # they finished: the router does not know
    view.routed("a", 0.45, 100)
    assert _state(view, a, 0.46) == (3, 1, 0.5, 140)
    a.num_running = 1
    view.snapshot([a], 0.5)
    assert _state(view, a, 0.55) == (3, 1, 0.5, 140)         # the new record is on its way
    assert _state(view, a, 0.61) == (1, 0, 0.0, 0)           # it holds the request sent at 0.45
    assert _state(FreshView(), a, 0.61) == (1, 0, 0.0, 0)
    view.forget("a")
    assert _state(view, a, 0.7) == (0, 0, 0.0, 0)


def test_before_any_record_the_view_holds_only_what_was_sent():
    view, a = StaleView(0.5, 0.0), FakeReplica("a")
    a.num_running = 4
    view.routed("a", 0.1, 10)
    view.routed("a", 0.2, 20)
    assert _state(view, a, 0.3) == (0, 2, 0.0, 30)


def test_the_delay_is_the_mean_age_less_half_a_period_and_no_period_is_a_live_view():
    assert delay_from_mean_age(0.4, 0.5) == pytest.approx(0.15)
    assert delay_from_mean_age(0.1, 0.5) == 0.0
    assert isinstance(router_view(None), FreshView)
    assert isinstance(router_view(0.5, 0.1), StaleView)
    with pytest.raises(ValueError):
        StaleView(0.0, 0.1)


def _two_replicas(view) -> tuple[Deployment, FakeReplica, FakeReplica]:
    sizing = prepare(ONE_MODEL).sizings[0]
    log = RequestLog([0.2] * 3, [0] * 3, [0] * 3, [64] * 3, [8] * 3)
    dep = Deployment(0, sizing, ResidencyTier.HOT, log, replica_factory=FakeReplica, view=view)
    for _ in range(2):
        name, _ = dep.start_replica(0.0)
        dep.replica_ready(name, 0.0)
    return dep, dep.ready[0], dep.ready[1]


def test_the_deployment_routes_by_its_view_a_replica_busy_at_the_last_record_is_avoided_until_the_next():
    dep, a, b = _two_replicas(StaleView(0.5, 0.1))
    a.num_running = dep.sizing.max_num_seqs
    dep.view.snapshot(dep.ready, 0.0)
    a.num_running = 0                                        # a's requests finished after the record
    assert [dep.route(i, 0.2)[0] for i in range(2)] == [b, b]
    dep.view.snapshot(dep.ready, 0.5)
    assert dep.route(2, 0.7)[0] is a                         # b holds the two it was sent
    live, a, b = _two_replicas(FreshView())
    assert {live.route(i, 0.2)[0].name for i in range(2)} == {a.name, b.name}


def test_the_fleet_loop_records_the_stats_every_period_and_ends():
    scenario = replace(ONE_MODEL, router_stats_period_s=0.5, router_stats_delay_s=0.1)
    seqs = prepare(scenario).sizings[0].max_num_seqs
    log = RequestLog([1.0 + 0.01 * i for i in range(3 * seqs)], [0] * 3 * seqs, [0] * 3 * seqs,
                     [256] * 3 * seqs, [32] * 3 * seqs)
    _, arrays, sim = run_policy(scenario, prepare(scenario), "always_on", log=log)
    view = sim.deployments[0].view
    assert isinstance(view, StaleView) and (arrays["ttft_s"] > 0).all()
    assert all(records for records in view.stats.values())
    again = run_policy(scenario, prepare(scenario), "always_on", log=log.fresh())[1]
    assert (again["ttft_s"] == arrays["ttft_s"]).all()
