"""Tier 1: the shared host of the simulator-vs-cluster check (``fleetsim/host_cpu.py``): the
contention factor's arithmetic, the plane's CPU measured from counters, a start's CPU from
process snapshots, the /proc readers on a real busy process, and simulated replicas slowed by
sharing one host (with one another and with a replica starting)."""
from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

import pytest

from kvserve.autoscale.tiers import ResidencyTier
from kvserve.fleetsim.deployment import Deployment
from kvserve.fleetsim.host_cpu import (CpuReading, PlaneFit, SharedHost, engines_cpu_s, idle_readings, machine_busy_s, wait_until_quiet,
                                       new_processes_cpu_s, process_cpu)
from kvserve.fleetsim.log import RequestLog
from kvserve.fleetsim.run import prepare
from kvserve.fleetsim.scenario import ModelTraffic, Scenario
from kvserve.fleetsim.sched_replica import SchedulerReplica

NO_PLANE = PlaneFit(0.0, 0.0)


def test_engines_within_the_cores_run_alone_and_beyond_them_share():
    host = SharedHost(2, 1, NO_PLANE)
    host.busy("a", 100.0)
    assert host.factor() == 1.0
    host.busy("b", 100.0)
    assert host.factor() == 1.0                      # two one-thread engines on two cores
    host.busy("c", 100.0)
    assert host.factor() == pytest.approx(1.5)
    host.idle("c")
    host.idle("c")                                   # idle twice is harmless
    assert host.factor() == 1.0


def test_the_plane_slows_with_the_engines_and_the_factor_solves_the_balance():
    plane = PlaneFit(0.1, 0.003)
    host = SharedHost(2, 1, plane)
    host.busy("a", 90.0)
    host.busy("b", 90.0)
    s = host.factor()
    assert s > 1.0
    assert s * 2 == pytest.approx(2 * 1 + 0.1 + 0.003 * 180.0 / s)     # s·C = n·threads + b + c·R/s


def test_a_starting_replica_loads_the_host_until_its_start_ends():
    host = SharedHost(2, 1, NO_PLANE, start_cores=1.0)
    host.busy("a", 90.0)
    host.busy("b", 90.0)
    assert host.factor() == 1.0
    host.starting("c")
    assert host.factor() == pytest.approx(1.5)       # the start takes its fair 2/3 (of 1), 2 engines share 4/3
    host.start_ended("c")
    host.start_ended("c")                            # ended twice (served after a cancel) is harmless
    assert host.factor() == 1.0
    assert SharedHost(2, 1, NO_PLANE).start_cores == 0.0      # no measured start: starts are free


def test_a_start_takes_the_cores_it_was_measured_to_get_and_the_engines_share_the_rest():
    plane = PlaneFit(0.11, 0.0047)                   # as measured on this check's host
    host = SharedHost(2, 1, plane, start_cores=0.8)
    host.busy("a", 100.0)
    alone = host.factor()
    host.starting("b")
    s = host.factor()
    assert alone == 1.0 and s == pytest.approx(1.24, abs=0.01)     # the engine measured 1.22x slower
    assert s * (2 - 0.8) == pytest.approx(1 + 0.11 + 0.0047 * 100.0 / s)
    host.busy("c", 100.0)                            # three heavy users: a start gets at most a third
    assert host.starts_take() == pytest.approx(2 / 3)


def test_a_busy_neighbour_adds_its_memory_contention_for_the_share_of_the_time_it_runs():
    host = SharedHost(2, 1, NO_PLANE, contention=1.1)
    host.busy("a", 100.0)
    assert host.factor() == 1.0                      # alone: no neighbour
    host.busy("b", 100.0)
    assert host.factor() == pytest.approx(1.1)       # two engines on two cores: each runs all the time
    host.busy("c", 100.0)
    s = 1.5                                          # three on two cores: each runs 2/3 of the time
    assert host.factor() == pytest.approx(s * (1 + 0.1 * 2 / s))
    assert SharedHost(2, 1, NO_PLANE, contention=0.97).contention == 1.0     # noise is not a speed-up


def test_new_processes_cpu_counts_the_newcomers_and_a_pid_that_took_a_new_command_line():
    before = {(10, b"engine"): 50.0, (11, b"ray::IDLE"): 2.0, (12, b"raylet"): 7.0}
    after = {(10, b"engine"): 58.0, (11, b"ray::ServeReplica"): 3.5, (12, b"raylet"): 7.4, (13, b"engine"): 4.0}
    assert new_processes_cpu_s(before, after) == pytest.approx(1.5 + 4.0)     # not the old engine's 8 s
    assert new_processes_cpu_s(after, after) == 0.0
    mine = next(cpu for (pid, _), cpu in process_cpu().items() if pid == os.getpid())
    assert mine > 0


