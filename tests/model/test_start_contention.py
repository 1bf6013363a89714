"""The start-contention probe on the real engine (``fleetsim/start_contention.py``): in a
subprocess, it times the engine alone and while a fresh engine process starts beside it, and
reads the start's seconds and core-seconds from the kernel."""
from __future__ import annotations

import os

import pytest

from kvserve.fleetsim.start_contention import measure_start_contention

pytestmark = pytest.mark.model


def test_the_probe_times_the_engine_alone_and_while_a_replica_starts():
    measured = measure_start_contention(runs=1, workload=(2, 16, 8), starts=1)
    assert len(measured.alone_cpu_s) == 1 and measured.beside_cpu_s       # short runs: several beside one start
    assert all(w > 0 and c > 0 for w, c in zip(measured.beside_wall_s, measured.beside_cpu_s))
    assert len(measured.starts_wall_s) == 1 and sum(measured.beside_wall_s) <= measured.starts_wall_s[0]  # inside it
    assert 0.1 < measured.start_cores <= len(os.sched_getaffinity(0)) + 0.5, measured  # the loading ran
    assert 0.5 < measured.cpu_factor < 3.0 and 0.5 < measured.wall_factor < 5.0, measured
