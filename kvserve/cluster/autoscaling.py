"""The cluster's autoscaling glue: what a replica reports, how Ray Serve's autoscaling context
becomes the pure policy's inputs (``kvserve.autoscale``), and the policy's state between ticks.

Pure: no Ray import, no clock, no globals. ``ray_autoscale.KVServeAutoscalingPolicy`` (the
object Ray Serve's controller calls every control-loop tick, ~0.1 s) hands ``autoscale_step``
what the ``AutoscalingContext`` holds and returns its answer; tests call ``autoscale_step`` and
the policy object with Ray's own context class.

The path of a token (docs/autoscaling.md, "Ray Serve wiring"):

1. each ``EngineReplica`` answers Ray Serve's ``record_autoscaling_stats()`` with
   ``replica_autoscaling_stats(server metrics)``: its cumulative counters under their
   ``/metrics`` names (``kvserve_prompt_tokens_total``, ``kvserve_prefix_cache_hit_tokens_total``,
   ``kvserve_generation_tokens_total``) and the gauges ``kvserve_num_requests_running`` /
   ``_waiting`` / ``kvserve_num_queued_prompt_tokens`` (the backlog); Ray records them every
   ``look_back_period_s x 0.2`` seconds and pushes the look-back window's samples to the
   controller every ``metrics_interval_s``;
2. the policy reads ``ctx.raw_metrics`` (per metric, per replica, the samples) and takes each
   replica's newest sample: one ``FleetScrape`` (``scrape_from_raw``; a counter's mean over the
   window, ``ctx.aggregated_metrics``, would be meaningless);
3. every ``demand_window_s`` the scrape is compared with the one kept in the policy state
   (``signals.token_demand``: counter deltas / seconds, a new replica counted from zero), which
   gives prefill and decode tokens/s; the requests queued at the handles with no replica to take
   them (``ctx.total_queued_requests``) are the demand of a model with no replica;
4. ``TokenPolicy.decide`` (or ``RequestCountPolicy.decide`` on Ray's own request count,
   ``ctx.total_num_requests``) with the ``ScaleState`` kept in the policy state gives the
   count; Ray's own up/down delays are 0 (``app.autoscaling_config``) so the stabilisation is
   applied once, here; with ``retier_window_s`` the bounds are those of the tier the model has
   now (``live_tier.step_tier``: promoted to hot by its measured load, back to its planned tier).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Mapping

from kvserve.autoscale import (AutoscaleInputError, FleetScrape, ReplicaBounds, ReplicaCapacity, ReplicaCounters,
                               RequestCountPolicy, ResidencyTier, ScaleState, StabilizerConfig, TokenDemand,
                               TokenPolicy, token_demand)
from kvserve.autoscale.residency import RetierConfig
from kvserve.cluster.live_tier import step_tier

MODES = ("tokens", "requests")
WINDOW_LOG = 32                # closed demand windows the policy state keeps (``log_window``)
STATE_KEY = "kvserve"          # our part of Ray's policy_state (Ray keeps its delay counters beside it)

# replica stats key -> ReplicaCounters field (the keys are the replica's own /metrics names)
COUNTER_FIELDS = {
    "kvserve_prompt_tokens_total": "prompt_tokens_total",
    "kvserve_prefix_cache_hit_tokens_total": "prefix_hit_tokens_total",
    "kvserve_generation_tokens_total": "generation_tokens_total",
    "kvserve_num_requests_running": "requests_running",
    "kvserve_num_requests_waiting": "requests_waiting",
    "kvserve_num_queued_prompt_tokens": "queued_prompt_tokens",
}


@dataclass(frozen=True)
class AutoscaleSettings:
    """One deployment's autoscaling: the policy (``mode``), its residency tier and replica
    bounds, the capacity of one replica at the SLO (tokens/s, and where it came from), the
    headroom, the demand window and the stabiliser's down-scaling window. JSON-ready
    (``to_kwargs``): Ray Serve passes it to the policy as ``policy_kwargs``."""

    mode: str
    tier: str = "hot"
    min_replicas: int = 1
    max_replicas: int = 1
    prefill_tokens_per_s: float = 1.0
    decode_tokens_per_s: float = 1.0
    capacity_source: str = ""
    headroom_factor: float = 1.25
    demand_window_s: float = 10.0
    downscale_window_s: float = 300.0
    target_ongoing_requests: float = 2.0
    retier_window_s: float = 0.0       # > 0: re-tier from measured load over windows this long (live_tier.py)
    promote_load: float = 0.5          # replica-equivalents that promote a warm / cold model to hot
    demote_load: float = 0.25          # ... and below which it returns to its planned tier

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise AutoscaleInputError(f"autoscale mode {self.mode!r}: choose from {MODES}", param="autoscale")
        if not self.demand_window_s > 0:
            raise AutoscaleInputError("the demand window must be positive", param="demand_window_s")
        if not (self.headroom_factor >= 1 and math.isfinite(self.headroom_factor)):
            raise AutoscaleInputError(f"headroom_factor {self.headroom_factor} must be >= 1", param="headroom_factor")
        if self.retier_window_s < 0 or (self.retier_window_s > 0 and self.mode != "tokens"):
            raise AutoscaleInputError("re-tiering reads the token demand: --autoscale tokens and a window >= 0",
                                      param="retier_window_s")
        self.retier_config()    # 0 <= demote <= promote
        self.bounds()           # the tier and the bounds agree (hot keeps >= 1)
        self.capacity()         # positive, finite
        self.token_policy()     # headroom >= 1, windows >= 0
        self.request_policy()

    def bounds(self, tier_now: str | None = None) -> ReplicaBounds:
        """``[min_replicas, max_replicas]`` in the planned tier, or in ``tier_now`` (re-tiering:
        a model promoted to hot keeps at least one replica); a hot model keeps at least one."""
        planned = ResidencyTier(self.tier)
        if planned is ResidencyTier.HOT and self.min_replicas < 1:
            raise AutoscaleInputError("a hot model keeps >= 1 replica: use --tier warm or cold to scale to zero",
                                      param="min_replicas")
        tier = ResidencyTier(tier_now or self.tier)
        minimum = max(1, self.min_replicas) if tier is ResidencyTier.HOT else self.min_replicas
        return ReplicaBounds(minimum, self.max_replicas, tier,
                             host_weights_resident=ResidencyTier.WARM in (tier, planned))

    def retier_config(self) -> RetierConfig:
        """Re-tiering's thresholds (its host cache: ``live_tier``'s docstring)."""
        return RetierConfig(self.promote_load, self.demote_load)

    def capacity(self) -> ReplicaCapacity:
        """One replica's prefill and decode tokens/s at the SLO."""
        return ReplicaCapacity(self.prefill_tokens_per_s, self.decode_tokens_per_s, self.capacity_source)

    def token_policy(self) -> TokenPolicy:
        return TokenPolicy(self.capacity(), self.headroom_factor, StabilizerConfig(self.downscale_window_s))

    def request_policy(self) -> RequestCountPolicy:
        if not self.target_ongoing_requests > 0:
            raise AutoscaleInputError("target_ongoing_requests must be positive", param="target_ongoing_requests")
        return RequestCountPolicy(self.target_ongoing_requests, StabilizerConfig(self.downscale_window_s))

    def to_kwargs(self) -> dict:
        """The settings as plain JSON values (Ray Serve's ``policy_kwargs``)."""
        return dataclasses.asdict(self)


