"""Fair sharing between tenants: the Virtual Token Counter (VTC) of Sheng et al., "Fairness
in Serving Large Language Models" (OSDI '24), as a scheduling policy that wraps the class
policy (``SloPolicy`` or ``FcfsPolicy``, ``engine/policy.py``).

- Counter: every tenant has a virtual token counter. Each token the scheduler computes for
  one of its sequences adds ``input_weight`` (a prompt position) or ``output_weight`` (a
  generated position: a decode, or an output token recomputed after preemption), divided
  by the tenant's weight: 1 and 2 by default, as in the paper. Unknown tenants weigh 1;
  requests without a tenant are one tenant (``None``). Prefix-cache hits are not computed,
  so not charged; lookahead (speculative) tokens are not charged.
- Order: within the inner policy's groups (its first ``num_group_keys`` sort-key elements:
  SLO class rank and priority; FCFS priority), the sequences of the tenant with the lower
  counter come first, then the inner order (arrival). Among backlogged tenants the one
  served least per weight is admitted first, gets the budget first and is preempted last,
  so one tenant's flood cannot starve another: over a window where both are backlogged,
  their served weighted tokens divide as their weights.
- Lift: a tenant that becomes active (it had no running or waiting sequence) starts at
  the smallest counter of the tenants still active (or, when none is, the last active
  ones'), so idle time is not banked as credit: a returning tenant shares the machine
  from then on; it does not get it to itself until it has caught up.
- Everything else (budget, admission ahead of running sequences, holding back,
  preemption rights, abort grace, wake-ups) is the inner policy's.

Counters change only between steps: ``begin_step`` lifts the newly active tenants (the
sort keys the scheduler computed just before already used the lifted values) and
``end_step`` charges the step's tokens; the scheduler re-sorts its running list and
re-heapifies its waiting queue at the start of every ``schedule()``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Hashable, Iterable, Mapping, Sequence as Seq

from kvserve.engine.policy import SchedulingPolicy
from kvserve.engine.sequence import Sequence

Tenant = Hashable          # a tenant name, or None for requests that name none


@dataclass(frozen=True)
class FairShareSettings:
    """Resolved fair-share settings (``EngineConfig.fair_share``, ``tenant_weights``):
    tenant -> positive weight (others weigh ``default_weight``) and the token weights."""

    weights: dict[str, float] = field(default_factory=dict)
    default_weight: float = 1.0
    input_weight: float = 1.0
    output_weight: float = 2.0


def check_weights(weights: Mapping | None) -> dict[str, float]:
    """``weights`` as tenant name -> float; ValueError for a non-string name or a weight
    that is not a finite number > 0."""
    checked = {}
    for name, weight in (weights or {}).items():
        if not isinstance(name, str):
            raise ValueError(f"tenant names must be strings, got {name!r}")
        if isinstance(weight, bool) or not isinstance(weight, (int, float)):
            raise ValueError(f"the weight of tenant {name!r} must be a number, got {weight!r}")
        if not (math.isfinite(weight) and weight > 0):
            raise ValueError(f"the weight of tenant {name!r} must be finite and > 0, got {weight!r}")
        checked[name] = float(weight)
    return checked


class VirtualTokenCounter:
    """Per-tenant virtual token counters (weighted tokens served / tenant weight), the set
    of active tenants, and the lift of tenants that become active."""

    def __init__(self, settings: FairShareSettings | None = None):
        self.settings = settings or FairShareSettings()
        self._counters: dict[Tenant, float] = {}
        self._served: dict[Tenant, int] = {}      # tokens computed (unweighted), for metrics
        self._active: frozenset = frozenset()
        self._idle_floor = 0.0                    # the floor when no tenant is active

    def weight(self, tenant: Tenant) -> float:
        """The tenant's weight (``default_weight`` for tenants the settings do not name)."""
        return self.settings.weights.get(tenant, self.settings.default_weight)

    def counter(self, tenant: Tenant) -> float:
        """The tenant's stored counter (0 for a tenant never seen)."""
        return self._counters.get(tenant, 0.0)

    def charge(self, tenant: Tenant, input_tokens: int, output_tokens: int) -> None:
        """Add ``(input_weight * input_tokens + output_weight * output_tokens) / weight``."""
        s = self.settings
        cost = s.input_weight * input_tokens + s.output_weight * output_tokens
        self._counters[tenant] = self.counter(tenant) + cost / self.weight(tenant)
        self._served[tenant] = self._served.get(tenant, 0) + input_tokens + output_tokens

    @property
    def active(self) -> frozenset:
        """Tenants with a running or waiting sequence at the last ``set_active``."""
        return self._active

    def floor(self) -> float:
        """The counter a tenant becoming active now is lifted to: the smallest counter of
        the active tenants (the last active ones' when none is)."""
        return min((self.counter(t) for t in self._active), default=self._idle_floor)

    def effective(self, tenant: Tenant) -> float:
        """The counter the tenant is ordered by: its own if active, else lifted to ``floor()``
        (what ``set_active`` will store when it becomes active)."""
        own = self.counter(tenant)
        return own if tenant in self._active else max(own, self.floor())

    def set_active(self, tenants: Iterable[Tenant]) -> None:
        """The tenants with running or waiting sequences now: those that were not active
        are lifted to the floor of the previously active ones."""
        tenants = frozenset(tenants)
        floor = self.floor()
        for tenant in tenants - self._active:
            self._counters[tenant] = max(self.counter(tenant), floor)
        if self._active:
            self._idle_floor = floor
        self._active = tenants

    def served_tokens(self) -> dict[Tenant, int]:
        """Tokens computed per tenant since start (unweighted)."""
        return dict(self._served)

    def counters(self) -> dict[Tenant, float]:
        """Every tenant's stored counter."""
        return dict(self._counters)


