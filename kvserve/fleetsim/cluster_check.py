"""The simulator against the local Ray cluster on the same short trace (issue 19, test 4).

One model on ``kvserve cluster serve --autoscale tokens``: a trace whose rate steps up and back
down (``phased_trace``) makes the autoscaler add a replica and later remove it. The same
requests go through ``simulate_autoscaled``: one simulated deployment with the cluster's limits
(``max_num_seqs``, ``max_num_batched_tokens``, KV pool; the engine's scheduler, ``SchedulerReplica``),
step times from the hardware entry
``kvserve profile`` measured on this machine (slowed by the factor ``host_fit`` measured through
the running cluster, with its serving-path latency), the cluster's autoscaling settings
(``AutoscaleSettings``: the same capacity, headroom, demand window and down-scaling window; the
decisions' rhythm and delay from Ray Serve's metrics pipeline, ``ray_decision_timing``), the
ingress's queue (``cluster/admission.py``: at most ``fleet_slots`` requests on the replicas, the
rest wait at the ingress and take the slots as requests finish), the router's view of the
replicas (their stats as Ray Serve delivers them, ``router_view.StaleView``, at the age the
cluster measured) and the replica start the cluster was measured to take.

Compared (``compare_cluster``): TTFT p50 and p99 and TPOT p50 of the requests, and the serving replica count
over time: replica-seconds over the trace and the mean absolute difference of the two step
functions (sampled every second) over the mean count, each as simulated / measured.

``simulate_fixed`` plays a trace through a fixed cluster (``--replicas N --router R``) whose
simulated replicas have the engine's prefix cache: the shared-prefix routing check
(``benchmarks/fleet_sim_cluster_prefix.py``).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

import numpy as np

from kvserve.autoscale.capacity import ReplicaCapacity
from kvserve.autoscale.tiers import ResidencyTier
from kvserve.fleetsim.fleet import FleetSim
from kvserve.fleetsim.host_cpu import SharedHost
from kvserve.fleetsim.log import RequestLog
from kvserve.fleetsim.scenario import ModelTraffic, Scenario
from kvserve.fleetsim.sched_replica import SchedulerReplica
from kvserve.fleetsim.sizing import ColdStartLayers, ReplicaSizing
from kvserve.fleetsim.validate import trace_log

MODEL = "engine"
CONTROL_LOOP_S = 0.1        # Ray Serve's controller loop (RAY_SERVE_CONTROL_LOOP_INTERVAL_S)


def phased_trace(phases: list[tuple[float, float]], prompt_mean: float, output_mean: float,
                 seed: int = 0) -> RequestLog:
    """Poisson arrivals at ``rate`` per second for each ``(seconds, rate)`` phase in turn;
    lengths as ``validate.trace_log`` draws them."""
    rng = np.random.default_rng(seed)
    arrivals, start = [], 0.0
    for seconds, rate in phases:
        t = start + rng.exponential(1.0 / rate)
        while t < start + seconds:
            arrivals.append(t)
            t += rng.exponential(1.0 / rate)
        start += seconds
    return trace_log(rng, arrivals, prompt_mean, output_mean)


@dataclass(frozen=True)
class DecisionClock:
    """When the simulated autoscaler reads the replicas and decides, on the trace's clock (0: the
    trace's first request is sent; a lead-in before it runs at negative times): a reading every
    ``interval_s``, one of them at ``phase_s`` (None: the first one interval after the simulation
    starts), each decided ``delay_s`` after it (the age of the sample the decision reads)."""

    interval_s: float
    delay_s: float
    phase_s: float | None = None

    def on_clock_from(self, start_s: float) -> DecisionClock:
        """The same readings on a clock that starts at ``start_s`` of this one's (a lead-in's
        simulation starts ``-lead_s`` before the trace)."""
        return self if self.phase_s is None else replace(self, phase_s=self.phase_s - start_s)

    def first_tick_s(self) -> float | None:
        """The first reading after the clock's 0 (None: one interval in)."""
        if self.phase_s is None:
            return None
        first = math.fmod(self.phase_s, self.interval_s)
        first = first + self.interval_s if first < 0 else first
        return first if first > 1e-9 else self.interval_s