def replica_autoscaling_stats(metrics) -> dict[str, float]:
    """What a replica reports to Ray Serve's ``record_autoscaling_stats``: each counter and
    gauge of ``COUNTER_FIELDS`` summed over its label sets, read from the replica's own
    ``ServerMetrics`` (the numbers its ``/metrics`` shows)."""
    series = {"kvserve_prompt_tokens_total": metrics.prompt_tokens,
              "kvserve_prefix_cache_hit_tokens_total": metrics.prefix_hit_tokens,
              "kvserve_generation_tokens_total": metrics.generation_tokens,
              "kvserve_num_requests_running": metrics.running,
              "kvserve_num_requests_waiting": metrics.waiting,
              "kvserve_num_queued_prompt_tokens": metrics.queued_prompt_tokens}
    return {name: float(sum(metric.values.values())) for name, metric in series.items()}


def _replica_key(replica_id: Any) -> str:
    return str(getattr(replica_id, "unique_id", replica_id))


def scrape_from_raw(raw_metrics: Mapping[str, Mapping[Any, list]] | None, now_s: float,
                    queued_requests: int = 0) -> FleetScrape:
    """One ``FleetScrape`` from Ray Serve's ``ctx.raw_metrics`` (metric -> replica -> samples
    with ``.timestamp`` and ``.value``): each replica's newest sample of each counter; the
    scrape's time is the newest sample's (``now_s`` when no replica reported). A replica
    missing a counter has 0 there."""
    values: dict[str, dict[str, float]] = {}
    newest = None
    for name, field_name in COUNTER_FIELDS.items():
        for replica_id, samples in (raw_metrics or {}).get(name, {}).items():
            if not samples:
                continue
            last = max(samples, key=lambda s: s.timestamp)
            values.setdefault(_replica_key(replica_id), {})[field_name] = float(last.value)
            newest = last.timestamp if newest is None else max(newest, last.timestamp)
    replicas = {key: ReplicaCounters(prompt_tokens_total=v.get("prompt_tokens_total", 0.0),
                                     prefix_hit_tokens_total=v.get("prefix_hit_tokens_total", 0.0),
                                     generation_tokens_total=v.get("generation_tokens_total", 0.0),
                                     requests_running=int(v.get("requests_running", 0)),
                                     requests_waiting=int(v.get("requests_waiting", 0)),
                                     queued_prompt_tokens=v.get("queued_prompt_tokens", 0.0))
                for key, v in values.items()}
    return FleetScrape(now_s if newest is None else newest, replicas, queued_requests)