def split_tokens(seq: Sequence, num_tokens: int) -> tuple[int, int]:
    """(input, output) tokens of ``num_tokens`` computed from ``seq.num_computed_tokens``:
    positions before the end of the prompt are input, the others output."""
    start, prompt_len = seq.num_computed_tokens, len(seq.prompt_token_ids)
    num_input = max(0, min(start + num_tokens, prompt_len) - start)
    return num_input, num_tokens - num_input


class FairSharePolicy:
    """The inner policy with tenants ordered by virtual token counter inside its groups
    (see the module docstring)."""

    def __init__(self, inner: SchedulingPolicy, settings: FairShareSettings | None = None):
        """``inner``: the class policy; its ``num_group_keys`` leading sort-key elements
        stay first, the tenant's counter is inserted after them."""
        self.inner = inner
        self.counter = VirtualTokenCounter(settings)
        self.num_group_keys = inner.num_group_keys

    # ------------------------------------------------------------------ order
    def sort_key(self, seq: Sequence) -> tuple:
        key = self.inner.sort_key(seq)
        cut = self.num_group_keys
        return (*key[:cut], self.counter.effective(seq.tenant), *key[cut:])

    # ------------------------------------------------------------------- step
    def begin_step(self, running: Seq[Sequence], waiting: Seq[Sequence], max_num_batched_tokens: int,
                   free_seq_slots: int, now: float) -> int:
        self.counter.set_active({seq.tenant for seq in (*running, *waiting)})
        return self.inner.begin_step(running, waiting, max_num_batched_tokens, free_seq_slots, now)

    def end_step(self, scheduled: list[tuple[Sequence, int]]) -> None:
        """Charge each scheduled sequence's tenant for its tokens (before ``update``, so
        ``num_computed_tokens`` is where they start)."""
        for seq, num_tokens in scheduled:
            self.counter.charge(seq.tenant, *split_tokens(seq, num_tokens))
        self.inner.end_step(scheduled)

    # -------------------------------------------------- the inner policy's answers
    def admit_before(self, waiting: Sequence, running: Sequence) -> bool:
        return self.inner.admit_before(waiting, running)

    def holds_back(self, seq: Sequence) -> bool:
        return self.inner.holds_back(seq)

    def may_preempt_for(self, seq: Sequence, victim: Sequence) -> bool:
        return self.inner.may_preempt_for(seq, victim)

    def abort_grace_s(self, seq: Sequence, grace_s: float) -> float:
        return self.inner.abort_grace_s(seq, grace_s)

    def wake_in_s(self, now: float) -> float | None:
        return self.inner.wake_in_s(now)

    # ----------------------------------------------------------------- metrics
    def tenant_served_tokens(self) -> dict[str, int]:
        """Tokens computed per tenant since start; requests without a tenant under ""."""
        return {("" if tenant is None else str(tenant)): n for tenant, n in self.counter.served_tokens().items()}


def tenant_served_tokens(policy: SchedulingPolicy) -> dict[str, int]:
    """Per-tenant tokens computed, when ``policy`` shares by tenant ({} otherwise)."""
    return policy.tenant_served_tokens() if isinstance(policy, FairSharePolicy) else {}
