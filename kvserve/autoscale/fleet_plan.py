"""The fleet question (``kvserve plan --fleet FILE --budget USD``): for dozens of models with
their traffic, which residency tier each gets, how many replicas, what it costs a month, and
what share of its requests meets the TTFT SLO — by stated arithmetic (docs/autoscaling.md).

Per model, from the planner (``replica_capacity`` on the model's preset, the GPU, its prompt and
output lengths and the SLOs): one replica's prefill and decode tokens/s at the SLO and its TP.

- load (replica-equivalents) = rps x prompt / prefill capacity + rps x output / decode
  capacity; peak = load x peak_to_mean; replicas at peak = ceil(peak x headroom).
- Cold start of a replica: runtime_s + weight bytes / storage bytes/s (cold only: a warm
  model's weights are in host memory) + weight bytes / host->device bytes/s + warmup_s.
- A model scaled to zero starts again when a request arrives after an idle gap longer than the
  scale-down window W: with Poisson arrivals that is a fraction exp(-rps x W) of its requests,
  and each such request waits a cold start (a TTFT SLO miss when the start is longer than it).
  Starts a month = requests x exp(-rps x W); each keeps a replica for start + W seconds.
- GPU-hours a month: hot = max(1, load x headroom) replicas x TP x 730 h; warm / cold =
  max(load x headroom, 1 - exp(-rps x W)) x TP x 730 h + starts x start x TP / 3600: a model
  is down only in the part of each idle gap beyond W (a share exp(-rps x W) of the time with
  Poisson arrivals), and while up it holds a whole replica however light its load (the fleet
  simulator showed the earlier busy-time-only figure under-counting). Cost = GPU-hours x price.
- Tiers: models whose mean load is at least ``hot_load`` replicas are ``hot`` (they are busy
  anyway); the others start ``warm`` while their weights fit the host cache (most requests
  first), else ``cold`` — the cheapest layout. Then models are promoted to ``hot`` in order of
  cold-start waits avoided per extra dollar, while the budget allows (a greedy knapsack).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from kvserve.autoscale.capacity import capacity_from_candidate
from kvserve.autoscale.tiers import ResidencyTier
from kvserve.planner.candidates import PlanInputs
from kvserve.planner.dtypes import kv_dtype, weight_dtype
from kvserve.planner.memory import weight_bytes
from kvserve.planner.presets import preset
from kvserve.planner.workload import LengthDist, Workload

HOURS_PER_MONTH = 730.0


@dataclass(frozen=True)
class FleetModel:
    """One model's traffic: mean requests/s over the month and its request shape."""

    name: str
    preset: str
    rps: float
    peak_to_mean: float = 3.0
    prompt_tokens: float = 1024.0
    output_tokens: float = 256.0


@dataclass(frozen=True)
class FleetQuestion:
    """The fleet, the GPU, the budget, the SLOs and the stated cold-start and tier constants."""

    models: tuple[FleetModel, ...]
    hw: object                                # planner HardwareSpec
    budget_usd_month: float
    ttft_p99_s: float = 2.0
    tpot_s: float = 0.05
    headroom: float = 1.25
    scale_down_window_s: float = 300.0
    host_cache_bytes: float = 512 * 2**30
    runtime_s: float = 10.0                   # container / process start and imports
    storage_bytes_per_s: float = 2e9          # checkpoint read (cold tier only)
    host_to_device_bytes_per_s: float = 25e9  # PCIe copy of the weights
    warmup_s: float = 5.0                     # KV allocation, kernel JIT / graph capture
    hot_load: float = 0.5                     # replicas of mean load from which a model stays up


@dataclass(frozen=True)
class ModelPlan:
    """One model's tier, replicas, start time, cost and predicted SLO attainment."""

    name: str
    tier: ResidencyTier
    tp: int
    load_mean: float
    replicas_peak: int
    start_s: float
    cold_start_share: float
    gpu_hours_month: float
    cost_usd_month: float
    slo_attainment: float
    weight_bytes: float
    arithmetic: str