def _scrape_to_state(scrape: FleetScrape) -> dict:
    return {"time_s": scrape.time_s,
            "replicas": {k: dataclasses.asdict(c) for k, c in scrape.replicas.items()}}


def _scrape_from_state(saved: Mapping) -> FleetScrape:
    return FleetScrape(saved["time_s"], {k: ReplicaCounters(**c) for k, c in saved["replicas"].items()})


def _scale_state(saved: Mapping, target_replicas: int) -> ScaleState:
    """The stabiliser's state; its timers restart when Ray's target is not the count it last
    chose (Ray's own scale-from-zero fast path, a redeploy)."""
    fields = saved.get("scale")
    if fields and fields["replicas"] == target_replicas:
        return ScaleState(**fields)
    last = fields or {}
    return ScaleState(target_replicas, last.get("time_s"), last_down_s=last.get("last_down_s"))


def roll_demand_window(saved: Mapping, scrape: FleetScrape, window_s: float) -> tuple[dict, tuple[float, float]]:
    """The window's start scrape and the demand (prefill, decode tokens/s): a new demand from
    ``signals.token_demand`` once ``scrape`` is ``window_s`` after the start, which then moves
    to ``scrape``; else the last demand (0 before the first window closed)."""
    start = saved.get("window")
    demand = tuple(saved.get("demand", (0.0, 0.0)))
    if start is None:
        return _scrape_to_state(scrape), demand
    earlier = _scrape_from_state(start)
    if scrape.time_s - earlier.time_s < window_s:
        return dict(start), demand
    measured = token_demand(earlier, scrape)
    return _scrape_to_state(scrape), (measured.prefill_tokens_per_s, measured.decode_tokens_per_s)


