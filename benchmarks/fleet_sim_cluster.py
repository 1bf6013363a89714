"""The fleet simulator against the local Ray cluster: the same trace, the replica count over time.

1. ``kvserve profile --quick --threads 1`` on this machine (or ``--hardware PATH``: a saved entry).
2. ``kvserve cluster serve`` of the default model, one thread per replica, ``--autoscale tokens``
   between 1 and 2 replicas, its capacity planned on that hardware entry (``--capacity-gpu``),
   ``--router least_loaded`` (the trace's prompts share no prefix), headroom factor 1.5: with the
   default 1.25 a step of 0.9 of a replica (needed to sit clearly above the threshold) kept one
   replica near saturation for 25-35 s, where the cluster drifting from its probe showed as a
   TTFT p50 0.62x in one run of four; at 1.5 a step of 0.8 suffices.
3. An open-loop trace whose rate steps up, then down (``--phases``), streamed through the ingress
   (``fleetsim/replay.py``) while ``/cluster/status`` is polled for the running replicas. Each
   phase's load is a fraction of one replica's capacity as the cluster plans it on that profile
   (``load_rates``), so the token policy's decisions do not move with the profile: with the rate
   in requests/s, one quick profile put a 1.5 requests/s step at 0.77 of a replica (x headroom
   1.25 = 0.96, under the threshold of 1, so only a burst window scaled up), another at 1.03.
   The requests are 128 / 24 tokens on the mean, shorter on a host where those cost a replica
   more than 1 / 1.6 s (``trace_shape``, ``fleetsim/trace_shape.py``: the trace then holds as
   many requests and the probe as much work as where the check was set).
   Before the trace, a probe (``fleetsim/host_fit.py``: requests one at a time with prompts of
   four lengths, then a stream of ten, ``PROBE_STREAM``) measures the host as the cluster's
   engines see it: how much slower they decode and prefill than the profile and the latency the
   serving path adds to a first token; and, from /proc, the serving plane's CPU per streamed
   token and the background's cores (``fleetsim/host_cpu.py``). Before the cluster starts, the
   engine is timed alone and beside a second busy engine, each pinned to a core
   (``fleetsim/host_contention.py``): the two engines' contention for the memory system.
4. The simulator plays the same requests through one deployment with the cluster's limits,
   ingress queue and autoscaling settings, the engine's scheduler, the profile's step times
   slowed by the probe's factors and per-sequence cost, the probe's path latency, the replica
   start the cluster took, the host's cores shared by the busy engines, the replicas starting
   (the cores a start kept busy, measured from /proc over the trace's starts) and the plane
   (with the share of the plane's and background's load that lands on a busy engine's core, read
   by the engine's clock over the probe's stream, ``plane_reach``; the probe is fitted on that
   shared host, so its factors hold only what the host does not), the busy engines' memory
   contention, and
   the router's view of the replicas: their stats as Ray Serve delivers them, every
   ``ROUTING_STATS_PERIOD_S`` and as old as the ingress measured at its decisions
   (``kvserve_router_stats_age_seconds``; ``fleetsim/router_view.py``). It plays the probe first,
   at the lead it had (its load is in the autoscaler's first windows), reads and decides on the
   cluster's own clock (``ClusterRun.clock``: the spacing, phase and age of the readings its
   policy closed its demand windows on, ``cluster_windows``). The host's drift is read beside the
   cluster by ``fleetsim/host_meter.py``; the trace's steps are slowed by one factor of it, its
   median over the trace's spans as quiet as the probe (``quiet_drift`` in the JSON,
   ``trace_drift``: the host's move from the probe to the trace), not by the drift over time
   (over fifteen runs that made every figure worse: TTFT p99's mean |log ratio| 0.35 against
   0.23; the meter reads our own engines' memory traffic with the host's; docs/fleet_simulator.md).
   Beside it, the same with one part changed (``profile_alone``: on the bare profile;
   ``cores_unshared``: the probe's fit without the shared cores (nor the quiet drift, played on
   them); ``starts_cost_no_cpu``: shared cores, the starts left out; ``memory_contention_off``: the
   busy engines share the cores only; ``router_view_live``: the router sees the replicas as they
   are; ``host_drift_metered``: every step slowed by the metered drift over time;
   ``host_drift_none``: the trace at the probe's speed; ``engine_clock_speed``: the trace's steps
   by one factor from the engines' own CPU per step where one was busy alone, over the simulated
   (``engine_clocks``' ``cpu_per_step_measured_over_simulated``); ``probe_not_played``; ``decision_clock_estimated``:
   ``ray_decision_timing``'s clock; ``window_phase_unaligned``: the cluster's spacing and age, the first reading one interval
   into the probe; ``plane_reach_off``: no reach, the probe fitted on an unshared host
   (``plane_reach_off_fit``; the main comparison until 2026-12-07);
   ``decode_one_factor``: the probe's decode fitted as one factor on its stream, no per-sequence
   cost, ``decode_one_factor_fit``; with ``--start-contention``, ``start_contention_measured``:
   the steps slowed while a replica starts by an engine's CPU per run beside a replica start,
   timed before the cluster, ``fleetsim/start_contention.py``, ``start_contention`` in the JSON).

    .venv/bin/python benchmarks/fleet_sim_cluster.py [--phases 35:0.25,40:0.8,60:0.2] [--hardware PATH]
        [--seed N] [--runs K] [--repeat-cluster] [--dtype float32] [--start-contention] [--record DIR]
    .venv/bin/python benchmarks/fleet_sim_cluster.py --replay DIR/run0.pkl.gz [...]

Prints one JSON object: TTFT p50 / p99 and the replica count (replica-seconds, the step functions,
their mean absolute difference over the mean), measured and simulated, with the ratios
(simulated / measured); the issue's bar is within 20%. Beside them, the engines' step clocks
over the trace (read through the ingress every 2 s) and the simulated host's steps, grouped by
engines busy and whether a replica was starting (``engine_clocks``: the CPU share the steps got
and their CPU per step, measured over simulated by group; ``fleetsim/engine_clock.py``), over
the probe the engines' steps (``probe_clock``: over its singles and its stream), the
one-at-a-time requests' path the clocks measured (``probe_path_measured_s``, beside the fit's
intercept) and the plane's reach
(``plane_reach``, over the probe's stream; reported only, over the whole probe and over the
trace), and the autoscaler's input: the demand windows the cluster's policy closed and the
simulator's (``cluster_windows``, ``simulated_windows``: ``[reading, decision, load]`` on the trace's clock) and, over the pairs
read at the same moment, the loads' median ratio, mean absolute difference and the share on the
same side of the scale-up threshold (``window_loads``, ``cluster_check.compare_windows``). With
``--runs K``: each run's object under ``runs`` and, under ``pooled``, the latencies over all the
runs' requests together
(``cluster_check.pooled_latency``). With ``--repeat-cluster`` a second cluster plays each run's
probe and trace again and is compared with the first as the simulator is (``cluster_repeat``:
its figures and the ratios second / first; ``pooled_cluster_repeat`` over the runs): how well
the cluster reproduces itself, a floor under any simulator's agreement with it.

``--record DIR`` saves each run's cluster side as ``DIR/run<SEED>.pkl.gz`` (``cluster_recording.py``);
``--replay`` simulates saved runs again without a cluster, the same JSON (``seeds``: their paths).
"""
from __future__ import annotations

