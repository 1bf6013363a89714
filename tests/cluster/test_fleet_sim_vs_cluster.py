"""The cluster tier, issue 19's test 4: the fleet simulator reproduces the local Ray cluster on a
short trace (``benchmarks/fleet_sim_cluster.py``, whose JSON the docs quote).

The machine is profiled (``kvserve profile --quick --threads 1 --repeats 1``); ``kvserve cluster
serve --autoscale tokens`` (1 to 2 replicas of the default model, one thread each, the capacity
planned on that profile) takes a 100 s open-loop trace whose rate steps 0.5 -> 1.5 -> 0.4
requests/s, streamed through the ingress, while ``/cluster/status`` is polled; the simulator
plays the same requests with the cluster's limits and autoscaling settings, the profile's step
times, Ray's decision rhythm and the replica start the cluster took.

The replica count over time is held to the issue's 20% (replica-seconds, and the mean absolute
difference of the two step functions over the mean); measured 1.03x / 0.04 and 1.02x / 0.03, the
scale-up within 1.2 s and the scale-down within 6 s of the cluster's. TTFT is not: the simulator's
p50 / p99 were 0.48x-0.67x / 0.34x-0.71x of the cluster's over four runs, because on this two-core
machine the cluster's engines run slower than the profile's (TPOT p50 1.3x the simulated at low
load with one replica, 1.5x over the trace: the engine processes, their replica actors, the
ingress, the proxy and Ray's own processes share the cores, and every streamed token crosses
three processes; the simulator gives each replica a device of its own, and against the engine
alone its TTFT is within ~12%, benchmarks/fleet_sim_validation.json). So TTFT is only held to a
sanity band (0.25x-1.5x): outside it the simulator, the profile or the cluster broke.
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
    assert 0.8 <= result["ratio"]["replica_seconds"] <= 1.2, result
    assert result["replica_count_mean_abs_diff_over_mean"] <= 0.2, result
    for key in ("p50_ttft_s", "p99_ttft_s"):
        assert 0.25 <= result["ratio"][key] <= 1.5, result
