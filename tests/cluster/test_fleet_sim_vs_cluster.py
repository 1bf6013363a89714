"""The cluster tier, issue 19's test 4: the fleet simulator reproduces the local Ray cluster on a
short trace (``benchmarks/fleet_sim_cluster.py``, whose JSON the docs quote).

The machine is profiled (``kvserve profile --quick --threads 1 --repeats 1``); ``kvserve cluster
serve --autoscale tokens`` (1 to 2 replicas of the default model, one thread each, the capacity
planned on that profile) takes a 100 s open-loop trace whose rate steps 0.5 -> 1.5 -> 0.4
requests/s, streamed through the ingress, while ``/cluster/status`` is polled; the simulator
plays the same requests with the cluster's limits and autoscaling settings, the profile's step
times, Ray's decision rhythm and the replica start the cluster took.

Before the trace a probe through the cluster (``fleetsim/host_fit.py``: four requests one at a
time, then a batch of four) fits how much slower the cluster's engines step than the profile,
what each sequence of a step costs beyond it and the latency the serving path adds to a first
token, and /proc gives the serving plane's CPU per streamed token (``fleetsim/host_cpu.py``); the
simulator plays the trace with the ingress's queue, the engine's scheduler and that host, its
cores shared by the busy engines, the replicas starting (the cores the processes of a scale-up
kept busy, from /proc snapshots at the start's ends) and the plane. The fit is checked to be
sane (a slowdown of at most 1.5x, at most 20 ms per sequence, a path of at most 0.2 s, the
batch's TPOT reproduced, a plane of under 20 ms per token, a start's cores within the host's).

The replica count over time is held to the issue's 20% (replica-seconds, and the mean absolute
difference of the two step functions over the mean; measured 1.07x / 0.08). TTFT is not: near one
replica's saturation the queue amplifies every difference in service time and in the moment of
the scale-up, and the cluster itself moves from run to run. On this trace the simulator's p50 /
p99 were 1.01x / 0.89x (p99 0.68x with the starts' CPU left out; 0.84x / 0.54x in an earlier
run); on the 2.5 requests/s step 0.59x / 0.92x (docs/fleet_simulator.md). So TTFT is only held to
a sanity band (0.25x-1.5x): outside it the simulator, the profile or the cluster broke.
"""
from __future__ import annotations

import pytest

from benchmarks.fleet_sim_cluster import check, profile

pytestmark = [pytest.mark.cluster, pytest.mark.model]

PHASES = [(20.0, 0.5), (40.0, 1.5), (40.0, 0.4)]


def test_the_simulator_follows_the_cluster_on_the_same_trace(tmp_path):
    result, measured, simulated = check(profile(str(tmp_path / "local.json"), repeats=1), PHASES)
    assert result["measured"]["not_served"] == 0 and result["simulated"]["not_served"] == 0
    # the step up made both add a replica, and both went back to one
    for side in ("measured", "simulated"):
        steps = [count for _, count in result[side]["replica_steps"]]
        assert max(steps) == 2 and steps[-1] == 1, result
    assert result["replica_start_s"] > 0, result
    fit, plane = result["host_fit"], result["plane_fit"]
    assert 0.8 <= fit["slowdown"] <= 1.5 and 0.0 <= fit["path_latency_s"] <= 0.2, fit
    assert 0.0 <= fit["seq_extra_s"] <= 0.02, fit
    assert fit["fitted_batch_tpot_s"] == pytest.approx(fit["measured_batch_tpot_s"], rel=0.05), fit
    assert plane["background_cores"] < 0.5 * result["host_cores"] and 0.0 < plane["cpu_ms_per_token"] < 20.0, plane
    assert 0.0 < result["start_cpu_cores"] <= result["host_cores"], result      # the scale-up's processes ran
    assert 0.8 <= result["ratio"]["replica_seconds"] <= 1.2, result
    assert result["replica_count_mean_abs_diff_over_mean"] <= 0.2, result
    for key in ("p50_ttft_s", "p99_ttft_s"):
        assert 0.25 <= result["ratio"][key] <= 1.5, result