def ray_decision_timing(demand_window_s: float) -> DecisionClock:
    """The token policy's decisions on Ray Serve as ``cluster/ray_autoscale.py`` configures it,
    estimated: a replica records a sample every ``LOOK_BACK_S x 0.2`` seconds and, on its own
    timer of ``METRICS_INTERVAL_S``, pushes the samples to the controller, whose next
    control-loop pass (every ``CONTROL_LOOP_S``) reads them. The demand window closes on the first
    sample at least ``demand_window_s`` after its start, so decisions come every ``ceil(window /
    record) x record`` seconds; the sample that closes it is between 0 and one record interval old
    when pushed, so were the two timers' phases random a decision would read it ``record / 2 +
    CONTROL_LOOP_S`` after it was taken, on the mean. The phase is unknown (None). The cluster
    measures all three (``cluster_decision_clock``), which the cluster check uses instead."""
    from kvserve.cluster.ray_autoscale import LOOK_BACK_S, METRICS_INTERVAL_S
    record_every = min(LOOK_BACK_S * 0.2, METRICS_INTERVAL_S)
    return DecisionClock(math.ceil(demand_window_s / record_every - 1e-9) * record_every,
                         record_every / 2 + CONTROL_LOOP_S)


def cluster_decision_clock(windows: list, trace_start_s: float, estimate: DecisionClock) -> DecisionClock:
    """The cluster's own decision clock from its policy's closed demand windows (``[sample_s,
    decided_s, ...]`` on the wall clock, ``autoscaling.log_window``, on its ``/cluster/status``)
    and the wall-clock time the trace started: the readings' median spacing, the decisions' mean
    delay after them and the readings' phase on the trace's clock (their offsets from a grid of
    that spacing, their median). ``estimate`` when fewer than two windows were logged."""
    if len(windows) < 2:
        return estimate
    reads = np.array([w[0] for w in windows]) - trace_start_s
    interval = float(np.median(np.diff(reads)))
    steps = np.round((reads - reads[0]) / interval)
    phase = float(np.median(reads - steps * interval))
    delay = float(np.mean([w[1] - w[0] for w in windows]))
    return DecisionClock(interval, delay, phase)


def _trace_scenario(duration_s: float, settings, clock: DecisionClock, slots: int | None, queue_wait_s: float,
                    router_stats: tuple[float, float] | None, log_windows: bool) -> Scenario:
    """The one-model scenario ``simulate_autoscaled`` runs: the cluster's autoscaling settings on
    ``clock``, its ingress's slots and queue wait, its router's view of the replicas."""
    return Scenario(name="cluster-trace", models=(ModelTraffic(MODEL, "smollm2-135m"),), duration_s=duration_s,
                    budget_usd_month=0.0, autoscale_interval_s=clock.interval_s, decision_delay_s=clock.delay_s,
                    autoscale_first_tick_s=clock.first_tick_s(), downscale_window_s=settings.downscale_window_s,
                    headroom=settings.headroom_factor, max_replicas=settings.max_replicas,
                    max_queue_wait_s=queue_wait_s, ingress_slots=slots, policies=("tiers_tokens",),
                    router_stats_period_s=router_stats[0] if router_stats else None,
                    router_stats_delay_s=router_stats[1] if router_stats else 0.0, log_demand_windows=log_windows)


