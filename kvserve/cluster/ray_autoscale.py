"""Ray Serve's side of kvserve's autoscaling: the policy object its controller calls, and the
``AutoscalingConfig`` that installs it (docs/autoscaling.md, "Ray Serve wiring").

Ray Serve 2.60's custom autoscaling policy (``AutoscalingConfig(policy=AutoscalingPolicy(
policy_function=..., policy_kwargs=...))``; alpha, hence ray[serve] is pinned): when
``policy_function`` names a class, the controller builds it once with ``policy_kwargs`` and
calls ``instance(ctx)`` every control-loop tick with an ``AutoscalingContext``; it returns
``(replicas, policy_state)``. Ray wraps the call: with no running replica and requests queued at
a handle it scales to ``max(1, target)`` without calling the policy (its scale-from-zero fast
path, which the handle triggers by pushing its queue at once); otherwise it applies its scaling
factors (none set: 1), its up/down delays (set to 0 here: the stabilisation is ``kvserve.
autoscale``'s) and the min/max bounds to what the policy returned.

Ray imports this module by value (cloudpickle) into the controller; everything it uses lives in
``kvserve.cluster.autoscaling`` (imported by name there), so kvserve must be importable in the
controller's process, which it is on the local cluster (same interpreter and environment).
"""
from __future__ import annotations

import logging

from kvserve.cluster import policy_board
from kvserve.cluster.autoscaling import AutoscaleSettings, StepInputs, autoscale_step

LOG = "ray.serve"           # the controller's log file (logs/serve/controller_*.log) records this logger's lines
METRICS_INTERVAL_S = 2.0    # replicas push their samples to the controller this often (Ray's default: 10 s)
LOOK_BACK_S = 10.0          # samples kept per push; recorded every LOOK_BACK_S x 0.2 = 2 s


class KVServeAutoscalingPolicy:
    """Ray Serve's custom autoscaling policy for one ``EngineReplica`` deployment: reads the
    context, calls ``autoscaling.autoscale_step`` (the pure policy), and on each change of the
    decision, the demand or the tier logs it to the controller's log; on that and on each closed
    demand window it publishes it for the ingress's ``/cluster/status`` (``policy_board.py``),
    with the mean age of the samples that closed its demand windows
    (``autoscaling.count_sample_age``) and its last closed windows (``autoscaling.log_window``)."""

    def __init__(self, **settings):
        self.settings = AutoscaleSettings(**settings)
        self._last_logged = None
        self._windows_published = 0

    def __call__(self, ctx) -> tuple[int, dict]:
        inputs = StepInputs(now_s=float(ctx.current_time), target_replicas=int(ctx.target_num_replicas),
                            raw_metrics=ctx.raw_metrics if self.settings.mode == "tokens" else None,
                            queued_requests=float(ctx.total_queued_requests or 0.0),
                            total_requests=float(ctx.total_num_requests or 0.0))
        replicas, state, reason = autoscale_step(self.settings, ctx.policy_state, inputs)
        demand = tuple(round(x, 1) for x in state["kvserve"].get("demand", ()))
        tier = (state["kvserve"].get("retier") or {}).get("tier", self.settings.tier)
        ages = state["kvserve"].get("sample_age") or {"count": 0, "sum_s": 0.0}
        if (replicas, demand, tier) != self._last_logged:
            self._last_logged = (replicas, demand, tier)
            shown = tier if tier == self.settings.tier else f"{tier}, planned {self.settings.tier}"
            logging.getLogger(LOG).info("kvserve autoscale %s (%s, tier %s): %d replicas: %s",
                                        ctx.deployment_name, self.settings.mode, shown, replicas, reason)
        elif ages["count"] == self._windows_published:
            return replicas, state
        self._windows_published = ages["count"]
        policy_board.publish(ctx.app_name, ctx.deployment_name,
                             {"mode": self.settings.mode, "tier": tier, "planned_tier": self.settings.tier,
                              "replicas": replicas, "reason": reason, "at_s": round(inputs.now_s, 3),
                              "windows_closed": ages["count"],
                              "mean_sample_age_s": round(ages["sum_s"] / ages["count"], 4) if ages["count"] else None,
                              "windows": state["kvserve"].get("windows", [])})
        return replicas, state


def autoscaling_config(settings: AutoscaleSettings):
    """Ray Serve's ``AutoscalingConfig`` running ``KVServeAutoscalingPolicy`` with ``settings``:
    bounds from the settings, the first replicas at the minimum (0 for a cold or warm model), and
    Ray's delays at 0 so its own stabilisation does not add to ours."""
    from ray.serve.config import AutoscalingConfig, AutoscalingPolicy
    policy = AutoscalingPolicy(policy_function="kvserve.cluster.ray_autoscale:KVServeAutoscalingPolicy",
                               policy_kwargs=settings.to_kwargs())
    return AutoscalingConfig(min_replicas=settings.min_replicas, max_replicas=settings.max_replicas,
                             initial_replicas=settings.min_replicas,
                             target_ongoing_requests=settings.target_ongoing_requests,
                             metrics_interval_s=METRICS_INTERVAL_S, look_back_period_s=LOOK_BACK_S,
                             upscale_delay_s=0.0, downscale_delay_s=0.0, downscale_to_zero_delay_s=0.0,
                             policy=policy)
