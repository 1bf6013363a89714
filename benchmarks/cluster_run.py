"""The local Ray cluster measured for the fleet simulator's check (``fleet_sim_cluster.py``): the
host's contention timed first, then ``kvserve cluster serve`` idle, its probe and the trace,
with the replicas, their engines' step clocks and the host's drift watched (``ClusterRun``)."""
from __future__ import annotations

import asyncio
import functools
import time
from dataclasses import dataclass

from benchmarks.server_process import ServerProcess

IDLE_S = 3.0                # the cluster idles this long before the probe: the host's background CPU
IDLE_WINDOWS = 6            # ... in this many windows, the background their median (a burst is not background)


@dataclass
class ClusterRun:
    """What ``measure_cluster`` measured: ``probed`` and ``measured`` (the filled logs),
    ``served_by``, ``changes`` (the replicas by state), ``snapshots`` (the processes' CPU at each
    change), ``plane`` (``PlaneFit``), ``stats_age_s`` (``mean_stats_age``), ``sample_age_s`` and
    ``windows`` (``decision_record``), ``probe_lead_s`` (the probe was sent this long before the
    trace), ``trace_wall_s`` (the trace's start on the wall clock) and ``drift``
    (``host_meter.HostDrift`` relative to the probe, from the probe's start), ``contention``
    (``host_contention.Contention``) and ``clocks`` / ``probe_clocks``, the engines' step clocks
    read over the trace / the probe (``engine_clock.ClockReading``); ``start_contention``
    (``start_contention.StartContention``, None where not measured), the engines' ``threads`` and
    ``start_layers``, each replica's engine start by layer as the probe's and the trace's watchers
    first saw it (``ClockWatcher.start_layers``)."""

    probed: object
    measured: object
    served_by: list
    changes: list
    snapshots: list
    plane: object
    stats_age_s: float
    sample_age_s: float | None
    windows: list
    probe_lead_s: float
    trace_wall_s: float
    drift: object
    contention: object
    clocks: list
    probe_clocks: list
    start_contention: object = None
    threads: int = 1
    start_layers: tuple[dict, dict] = ({}, {})

    def clock(self, estimate):
        """The cluster's decision clock (``cluster_check.cluster_decision_clock``)."""
        from kvserve.fleetsim.cluster_check import cluster_decision_clock
        return cluster_decision_clock(self.windows, self.trace_wall_s, estimate)

    @functools.cached_property
    def quiet_drift(self) -> tuple[float, int] | None:
        """The metered drift's median over the trace's spans as quiet as the probe (at most one
        engine's busy share, no replica starting: ``engine_clock.quiet_spans``) and its readings:
        how much the host itself moved from the probe to the trace (None: no such reading)."""
        from kvserve.fleetsim.engine_clock import quiet_spans
        from kvserve.fleetsim.replay import start_spans
        return self.drift.shifted(self.probe_lead_s).median_over(quiet_spans(self.clocks, start_spans(self.changes)))

    def windows_on_trace_clock(self, capacity) -> list[list[float]]:
        """The policy's closed windows as ``[reading, decision, load]`` on the trace's clock
        (``cluster_check.windows_as_loads``)."""
        from kvserve.fleetsim.cluster_check import windows_as_loads
        return windows_as_loads(self.windows, capacity, self.trace_wall_s)

    def replica_start_layers(self) -> dict:
        """The replicas' engine starts by layer: ``initial``, those running as the probe began;
        ``probe``, those first seen running over the probe; ``trace``, over the trace, each beside
        its start as the trace's poll timed it (``start_layers.replica_layers``)."""
        from kvserve.fleetsim.start_layers import replica_layers, start_spans_seen
        over_probe, over_trace = self.start_layers
        initial = set(self.probe_clocks[0].replicas) if self.probe_clocks else set()
        return {"initial": replica_layers(over_probe, set(over_probe) - initial),
                "probe": replica_layers(over_probe, initial),
                "trace": replica_layers(over_trace, initial | set(over_probe), start_spans_seen(self.changes),
                                        self.trace_wall_s),
                "changes": [[round(t, 2), states] for t, states in self.changes]}


def measure_cluster(flags: list[str], trace, probe, vocab: int, seed: int, threads: int = 1,
                    workload: tuple[int, int, int] = (4, 128, 24), dtype: str = "auto",
                    start_probe: bool = False) -> ClusterRun:
    """Time an engine of ``threads`` beside a second one on ``workload`` (a batch of requests of
    the trace's mean prompt and output tokens; ``host_contention.measure_contention``), with
    ``start_probe`` beside a replica start too (``start_contention.measure_start_contention``);
    start ``kvserve cluster serve`` with ``flags``; read the idle host, play the probe, measure the serving plane over
    it, play the trace while watching the replicas and their engines' step clocks (``ClusterRun``)."""
    from kvserve.fleetsim.cluster_reads import decision_record, mean_stats_age
    from kvserve.fleetsim.engine_clock import ClockWatcher
    from kvserve.fleetsim.host_contention import measure_contention
    from kvserve.fleetsim.host_cpu import PlaneFit, idle_readings, process_cpu, read_cpu
    from kvserve.fleetsim.host_meter import HostDrift, HostMeter
    from kvserve.fleetsim.replay import replay_and_watch, replay_trace
    from kvserve.fleetsim.start_contention import measure_start_contention
    contention = measure_contention(threads=threads, workload=workload, dtype=dtype)
    starting = measure_start_contention(threads=threads, workload=workload, dtype=dtype) if start_probe else None
    with ServerProcess(*flags, command=("cluster", "serve"), startup_timeout_s=420) as cluster, \
            HostMeter() as meter:
        idle = idle_readings(IDLE_S, IDLE_WINDOWS)
        probe_t0 = time.perf_counter()
        with ClockWatcher(cluster.url, probe_t0, period_s=1.0) as probe_clocks:
            probed, _ = asyncio.run(replay_trace(cluster.url, probe, vocab, seed=seed + 1, t0=probe_t0))
        probe_end = time.perf_counter()
        plane = PlaneFit.measure(idle, read_cpu(), sum(probe.output))
        snapshots, trace_t0 = [], time.perf_counter()
        trace_wall_s = time.time() - (time.perf_counter() - trace_t0)
        with ClockWatcher(cluster.url, trace_t0) as clocks:
            measured, served_by, changes = asyncio.run(replay_and_watch(
                cluster.url, trace, vocab, on_change=lambda: snapshots.append(process_cpu()), t0=trace_t0))
        stats_age_s, decisions = mean_stats_age(cluster.url), decision_record(cluster.url)
    return ClusterRun(probed, measured, served_by, changes, snapshots, plane, stats_age_s,
                      decisions.get("mean_sample_age_s"), decisions.get("windows", []), trace_t0 - probe_t0,
                      trace_wall_s, HostDrift.from_readings(meter.readings, (probe_t0, probe_end), origin=probe_t0),
                      contention, clocks.readings, probe_clocks.readings, starting, threads,
                      (probe_clocks.start_layers, clocks.start_layers))