import argparse
import functools
from collections import Counter
import json
import os
import pickle
import subprocess
import sys
import tempfile
from dataclasses import replace

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.cluster_recording import Recording  # noqa: E402
from benchmarks.cluster_run import measure_cluster  # noqa: E402

KV_CACHE_GIB = 0.25
MAX_NUM_SEQS = 4         # each replica's batch; the capacity is planned for a full one (``full_batch_tpot_ms``)
TPOT_SLACK = 1.2         # the planner's TPOT SLO over a full batch's step on this host
HEADROOM_FACTOR = 1.5   # the policy scales up past 1 / 1.5 = 0.67 of the planned capacity (step 2 above)
PROBE_STREAM = dict(batch=10, batch_gap_s=0.25)   # the probe's busy part: 10 requests 0.25 s apart (4/s)


def host_cores() -> int:
    """The cores this process (and the cluster it starts) may run on."""
    return len(os.sched_getaffinity(0))


def cluster_flags(hw_path: str, lengths: tuple[int, int], demand_window_s: float = 5.0,
                  downscale_window_s: float = 20.0, dtype: str = "auto") -> list[str]:
    """``kvserve cluster serve`` options of the check (the simulator reads the same ones), its
    capacity planned for requests of ``lengths`` (mean prompt and output tokens), its engines'
    weights in ``dtype`` (as the profile's)."""
    prompt_tokens, output_tokens = lengths
    return ["--threads", "1", "--dtype", dtype, "--kv-cache-gib", str(KV_CACHE_GIB),
            "--max-num-seqs", str(MAX_NUM_SEQS), "--replicas", "1",
            "--capacity-tpot-ms", str(round(full_batch_tpot_ms(hw_path, lengths), 1)),
            "--router", "least_loaded", "--no-ladder", "--autoscale", "tokens", "--tier", "hot",
            "--min-replicas", "1", "--max-replicas", "2", "--headroom-factor", str(HEADROOM_FACTOR),
            "--capacity-gpu", hw_path,
            "--capacity-prompt-tokens", str(prompt_tokens), "--capacity-output-tokens", str(output_tokens),
            "--demand-window-s", str(demand_window_s), "--downscale-window-s", str(downscale_window_s)]


