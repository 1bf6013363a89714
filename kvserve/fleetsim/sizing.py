"""What one replica of a model is on the simulated GPU, from the planner's pure functions.

For a model preset on a hardware entry (a catalog GPU's roofline, or the file ``kvserve
profile`` saved), the planner's chosen candidate at the SLOs gives the replica's TP degree,
its batch at the TPOT SLO (the simulated engine's ``max_num_seqs``), its KV pool in tokens,
its cost model (step times) and its capacity at the SLO (the token autoscaler's divisor);
the cold-start layers follow the fleet plan's stated constants (``FleetQuestion``):
runtime + weights / storage (cold only) + weights / host-to-device + warm-up.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvserve.autoscale.capacity import ReplicaCapacity, capacity_from_candidate
from kvserve.autoscale.fleet_plan import FleetQuestion
from kvserve.autoscale.tiers import ResidencyTier
from kvserve.planner.candidates import PlanInputs, PlanOptions
from kvserve.planner.dtypes import kv_dtype, weight_dtype
from kvserve.planner.memory import weight_bytes
from kvserve.planner.presets import preset
from kvserve.planner.roofline import CostModel
from kvserve.planner.workload import LengthDist, Workload


@dataclass(frozen=True)
class ColdStartLayers:
    """The three layers of a replica's cold start, in seconds (weights split by source)."""

    runtime_s: float
    storage_s: float          # checkpoint read from disk (skipped when weights are in host memory)
    host_to_device_s: float
    warmup_s: float

    def start_s(self, weights_in_host_memory: bool) -> float:
        """Seconds from the start request to a replica that serves."""
        storage = 0.0 if weights_in_host_memory else self.storage_s
        return self.runtime_s + storage + self.host_to_device_s + self.warmup_s


@dataclass(frozen=True)
class ReplicaSizing:
    """One replica of a model: the planner's choice and what the simulator needs from it."""

    model: str
    tp: int
    max_num_seqs: int
    max_batched_tokens: int
    kv_tokens: int
    cost: CostModel
    capacity: ReplicaCapacity
    weight_bytes: float
    cold_start: ColdStartLayers


@dataclass(frozen=True)
class StartConstants:
    """The fleet plan's cold-start constants (``FleetQuestion``'s defaults)."""

    runtime_s: float = FleetQuestion.runtime_s
    storage_bytes_per_s: float = FleetQuestion.storage_bytes_per_s
    host_to_device_bytes_per_s: float = FleetQuestion.host_to_device_bytes_per_s
    warmup_s: float = FleetQuestion.warmup_s


def size_replica(name: str, preset_name: str, hw, rps: float, prompt_tokens: float, output_tokens: float,
                 ttft_p99_s: float, tpot_s: float, starts: StartConstants = StartConstants(),
                 max_batched_tokens: int = 8192) -> ReplicaSizing:
    """The planner's replica for ``preset_name`` on ``hw`` under the model's mean traffic and SLOs."""
    from kvserve.planner.plan import make_plan
    spec = preset(preset_name)
    workload = Workload(rps=max(rps, 1e-6), prompt=LengthDist.parse(prompt_tokens, "prompt"),
                        output=LengthDist.parse(output_tokens, "output"), ttft_p99_s=ttft_p99_s, tpot_s=tpot_s)
    inp = PlanInputs(spec, hw, weight_dtype("bf16"), kv_dtype("bf16"), workload,
                     options=PlanOptions(max_batched_tokens=max_batched_tokens))
    chosen = make_plan(inp).chosen
    wbytes = weight_bytes(spec, weight_dtype("bf16")).value
    layers = ColdStartLayers(starts.runtime_s, wbytes / starts.storage_bytes_per_s,
                             wbytes / starts.host_to_device_bytes_per_s, starts.warmup_s)
    return ReplicaSizing(name, chosen.tp, max(1, chosen.batch), max_batched_tokens, chosen.memory.kv_tokens,
                         chosen.cm, capacity_from_candidate(inp, chosen), wbytes, layers)


def weights_in_host_memory(tier: ResidencyTier) -> bool:
    """A warm model's weights are in the host cache; hot keeps them too (its replicas hold them)."""
    return tier in (ResidencyTier.WARM, ResidencyTier.HOT)