@dataclass(frozen=True)
class FleetPlan:
    models: tuple[ModelPlan, ...]
    cost_usd_month: float
    budget_usd_month: float
    host_cache_used_bytes: float
    notes: tuple[str, ...] = field(default_factory=tuple)
    slo_attainment: float = 1.0               # share of all requests within the TTFT SLO

    @property
    def within_budget(self) -> bool:
        return self.cost_usd_month <= self.budget_usd_month

    def to_json(self) -> dict:
        """Totals, and per model its tier, replicas, cost and predicted SLO attainment."""
        return {"budget_usd_month": self.budget_usd_month, "cost_usd_month": round(self.cost_usd_month, 2),
                "within_budget": self.within_budget, "slo_attainment": round(self.slo_attainment, 6),
                "host_cache_used_bytes": self.host_cache_used_bytes,
                "notes": list(self.notes),
                "models": [{"name": m.name, "tier": m.tier.value, "tp": m.tp, "load_mean": round(m.load_mean, 4),
                            "replicas_peak": m.replicas_peak, "start_s": round(m.start_s, 2),
                            "cold_start_share": round(m.cold_start_share, 6),
                            "gpu_hours_month": round(m.gpu_hours_month, 2),
                            "cost_usd_month": round(m.cost_usd_month, 2), "slo_attainment": round(m.slo_attainment, 6),
                            "arithmetic": m.arithmetic} for m in self.models]}


@dataclass(frozen=True)
class _Sized:
    model: FleetModel
    tp: int
    load_mean: float
    replicas_peak: int
    weight_bytes: float
    capacity_text: str


def _size(q: FleetQuestion, m: FleetModel) -> _Sized:
    spec = preset(m.preset)
    workload = Workload(rps=m.rps, peak_to_mean=m.peak_to_mean, prompt=LengthDist.parse(m.prompt_tokens, "prompt"),
                        output=LengthDist.parse(m.output_tokens, "output"), ttft_p99_s=q.ttft_p99_s,
                        tpot_s=q.tpot_s, headroom=q.headroom - 1.0)
    inp = PlanInputs(spec, q.hw, weight_dtype("bf16"), kv_dtype("bf16"), workload)
    from kvserve.planner.plan import make_plan
    chosen = make_plan(inp).chosen
    tp, cap = chosen.tp, capacity_from_candidate(inp, chosen)
    load = m.rps * m.prompt_tokens / cap.prefill_tokens_per_s + m.rps * m.output_tokens / cap.decode_tokens_per_s
    peak = math.ceil(load * m.peak_to_mean * q.headroom)
    return _Sized(m, tp, load, max(1, peak), weight_bytes(spec, weight_dtype("bf16")).value, cap.arithmetic)


def _price(q: FleetQuestion, s: _Sized, tier: ResidencyTier) -> ModelPlan:
    start = q.runtime_s + s.weight_bytes / q.host_to_device_bytes_per_s + q.warmup_s
    if tier is ResidencyTier.COLD:
        start += s.weight_bytes / q.storage_bytes_per_s
    busy_hours = s.load_mean * q.headroom * s.tp * HOURS_PER_MONTH
    if tier is ResidencyTier.HOT:
        share, hours = 0.0, max(1.0, s.load_mean * q.headroom) * s.tp * HOURS_PER_MONTH
        text = f"hot: max(1, {s.load_mean:.3f} x {q.headroom:g}) replicas x TP {s.tp} x 730 h"
    else:
        share = math.exp(-s.model.rps * q.scale_down_window_s)
        starts = s.model.rps * HOURS_PER_MONTH * 3600 * share
        up_hours = (1.0 - share) * s.tp * HOURS_PER_MONTH
        hours = max(busy_hours, up_hours) + starts * start * s.tp / 3600
        text = (f"{tier.value}: max(busy {s.load_mean:.3f} x {q.headroom:g} x TP {s.tp} x 730 h = {busy_hours:,.1f} h, "
                f"up (1 - {share:.3g}) x TP {s.tp} x 730 h = {up_hours:,.1f} h) + starts {starts:,.0f} "
                f"(exp(-{s.model.rps:g} x {q.scale_down_window_s:g}) = {share:.3g} of requests) x {start:.1f} s")
    missed = share if start > q.ttft_p99_s else 0.0
    return ModelPlan(s.model.name, tier, s.tp, s.load_mean, s.replicas_peak, start, share, hours,
                     hours * q.hw.price_per_hour, 1.0 - missed, s.weight_bytes, f"{text}; {s.capacity_text}")


