"""The cluster tier, issue 19's test 4: the fleet simulator reproduces the local Ray cluster on a
short trace (``benchmarks/fleet_sim_cluster.py``, whose JSON the docs quote).

The machine is profiled (``kvserve profile --quick --threads 1``, best of two rounds: with one
its fit swung from run to run, and a profile a third slow at one sequence gave the cluster a
decode slowdown of 0.75, under the bound below), once the host is quiet; ``kvserve cluster
serve --autoscale tokens`` (1 to 2 replicas of the default model, one thread each, the capacity
planned on that profile, headroom factor 1.5) takes a 135 s open-loop trace whose load steps
0.25 -> 0.8 -> 0.2 of one replica's planned capacity over 35, 40 and 60 s (x 1.5: 0.38 -> 1.2 ->
0.3 replicas, so one, two, one), streamed through the ingress, while ``/cluster/status`` is polled; the simulator
plays the same requests with the cluster's limits and autoscaling settings, the profile's step
times, Ray's decision rhythm and the replica start the cluster took.

Before the trace a probe through the cluster (``fleetsim/host_fit.py``: four requests one at a
time, prompts of 64-384 tokens, then a stream of ten 0.25 s apart) fits how much slower the cluster's engines
decode and prefill than the profile, what each sequence of a step costs beyond it and the
latency the serving path adds to a first token, and /proc gives the serving plane's CPU per
streamed token (``fleetsim/host_cpu.py``); the simulator plays the trace with the ingress's
queue, the engine's scheduler and that host, its cores shared by the busy engines, the replicas
starting (the cores the processes of a scale-up kept busy, from /proc snapshots at the start's
ends) and the plane, each busy engine slowed by the other's memory traffic (measured before the
cluster starts: an engine pinned to one core alone and beside a second one on the other,
``fleetsim/host_contention.py``; 1.03-1.05x here), and its router sees the replicas' stats as
Ray Serve delivers them to the cluster's router, as old as the ingress measured
(``fleetsim/router_view.py``). The simulator
plays the probe before the trace, as the cluster took it, so the autoscaler's first windows hold
its load; reads and decides on the cluster's own clock: the spacing, phase and age of the readings
its policy closed its demand windows on (``decision_clock``, from ``cluster_windows``). The host's
drift over the run, read by a small fixed workload beside the cluster (``fleetsim/host_meter.py``),
is played as one factor, its median over the trace's spans as quiet as the probe (the host's
move from the probe to the trace: over six attempts on a host that moved 20-30% within
minutes, TTFT p50's mean |log ratio| 0.29 against 0.35 without; over nine runs on a steady one
0.045 against 0.034; the probe is fitted on the shared host, docs/fleet_simulator.md), not over
time (over fifteen runs that made every figure worse: TTFT p99's mean |log ratio| 0.35 against
0.23 without). The autoscaler's input is compared window by window
(``window_loads``: the simulated windows read at the cluster's moments; nine runs: the loads'
median ratio 0.99-1.00, 0.03-0.06 of a replica apart on the mean, on the same side of the
scale-up threshold in 84-100% of the windows). The fit is checked to be sane (slowdowns of at
most 1.5x, at most 20 ms per sequence, a path of at most 0.2 s, the stream's TPOT reproduced, a
plane of under 20 ms per token, a start's cores within the host's, a contention of 0.9-1.5x
measured on pinned cores).

The trace was first given in requests/s at headroom 1.25: a step of 1.5 requests/s sat at the
token policy's threshold on one profile and under it on a faster one, and a CI run had only the
cluster scale up. In load units at 1.25 a saturated replica 24% slower than its profile still
read at the threshold, until the token demand counted the engines' backlog (docs/autoscaling.md);
at 1.25 a step must sit at 0.9 to clear the threshold, which keeps one replica near saturation
for half a minute, so the check runs 1.5 and 0.8 (docs/fleet_simulator.md).

The replica count over time is held to the issue's 20% (replica-seconds, and the mean absolute
difference of the two step functions over the mean; on the cluster's decision clock, in eight
runs of nine 0.99x-1.02x / 0.000-0.015, the simulated scale-ups 0.4-1.2 s early).
TTFT p50 is held to 0.5x-1.4x (0.51x-1.07x over fifteen runs without the drift, median 0.85x;
pooled over six 0.76x: the simulated engines step faster than the cluster's, not explained yet;
0.54x-2.19x with it). TTFT p99 only to a sanity band
(0.25x-1.5x): before the second replica one replica runs near saturation, where the queue
amplifies every difference in service time and in the moment of the scale-up, the cluster itself
moves from run to run, and p99 of 69-81 requests is their slowest one or two (0.41x-1.34x over
ten runs; pooled over five traces 0.54x, the cluster decoding slower under the trace than its
probe in three of them; docs/fleet_simulator.md).
The check's time scales (a 135 s trace in phases of 35, 40 and 60 s, a probe of ten requests 0.25 s
apart, 5 s demand windows) were set on a host whose replica serves ~1.6-1.8 of the trace's
requests a second (69-81 requests in the trace). On the AVX2 EPYC (a batch of four steps in
~145 ms, 0.57 requests/s) the trace held 22 requests and the probe alone, 17 s of one replica's
work, scaled the cluster to two before the trace began (benchmarks/fleet_sim_cluster_slow_host.json).
So a slow host gets shorter requests (``trace_shape``, ``fleetsim/trace_shape.py``: prompts and
outputs shortened by one factor until a request costs a replica 1 / 1.6 s, at most by 4x), and
the test skips, saying why, only where the trace would still hold fewer than
``MIN_TRACE_REQUESTS``.
Outside these the simulator, the profile or the cluster broke, or the host moved: in one CI run
of this check the cluster's replica took 18 s to start (8-13 s otherwise) and its TTFT p50 came
out 2.5x the simulator's, a host slower over the trace than over the probe a minute before.
The last phase was 40 s until the AVX-512 EPYC: both sides come down to one replica about 30 s
after the load drops (a 5 s demand window, the 20 s down-scaling window, Ray's ~6 s decision
rhythm), at 74-91 s in nine runs there and up to 100 s in earlier ones, and a CI run ended with a
side still at two. At 60 s the check ends ~30 s after the usual scale-down. The first phase was
20 s: the probe's stream scales both sides up just before the trace, and they drop that replica
again 22-26 s into the trace, as the step's first windows close: in two runs of eight the
simulator read the step first and kept it, the cluster dropped it and served the step on one
replica for 20 s (TTFT p50 0.68x and 0.78x). At 35 s the probe's replica has gone ~10 s before
the step.
When the latencies or the count fall outside their bands, either side did not go from one
replica to two and back, or the probe's fit finds the profile off (a decode or prefill slowdown
outside 0.8-1.5), the check runs again, with a new profile, cluster and probe, up to four times
(``ATTEMPTS``: in one CI run on the AVX-512 EPYC both of two attempts missed, the second ending
with a side at two replicas; its profiles planned a request 8-13% dearer than the session's
others; a CI run needed all three of three, and on the same EPYC an hour when the host moved
20-30% within minutes a run missed all three, two of them to a bug since fixed), and reports
the earlier runs' ratios beside the last's. The count's is there because the cluster and the
simulator read the same windows: a window that read 0.669 of a replica in the cluster (x 1.5 =
1.004, over the threshold of 1) read under it simulated, and the simulator scaled up three
windows later (mean abs. diff 0.21).
Each missed attempt is a warning naming the bands it missed (in the warnings summary, passed or
failed), and every attempt's JSON is kept in the test's ``tmp_path`` (``attempt<N>.json``, with
the profile it ran on and the recording of its cluster side, ``attempt<N>.run.pkl.gz``, which
``benchmarks/fleet_sim_cluster.py --replay`` simulates again), so a CI run that needed its retries
says why. The last attempt's recording, replayed, gives its JSON again: the recording holds all
the simulation reads, and the simulator is deterministic on it.
"""
from __future__ import annotations