def full_batch_tpot_ms(hw_path: str, lengths: tuple[int, int]) -> float:
    """The planner's TPOT SLO for the check: one that a batch of ``MAX_NUM_SEQS`` meets on this
    host (its decode step there, from the planner without an SLO, x ``TPOT_SLACK``), at least the
    cluster's default 100 ms. The capacity is then a full batch's on every host: on the AVX2
    host a batch of four steps in ~145 ms, so at 100 ms the planner allowed one sequence."""
    import argparse
    from kvserve.cluster.capacity_source import planned_capacity
    from kvserve.loader.api import default_model_path
    unbound = argparse.Namespace(capacity_gpu=hw_path, capacity_prompt_tokens=lengths[0],
                                 capacity_output_tokens=lengths[1], capacity_tpot_ms=1e9,
                                 capacity_ttft_ms=2000.0, max_num_seqs=MAX_NUM_SEQS)
    step_s = MAX_NUM_SEQS / planned_capacity(default_model_path(), unbound).decode_tokens_per_s
    return max(100.0, 1e3 * step_s * TPOT_SLACK)


def profile(path: str | None = None, repeats: int | None = None, dtype: str = "auto") -> str:
    """``kvserve profile --quick --threads 1 --dtype DTYPE`` (the replicas' thread count and
    weights) into ``path`` (a temporary file by default), once the host is quiet
    (``host_cpu.wait_until_quiet``: a cluster that an earlier run stopped may still be winding
    down, and a profile taken beside it times every step slow); the path."""
    from kvserve.fleetsim.host_cpu import wait_until_quiet
    path = path or os.path.join(tempfile.mkdtemp(), "local.json")
    extra = ["--repeats", str(repeats)] if repeats else []
    waited, busy = wait_until_quiet()
    print(f"profile: waited {waited:.0f} s for a quiet host (busy cores per second: {busy})", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "kvserve.cli", "profile", "--quick", "--threads", "1", "--dtype", dtype,
                    *extra, "--out", path], check=True, stdout=subprocess.DEVNULL)
    return path


def seconds_per_request(settings, lengths: tuple[int, int]) -> float:
    """What a request of ``lengths`` (prompt, output tokens) costs one replica at the planned
    capacity (``settings``' prefill and decode tokens/s): ``P / C_p + O / C_d``, the token
    policy's load of one such request a second (``autoscale/policy.py``)."""
    return lengths[0] / settings.prefill_tokens_per_s + lengths[1] / settings.decode_tokens_per_s


def load_rates(phases: list[tuple[float, float]], shape) -> list[tuple[float, float]]:
    """``(seconds, load)`` phases as ``(seconds, requests/s)``: a load of 1 is one replica's
    planned capacity for requests of the ``shape``'s mean lengths (``TraceShape``: its cost at
    the capacity, ``seconds_per_request``), ``rate = load / cost``, the token policy's load read
    backwards."""
    return [(seconds, load / shape.seconds_per_request) for seconds, load in phases]