def _initial_tiers(q: FleetQuestion, sized: list[_Sized]) -> dict[str, ResidencyTier]:
    """Busy models (mean load >= ``hot_load``) hot; the rest warm while their weights fit the
    host cache (most requests first), then cold: the cheapest layout that serves everything."""
    tiers, cache_left = {}, q.host_cache_bytes
    for s in sorted(sized, key=lambda s: -s.model.rps):
        if s.load_mean >= q.hot_load:
            tiers[s.model.name] = ResidencyTier.HOT
        elif s.weight_bytes <= cache_left:
            tiers[s.model.name], cache_left = ResidencyTier.WARM, cache_left - s.weight_bytes
        else:
            tiers[s.model.name] = ResidencyTier.COLD
    return tiers


def _missed_per_month(p: ModelPlan, m: FleetModel) -> float:
    return m.rps * HOURS_PER_MONTH * 3600 * (1.0 - p.slo_attainment)


def plan_fleet(q: FleetQuestion) -> FleetPlan:
    """The cheapest layout (``_initial_tiers``), then models promoted to hot in order of SLO
    misses avoided per extra dollar while the budget allows (a greedy knapsack)."""
    sized = {m.name: _size(q, m) for m in q.models}
    tiers, notes = _initial_tiers(q, list(sized.values())), []
    plans = {name: _price(q, sized[name], tier) for name, tier in tiers.items()}
    cost = sum(p.cost_usd_month for p in plans.values())
    if cost > q.budget_usd_month:
        notes.append(f"over budget with every model scaled to zero that can be: ${cost:,.0f} > "
                     f"${q.budget_usd_month:,.0f}")
    options = []
    for name, plan in plans.items():
        missed = _missed_per_month(plan, sized[name].model)
        if plan.tier is not ResidencyTier.HOT and missed >= 1.0:          # at least one wait a month
            hot = _price(q, sized[name], ResidencyTier.HOT)
            options.append((missed / max(hot.cost_usd_month - plan.cost_usd_month, 1e-9), name, hot))
    for _value, name, hot in sorted(options, key=lambda o: -o[0]):
        extra = hot.cost_usd_month - plans[name].cost_usd_month
        if cost + extra <= q.budget_usd_month:
            notes.append(f"{name}: {plans[name].tier.value} -> hot (avoids "
                         f"{_missed_per_month(plans[name], sized[name].model):,.0f} cold-start waits a month for "
                         f"${extra:,.0f})")
            plans[name], cost = hot, cost + extra
    used = sum(p.weight_bytes for p in plans.values() if p.tier is ResidencyTier.WARM)
    notes.append(f"headroom x{q.headroom:g}, scale-down window {q.scale_down_window_s:g} s, cold start = "
                 f"{q.runtime_s:g} s runtime + weights / {q.storage_bytes_per_s / 1e9:g} GB/s (cold) + weights / "
                 f"{q.host_to_device_bytes_per_s / 1e9:g} GB/s + {q.warmup_s:g} s warm-up")
    return FleetPlan(tuple(sorted(plans.values(), key=lambda p: p.name)), cost, q.budget_usd_month, used,
                     tuple(notes), _fleet_attainment(plans, sized))


def _fleet_attainment(plans: dict, sized: dict) -> float:
    """Share of the fleet's requests within the TTFT SLO (cold-start waits are the misses)."""
    requests = sum(s.model.rps for s in sized.values())
    if requests <= 0:
        return 1.0
    return sum(sized[n].model.rps * p.slo_attainment for n, p in plans.items()) / requests


def question_from_json(raw: dict, hw, budget_usd_month: float | None = None) -> FleetQuestion:
    """A ``FleetQuestion`` from a fleet file's JSON: ``{"models": [{"name", "preset", "rps", ...}],
    "budget_usd_month"?, "ttft_p99_s"?, "tpot_s"?, ...}`` (examples/fleet.json)."""
    models = tuple(FleetModel(**m) for m in raw["models"])
    constants = {k: v for k, v in raw.items() if k not in ("models", "budget_usd_month")}
    budget = budget_usd_month if budget_usd_month is not None else raw["budget_usd_month"]
    return replace(FleetQuestion(models, hw, float(budget)), **constants)