import json
import warnings

import pytest

from benchmarks.cluster_recording import Recording
from benchmarks.fleet_sim_cluster import check, profile, simulate_recording, trace_requests, trace_shape

pytestmark = [pytest.mark.cluster, pytest.mark.model]

PHASES = [(35.0, 0.25), (40.0, 0.8), (60.0, 0.2)]   # (seconds, load); the first and last: the module docstring
ATTEMPTS = 4          # another profile, cluster and probe when a run falls outside the bands (three: the docstring)
MIN_TRACE_REQUESTS = 50   # fewer, and the p99 is the slowest request, and the probe alone may scale up


def _misses(result: dict) -> list[str]:
    """The bands a run fell outside, named with the figure that missed (empty: within them all):
    both sides went from one replica to two and back, the latencies and the replica count are
    within the bands the test holds them to, on a profile the probe found sane (the engines in
    place no more than 1.25x faster or 1.5x slower: a profile timed slow at one sequence, as one
    here 23% slower than the runs before and after it, gives a decode slowdown under 0.8) and a
    fit that reproduces the probe's stream within 5% (a CI run within every other band, TTFT p50
    0.998x, failed on it: the stream's steps 5% faster than its singles' fit allows, the
    per-sequence cost at its floor of 0)."""
    misses = [f"{side} replicas {[count for _, count in result[side]['replica_steps']]}"
              for side in ("measured", "simulated")
              if max(c for _, c in result[side]["replica_steps"]) != 2 or result[side]["replica_steps"][-1][1] != 1]
    fit, ratio = result["host_fit"], result["ratio"]
    batch = fit["fitted_batch_tpot_s"] / fit["measured_batch_tpot_s"]     # the fit reproduces the probe's stream
    bands = [("decode slowdown", fit["slowdown"], 0.8, 1.5), ("prefill slowdown", fit["prefill_slowdown"], 0.8, 1.5),
             ("probe stream's TPOT fitted over measured", batch, 0.95, 1.05),
             ("TTFT p50", ratio["p50_ttft_s"], 0.5, 1.4), ("TTFT p99", ratio["p99_ttft_s"], 0.25, 1.5),
             ("replica-seconds", ratio["replica_seconds"], 0.8, 1.2),
             ("replica count mean abs. diff", result["replica_count_mean_abs_diff_over_mean"], 0.0, 0.2),
             ("windows on the same side", result.get("window_loads", {}).get("same_side_of_threshold", 0.0), 0.75, 1.0)]
    return misses + [f"{name} {value:.3f} outside {low}-{high}" for name, value, low, high in bands
                     if not low <= value <= high]