def trace_shape(hw_path: str):
    """The check's request lengths on the hardware entry ``hw_path`` (``fleetsim/trace_shape.py``):
    shortened on a slow host until a request costs a replica what 128 / 24 tokens cost on the
    host the check was set on."""
    from kvserve.fleetsim.trace_shape import shape_for_host

    def cost(prompt_tokens: int, output_tokens: int) -> float:
        lengths = (prompt_tokens, output_tokens)
        return seconds_per_request(cluster_settings(cluster_flags(hw_path, lengths))[1], lengths)
    return shape_for_host(cost)


def cluster_settings(flags: list[str]) -> tuple:
    """The parsed ``kvserve cluster serve`` options and the autoscaler's settings they give."""
    from kvserve.cli import build_parser
    from kvserve.cluster.capacity_source import settings_from_args
    from kvserve.loader.api import default_model_path
    args = build_parser().parse_args(["cluster", "serve", *flags])
    return args, settings_from_args(args, default_model_path())


def trace_requests(phases: list[tuple[float, float]], shape) -> float:
    """How many requests the check's trace holds for requests of ``shape`` (``trace_shape``; its
    phases' rates, ``load_rates``, times their seconds)."""
    return sum(seconds * rate for seconds, rate in load_rates(phases, shape))


def case(hw_path: str, phases, shape, demand_window_s: float, downscale_window_s: float, seed: int, dtype: str,
         start_probe: bool) -> tuple:
    """The check's cluster and requests: the cluster's parsed arguments and autoscaling settings,
    the phases' rates, the trace and the probe (``shape``'s lengths), and ``measure()``, which runs
    the cluster on them (``measure_cluster``)."""
    from kvserve.fleetsim.cluster_check import phased_trace
    from kvserve.fleetsim.host_fit import probe_trace
    from kvserve.loader.api import default_model_path
    from kvserve.planner.model_io import model_from_gguf
    lengths = (shape.prompt_tokens, shape.output_tokens)
    flags = cluster_flags(hw_path, lengths, demand_window_s, downscale_window_s, dtype)
    (args, settings), rates = cluster_settings(flags), load_rates(phases, shape)
    trace = phased_trace(rates, *lengths, seed)
    probe = probe_trace(**PROBE_STREAM, prompt_tokens=lengths[0], output_tokens=lengths[1], gap_s=shape.singles_gap_s)
    measure = functools.partial(measure_cluster, flags, trace, probe, model_from_gguf(default_model_path()).vocab_size,
                                seed, threads=args.threads, workload=(args.max_num_seqs, *lengths), dtype=dtype,
                                start_probe=start_probe)
    return args, settings, rates, trace, probe, measure


def check(hw_path: str, phases: list[tuple[float, float]], demand_window_s: float = 5.0,
          downscale_window_s: float = 20.0, seed: int = 0, repeat: bool = False,
          dtype: str = "auto", shape=None, start_probe: bool = False,
          record: str | None = None) -> tuple[dict, object, object, object | None]:
    """Run the cluster on the probe and the trace whose ``(seconds, load)`` phases ``load_rates``
    turns into rates, simulate both, compare (the module docstring): (the comparison, the
    measured log, the simulated log, the second cluster's log or None), the requests of
    ``shape`` (None: ``trace_shape`` on ``hw_path``), the engines' weights in ``dtype``. With
    ``repeat``, a second cluster plays the same probe and trace, compared with the first as the
    simulator is (``cluster_repeat``); ``start_probe``: ``measure_cluster``'s, for a variant;
    ``record``: a path where the run's ``Recording`` is saved (``cluster_recording.py``)."""
    from kvserve.fleetsim.cluster_check import compare_cluster
    from kvserve.fleetsim.replay import running_steps
    shape = shape or trace_shape(hw_path)
    *_, measure = case(hw_path, phases, shape, demand_window_s, downscale_window_s, seed, dtype, start_probe)
    recording = Recording.of(hw_path, phases, shape, demand_window_s, downscale_window_s, seed, dtype, host_cores(),
                             measure())
    if record:
        recording.save(record)
    result, measured, simulated = simulate_recording(recording)
    again = measure() if repeat else None
    if again:
        compared = compare_cluster(measured, running_steps(recording.run.changes), again.measured,
                                   running_steps(again.changes), end_s=sum(seconds for seconds, _ in phases))
        result["cluster_repeat"] = repeat_record(compared)
    return result, measured, simulated, again.measured if again else None


