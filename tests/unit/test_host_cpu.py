"""Tier 1: the shared host of the simulator-vs-cluster check (``fleetsim/host_cpu.py``): the
contention factor's arithmetic, the plane's CPU measured from counters, the /proc readers on
a real busy process, and simulated replicas slowed by sharing one host."""
from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

import pytest

from kvserve.fleetsim.host_cpu import CpuReading, PlaneFit, SharedHost, engines_cpu_s, machine_busy_s
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


def test_the_plane_fit_is_the_busy_cpu_less_engines_and_background_per_token():
    idle_from = CpuReading(0.0, 100.0, 50.0)
    idle_to = CpuReading(2.0, 100.2, 50.0)               # 0.1 cores in the background
    probe_to = CpuReading(12.0, 111.2, 59.0)             # 11 busy core-seconds, 9 of them the engine's
    fit = PlaneFit.measure(idle_from, idle_to, probe_to, tokens_streamed=200)
    assert fit.background_cores == pytest.approx(0.1)
    assert fit.cpu_s_per_token == pytest.approx((11.0 - 9.0 - 0.1 * 10.0) / 200)


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
