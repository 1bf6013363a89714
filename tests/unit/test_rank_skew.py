"""Tier 1: the ranks' skew — the planner's arithmetic (``planner/rank_skew.py`` and its term in
``roofline.step_time``), the arrivals a rank group adds up (``parallel/skew.py``), the fit of
the skew probe (``collective_bench.fit_skew``), and the shared-memory mapping's stamps,
command broadcast, patient wait and dead-rank check (two ranks as threads of this process)."""
from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys
import threading
import time

import pytest

from kvserve.parallel.collective_bench import fit_skew
from kvserve.parallel.shm import ShmCollectives
from kvserve.parallel.skew import ArrivalSkew
from kvserve.planner.dtypes import kv_dtype, weight_dtype
from kvserve.planner.hardware import HardwareSpec
from kvserve.planner.presets import preset
from kvserve.planner.rank_skew import expected_max_normal, rank_skew_s
from kvserve.planner.roofline import collectives_per_step, cost_model, decode_work, step_time

HOST = HardwareSpec(name="host", memory_bytes=24e9, mem_bandwidth=28e9, flops={"fp32": 1.6e11},
                    interconnect_bw=8e9, interconnect_latency_s=40e-6, gpus_per_node=8,
                    rank_skew_fixed_s=5e-6, rank_jitter_cv=0.03, dispatch_s=150e-6)


def test_expected_max_of_normals():
    assert expected_max_normal(1) == 0.0
    assert expected_max_normal(2) == pytest.approx(1 / math.sqrt(math.pi), rel=1e-6)
    assert expected_max_normal(3) == pytest.approx(1.5 / math.sqrt(math.pi), rel=1e-6)
    assert expected_max_normal(4) == pytest.approx(1.02938, rel=1e-4)
    assert expected_max_normal(8) == pytest.approx(1.42360, rel=1e-4)


def test_skew_arithmetic_per_step():
    assert rank_skew_s(HOST, 1, 60, 0.05) == 0.0
    expected = 60 * 5e-6 + 0.03 * expected_max_normal(4) * 0.05 + 150e-6
    assert rank_skew_s(HOST, 4, 60, 0.05) == pytest.approx(expected)
    assert rank_skew_s(HOST, 8, 60, 0.05) > rank_skew_s(HOST, 2, 60, 0.05)


def test_step_time_adds_the_skew_at_tp_and_not_at_peak():
    model = preset("llama-3-8b")
    work = decode_work(16, 1024)
    tp1 = step_time(cost_model(model, HOST, weight_dtype("fp32"), kv_dtype("fp32"), 1), work)
    assert tp1.skew_s == 0.0
    cm = cost_model(model, HOST, weight_dtype("fp32"), kv_dtype("fp32"), 2)
    st = step_time(cm, work)
    compute = st.total_s - st.overhead_s - st.comm_s - st.skew_s        # GEMMs + attention
    assert collectives_per_step(cm) == 2 * model.num_layers + 2
    assert st.skew_s == pytest.approx(rank_skew_s(HOST, 2, collectives_per_step(cm), compute))
    unskewed = step_time(cost_model(model, dataclasses.replace(HOST, rank_skew_fixed_s=0.0, rank_jitter_cv=0.0,
                                                               dispatch_s=0.0), weight_dtype("fp32"),
                                    kv_dtype("fp32"), 2), work)
    assert st.total_s == pytest.approx(unskewed.total_s + st.skew_s)
    assert step_time(cm, work, peak=True).skew_s == 0.0


def test_arrival_skew_sums_wait_and_spread():
    skew = ArrivalSkew()
    skew.record([1.000, 1.004], rank=0, first_after_command=False)     # rank 1 late by 4 ms
    skew.record([1.010, 1.008], rank=0, first_after_command=False)     # rank 0 the late one
    before = skew.snapshot()
    skew.record([2.000, 2.001, 2.005], rank=1, first_after_command=True)
    assert skew.calls == 2 and skew.wait_s == pytest.approx(0.004)
    assert skew.spread_s == pytest.approx(0.002 + 0.001)
    added = skew.since(before)
    assert added.calls == 0 and added.calls_first == 1
    assert added.wait_first_s == pytest.approx(0.004)
    assert added.spread_first_s == pytest.approx(2.005 - 2.002)


def test_fit_skew_recovers_fixed_and_cv():
    fixed, cv = 4e-6, 0.05
    record = {"segments": [[s, fixed + cv * expected_max_normal(2) * s] for s in (1e-5, 1e-4, 1e-3, 4e-3)]}
    got_fixed, got_cv = fit_skew(record, 2)
    assert got_fixed == pytest.approx(fixed, rel=1e-6) and got_cv == pytest.approx(cv, rel=1e-6)


@pytest.fixture
def pair():
    path = ShmCollectives.new_path()
    ranks = [ShmCollectives(path, 0, 2, 4096, create=True, timeout_s=30.0),
             ShmCollectives(path, 1, 2, 4096, create=False, timeout_s=30.0)]
    yield ranks
    os.unlink(path)


def _on_rank1(fn):
    out = {}
    thread = threading.Thread(target=lambda: out.update(result=fn(), cpu=time.thread_time()), daemon=True)
    thread.start()
    return thread, out


def test_broadcast_bytes_and_arrival_stamps(pair):
    rank0, rank1 = pair
    thread, out = _on_rank1(lambda: rank1.broadcast_bytes(None))
    time.sleep(0.05)                                 # rank 1 arrives first and waits for the command
    assert rank0.broadcast_bytes(b"forward") == b"forward"
    thread.join(10)
    assert out["result"] == b"forward"
    first, second = rank0.arrivals()
    assert second < first and first - second >= 0.04            # rank 1 stamped its arrival ~50 ms earlier
    thread, out = _on_rank1(lambda: rank1.broadcast_bytes(None))
    assert rank0.broadcast_bytes(b"x" * 5000) is None            # over the slot: the caller uses gloo
    thread.join(10)
    assert out["result"] is None


def test_an_idle_worker_naps_instead_of_spinning(pair):
    rank0, rank1 = pair
    thread, out = _on_rank1(lambda: (time.thread_time(), rank1.broadcast_bytes(None)))
    time.sleep(0.6)
    rank0.broadcast_bytes(b"stop")
    thread.join(10)
    started_cpu, payload = out["result"]
    assert payload == b"stop"
    assert out["cpu"] - started_cpu < 0.3, "a worker waiting 0.6 s for a command held its core"


def test_a_dead_rank_is_noticed_not_waited_for(pair):
    rank0, rank1 = pair
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    rank1._pids[1] = dead.pid                          # rank 1's process is gone
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1 .* is gone"):
        rank0.broadcast_bytes(b"forward")
    assert time.monotonic() - started < 5