def simulate_autoscaled(trace: RequestLog, cost, max_num_seqs: int, max_batched_tokens: int, kv_tokens: int,
                        settings, start_s: float, path_latency_s: float = 0.0, slots: int | None = None,
                        queue_wait_s: float = float("inf"), host: SharedHost | None = None,
                        router_stats: tuple[float, float] | None = None,
                        lead_in: tuple[RequestLog, float] | None = None, clock: DecisionClock | None = None,
                        windows: list | None = None) -> tuple[RequestLog, list[tuple[float, int]]]:
    """The trace through one simulated hot deployment autoscaled by ``settings`` (the cluster's
    ``AutoscaleSettings``, token mode) whose replicas take ``start_s`` to start: (the filled log,
    the serving replica count's step function). A hot model's first replica serves at time 0, as
    the cluster's does (it is up before the trace starts); decisions follow ``clock`` (None:
    ``ray_decision_timing``'s estimate).
    A request reaches the replica ``path_latency_s`` after it is sent (``host_fit``: the serving
    path's hops); its TTFT counts from the send. ``slots`` and ``queue_wait_s``: the ingress's
    queue (``cluster/admission.fleet_slots``): beyond ``slots`` requests on the replicas, the
    rest wait at the deployment, at most ``queue_wait_s``. The replicas run the engine's scheduler
    (``SchedulerReplica``) on ``host`` (``host_cpu.SharedHost``: the cores they, the replicas
    starting and the serving plane share; None: each its own). ``router_stats``: (period, delay) of
    the replica stats the router places requests by (``router_view.StaleView``; None: live).
    ``lead_in``: (requests, seconds): requests sent that long before the trace started (the
    cluster's probe), played first and left out of the result, so the autoscaler's first windows
    hold their load as the cluster's do. ``windows``: a list to extend with the demand windows the
    autoscaler closed, ``(read at, decided at, prefill tokens/s, decode tokens/s)`` on the trace's
    clock (the lead-in's before 0), as the cluster's policy logs them (``autoscaling.log_window``)."""
    if settings.mode != "tokens":
        raise ValueError("the cluster check simulates the token policy")
    if lead_in is not None:
        lead, lead_s = lead_in
        played_windows = [] if windows is not None else None
        log, steps = simulate_autoscaled(lead.followed_by(trace, lead_s), cost, max_num_seqs, max_batched_tokens,
                                         kv_tokens, settings, start_s, path_latency_s, slots, queue_wait_s, host,
                                         router_stats, clock=clock and clock.on_clock_from(-lead_s),
                                         windows=played_windows)
        if windows is not None:
            windows.extend((read - lead_s, decided - lead_s, p, d) for read, decided, p, d in played_windows)
        played = log.part_from(len(lead), lead_s)
        played.arrival = list(trace.arrival)          # the shift's rounding left out
        return played, shift_steps(steps, lead_s)
    capacity = ReplicaCapacity(settings.prefill_tokens_per_s, settings.decode_tokens_per_s, settings.capacity_source)
    sizing = ReplicaSizing(MODEL, 1, max_num_seqs, max_batched_tokens, kv_tokens, cost, capacity, 0.0,
                           ColdStartLayers(start_s, 0.0, 0.0, 0.0))
    log = trace.fresh()
    log.arrival = [t + path_latency_s for t in trace.arrival]
    clock = clock or ray_decision_timing(settings.demand_window_s)
    scenario = _trace_scenario(max(trace.arrival) + 1.0, settings, clock, slots, queue_wait_s, router_stats,
                               windows is not None)
    sim = FleetSim(scenario, "tiers_tokens", [sizing], log, {MODEL: ResidencyTier.HOT}, [0.0], [0.0],
                   functools.partial(SchedulerReplica, host=host), host=host)
    record = sim.run()
    if windows is not None:
        windows.extend(record["windows"][0])
    serving = record["serving"]
    log.arrival = list(trace.arrival)
    return log, [(t, counts[0]) for t, counts in serving]


