"""Re-tiering inside the cluster: the deployment's residency tier from its measured load, by the
rule the simulator's fleet uses (``autoscale/residency.retier``), advanced by the autoscaling
policy on every tick (``autoscaling.autoscale_step``).

With ``--retier-window-s W`` (token autoscaling), a model started ``--tier warm`` or ``cold`` (its
*planned* tier) is promoted to hot once its measured load over a window of ``W`` seconds reaches
``promote_load``, and goes back to its planned tier once a window's load falls below
``demote_load`` (the hysteresis: between the two it keeps the tier it has). The load is in
replica-equivalents: the window's mean of prefill tokens/s over one replica's prefill capacity
plus decode tokens/s over its decode capacity (the demand the token policy reads). While hot
the deployment keeps at least one replica (the next request meets no cold start); back in its
planned tier it may scale to zero again. A planned hot model stays hot (the rule's first clause).

The host cache's budget: one model per cluster, and a planned warm model's weights are put in
host memory at start (``warm_tier.py``), so a warm model demotes to warm (its weights stay
cached) and a cold one to cold; the fleet-wide budget across models is the simulator's and
``kvserve plan --fleet``'s. The state is plain JSON (it lives in Ray's ``policy_state``).
"""
from __future__ import annotations

from typing import Mapping

from kvserve.autoscale.residency import RetierConfig, retier
from kvserve.autoscale.tiers import ResidencyTier

MODEL = "deployment"            # the one model retier() sees


def step_tier(saved: Mapping | None, planned: str, load: float, now_s: float, window_s: float,
              config: RetierConfig) -> dict:
    """The next re-tiering state from ``saved`` (None: the first tick) after ``load`` held since
    the last tick: ``tier`` (now), ``since`` / ``load_s`` (the open window's start and its
    integral of load over time), ``last_s`` (the last tick) and ``mean_load`` (the last closed
    window's). A window closes on the first tick ``window_s`` after it opened; its mean load
    re-tiers the model."""
    state = dict(saved) if saved else {"tier": planned, "since": now_s, "load_s": 0.0, "last_s": now_s,
                                       "mean_load": None}
    state["load_s"] += max(0.0, load) * max(0.0, now_s - state["last_s"])
    state["last_s"] = max(now_s, state["last_s"])
    elapsed = now_s - state["since"]
    if elapsed >= window_s and elapsed > 0:
        mean = state["load_s"] / elapsed
        cache = 1.0 if planned == ResidencyTier.WARM.value else 0.0
        tier = retier({MODEL: ResidencyTier(state["tier"])}, {MODEL: ResidencyTier(planned)}, {MODEL: mean},
                      {MODEL: 1.0}, RetierConfig(config.promote_load, config.demote_load, host_cache_bytes=cache))
        state.update(tier=tier[MODEL].value, since=now_s, load_s=0.0, mean_load=mean)
    return state
