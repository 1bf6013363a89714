"""What the cluster check reads off the running local cluster beside its trace: the age of the
replica stats its router decided on, its autoscaling policy's record, the cores a starting
replica kept busy (``benchmarks/fleet_sim_cluster.py``, docs/fleet_simulator.md)."""
from __future__ import annotations


def router_stats(mean_age_s: float) -> tuple[float, float]:
    """(period, delay) of the replica stats the cluster's router saw, from their mean age."""
    from kvserve.cluster.app import ROUTING_STATS_PERIOD_S
    from kvserve.fleetsim.router_view import delay_from_mean_age
    return ROUTING_STATS_PERIOD_S, delay_from_mean_age(mean_age_s, ROUTING_STATS_PERIOD_S)


def decision_record(url: str) -> dict:
    """The engine deployment's autoscaling record as its policy published it (``/cluster/status``):
    ``mean_sample_age_s``, the mean age of the samples that closed its demand windows, and
    ``windows``, its last closed windows (``autoscaling.log_window``); {} before its first tick."""
    import httpx
    status = httpx.get(f"{url}/cluster/status", timeout=30.0).json()
    return status["deployments"]["engine"].get("autoscale") or {}


def mean_stats_age(url: str) -> float:
    """The mean age of the replica stats the cluster's router decided on
    (``kvserve_router_stats_age_seconds`` on the ingress's ``/metrics``; 0 before any decision)."""
    import httpx
    from kvserve.server.metrics import parse_metrics
    samples = parse_metrics(httpx.get(f"{url}/metrics", timeout=30.0).text)
    count = samples.get("kvserve_router_stats_age_seconds_count", 0.0)
    return samples.get("kvserve_router_stats_age_seconds_sum", 0.0) / count if count else 0.0


def starting_cores(changes: list, snapshots: list) -> float:
    """The cores a starting replica kept busy: over the measured starts the poll saw whole
    (``replay.whole_start_windows``: a start under way before the watch had its processes already,
    which would count as no CPU), the core-seconds of the processes that appeared meanwhile
    (``host_cpu.new_processes_cpu_s``: Ray's worker taking the replica actor, the engine process
    it spawned) over the seconds."""
    from kvserve.fleetsim.host_cpu import new_processes_cpu_s
    from kvserve.fleetsim.replay import whole_start_windows
    spans = [(new_processes_cpu_s(snapshots[b], snapshots[e]), changes[e][0] - changes[b][0])
             for b, e in whole_start_windows(changes)]
    seconds = sum(s for _, s in spans)
    return sum(cpu for cpu, _ in spans) / seconds if seconds > 0 else 0.0
