"""Scale up fast, down slowly: the stabiliser both policies share.

Given the current replica count ``n``, the policy's desired count ``d`` and the bounds,
``target = min(max(d, min_replicas), max_replicas)`` and, at time ``now`` (passed in, seconds)::

    target > n:  up at once:      n' = min(target, n + max_step_up)   (max_step_up None: n' = target)
    target = n:  hold;            the "below since" timer is cleared
    target < n:  below_since = the time target first went below n (kept while it stays below)
                 down only when   now - below_since >= downscale_window_s
                             and  now - last_down   >= downscale_step_interval_s
                 then             n' = max(n - max_step_down, highest target seen since the last step)

So a count that went down stayed lower for a whole window, and each step is at most
``max_step_down`` (1 by default) replicas; any tick whose target is not below ``n`` restarts the
window, which is why a load oscillating faster than the window never scales down (no flapping).
Bounds are hard: a count below ``min_replicas`` rises at once, one above ``max_replicas``
(bounds changed, e.g. a tier change) drops at once. The state is a frozen value: no clocks,
no globals; the same inputs give the same decision.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from kvserve.autoscale.errors import AutoscaleInputError
from kvserve.autoscale.tiers import ReplicaBounds


@dataclass(frozen=True)
class StabilizerConfig:
    """How fast the count may move. ``downscale_step_interval_s`` None = the window itself."""

    downscale_window_s: float = 300.0
    downscale_step_interval_s: float | None = None
    max_step_up: int | None = None
    max_step_down: int = 1

    def __post_init__(self) -> None:
        interval = self.downscale_step_interval_s
        if self.downscale_window_s < 0 or (interval is not None and interval < 0):
            raise AutoscaleInputError("downscale windows cannot be negative", param="downscale_window_s")
        if (self.max_step_up is not None and self.max_step_up < 1) or self.max_step_down < 1:
            raise AutoscaleInputError("max_step_up and max_step_down must be >= 1", param="max_step_down")

    @property
    def step_interval_s(self) -> float:
        """Seconds between two down steps."""
        return self.downscale_window_s if self.downscale_step_interval_s is None else self.downscale_step_interval_s


@dataclass(frozen=True)
class ScaleState:
    """Where one model's autoscaler stands: its replica count and the down-scaling timer."""

    replicas: int
    time_s: float | None = None          # the last decision's time
    below_since_s: float | None = None   # when the target went (and stayed) below ``replicas``
    last_down_s: float | None = None     # the last down step
    highest_below: int = 0               # the highest target seen since below_since / the last step


@dataclass(frozen=True)
class ScaleDecision:
    """One decision: ``replicas`` now, from ``previous``; ``desired`` from the policy,
    ``target`` within the bounds; ``action`` is "up", "down" or "hold"; ``reason`` says why."""

    replicas: int
    previous: int
    desired: int
    target: int
    action: str
    reason: str


def _check_time(state: ScaleState, now_s: float) -> None:
    if not math.isfinite(now_s) or (state.time_s is not None and now_s < state.time_s):
        raise AutoscaleInputError(f"time must be finite and never go back: {now_s} after {state.time_s}",
                                  param="now_s")


def _scale_up(state: ScaleState, target: int, bounds: ReplicaBounds, config: StabilizerConfig) -> tuple[int, str]:
    n = state.replicas
    stepped = target if config.max_step_up is None else min(target, n + config.max_step_up)
    new = max(stepped, bounds.min_replicas)
    if new < target:
        return new, f"up {n} -> {new}: target {target}, at most {config.max_step_up} per decision"
    return new, f"up {n} -> {new}: target {target} at once"


def _scale_down(state: ScaleState, now_s: float, target: int, config: StabilizerConfig) -> tuple[ScaleState, str]:
    """The below-target timer and, when the window and the step interval have passed, one step."""
    n = state.replicas
    below_since = state.below_since_s if state.below_since_s is not None else now_s
    highest = max(state.highest_below, target) if state.below_since_s is not None else target
    held_s = now_s - below_since
    since_step_s = math.inf if state.last_down_s is None else now_s - state.last_down_s
    if held_s < config.downscale_window_s or since_step_s < config.step_interval_s:
        wait = max(config.downscale_window_s - held_s, config.step_interval_s - since_step_s)
        return (replace(state, time_s=now_s, below_since_s=below_since, highest_below=highest),
                f"hold {n}: target {target} below for {held_s:g} s; down in {wait:g} s if it stays below")
    new = max(n - config.max_step_down, highest)
    still_below = target < new
    nxt = ScaleState(new, now_s, below_since if still_below else None, now_s, target if still_below else 0)
    return nxt, (f"down {n} -> {new}: target {target} (highest since the last step {highest}) below for "
                 f"{held_s:g} s >= window {config.downscale_window_s:g} s; step <= {config.max_step_down}")


def stabilize(state: ScaleState, now_s: float, desired: int, bounds: ReplicaBounds,
              config: StabilizerConfig) -> tuple[ScaleDecision, ScaleState]:
    """The replica count at ``now_s`` for a policy that wants ``desired`` (rules in the module
    docstring); returns the decision and the next state."""
    _check_time(state, now_s)
    n = state.replicas
    target = bounds.clamp(desired)
    if n > bounds.max_replicas:
        nxt, action = ScaleState(bounds.max_replicas, now_s), "down"
        reason = f"down {n} -> {bounds.max_replicas}: above max_replicas (hard bound)"
    elif target > n:
        new, reason = _scale_up(state, target, bounds, config)
        nxt, action = ScaleState(new, now_s, last_down_s=state.last_down_s), "up"
    elif target == n:
        nxt, action, reason = ScaleState(n, now_s, last_down_s=state.last_down_s), "hold", f"hold {n}: at target"
    else:
        nxt, reason = _scale_down(state, now_s, target, config)
        action = "down" if nxt.replicas < n else "hold"
    return ScaleDecision(nxt.replicas, n, desired, target, action, reason), nxt