def simulate_recording(recording: Recording) -> tuple[dict, object, object]:
    """Simulate the probe and the trace of a cluster run (``Recording``: measured now by
    ``check`` or saved earlier) and compare (the module docstring): (the comparison, the measured
    log, the simulated log)."""
    from kvserve.fleetsim.cluster_check import compare_cluster, ray_decision_timing, windows_as_loads
    from kvserve.fleetsim.cluster_sim import ClusterSimulator
    from kvserve.fleetsim.cluster_reads import router_stats, starting_cores
    from kvserve.fleetsim.engine_clock import trace_clocks
    from kvserve.fleetsim.host_cpu import SharedHost
    from kvserve.fleetsim.replay import running_steps, start_durations, start_spans
    rec, run = recording, recording.run
    with rec.hardware_file() as hw_path:
        args, settings, rates, trace, probe, _ = case(hw_path, rec.phases, rec.shape, rec.demand_window_s,
                                                      rec.downscale_window_s, rec.seed, rec.dtype, False)
        estimated = ray_decision_timing(rec.demand_window_s)
        simulate = ClusterSimulator(hw_path, args, settings, run.clock(estimated))
    lead_in, starts = (probe, run.probe_lead_s), start_durations(run.changes)
    start_s, start_cores = sum(starts) / len(starts) if starts else 0.0, starting_cores(run.changes, run.snapshots)
    reach = probe_reach(run, probe)
    host = functools.partial(SharedHost, rec.host_cores, args.threads, run.plane, contention=run.contention.factor,
                             drift=trace_drift(run), reach=reach or 0.0)
    fit, one_factor, unreached = (fit_probe(run, probe, simulate, host=lambda: host(0.0)),
                                  fit_probe(run, probe, simulate, host=lambda: host(0.0), per_sequence=False),
                                  fit_probe(run, probe, simulate))
    stats = router_stats(run.stats_age_s)
    on_fit = functools.partial(simulate_on_fit, simulate, trace, fit, start_s, router_stats=stats, lead_in=lead_in)
    simulated, sim_steps = on_fit(host(start_cores, record=(host_record := [])), windows=(sim_windows := []))
    compare = functools.partial(compare_cluster, run.measured, running_steps(run.changes),
                                end_s=sum(seconds for seconds, _ in rec.phases))
    result = compare(simulated, sim_steps)
    clocks = trace_clocks(run.clocks, host_record, run.measured, start_spans(run.changes), lead_in[1])
    variants = {name: compare(*sim) for name, sim in (
        ("profile_alone", simulate(trace, 1.0, 0.0, start_s, router_stats=stats, lead_in=lead_in)),
        *one_part_changed(on_fit, host, start_cores, run, simulate.clock, estimated,
                          clocks["cpu_per_step_measured_over_simulated"].get("1")),
        ("plane_reach_off", on_fit(host(start_cores, reach=0.0), fitted=unreached)),
        ("decode_one_factor", on_fit(host(start_cores), fitted=one_factor)))}
    return {**case_record(rec, rates, len(trace), settings, simulate),
            **cluster_record(run, simulate.clock, starts, start_cores, stats, rec.host_cores),
            **window_record(run.windows_on_trace_clock(settings.capacity()),
                            windows_as_loads(sim_windows, settings.capacity()), settings.headroom_factor),
            "host_fit": fit.as_dict(), "decode_one_factor_fit": one_factor.as_dict(),
            "plane_reach_off_fit": unreached.as_dict(), **probe_record(run, probe, reach),
            "engine_clocks": clocks,
            **result, **{name: {"simulated": v["simulated"], "ratio": v["ratio"]} for name, v in variants.items()}}, \
        run.measured, simulated