def count_sample_age(counted: Mapping | None, age_s: float) -> dict:
    """``{"count", "sum_s"}`` of the ages of the samples that closed a demand window (the
    decision's time less the newest sample's): how old the metrics a decision reads are, as the
    simulator's ``decision_delay_s`` wants it (``fleetsim/cluster_check.py``)."""
    counted = counted or {"count": 0, "sum_s": 0.0}
    return {"count": counted["count"] + 1, "sum_s": counted["sum_s"] + max(0.0, age_s)}


def log_window(logged: list | None, sample_s: float, decided_s: float, demand: tuple[float, float]) -> list:
    """The last ``WINDOW_LOG`` closed demand windows, oldest first, with one more: ``[sample_s,
    decided_s, prefill, decode]``, the time of the sample that closed it, of the tick that closed
    it, and the tokens/s it measured. When a cluster's decisions come and what they read, as the
    fleet simulator's cluster check replays them (``fleetsim/cluster_check.DecisionClock``)."""
    entry = [round(sample_s, 3), round(decided_s, 3), round(demand[0], 2), round(demand[1], 2)]
    return [*(logged or [])[-(WINDOW_LOG - 1):], entry]


@dataclass(frozen=True)
class StepInputs:
    """What one tick reads from Ray Serve's ``AutoscalingContext``."""

    now_s: float
    target_replicas: int               # ctx.target_num_replicas (Ray's current target)
    raw_metrics: Mapping | None = None  # ctx.raw_metrics
    queued_requests: float = 0.0       # ctx.total_queued_requests (at the handles: no replica took them)
    total_requests: float = 0.0        # ctx.total_num_requests (Ray's own count: running + queued)


def autoscale_step(settings: AutoscaleSettings, policy_state: Mapping,
                   inputs: StepInputs) -> tuple[int, dict, str]:
    """One tick: (replicas wanted, the next policy state, the arithmetic and the reason).
    ``policy_state`` is Ray's dict; only its ``STATE_KEY`` entry is ours and it is replaced,
    never mutated."""
    saved = dict(policy_state.get(STATE_KEY) or {})
    last_time = (saved.get("scale") or {}).get("time_s")
    now = inputs.now_s if last_time is None else max(inputs.now_s, last_time)   # a wall clock may step back
    scale = _scale_state(saved, inputs.target_replicas)
    queued = math.ceil(max(0.0, inputs.queued_requests or 0.0))
    if settings.mode == "requests":
        decision, nxt, desired = settings.request_policy().decide(scale, now, max(0.0, inputs.total_requests or 0.0),
                                                                 settings.bounds())
        saved.pop("window", None)
    else:
        scrape = scrape_from_raw(inputs.raw_metrics, now, queued)
        opened_at = (saved.get("window") or {}).get("time_s")
        saved["window"], saved["demand"] = roll_demand_window(saved, scrape, settings.demand_window_s)
        if opened_at is not None and saved["window"]["time_s"] != opened_at and scrape.replicas:
            saved["sample_age"] = count_sample_age(saved.get("sample_age"), now - scrape.time_s)
            saved["windows"] = log_window(saved.get("windows"), scrape.time_s, now, saved["demand"])
        demand = TokenDemand(saved["demand"][0], saved["demand"][1], queued)
        tier_now = None
        if settings.retier_window_s > 0:
            load = settings.capacity().load(*saved["demand"])
            saved["retier"] = step_tier(saved.get("retier"), settings.tier, load, now, settings.retier_window_s,
                                        settings.retier_config())
            tier_now = saved["retier"]["tier"]
        decision, nxt, desired = settings.token_policy().decide(scale, now, demand, settings.bounds(tier_now))
    saved["scale"] = dataclasses.asdict(nxt)
    return decision.replicas, {**policy_state, STATE_KEY: saved}, f"{desired.arithmetic}; {decision.reason}"
