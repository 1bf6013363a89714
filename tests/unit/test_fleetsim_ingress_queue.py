"""Tier 1: the simulated deployment's ingress queue (``fleetsim/deployment.py`` with ``slots``,
as ``cluster/admission.py``'s fleet slots): beyond the slots requests wait at the deployment,
not in a replica's queue, and each finished request hands its slot to the oldest waiter,
routed then by the policy (to a replica that became ready meanwhile)."""
from __future__ import annotations

from dataclasses import replace

from kvserve.autoscale.tiers import ResidencyTier
from kvserve.cluster.admission import fleet_slots
from kvserve.fleetsim.deployment import Deployment
from kvserve.fleetsim.log import RequestLog
from kvserve.fleetsim.run import prepare, run_policy
from kvserve.fleetsim.scenario import ModelTraffic, Scenario

ONE_MODEL = Scenario(name="one", models=(ModelTraffic("a", "llama-3-8b"),), peak_users=100, think_s=60,
                     duration_s=60, budget_usd_month=1e6)


def _burst(count: int, prompt: int = 256, output: int = 32) -> RequestLog:
    return RequestLog([1.0] * count, [0] * count, [0] * count, [prompt] * count, [output] * count)


def _ready_replica(dep: Deployment, now: float):
    name, _ = dep.start_replica(now)
    dep.replica_ready(name, now)
    return next(r for r in dep.ready if r.name == name)


def test_fleet_slots_are_the_most_replicas_times_the_batch_and_none_without_a_wait():
    assert fleet_slots(2, 4, 60.0) == 8
    assert fleet_slots(2, 4, 0.0) is None and fleet_slots(2, 4, None) is None


def test_requests_beyond_the_slots_wait_at_the_deployment_and_take_freed_slots_oldest_first():
    sizing = prepare(ONE_MODEL).sizings[0]
    seqs = sizing.max_num_seqs
    log = _burst(2 * seqs + 2)
    dep = Deployment(0, sizing, ResidencyTier.HOT, log, slots=2 * seqs)
    first = _ready_replica(dep, 0.0)
    routed = [dep.arrive(i, 1.0) for i in range(len(log))]
    assert all(r is not None and r[0] is first for r in routed[:2 * seqs])
    assert routed[2 * seqs:] == [None, None] and list(dep.queue) == [2 * seqs, 2 * seqs + 1]
    assert not any(log.waited_for_start) and dep.queued_without_replica == 0
    second = _ready_replica(dep, 2.0)
    assert second.num_running + second.num_waiting == 0          # every slot is taken: it waits
    events = dep.finished(1, 3.0)
    assert [replica for replica, _ in events] == [second]        # the oldest waiter, to the idle replica
    assert list(dep.queue) == [2 * seqs + 1] and dep.in_flight == 2 * seqs


def test_without_a_replica_the_queue_is_what_the_autoscaler_counts():
    sizing = prepare(ONE_MODEL).sizings[0]
    log = _burst(3)
    dep = Deployment(0, sizing, ResidencyTier.COLD, log, slots=4)
    assert [dep.arrive(i, 1.0) for i in range(3)] == [None] * 3
    assert dep.queued_without_replica == 3 and all(log.waited_for_start)
    _ready_replica(dep, 5.0)
    assert dep.queued_without_replica == 0 and not dep.queue and dep.in_flight == 3


def test_a_burst_through_the_ingress_queue_is_answered_in_waves_and_every_slot_comes_back():
    scenario = replace(ONE_MODEL, ingress_slots=prepare(ONE_MODEL).sizings[0].max_num_seqs)
    seqs = scenario.ingress_slots
    log = _burst(3 * seqs)
    _, arrays, sim = run_policy(scenario, prepare(scenario), "always_on", log=log)
    dep = sim.deployments[0]
    assert (arrays["ttft_s"] > 0).all() and dep.in_flight == 0 and not dep.queue
    first = arrays["ttft_s"]
    assert max(first[:seqs]) < min(first[seqs:2 * seqs]) and max(first[seqs:2 * seqs]) < min(first[2 * seqs:])
