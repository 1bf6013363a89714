"""The degradation ladder: what to give up, in order, when demand outruns the fleet.

Rungs, each keeping the ones below it:

1. ``speculation_off``: no speculative decoding (its drafts cost compute that queued
   requests need once the batch is full);
2. ``cap_batch_tokens``: batch-class requests get at most ``batch_max_tokens`` output tokens;
3. ``shed_batch``: batch-class requests are refused (503 + Retry-After);
4. ``overflow_chat``: chat traffic beyond what the fleet takes (its decode slots all busy)
   goes to a smaller fallback model (skipped when none is configured; ``overflow.py``);
5. ``priority_only``: only the priority tenants are admitted (skipped when none are named).

The one number that moves the ladder is the **pressure**, the largest of three measured
ratios, each 1.0 exactly where it starts to hurt:

    pressure = max(chat queue wait p90 / chat TTFT SLO,
                   KV blocks in use / kv_high,
                   503 refusal rate / rejection_high)

A queue wait equal to the chat TTFT SLO means chat requests miss it on queueing alone; KV at
``kv_high`` (0.95) means the next admissions preempt (5% of a 2,000-block pool of 16-token
blocks is 100 blocks: one 1,000-token prompt takes 63 of them, and 32 running sequences
fill the rest in ~48 decode steps, a few seconds); refusals at ``rejection_high`` (5%)
means one request in twenty already fails. At pressure >= ``engage_at`` (1.0) held for
``engage_dwell_s`` the next rung engages (one rung per dwell, so in order); at pressure <=
``release_at`` (0.6) held for ``release_dwell_s`` the top rung releases. Between the two the
ladder holds: with a rung's relief the pressure falls, and the gap keeps it from flapping
(releasing at 0.6 leaves room for the ~1/0.6 = 1.7x load that the released rung lets back).
Releases are slower than engagements (30 s vs 10 s): coming back too early costs a second
overload.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

from kvserve.engine.service_class import ServiceClass


class Rung(enum.IntEnum):
    """The ladder's rungs, in the order they engage."""

    NORMAL = 0
    SPECULATION_OFF = 1
    CAP_BATCH_TOKENS = 2
    SHED_BATCH = 3
    OVERFLOW_CHAT = 4
    PRIORITY_ONLY = 5


@dataclass(frozen=True)
class LoadSignal:
    """What the fleet measured over the last window."""

    chat_queue_wait_s: float = 0.0      # p90 queue wait of chat-class requests
    kv_usage: float = 0.0               # fraction of KV blocks in use (the fullest replica)
    rejection_rate: float = 0.0         # fraction of requests refused with 503


@dataclass(frozen=True)
class LadderSettings:
    """Thresholds and effects (see the module docstring for the arithmetic)."""

    chat_ttft_slo_s: float = 1.0
    kv_high: float = 0.95
    rejection_high: float = 0.05
    engage_at: float = 1.0
    release_at: float = 0.6
    engage_dwell_s: float = 10.0
    release_dwell_s: float = 30.0
    batch_max_tokens: int = 256
    fallback_model: str | None = None
    priority_tenants: frozenset[str] = frozenset()

    def __post_init__(self):
        if not 0 < self.release_at < self.engage_at:
            raise ValueError("the ladder needs 0 < release_at < engage_at (hysteresis)")


@dataclass(frozen=True)
class Degradation:
    """The effects in force at a rung, for the runtime to apply."""

    rung: Rung = Rung.NORMAL
    speculation: bool = True
    batch_max_tokens: int | None = None              # None: no cap
    shed_classes: frozenset[ServiceClass] = frozenset()
    overflow_chat_to: str | None = None
    admit_only_tenants: frozenset[str] | None = None  # None: every tenant

    @property
    def header(self) -> str:
        """The response header's value: the rung's number and name."""
        return f"{int(self.rung)}; {self.rung.name.lower()}"


def pressure_components(signal: LoadSignal, settings: LadderSettings) -> dict[str, float]:
    """The three ratios by signal name (``chat_queue_wait``, ``kv_usage``, ``rejection_rate``)."""
    return {"chat_queue_wait": signal.chat_queue_wait_s / settings.chat_ttft_slo_s,
            "kv_usage": signal.kv_usage / settings.kv_high,
            "rejection_rate": signal.rejection_rate / settings.rejection_high}


def pressure(signal: LoadSignal, settings: LadderSettings) -> float:
    """The largest of the three ratios (1.0 = where each starts to hurt)."""
    return max(pressure_components(signal, settings).values())


def available_rungs(settings: LadderSettings) -> list[Rung]:
    """The rungs this configuration can use, bottom first (overflow needs a fallback model,
    priority-only needs priority tenants)."""
    rungs = [Rung.NORMAL, Rung.SPECULATION_OFF, Rung.CAP_BATCH_TOKENS, Rung.SHED_BATCH]
    if settings.fallback_model:
        rungs.append(Rung.OVERFLOW_CHAT)
    if settings.priority_tenants:
        rungs.append(Rung.PRIORITY_ONLY)
    return rungs


def effects(rung: Rung, settings: LadderSettings) -> Degradation:
    """What is in force at ``rung`` (every rung keeps the ones below it)."""
    return Degradation(
        rung=rung, speculation=rung < Rung.SPECULATION_OFF,
        batch_max_tokens=settings.batch_max_tokens if rung >= Rung.CAP_BATCH_TOKENS else None,
        shed_classes=frozenset({ServiceClass.BATCH}) if rung >= Rung.SHED_BATCH else frozenset(),
        overflow_chat_to=settings.fallback_model if rung >= Rung.OVERFLOW_CHAT else None,
        admit_only_tenants=settings.priority_tenants if rung >= Rung.PRIORITY_ONLY else None)


class Ladder:
    """Moves one rung at a time from the pressure it observes, with dwell and hysteresis."""

    def __init__(self, settings: LadderSettings | None = None):
        self.settings = settings or LadderSettings()
        self.rungs = available_rungs(self.settings)
        self.level = 0                      # index into self.rungs
        self.last_pressure = 0.0
        self._hot_since: float | None = None    # pressure >= engage_at since then
        self._calm_since: float | None = None   # pressure <= release_at since then

    @property
    def rung(self) -> Rung:
        return self.rungs[self.level]

    def current(self) -> Degradation:
        return effects(self.rung, self.settings)

    def observe(self, signal: LoadSignal, now: float) -> Degradation:
        """Take one measurement at ``now`` (seconds); returns the effects in force after it."""
        s = self.settings
        self.last_pressure = p = pressure(signal, s)
        if p >= s.engage_at:
            self._calm_since = None
            self._hot_since = now if self._hot_since is None else self._hot_since
            if now - self._hot_since >= s.engage_dwell_s and self.level < len(self.rungs) - 1:
                self.level += 1
                self._hot_since = now           # the next rung waits a whole dwell
        elif p <= s.release_at:
            self._hot_since = None
            self._calm_since = now if self._calm_since is None else self._calm_since
            if now - self._calm_since >= s.release_dwell_s and self.level > 0:
                self.level -= 1
                self._calm_since = now
        else:                                   # between the thresholds: hold
            self._hot_since = self._calm_since = None
        return self.current()