def simulate_fixed(trace: RequestLog, cost, max_num_seqs: int, max_batched_tokens: int, kv_tokens: int,
                   replicas: int, router: str, path_latency_s: float = 0.0, host: SharedHost | None = None,
                   prefix_cache: bool = True, slots: int | None = None,
                   queue_wait_s: float = float("inf"), turn_gap_s: float | None = None,
                   router_stats: tuple[float, float] | None = None) -> RequestLog:
    """The trace through ``replicas`` always-on simulated replicas of the engine's scheduler (with
    its prefix cache when ``prefix_cache``), placed by the router's ``router`` policy, on ``host``,
    behind the ingress's queue (``slots``, ``queue_wait_s``: as ``simulate_autoscaled``); a
    request reaches them ``path_latency_s`` after it is sent: the filled log (a fixed cluster,
    ``kvserve cluster serve --replicas N --router R``). With ``turn_gap_s`` its conversations are
    closed loop, as ``replay.replay_trace`` plays them (a turn is sent the gap after its previous
    answer, and reaches a replica the path's latency later). ``router_stats``: (period, delay) of
    the replica stats the router places requests by, as ``simulate_autoscaled``'s (None: live)."""
    sizing = ReplicaSizing(MODEL, 1, max_num_seqs, max_batched_tokens, kv_tokens, cost, ReplicaCapacity(1.0, 1.0),
                           0.0, ColdStartLayers(0.0, 0.0, 0.0, 0.0))
    log = trace.fresh()
    log.arrival = [t + path_latency_s for t in trace.arrival]
    closed = turn_gap_s is not None
    model = ModelTraffic(MODEL, "smollm2-135m", closed_loop=closed,
                         turn_gap_s=turn_gap_s + path_latency_s if closed else 0.0)
    scenario = Scenario(name="cluster-fixed", models=(model,), duration_s=max(trace.arrival) + 1.0,
                        budget_usd_month=0.0, policies=("always_on",), max_queue_wait_s=queue_wait_s,
                        ingress_slots=slots, router_stats_period_s=router_stats[0] if router_stats else None,
                        router_stats_delay_s=router_stats[1] if router_stats else 0.0)
    FleetSim(scenario, "always_on", [sizing], log, {MODEL: ResidencyTier.HOT}, [0.0], [0.0],
             functools.partial(SchedulerReplica, host=host, prefix_cache=prefix_cache), host=host, router=router,
             initial_replicas=[replicas]).run()
    # each request's send time: a closed loop's turns were sent when they were due
    log.arrival = [t - path_latency_s for t in log.arrival] if closed else list(trace.arrival)
    return log


def shift_steps(steps: list[tuple[float, int]], by_s: float) -> list[tuple[float, int]]:
    """A step function ``[(time, value), ...]`` moved ``by_s`` earlier, starting at 0 with the
    value it had at ``by_s``."""
    moved = [(t - by_s, v) for t, v in steps]
    before = [v for t, v in moved if t <= 0.0]
    return ([(0.0, before[-1])] if before else []) + [(t, v) for t, v in moved if t > 0.0]


def sample_steps(steps: list[tuple[float, int]], end_s: float, every_s: float = 1.0) -> np.ndarray:
    """A step function ``[(time, value), ...]`` (sorted, first at or before 0) read every ``every_s``
    seconds over ``[0, end_s)``."""
    times = np.array([t for t, _ in steps])
    values = np.array([v for _, v in steps], dtype=float)
    grid = np.arange(0.0, end_s, every_s)
    return values[np.clip(np.searchsorted(times, grid, side="right") - 1, 0, None)]


def _latency(log: RequestLog) -> dict:
    arr = log.arrays()
    ttft = arr["ttft_s"][~np.isnan(arr["ttft_s"])]
    tpot = arr["tpot_s"][~np.isnan(arr["tpot_s"])]
    return {"p50_ttft_s": float(np.percentile(ttft, 50)), "p99_ttft_s": float(np.percentile(ttft, 99)),
            "p50_tpot_s": float(np.percentile(tpot, 50)), "served": int(ttft.size),
            "not_served": int(len(log) - ttft.size)}