def test_the_simulator_follows_the_cluster_on_the_same_trace(tmp_path):
    earlier = []
    for attempt in range(ATTEMPTS):
        hardware = profile(str(tmp_path / f"local{attempt}.json"))
        shape = trace_shape(hardware)             # shorter requests on a slow host (fleetsim/trace_shape.py)
        if attempt == 0 and (requests := trace_requests(PHASES, shape)) < MIN_TRACE_REQUESTS:
            pytest.skip(f"this host's replica is planned at so few requests/s, even with requests of "
                        f"{shape.prompt_tokens} / {shape.output_tokens} tokens, that the check's "
                        f"{sum(s for s, _ in PHASES):.0f} s trace would hold {requests:.0f} requests (at least "
                        f"{MIN_TRACE_REQUESTS}): its probe alone would scale the cluster up, its p99 would be one "
                        "request (docs/fleet_simulator.md)")
        recording = tmp_path / f"attempt{attempt}.run.pkl.gz"     # the cluster side, for --replay
        result, *_ = check(hardware, PHASES, shape=shape, record=str(recording))
        (tmp_path / f"attempt{attempt}.json").write_text(json.dumps(result, indent=1, default=str))  # kept by pytest
        if not (misses := _misses(result)):
            break
        earlier.append({"misses": misses, **{k: result[k] for k in ("ratio", "replica_start_s", "host_fit")}})
        warnings.warn(f"attempt {attempt} missed: {'; '.join(misses)}; ratios {result['ratio']}, replica start "
                      f"{result['replica_start_s']:.1f} s")     # in the warnings summary, passed or failed
    # the recording holds all the simulation reads: replayed, it gives the attempt's figures again
    replayed, *_ = simulate_recording(Recording.load(str(recording)))
    assert json.dumps(replayed, sort_keys=True, default=str) == json.dumps(result, sort_keys=True, default=str)
    result["earlier_attempts"] = earlier
    assert result["measured"]["not_served"] == 0 and result["simulated"]["not_served"] == 0
    # the step up made both add a replica, and both went back to one
    for side in ("measured", "simulated"):
        steps = [count for _, count in result[side]["replica_steps"]]
        assert max(steps) == 2 and steps[-1] == 1, result
    assert result["replica_start_s"] > 0, result
    fit, plane = result["host_fit"], result["plane_fit"]
    assert 0.8 <= fit["slowdown"] <= 1.5 and 0.0 <= fit["path_latency_s"] <= 0.2, fit
    assert 0.8 <= fit["prefill_slowdown"] <= 1.5, fit
    assert 0.0 <= fit["seq_extra_s"] <= 0.02, fit
    assert fit["fitted_batch_tpot_s"] == pytest.approx(fit["measured_batch_tpot_s"], rel=0.05), fit
    assert plane["background_cores"] < 0.5 * result["host_cores"] and 0.0 < plane["cpu_ms_per_token"] < 20.0, plane
    assert 0.0 < result["start_cpu_cores"] <= result["host_cores"], result      # the scale-up's processes ran
    contention = result["memory_contention"]          # an engine beside a second one, pinned apart
    assert contention["pinned"] == (result["host_cores"] >= 2) and 0.9 <= contention["factor"] <= 1.5, contention
    alone = result["engine_clocks"]["measured"].get("1")   # the engines' step clocks, read through the ingress
    assert alone is not None and alone["busy_windows"] >= 3 and 0.3 <= alone["cpu_share"] <= 1.2, result["engine_clocks"]
    # ... and over the probe: its one-at-a-time requests' path, all four first tokens and no later one counted
    assert result["probe_path_measured_s"] is not None and result["probe_path_measured_s"] < 0.2, result
    stats = result["router_stats"]                    # the age of the replica stats the router decided on
    assert 0.0 < stats["mean_age_s"] < 5.0 and stats["delay_s"] >= 0.0, stats
    # the age of the samples the cluster's scaling decisions read, the host's drift over the run
    assert result["decision_sample_age_s"] is not None and 0.0 <= result["decision_sample_age_s"] < 6.0, result
    clock = result["decision_clock"]                  # read off the windows the cluster's policy closed
    assert len(result["cluster_windows"]) >= 10 and clock["phase_s"] is not None, result
    assert 5.5 <= clock["interval_s"] <= 6.5 and clock["delay_s"] == pytest.approx(
        result["decision_sample_age_s"], abs=0.5), clock
    assert result["host_drift"]["readings"] >= 60 and result["probe_lead_s"] > 0.0, result
    windows = result["window_loads"]                  # the autoscaler's input, window by window
    assert windows["pairs"] >= 10 and windows["load_mean_abs_diff"] <= 0.15, windows
    assert windows["same_side_of_threshold"] >= 0.75, windows
    assert 0.8 <= result["ratio"]["replica_seconds"] <= 1.2, result
    assert result["replica_count_mean_abs_diff_over_mean"] <= 0.2, result
    assert 0.5 <= result["ratio"]["p50_ttft_s"] <= 1.4, result
    assert 0.25 <= result["ratio"]["p99_ttft_s"] <= 1.5, result