def test_a_deployment_tells_its_host_when_a_replica_starts_and_when_it_serves_or_is_cancelled():
    scenario = Scenario(name="one", models=(ModelTraffic("a", "llama-3-8b"),), duration_s=60, budget_usd_month=1e6)
    sizing = prepare(scenario).sizings[0]
    host = SharedHost(1, 1, NO_PLANE, start_cores=0.5)
    host.busy("x", 1.0)
    dep = Deployment(0, sizing, ResidencyTier.HOT, RequestLog([], [], [], [], []), SchedulerReplica, host=host)
    first, _ = dep.start_replica(0.0)
    second, _ = dep.start_replica(0.0)
    assert host.factor() == pytest.approx(3.0)      # 2 starts take their fair 2/3 of the core, 1 engine the rest
    dep.replica_ready(first, 1.0)
    assert host.factor() == pytest.approx(2.0)      # one start takes its 0.5
    dep.stop_replicas(1, 2.0)                        # the one still starting is cancelled
    assert host.factor() == 1.0


def test_the_plane_fit_is_the_busy_cpu_less_engines_and_background_per_token():
    idle = [CpuReading(0.0, 100.0, 50.0), CpuReading(1.0, 100.1, 50.0),
            CpuReading(2.0, 100.2, 50.0)]               # 0.1 cores in the background
    probe_to = CpuReading(12.0, 111.2, 59.0)             # 11 busy core-seconds, 9 of them the engine's
    fit = PlaneFit.measure(idle, probe_to, tokens_streamed=200)
    assert fit.background_cores == pytest.approx(0.1)
    assert fit.cpu_s_per_token == pytest.approx((11.0 - 9.0 - 0.1 * 10.0) / 200)


def test_a_burst_while_idle_is_not_background():
    # one window of five had a Ray process busy for 0.8 core-seconds: the median ignores it
    idle = [CpuReading(float(t), 100.0 + 0.1 * t + (0.8 if t >= 3 else 0.0), 50.0) for t in range(6)]
    probe_to = CpuReading(15.0, idle[-1].machine_busy_s + 11.0, 59.0)
    fit = PlaneFit.measure(idle, probe_to, tokens_streamed=200)
    assert fit.background_cores == pytest.approx(0.1)
    assert fit.cpu_s_per_token == pytest.approx((11.0 - 9.0 - 0.1 * 10.0) / 200)


def test_idle_readings_are_evenly_spaced():
    readings = idle_readings(0.2, 4)
    assert len(readings) == 5
    gaps = [b.wall_s - a.wall_s for a, b in zip(readings, readings[1:])]
    assert all(g >= 0.05 for g in gaps)


def test_machine_busy_reads_proc_stat(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text("cpu  100 0 50 1000 30 0 0 0 0 0\ncpu0 1 2 3 4\n")
    assert machine_busy_s(str(stat)) == pytest.approx(150 / os.sysconf("SC_CLK_TCK"))
    assert machine_busy_s() > 0


def test_the_engines_cpu_counts_the_processes_that_carry_the_marker():
    marker = f"kvserve-test-{uuid.uuid4().hex}"
    busy = subprocess.Popen([sys.executable, "-c", "import time\nt=time.process_time()\n"
                             "while time.process_time() - t < 0.4: pass\nimport sys; sys.stdin.read()", marker],
                            stdin=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while engines_cpu_s(marker) < 0.3 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert engines_cpu_s(marker) >= 0.3
        assert engines_cpu_s(f"kvserve-test-{uuid.uuid4().hex}") == 0.0
    finally:
        busy.communicate(b"")


def _finish_time(busy_neighbours: int) -> float:
    scenario = Scenario(name="one", models=(ModelTraffic("a", "llama-3-8b"),), duration_s=60, budget_usd_month=1e6)
    sizing = prepare(scenario).sizings[0]
    host = SharedHost(1, 1, NO_PLANE)
    for i in range(busy_neighbours):
        host.busy(f"other{i}", 10.0)
    log = RequestLog([0.0], [0], [0], [256], [8])
    replica = SchedulerReplica("a", sizing, log, host=host)
    t = replica.submit(0, 0.0)
    while t is not None:
        t = replica.complete(t)
    assert "a" not in host.busy_replicas              # idle once done
    return log.finish_s[0]


def test_a_replica_on_a_host_shared_with_a_busy_one_steps_twice_as_long():
    assert _finish_time(1) == pytest.approx(2 * _finish_time(0))


def test_a_measurement_waits_until_the_host_is_quiet_for_three_windows_in_a_row():
    """A host winding down (1.6 then 0.8 busy cores, a dip, a burst) counts as quiet only after
    three consecutive windows under the bar; one that never quiets is given up at the timeout."""
    busy = iter([0.0, 1.6, 2.4, 2.5, 2.6, 3.5, 3.6, 3.7, 3.8, 3.9])      # cumulative core-seconds
    waited, cores = wait_until_quiet(0.3, 1.0, 3, 60.0, busy_s=lambda: next(busy), sleep=lambda s: None)
    assert cores == pytest.approx([1.6, 0.8, 0.1, 0.1, 0.9, 0.1, 0.1, 0.1])
    assert waited == 8.0
    clock = iter(range(0, 1000, 2))                                        # always 2 cores busy
    waited, cores = wait_until_quiet(0.3, 1.0, 3, 5.0, busy_s=lambda: next(clock), sleep=lambda s: None)
    assert waited == 5.0 and cores == [2.0] * 5
