"""The memory-contention probe on the real engine (``fleetsim/host_contention.py``): it runs in a
subprocess, times the engine alone and beside a neighbour in turn, and leaves no neighbour behind."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil
import pytest

from kvserve.fleetsim.host_contention import measure_contention

pytestmark = pytest.mark.model


def _neighbours() -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter(["cmdline"]):
        cmdline = process.info["cmdline"] or []
        if "kvserve.fleetsim.host_contention" in cmdline and "--neighbour" in cmdline:
            found.append(process)
    return found


def test_the_probe_times_the_engine_alone_and_beside_a_neighbour_in_turn():
    before = os.sched_getaffinity(0)
    contention = measure_contention(runs=1, workload=(2, 16, 8))
    assert len(contention.alone_s) == 4 and len(contention.beside_s) == 4      # four rounds of one run each
    assert all(t > 0 for t in contention.alone_s + contention.beside_s)
    assert contention.pinned == (len(before) >= 2)
    assert 0.5 < contention.factor < 3.0, contention
    assert os.sched_getaffinity(0) == before          # the pinning stayed in the subprocess
    assert not _neighbours()                          # the neighbour was stopped with the probe


def test_a_neighbour_ends_with_the_measurement_that_started_it():
    measurer = subprocess.Popen([sys.executable, "-m", "kvserve.fleetsim.host_contention", "--runs", "50",
                                 "--workload", "2,16,8"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120

    def stopped() -> list[psutil.Process]:
        return [p for p in _neighbours() if p.status() == psutil.STATUS_STOPPED]
    while not stopped() and time.monotonic() < deadline:
        time.sleep(0.1)
    neighbours = stopped()
    assert neighbours, "the neighbour was never stopped for the runs alone"
    measurer.kill()                                   # killed mid-way (a timeout), its neighbour stopped
    measurer.wait()
    gone, alive = psutil.wait_procs(neighbours, timeout=30)
    assert not alive, alive