def case_record(recording, rates, requests: int, settings, simulate) -> dict:
    """The check's case for the JSON: the phases, the requests' shape and rates, the planned
    capacity, the profile's error and the autoscaler's windows."""
    return {"load_phases": [list(p) for p in recording.phases], "trace_shape": recording.shape.as_dict(),
            "rate_phases": [[seconds, round(rate, 3)] for seconds, rate in rates], "requests": requests,
            "capacity": settings.capacity_source,
            "profile_rms_error": dict(simulate.hw.calibration).get("rms_relative_error"),
            "demand_window_s": recording.demand_window_s, "downscale_window_s": recording.downscale_window_s}


def trace_drift(run):
    """The host's move from the probe to the trace, played in the main comparison: every step of
    the trace slowed by one factor, the drift meter's median over the trace's spans as quiet as the
    probe (``ClusterRun.quiet_drift``), the probe played before it at its own speed (the fit was
    made on it); None where no span was as quiet."""
    from kvserve.fleetsim.host_meter import HostDrift
    quiet = run.quiet_drift
    return HostDrift.step(quiet[0], run.probe_lead_s) if quiet else None


def simulate_on_fit(simulate, trace, fit, start_s: float, host=None, fitted=None, **kwargs):
    """``trace`` through ``simulate`` (``cluster_sim.ClusterSimulator``) on the probe's ``fitted``
    host (``host_fit.HostFit``; None: ``fit``) on ``host`` (``host_cpu.SharedHost``), its
    replicas starting in ``start_s``."""
    fitted = fitted or fit
    return simulate(trace, fitted.slowdown, fitted.seq_extra_s, start_s, fitted.path_latency_s, host,
                    prefill_slowdown=fitted.prefill_slowdown, **kwargs)


def repeat_record(compared: dict) -> dict:
    """A second cluster on the same trace against the first (``compare_cluster`` with the second
    in the simulator's place): its figures and the ratios second / first."""
    return {"measured_again": compared["simulated"], "ratio": compared["ratio"],
            "replica_count_mean_abs_diff_over_mean": compared["replica_count_mean_abs_diff_over_mean"]}


def one_part_changed(on_fit, host, start_cores: float, run, clock, estimated,
                     engine_speed: float | None = None) -> list[tuple[str, tuple]]:
    """The simulation on the probe's fit with one part changed (the module docstring's list):
    (name, the simulated log and steps); where ``run`` (``ClusterRun``) measured a start's
    contention (``StartContention``), the steps slowed by its ``cpu_factor`` while a replica
    starts too; where it has a quiet drift (``trace_drift``, played in the main comparison), the
    trace's steps at the probe's speed; where the engines' clocks had windows of one engine busy
    alone, every step of the trace slowed by ``engine_speed`` instead, their CPU per step over the
    simulated (``engine_clock.cpu_per_step_ratios``' ``"1"``) times the quiet drift."""
    from kvserve.fleetsim.host_meter import HostDrift
    start_contention, quiet = run.start_contention, run.quiet_drift
    slowed = host(start_cores, start_contention=start_contention.cpu_factor) if start_contention else None
    changed = [("start_contention_measured", on_fit(slowed))] if start_contention else []
    changed += [("host_drift_none", on_fit(host(start_cores, drift=None)))] if quiet else []
    speed = engine_speed and engine_speed * (quiet[0] if quiet else 1.0)
    changed += [("engine_clock_speed", on_fit(host(start_cores, drift=HostDrift.step(speed, run.probe_lead_s))))
                ] if speed else []
    return changed + [("decision_clock_estimated", on_fit(host(start_cores), clock=estimated)),
            ("window_phase_unaligned", on_fit(host(start_cores), clock=replace(clock, phase_s=None))),
            ("cores_unshared", on_fit(None)),
            ("memory_contention_off", on_fit(host(start_cores, contention=1.0))),
            ("starts_cost_no_cpu", on_fit(host())),
            ("host_drift_metered", on_fit(host(start_cores, drift=run.drift))),
            ("router_view_live", on_fit(host(start_cores), router_stats=None)),
            ("probe_not_played", on_fit(host(start_cores), lead_in=None))]


