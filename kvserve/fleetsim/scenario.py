"""A fleet scenario: the models and their popularity, the day's traffic, the GPU, the SLOs and
the budget. ``capstone()`` is the issue's scenario (40 models on simulated H100s); ``speed()``
the determinism / speed check (50 models, 10,000 concurrent users); ``from_json`` reads a file
(examples/fleet_scenario.json).

Traffic, stated: ``users(t) = peak_users x (floor + (1 - floor) x (1 - cos(2 pi (t - peak_hour
+ 12 h) / 24 h)) / 2)`` (lowest 12 h from the peak), each user sending one request every
``think_s`` on average, so the fleet's rate is ``users(t) / think_s`` requests/s, times
``doubling.multiplier`` inside the overnight doubling window and a spike's multiplier on its
model. Model ``i`` gets the share ``(i + 1)^-zipf_s / sum_j (j + 1)^-zipf_s`` (power law).
Prompt and output lengths are log-normal around each model's means (sigma ``length_sigma``),
clipped to [8, 8192] and [1, 4096].
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

HOUR = 3600.0
CLASSES = ("chat", "code")


@dataclass(frozen=True)
class ModelTraffic:
    """One model: its architecture preset, request shape and class (``chat`` or ``code``).
    With ``prefix_groups`` > 0 each request also starts with one of that many shared prefixes of
    ``shared_prefix_tokens`` tokens (uniformly drawn; ``prompt_tokens`` is then the mean of its
    own tokens after it): what a prefix cache and the KV-aware router reuse. With ``turns`` > 1
    requests are turns of conversations, ``turns`` on average, a turn at least
    ``turn_gap_s`` after the previous one (``conversations.py``): a later turn's prompt is the
    previous prompt, its answer and ``prompt_tokens`` of new message; with ``closed_loop`` a turn is
    also sent no sooner than ``turn_gap_s`` after the previous turn's answer ended. With
    ``session_keys`` each request carries its conversation's ``prompt_cache_key`` (the session
    term of the prefix-aware routers)."""

    name: str
    preset: str
    prompt_tokens: float = 1024.0
    output_tokens: float = 256.0
    klass: str = "chat"
    shared_prefix_tokens: int = 0
    prefix_groups: int = 0
    turns: float = 1.0
    turn_gap_s: float = 60.0
    closed_loop: bool = False
    session_keys: bool = False

    @property
    def mean_prompt_len(self) -> float:
        """A request's mean prompt length, shared prefix and conversation history included (what
        the planner sizes for: it counts no cache hits). A request is on average ``turns - 1``
        exchanges into its conversation (geometric turn counts; the history cap ignored)."""
        shared = self.shared_prefix_tokens if self.prefix_groups > 0 else 0
        return self.prompt_tokens + shared + (self.turns - 1.0) * (self.prompt_tokens + self.output_tokens)


@dataclass(frozen=True)
class Window:
    """``multiplier`` x the traffic between ``start_s`` and ``end_s`` (on ``model``; None: all)."""

    start_s: float
    end_s: float
    multiplier: float
    model: int | None = None


@dataclass(frozen=True)
class Scenario:
    name: str
    models: tuple[ModelTraffic, ...]
    gpu: str = "h100-sxm"
    peak_users: int = 10_000
    think_s: float = 600.0
    duration_s: float = 24 * HOUR
    zipf_s: float = 1.1
    diurnal_floor: float = 0.3
    peak_hour: float = 15.0
    length_sigma: float = 0.5
    spikes: tuple[Window, ...] = ()
    doubling: Window | None = None
    ttft_slo_s: float = 2.0
    tpot_slo_s: float = 0.05
    budget_usd_month: float = 0.0
    seed: int = 0
    bin_s: float = 60.0                  # traffic is drawn per bin (Poisson counts, uniform times)
    autoscale_interval_s: float = 10.0
    decision_delay_s: float = 0.0        # a scale decision reads the replicas this much earlier (metrics' age)
    autoscale_first_tick_s: float | None = None   # the first reading (None: one interval in)
    log_demand_windows: bool = False     # keep every token window the scalers close (FleetSim.run()["windows"])
    downscale_window_s: float = 300.0
    headroom: float = 1.25
    max_queue_wait_s: float = 120.0      # a request for a model with no replica waits at most this
    ingress_slots: int | None = None     # per model, requests on its replicas at most (the cluster ingress's queue)
    router_stats_period_s: float | None = None   # the router sees replica stats recorded this often (None: live)
    router_stats_delay_s: float = 0.0    # ... this much after they were recorded (``router_view.StaleView``)
    retier_interval_s: float = 600.0
    host_cache_bytes: float = 256 * 2**30
    max_replicas: int = 64
    policies: tuple[str, ...] = ("always_on", "scale_to_zero", "tiers_requests", "tiers_tokens")
    notes: tuple[str, ...] = field(default_factory=tuple)


def _model_mix(count: int) -> tuple[ModelTraffic, ...]:
    """``count`` models: 8B / 7B / 2B chat and code models, every 8th a 70B (TP from the planner)."""
    presets = ("llama-3-8b", "llama-3.1-8b", "llama-2-7b", "gemma-2b")
    models = []
    for i in range(count):
        preset = "llama-3-70b" if i % 8 == 3 else presets[i % len(presets)]
        code = i % 4 == 1
        models.append(ModelTraffic(f"m{i:02d}-{preset}", preset, 2048.0 if code else 1024.0,
                                   64.0 if code else 256.0, "code" if code else "chat"))
    return tuple(models)


def capstone() -> Scenario:
    """40 models on simulated H100s, a day with spikes and demand doubling overnight (20:00-24:00),
    p99 TTFT SLO 2 s, and a monthly budget the tiered policy must meet."""
    return Scenario(
        name="capstone", models=_model_mix(40), peak_users=1_000, think_s=600.0, zipf_s=1.3,
        spikes=(Window(10 * HOUR, 10.5 * HOUR, 4.0, 2), Window(13 * HOUR, 13.25 * HOUR, 6.0, 9),
                Window(17 * HOUR, 17.5 * HOUR, 3.0, 0)),
        doubling=Window(20 * HOUR, 24 * HOUR, 2.0), budget_usd_month=79_000.0,
        notes=("1,000 concurrent users at the peak, one request per user every 10 minutes on average",
               "cold-start constants: the fleet plan's (10 s runtime, 2 GB/s storage, 25 GB/s to the device, "
               "5 s warm-up)"))


def speed() -> Scenario:
    """The speed / determinism check: 50 models, 10,000 concurrent users, 24 hours, one policy."""
    return replace(capstone(), name="speed", models=_model_mix(50), peak_users=10_000, zipf_s=1.1,
                   policies=("tiers_tokens",))


def long_prompts() -> Scenario:
    """The capstone's day, 10,000 users at the peak, where every other model serves
    retrieval-style requests (6,144-token prompts, 32-token answers): few are in flight at
    once, but each carries a long prefill, so a request-count signal and a token signal ask
    for different fleets. Only the two tiered autoscaling policies are compared."""
    models = tuple(replace(m, prompt_tokens=6144.0, output_tokens=32.0, klass="chat") if i % 2 == 0 else m
                   for i, m in enumerate(_model_mix(40)))
    return replace(capstone(), name="long_prompts", models=models, peak_users=10_000,
                   policies=("tiers_requests", "tiers_tokens"),
                   notes=capstone().notes + ("even-numbered models: 6,144-token prompts, 32-token answers, "
                                             "10,000 users at the peak",))


SCENARIOS = {"capstone": capstone, "speed": speed, "long_prompts": long_prompts}


def from_json(raw: dict) -> Scenario:
    """A scenario from JSON: the ``Scenario`` fields, ``models`` as a list of objects, or
    ``"models": N`` for the built-in mix of N models; windows as objects."""
    data = dict(raw)
    models = data.pop("models")
    data["models"] = _model_mix(int(models)) if isinstance(models, int) else tuple(ModelTraffic(**m)
                                                                                  for m in models)
    if data.get("spikes"):
        data["spikes"] = tuple(Window(**w) for w in data["spikes"])
    if data.get("doubling"):
        data["doubling"] = Window(**data["doubling"])
    for key in ("policies", "notes"):
        if key in data:
            data[key] = tuple(data[key])
    return Scenario(**data)