def pooled_latency(measured: list[RequestLog], simulated: list[RequestLog]) -> dict:
    """TTFT p50 / p90 / p99 and TPOT p50 over the requests of several runs taken together,
    measured and simulated, with the ratios simulated / measured: one short trace's p99 is its
    slowest one or two requests, which the runs' pooled requests hold to a sample."""
    out = {}
    for side, logs in (("measured", measured), ("simulated", simulated)):
        arrays = [log.arrays() for log in logs]
        ttft = np.concatenate([a["ttft_s"] for a in arrays])
        tpot = np.concatenate([a["tpot_s"] for a in arrays])
        out[side] = {"requests": int(ttft.size), "p50_ttft_s": float(np.nanpercentile(ttft, 50)),
                     "p90_ttft_s": float(np.nanpercentile(ttft, 90)), "p99_ttft_s": float(np.nanpercentile(ttft, 99)),
                     "p50_tpot_s": float(np.nanpercentile(tpot, 50))}
    out["ratio"] = {k: round(out["simulated"][k] / out["measured"][k], 3)
                    for k in ("p50_ttft_s", "p90_ttft_s", "p99_ttft_s", "p50_tpot_s")}
    return out


def compare_cluster(measured: RequestLog, measured_steps: list[tuple[float, int]], simulated: RequestLog,
                    simulated_steps: list[tuple[float, int]], end_s: float) -> dict:
    """TTFT p50 / p99, TPOT p50 and the replica count over ``[0, end_s)``, measured and simulated,
    with the ratios simulated / measured and the count's mean absolute difference over its mean."""
    out = {"measured": _latency(measured), "simulated": _latency(simulated)}
    counts = {"measured": sample_steps(measured_steps, end_s), "simulated": sample_steps(simulated_steps, end_s)}
    for name, series in counts.items():
        out[name]["replica_seconds"] = float(series.sum())
        out[name]["max_replicas"] = int(series.max())
        up = np.flatnonzero(series > series[0])
        out[name]["first_scale_up_s"] = float(up[0]) if up.size else None
        out[name]["replica_steps"] = [[round(t, 1), int(v)] for t, v in
                                      (measured_steps if name == "measured" else simulated_steps)]
    out["ratio"] = {k: round(out["simulated"][k] / out["measured"][k], 3)
                    for k in ("p50_ttft_s", "p99_ttft_s", "p50_tpot_s", "replica_seconds")}
    out["replica_count_mean_abs_diff_over_mean"] = round(
        float(np.abs(counts["simulated"] - counts["measured"]).mean() / counts["measured"].mean()), 3)
    return out


def windows_as_loads(windows, capacity, origin_s: float = 0.0) -> list[list[float]]:
    """Demand windows ``(read at, decided at, prefill tokens/s, decode tokens/s)`` (the cluster's
    policy's, ``autoscaling.log_window``, or ``simulate_autoscaled``'s) as ``[reading, decision,
    load]``: seconds from ``origin_s``, the load in replicas (``capacity.load``, before the headroom)."""
    return [[round(w[0] - origin_s, 2), round(w[1] - origin_s, 2), round(capacity.load(w[2], w[3]), 3)]
            for w in windows]


def compare_windows(measured: list[list[float]], simulated: list[list[float]], threshold: float,
                    match_s: float = 1.0) -> dict:
    """The autoscaler's input window by window (``windows_as_loads``): each measured window paired
    with the simulated one read nearest it, within ``match_s``; over the pairs, the loads' median
    ratio (simulated / measured), their mean absolute difference in replicas, and the share of
    pairs on the same side of ``threshold`` (the load past which the policy adds a replica:
    1 / headroom with one serving)."""
    pairs = []
    for reading, _, load in measured:
        near = min(simulated, key=lambda w: abs(w[0] - reading), default=None)
        if near is not None and abs(near[0] - reading) <= match_s:
            pairs.append((load, near[2]))
    if not pairs:
        return {"pairs": 0}
    loads = np.array(pairs)
    measured_load, simulated_load = loads[:, 0], loads[:, 1]
    positive = measured_load > 0
    ratio = float(np.median(simulated_load[positive] / measured_load[positive])) if positive.any() else None
    same_side = (simulated_load > threshold) == (measured_load > threshold)
    return {"pairs": len(pairs), "load_ratio_median": None if ratio is None else round(ratio, 3),
            "load_mean_abs_diff": round(float(np.abs(simulated_load - measured_load).mean()), 3),
            "same_side_of_threshold": round(float(same_side.mean()), 3)}