def cluster_record(run, clock, starts: list[float], start_cores: float, stats: tuple[float, float],
                   cores: int) -> dict:
    """What the check measured around the trace, for the JSON: the replicas' starts and the cores
    they took, the decision clock and the router's stats' age, the host (cores, plane,
    contention, drift; ``cores``, the cores it ran on), the probe's lead and who served the trace."""
    return {"replica_start_s": round(sum(starts) / len(starts), 2) if starts else 0.0,
            "replica_starts_measured_s": [round(s, 2) for s in starts], "start_cpu_cores": round(start_cores, 3),
            "replica_start_layers": run.replica_start_layers(), "decision_sample_age_s": run.sample_age_s,
            "decision_clock": {k: None if v is None else round(v, 3) for k, v in vars(clock).items()},
            "router_stats": {"period_s": stats[0], "mean_age_s": round(run.stats_age_s, 4),
                             "delay_s": round(stats[1], 4)},
            "plane_fit": run.plane.as_dict(), "host_cores": cores, "memory_contention": run.contention.as_dict(),
            **({"start_contention": run.start_contention.as_dict(cores, run.threads)}
               if run.start_contention else {}),
            "probe_lead_s": round(run.probe_lead_s, 2), "host_drift": run.drift.summary(),
            "quiet_drift": (quiet := run.quiet_drift) and {"factor": round(quiet[0], 3), "readings": quiet[1]},
            "measured_requests_per_replica": dict(Counter(map(str, run.served_by)))}


def rounded(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)


def probe_reach(run, probe) -> float | None:
    """The share of the plane's and the background's load that lands on a busy engine's core
    (``engine_clock.plane_reach``), read by the engine's clock over the probe's stream, which
    loads the plane as the trace does: the shared host's ``reach``, the probe fitted on it (so
    the fit's factors hold only what the host does not) and the trace played on it."""
    from kvserve.fleetsim.engine_clock import plane_reach
    from kvserve.fleetsim.host_fit import SINGLE_PROMPTS
    return plane_reach(run.probe_clocks, run.probed, run.plane, since=probe.arrival[len(SINGLE_PROMPTS)])


def probe_record(run, probe, reach: float | None) -> dict:
    """What the engine's clock read over the probe (``engine_clock``): the one-at-a-time requests'
    serving path (``probe_path_measured_s``: beside the fit's ``path_latency_s``), the plane's
    ``reach`` (``probe_reach``; the same over the whole probe, ``plane_reach_whole_probe``, and
    over the trace, ``plane_reach_over_trace``, reported only), the engines' steps over the
    probe's singles and over its stream (``probe_clock``: ``engine_clock.span_clock``) and its
    requests' measured TTFT and TPOT (``probe_measured``: a fit can be redone from the JSON)."""
    from kvserve.fleetsim.engine_clock import plane_reach, singles_path, span_clock
    from kvserve.fleetsim.host_fit import SINGLE_PROMPTS
    stream_start = probe.arrival[len(SINGLE_PROMPTS)]
    return {"probe_path_measured_s": rounded(singles_path(run.probe_clocks, run.probed, len(SINGLE_PROMPTS))),
            "plane_reach": rounded(reach),
            "probe_clock": {"singles": span_clock(run.probe_clocks, 0.0, stream_start),
                            "stream": span_clock(run.probe_clocks, stream_start)},
            "probe_measured": {k: [rounded(float(v)) for v in run.probed.arrays()[k]] for k in ("ttft_s", "tpot_s")},
            "plane_reach_whole_probe": rounded(plane_reach(run.probe_clocks, run.probed, run.plane)),
            "plane_reach_over_trace": rounded(plane_reach(run.clocks, run.measured, run.plane))}


def window_record(measured: list, simulated: list, headroom: float) -> dict:
    """The cluster's and the simulator's demand windows (``[reading, decision, load]`` on the
    trace's clock) and their comparison (``cluster_check.compare_windows``) against the load past
    which one replica becomes two."""
    from kvserve.fleetsim.cluster_check import compare_windows
    return {"cluster_windows": measured, "simulated_windows": simulated,
            "window_loads": compare_windows(measured, simulated, 1.0 / headroom)}


