"""Tier 2: a two-rank ``RankGroup`` over gloo (rank 1 a spawned process): each collective's
result on both ranks (small all-reduce / all-gather through shared memory, a tensor larger than
a slot through gloo), and every listener of both processes on 127.0.0.1."""
from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from kvserve.parallel.group import RankGroup, open_store
from tests.support.rank_peer import loopback_listeners, peer

pytestmark = pytest.mark.model


def test_two_rank_collectives_on_loopback():
    store, path = open_store(2)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=peer, args=(path, results), daemon=True)
    proc.start()
    try:
        group = RankGroup(store, 0, 2)
        reduced = group.all_reduce_(torch.tensor([1.0, 2.0]))
        gathered = group.all_gather(torch.tensor([[1.0]]), dim=-1)
        # rank 0 sends 2 rows to itself and 1 to rank 1; receives 2 of its own and 1 from rank 1
        exchanged = group.all_to_all(torch.tensor([[0.0], [1.0], [2.0]]), send_rows=[2, 1], recv_rows=[2, 1])
        # the same through shared memory (a shared bound on the rows sent), rows of 2 columns
        via_shm = group.all_to_all(torch.tensor([[0.0, 0.5], [1.0, 1.5]]), send_rows=[0, 2], recv_rows=[0, 0],
                                   max_rows=4)
        group.broadcast_object({"step": 7, "rows": [1, 2, 3]})
        big = group.all_reduce_(torch.full((5 * 2**20,), 1.0))
        mine = loopback_listeners()
        theirs = results.get(timeout=60)
    finally:
        proc.join(30)
    assert reduced.tolist() == [11.0, 22.0] and theirs["reduced"] == [11.0, 22.0]
    assert gathered.tolist() == [[1.0, 3.0]] and theirs["gathered"] == [[1.0, 3.0]]
    assert exchanged.tolist() == [[0.0], [1.0], [10.0]]
    assert via_shm.shape == (0, 2) and theirs["via_shm"] == [[0.0, 0.5], [1.0, 1.5], [13.0, 13.5]]
    assert theirs["exchanged"] == [[2.0], [11.0], [12.0]]
    assert theirs["received"] == {"step": 7, "rows": [1, 2, 3]}
    assert group.uses_shared_memory and theirs["shm"]             # small CPU collectives: shared memory
    assert group.skew.calls == 3 and group.skew.spread_s >= 0     # the three shared-memory calls' arrivals
    assert float(big[0]) == 3.0 and theirs["big"] == 3.0 and float(big[-1]) == 3.0
    assert group.comm_calls == 5 and group.comm_seconds > 0
    assert mine and set(mine) == {"127.0.0.1"}, mine
    assert set(theirs["listeners"]) <= {"127.0.0.1"}, theirs["listeners"]


def test_profile_fits_the_link_to_measured_all_reduces():
    """``kvserve profile --tensor-parallel 2``'s step: two ranks time the engine's all-reduce
    and the entry gets the fitted latency and link the planner's TP cost reads."""
    from kvserve.planner.hardware import HardwareSpec
    from kvserve.planner.profile import calibrate_allreduce, summary
    raw = HardwareSpec(name="host", memory_bytes=24e9, mem_bandwidth=28e9, flops={"fp32": 1.6e11}, gpus_per_node=1)
    hw = calibrate_allreduce(raw, 2)
    record = hw.calibration["allreduce"]
    assert record["ranks"] == 2 and len(record["samples"]) == 6
    assert all(b > 0 and s > 0 for b, s in record["samples"])
    assert hw.gpus_per_node == 2 and hw.interconnect_bw == record["bytes_per_s"] > 0
    assert hw.interconnect_latency_s == record["latency_s"] >= 0
    assert any(line.startswith("all-reduce among 2 cpu ranks") for line in summary(hw))


def test_profile_measures_the_ranks_skew():
    """``kvserve profile --tensor-parallel 2``'s skew step: two ranks run the same products
    between all-reduces and a decode step's two commands; the entry gets the fixed spread, the
    jitter and the dispatch lag that ``rank_skew.rank_skew_s`` reads."""
    from kvserve.parallel.collective_bench import SKEW_ROWS
    from kvserve.planner.hardware import HardwareSpec
    from kvserve.planner.profile import calibrate_rank_skew, summary
    raw = HardwareSpec(name="host", memory_bytes=24e9, mem_bandwidth=28e9, flops={"fp32": 1.6e11}, gpus_per_node=2)
    hw = calibrate_rank_skew(raw, 2)
    record = hw.calibration["rank_skew"]
    assert record["ranks"] == 2 and len(record["segments"]) == len(SKEW_ROWS)
    segments = [row[0] for row in record["segments"]]
    assert max(segments) == segments[-1] > 4 * segments[1] > 0          # 8x the rows: the largest product
    assert all(spread >= 0 and wire > 0 for _, spread, wire in record["segments"])
    assert hw.rank_skew_fixed_s == record["fixed_s"] >= 0 and hw.rank_jitter_cv == record["cv"] >= 0
    assert 0 < hw.dispatch_s == record["dispatch_s"] < 0.05
    assert any(line.startswith("skew of 2 cpu ranks") for line in summary(hw))


def test_profile_fits_the_all_to_all_to_measured_ones():
    """``kvserve profile --expert-parallel 2``'s step: two ranks time the engine's all-to-all
    (the call an expert-parallel block makes) and the entry gets the fitted latency and link
    that ``moe.all_to_all_s`` reads."""
    from kvserve.planner.hardware import HardwareSpec
    from kvserve.planner.profile import calibrate_all_to_all, summary
    raw = HardwareSpec(name="host", memory_bytes=24e9, mem_bandwidth=28e9, flops={"fp32": 1.6e11}, gpus_per_node=1)
    hw = calibrate_all_to_all(raw, 2)
    record = hw.calibration["all_to_all"]
    assert record["ranks"] == 2 and len(record["samples"]) == 5
    assert all(b > 0 and s > 0 for b, s in record["samples"])
    assert [b for b, _ in record["samples"]] == sorted(b for b, _ in record["samples"])
    assert hw.all_to_all_link() == (record["bytes_per_s"], record["latency_s"]) and record["bytes_per_s"] > 0
    assert hw.interconnect_bw == raw.interconnect_bw                 # the all-reduce's link is its own
    assert any(line.startswith("all-to-all among 2 cpu ranks") for line in summary(hw))
