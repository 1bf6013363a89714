"""Tier 1: the cluster ingress's admission queue by service class (kvserve/cluster/admission.py):
under a full fleet each freed slot goes to the highest class waiting (FIFO within a class),
a wait past the bound is refused without taking a slot, and a cancelled waiter takes none."""
import asyncio

import pytest

from kvserve.cluster.admission import ClassQueue, QueueTimeout
from kvserve.engine.service_class import ServiceClass

I, C, B = ServiceClass.INTERACTIVE, ServiceClass.CHAT, ServiceClass.BATCH


async def _settle():
    for _ in range(5):
        await asyncio.sleep(0)


def test_a_full_fleet_releases_the_highest_class_first_fifo_within_a_class():
    async def scenario():
        queue = ClassQueue(slots=2, max_wait_s=None)
        held = [await queue.acquire(B), await queue.acquire(B)]          # the fleet is full of batch
        order, releases = [], []

        async def waiter(name, cls):
            releases.append(await queue.acquire(cls))
            order.append(name)
        arrivals = [("batch-1", B), ("chat-1", C), ("batch-2", B), ("interactive-1", I), ("chat-2", C),
                    ("interactive-2", I)]
        tasks = []
        for name, cls in arrivals:
            tasks.append(asyncio.create_task(waiter(name, cls)))
            await _settle()
        assert order == [] and queue.num_waiting == 6 and queue.num_in_flight == 2
        assert queue.waiting_by_class() == {"interactive": 2, "chat": 2, "batch": 2}
        for release in held:
            release()
            release()                                                    # once, however often
        await _settle()
        while releases:
            releases.pop(0)()
            await _settle()
        await asyncio.gather(*tasks)
        assert queue.num_in_flight == 0
        return order
    assert asyncio.run(scenario()) == ["interactive-1", "interactive-2", "chat-1", "chat-2", "batch-1", "batch-2"]


def test_a_free_slot_is_taken_at_once_and_counted():
    async def scenario():
        queue = ClassQueue(slots=2, max_wait_s=0.0)
        first, second = await queue.acquire(B), await queue.acquire(C)
        assert queue.num_in_flight == 2
        first()
        third = await queue.acquire(I)                                   # a slot is free: no wait at all
        second(), third()
        return queue.num_in_flight
    assert asyncio.run(scenario()) == 0


def test_a_wait_past_the_bound_is_refused_and_takes_no_slot():
    async def scenario():
        queue = ClassQueue(slots=1, max_wait_s=0.05)
        held = await queue.acquire(C)
        with pytest.raises(QueueTimeout) as refused:
            await queue.acquire(I)
        assert refused.value.retry_after_s >= 1 and "full" in str(refused.value)
        assert queue.num_waiting == 0 and queue.num_in_flight == 1
        held()
        assert queue.num_in_flight == 0                                  # nobody left to hand the slot to
        (await queue.acquire(B))()
        return queue.num_in_flight
    assert asyncio.run(scenario()) == 0


def test_a_cancelled_waiter_takes_no_slot_and_later_ones_still_get_theirs():
    async def scenario():
        queue = ClassQueue(slots=1, max_wait_s=None)
        held = await queue.acquire(B)
        gone = asyncio.create_task(queue.acquire(I))
        stays = asyncio.create_task(queue.acquire(B))
        await _settle()
        gone.cancel()
        await _settle()
        held()
        release = await asyncio.wait_for(stays, 1.0)
        assert queue.num_in_flight == 1 and queue.num_waiting == 0
        release()
        return queue.num_in_flight
    assert asyncio.run(scenario()) == 0


def _cluster_args(*argv: str):
    """The real `kvserve cluster serve` parser."""
    import argparse
    from kvserve.cluster.cli import register
    parser = argparse.ArgumentParser(prog="kvserve")
    register(parser.add_subparsers(dest="command"))
    return parser.parse_args(["cluster", "serve", *argv])


def test_the_ingress_gets_the_fleets_slots_and_the_tenants_limits_from_the_options():
    from kvserve.cluster.app import ingress_admission
    from kvserve.server.tenants import Tenant, TenantLimits, TenantsConfig
    tenants = TenantsConfig({"acme": Tenant("acme", ("k",), limits=TenantLimits(requests_per_min=7))})
    wired = ingress_admission(_cluster_args("--replicas", "3", "--max-num-seqs", "4"), tenants, None)
    assert wired["fleet_slots"] == 12 and wired["queue_wait_s"] == 60.0
    assert wired["tenant_limits"] == {"acme": TenantLimits(requests_per_min=7)}
    off = ingress_admission(_cluster_args("--queue-wait-s", "0"), None, None)
    assert off["fleet_slots"] is None and off["queue_wait_s"] is None and off["tenant_limits"] == {}
    assert wired["breakers"] == (3, 5.0)
    tuned = ingress_admission(_cluster_args("--breaker-failures", "5", "--breaker-open-s", "2.5"), None, None)
    assert tuned["breakers"] == (5, 2.5)


def test_the_ingress_queue_is_on_the_clusters_metrics():
    """``kvserve_ingress_queue_waiting{class}`` and the slots in use mirror the class queue;
    timeouts, waits and the fleet-wide 429s have their own series (issue 16)."""
    from kvserve.cluster.metrics import ClusterMetrics
    from kvserve.server.metrics import parse_metrics, render_metrics

    async def scenario():
        queue, metrics = ClassQueue(slots=1, max_wait_s=None), ClusterMetrics()
        release = await queue.acquire(C)
        waiting = [asyncio.create_task(queue.acquire(B)), asyncio.create_task(queue.acquire(I))]
        await _settle()
        metrics.update_admission(queue)
        samples = parse_metrics(render_metrics(metrics.all))
        assert samples['kvserve_ingress_queue_waiting{class="batch"}'] == 1
        assert samples['kvserve_ingress_queue_waiting{class="interactive"}'] == 1
        assert samples['kvserve_ingress_queue_waiting{class="chat"}'] == 0
        assert samples["kvserve_ingress_fleet_slots_in_use"] == 1
        release()
        await _settle()
        for task in waiting:
            task.cancel()
        metrics.queue_timeouts.inc(**{"class": "batch"})
        metrics.limited.inc(tenant="acme", status="429")
        metrics.queue_wait.observe(0.25, **{"class": "chat"})
        samples = parse_metrics(render_metrics(metrics.all))
        assert samples['kvserve_ingress_queue_timeouts_total{class="batch"}'] == 1
        assert samples['kvserve_ingress_rate_limited_total{status="429",tenant="acme"}'] == 1
        assert samples['kvserve_ingress_queue_wait_seconds_count{class="chat"}'] == 1
    asyncio.run(scenario())
