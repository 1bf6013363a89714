"""Tier 1: the autoscaling inputs (kvserve/autoscale/): a replica's capacity at the SLO derived
from the planner's pure functions, demand from the replicas' counters over a window, and the
package's import boundary (no torch, no Ray)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvserve.autoscale import (AutoscaleInputError, FleetScrape, ReplicaCounters, TokenDemand, ongoing_requests,
                               replica_capacity, token_demand, token_desired_replicas)
from kvserve.autoscale.capacity import prefill_utilisation_at_ttft
from kvserve.planner.candidates import PlanInputs, decode_step_s, prefill_s
from kvserve.planner.dtypes import kv_dtype, weight_dtype
from kvserve.planner.errors import ImpossibleInputError, PlannerInputError
from kvserve.planner.hardware import CATALOG
from kvserve.planner.plan import make_plan
from kvserve.planner.presets import preset
from kvserve.planner.workload import LengthDist, Workload

ROOT = Path(__file__).resolve().parents[2]


def _inputs(prompt: str = "8192", output: str = "64", tpot_s: float | None = 0.05,
            ttft_p99_s: float | None = 2.0, gpu: str = "h100-sxm", **workload) -> PlanInputs:
    w = Workload(prompt=LengthDist.parse(prompt, "prompt_tokens"), output=LengthDist.parse(output, "output_tokens"),
                 rps=1.0, tpot_s=tpot_s, ttft_p99_s=ttft_p99_s, **workload)
    return PlanInputs(preset("llama-3-8b"), CATALOG[gpu], weight_dtype("bf16"), kv_dtype("bf16"), w)


# --- capacity from the planner -------------------------------------------------------------------

def test_capacity_is_the_planners_batch_over_its_step():
    inp = _inputs(ttft_p99_s=None)
    chosen = make_plan(inp).chosen
    cap = replica_capacity(inp)
    kv_context = 8192 + 64 / 2
    assert cap.decode_tokens_per_s == pytest.approx(chosen.batch / decode_step_s(chosen.cm, None, chosen.batch,
                                                                                 kv_context))
    assert cap.prefill_tokens_per_s == pytest.approx(8192 / prefill_s(chosen.cm, 8192, 8192))   # rho_max 1
    assert f"batch {chosen.batch}" in cap.arithmetic


def test_decode_capacity_meets_the_tpot_slo():
    inp = _inputs(prompt="512", output="256", ttft_p99_s=None)
    chosen = make_plan(inp).chosen
    assert chosen.step_s <= 0.05
    strict = replica_capacity(_inputs(prompt="512", output="256", tpot_s=0.012, ttft_p99_s=None))
    loose = replica_capacity(inp)
    assert strict.decode_tokens_per_s < loose.decode_tokens_per_s     # a tighter TPOT, a smaller batch


def test_ttft_slo_caps_the_prefill_share():
    loose = replica_capacity(_inputs(ttft_p99_s=10.0))
    tight = replica_capacity(_inputs(ttft_p99_s=0.5))
    assert tight.prefill_tokens_per_s < loose.prefill_tokens_per_s
    assert tight.decode_tokens_per_s == loose.decode_tokens_per_s
    # 1 - 0.2 / (1.0 - 0.05) = 0.789..., and never above 0.95
    assert prefill_utilisation_at_ttft(0.05, 0.2, 1.0) == pytest.approx(1 - 0.2 / 0.95)
    assert prefill_utilisation_at_ttft(0.001, 0.001, 100.0) == 0.95
    assert prefill_utilisation_at_ttft(0.05, 0.2, None) == 1.0


def test_faster_gpu_more_capacity():
    h100, h200 = replica_capacity(_inputs()), replica_capacity(_inputs(gpu="h200"))
    assert h200.decode_tokens_per_s > h100.decode_tokens_per_s


def test_impossible_ttft_and_context_mode_are_refused():
    with pytest.raises(ImpossibleInputError):
        replica_capacity(_inputs(ttft_p99_s=0.01))          # an 8k prefill alone takes longer
    context_mode = PlanInputs(preset("llama-3-8b"), CATALOG["h100-sxm"], weight_dtype("bf16"), kv_dtype("bf16"),
                              Workload(context=4096, concurrency=8))
    with pytest.raises(PlannerInputError):
        replica_capacity(context_mode)


def test_long_prompts_need_more_replicas_than_their_request_count_suggests():
    # llama-3-8b on one H100: 10 req/s of 8,192-token prompts and 64-token answers
    cap = replica_capacity(_inputs())
    demand = TokenDemand(10 * 8192, 10 * 64)
    desired = token_desired_replicas(demand, cap, 1.25)
    load = demand.prefill_tokens_per_s / cap.prefill_tokens_per_s + demand.decode_tokens_per_s / cap.decode_tokens_per_s
    assert desired.value >= 3 and desired.value >= load * 1.25


# --- demand from counters ------------------------------------------------------------------------

def test_demand_sums_replica_deltas_over_the_window():
    earlier = FleetScrape(100.0, {"a": ReplicaCounters(1_000, 200, 500), "b": ReplicaCounters(0, 0, 0)})
    later = FleetScrape(110.0, {"a": ReplicaCounters(5_000, 1_200, 900, requests_running=3),
                                "b": ReplicaCounters(2_000, 0, 100, requests_waiting=2)}, queued_requests=1)
    demand = token_demand(earlier, later)
    # prefill: a (5,000 - 1,200) - (1,000 - 200) = 3,000; b 2,000 -> 5,000 / 10 s
    assert demand.prefill_tokens_per_s == pytest.approx(500.0)
    assert demand.decode_tokens_per_s == pytest.approx((400 + 100) / 10)
    assert demand.queued_requests == 1
    assert ongoing_requests(later) == 3 + 2 + 1


def test_new_and_restarted_replicas_count_from_zero():
    earlier = FleetScrape(0.0, {"a": ReplicaCounters(10_000, 0, 10_000)})
    later = FleetScrape(10.0, {"a": ReplicaCounters(300, 0, 30),            # restarted: counters went down
                               "c": ReplicaCounters(700, 0, 70)})           # new in this window
    demand = token_demand(earlier, later)
    assert demand.prefill_tokens_per_s == pytest.approx(100.0)
    assert demand.decode_tokens_per_s == pytest.approx(10.0)


def test_prefix_hits_outgrowing_prompt_tokens_is_not_a_restart():
    # the replica's counters as the cluster check logged them: 41 prompt tokens admitted and 96
    # prefix-hit tokens in the window, so admitted - hits went down (4,119 -> 4,078); read as a
    # restart, the whole 4,078 tokens were one window's demand (a 25x spike)
    earlier = FleetScrape(0.0, {"a": ReplicaCounters(4_279, 160, 650)})
    later = FleetScrape(6.0, {"a": ReplicaCounters(4_320, 256, 758)})
    demand = token_demand(earlier, later)
    assert demand.prefill_tokens_per_s == 0.0
    assert demand.decode_tokens_per_s == pytest.approx(108 / 6)
    # each counter keeps its own reset rule: a real restart still counts from zero
    restarted = FleetScrape(12.0, {"a": ReplicaCounters(600, 60, 40)})
    assert token_demand(later, restarted).prefill_tokens_per_s == pytest.approx(540 / 6)


def test_window_must_be_positive():
    scrape = FleetScrape(5.0, {})
    with pytest.raises(AutoscaleInputError):
        token_demand(scrape, scrape)


# --- import boundary -----------------------------------------------------------------------------

def test_autoscale_imports_without_torch_or_ray():
    code = ("import json, sys, kvserve.autoscale; "
            "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'ray'))))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