def fit_probe(run, probe, simulate, host=None, per_sequence: bool = True):
    """The host's fit (``host_fit.fit_host``; without ``per_sequence``, one decode factor fitted on
    the stream) to the probe ``run`` measured, the probe simulated by ``simulate``
    (``cluster_sim.ClusterSimulator``) on the cluster's clock (it was sent ``probe_lead_s`` before
    the trace), on a fresh ``host()`` each time (None: unshared; the fit then holds what the
    probe's host took from the engine)."""
    from kvserve.fleetsim.host_fit import SINGLE_PROMPTS, fit_host
    clock = simulate.clock.on_clock_from(-run.probe_lead_s)
    return fit_host(run.probed, lambda factor, extra, prefill: simulate(probe, factor, extra, prefill_slowdown=prefill,
                                                                        clock=clock, host=host and host())[0],
                    one_at_a_time=len(SINGLE_PROMPTS), per_sequence=per_sequence)


def parse_phases(text: str) -> list[tuple[float, float]]:
    """``SECONDS:LOAD,...``."""
    return [tuple(float(x) for x in part.split(":", 1)) for part in text.split(",")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--phases", type=parse_phases, default=parse_phases("35:0.25,40:0.8,60:0.2"),
                        help="SECONDS:LOAD,... where a load of 1 is one replica's planned capacity "
                             "(default 35:0.25,40:0.8,60:0.2)")
    parser.add_argument("--hardware", default=None, help="a saved hardware entry (default: profile now)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="auto",
                        help="the engines' weights in the profile and the cluster (float32 on a host with native "
                             "bf16 makes a slower host, where the trace's requests are shortened: trace_shape)")
    parser.add_argument("--runs", type=int, default=1,
                        help="repeat on the traces of seeds SEED.. SEED+RUNS-1, a cluster and (without --hardware) "
                             "a profile each, and pool their requests' latencies (one run's p99 is its slowest "
                             "one or two requests)")
    parser.add_argument("--dump", default=None, help="pickle both request logs' arrays here (each run's)")
    parser.add_argument("--repeat-cluster", action="store_true",
                        help="play each run's probe and trace on a second cluster too, compared with the first "
                             "as the simulator is (cluster_repeat: how well the cluster reproduces itself)")
    parser.add_argument("--start-contention", action="store_true",
                        help="time an engine beside a replica start before each cluster (start_contention.py) "
                             "and simulate the trace with it too (start_contention_measured)")
    parser.add_argument("--record", metavar="DIR", help="save each run's cluster side here (run<SEED>.pkl.gz)")
    parser.add_argument("--replay", nargs="+", metavar="RECORDING", help="simulate --record's runs again, no cluster")
    args = parser.parse_args()
    if args.replay and (args.repeat_cluster or args.record):
        parser.error("--replay plays saved runs: it neither records nor repeats a cluster")
    if args.record:
        os.makedirs(args.record, exist_ok=True)
    if args.replay:
        runs = [(*simulate_recording(Recording.load(path)), None) for path in args.replay]
    else:
        runs = [check(args.hardware or profile(dtype=args.dtype), args.phases, seed=args.seed + k,
                      repeat=args.repeat_cluster, dtype=args.dtype, start_probe=args.start_contention,
                      record=args.record and os.path.join(args.record, f"run{args.seed + k}.pkl.gz"))
                for k in range(args.runs)]
    if args.dump:
        with open(args.dump, "wb") as f:
            pickle.dump([{"measured": m.arrays(), "simulated": s.arrays(), "result": r,
                          "measured_again": a.arrays() if a else None} for r, m, s, a in runs], f)
    if len(runs) == 1:
        print(json.dumps(runs[0][0], indent=1))
        return
    from kvserve.fleetsim.cluster_check import pooled_latency
    pooled = {"pooled": pooled_latency([m for _, m, _, _ in runs], [s for _, _, s, _ in runs])}
    if args.repeat_cluster:                  # the second clusters in the simulator's place: second / first
        pooled["pooled_cluster_repeat"] = pooled_latency([m for _, m, _, _ in runs], [a for *_, a in runs])
    seeds = args.replay or [args.seed + k for k in range(args.runs)]     # replayed: the recordings' paths
    print(json.dumps({"runs": [r for r, *_ in runs], "seeds": seeds, **pooled}, indent=1))


if __name__ == "__main__":
    main()
