"""Running a tenant's guards at one point: concurrently, each under its own timeout,
failing open or closed as configured, every decision timed and reported.

    GuardSet.run(point, text, context)
        ├─ guard A.check ── wait_for(timeout A) ──▶ verdict | timeout | error ─┐
        └─ guard B.check ── wait_for(timeout B) ──▶ verdict | timeout | error ─┴─▶ GuardOutcome

A timeout (or an exception) becomes an allow when the guard fails open and a block when
it fails closed, with the reason recorded. Any block wins; otherwise the redactions of
every guard are merged and applied once; otherwise the text is allowed.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from kvserve.guards.base import (Action, ContentPolicyViolation, Guard, GuardContext, GuardPoint, Span, Verdict,
                                 apply_spans, merge_spans)
from kvserve.guards.stream import Release, StreamGuard

logger = logging.getLogger("kvserve.guards")
FAIL_MODES = ("open", "closed")
Observer = Callable[[str, str, str, float], None]   # (guard name, point, decision, seconds)


@dataclass(frozen=True)
class GuardSpec:
    """One guard as configured: where it runs, how long it may take, how it fails.

    - ``points``: the points it runs at (None: the guard's own ``points``).
    - ``timeout_s``: the most one check may take; ``on_timeout`` / ``on_error``: "open"
      (the text passes) or "closed" (the text is blocked) when it takes longer / raises.
    - ``every_tokens`` / ``window_chars``: at the stream point, check every N generated
      tokens over the last W released characters plus the pending text.
    """

    guard: Guard
    points: frozenset[GuardPoint] | None = None
    timeout_s: float = 1.0
    on_timeout: str = "closed"
    on_error: str = "closed"
    every_tokens: int = 16
    window_chars: int = 512

    def __post_init__(self):
        if self.on_timeout not in FAIL_MODES or self.on_error not in FAIL_MODES:
            raise ValueError(f'on_timeout / on_error: expected "open" or "closed", got '
                             f"{self.on_timeout!r} / {self.on_error!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s!r}")

    @property
    def name(self) -> str:
        return self.guard.name

    def runs_at(self, point: GuardPoint) -> bool:
        return point in (self.points if self.points is not None else self.guard.points)


@dataclass(frozen=True)
class GuardResult:
    """One guard's part in one run. ``decision`` is its metric label: allow, block,
    redact, or timeout_open / timeout_closed / error_open / error_closed; ``action`` is
    what it means for the text."""

    guard: str
    point: GuardPoint
    decision: str
    action: Action
    reason: str
    seconds: float
    verdict: Verdict | None = None


@dataclass
class GuardOutcome:
    """What a run decided about one text.

    - ``action``: block if any guard blocked (or failed closed), else redact if any
      redacted, else allow.
    - ``text``: the text to use (redacted when ``action`` is redact).
    - ``spans``: the merged redactions (coordinates of the text checked).
    - ``blocked_by`` / ``reason``: the first blocking guard (in configuration order) and why.
    - ``results``: one entry per guard that ran (for the audit log).
    """

    action: Action
    text: str
    spans: tuple[Span, ...] = ()
    reason: str = ""
    blocked_by: str | None = None
    results: list[GuardResult] = field(default_factory=list)

    @property
    def blocked(self) -> bool:
        return self.action is Action.BLOCK

    @property
    def redacted(self) -> bool:
        return self.action is Action.REDACT

    def error(self, param: str | None = None) -> ContentPolicyViolation:
        """The 400 ``content_policy_violation`` of a blocked input (``param``: the field)."""
        return ContentPolicyViolation(f"the input was refused by the content policy ({self.blocked_by}: "
                                      f"{self.reason})", param=param)


def combine(outcomes: Sequence[GuardOutcome], text: str) -> GuardOutcome:
    """One outcome from several runs on (parts of) ``text``; spans must already be in
    ``text``'s coordinates."""
    blocking = next((o for o in outcomes if o.blocked), None)
    block = (blocking.reason, blocking.blocked_by) if blocking else None
    return _outcome(text, [r for o in outcomes for r in o.results], block, [s for o in outcomes for s in o.spans])


class GuardSet:
    """The guards one tenant's traffic passes, in configuration order.

    ``observe(guard, point, decision, seconds)`` is called once per guard per run (the
    server turns it into ``kvserve_guard_latency_seconds`` and the decisions counter);
    the per-run ``observe`` of ``run`` is called too.
    """

    def __init__(self, specs: Sequence[GuardSpec], observe: Observer | None = None):
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"two guards share a name in {names}")
        self.specs, self.observe = tuple(specs), observe

    def at(self, point: GuardPoint) -> list[GuardSpec]:
        """The guards that run at ``point``."""
        return [s for s in self.specs if s.runs_at(point)]

    def has(self, point: GuardPoint) -> bool:
        return any(s.runs_at(point) for s in self.specs)

    # ------------------------------------------------------------------ runs
    async def run(self, point: GuardPoint, text: str, context: GuardContext,
                  observe: Observer | None = None) -> GuardOutcome:
        """Run the guards of ``point`` on ``text`` concurrently; never raises for a guard's
        timeout or error (those follow its fail mode)."""
        context = dataclasses.replace(context, point=point)
        specs = self.at(point)
        results = list(await asyncio.gather(*(self._run_one(s, point, text, context) for s in specs)))
        for result in results:
            for callback in (self.observe, observe):
                if callback is not None:
                    callback(result.guard, point.value, result.decision, result.seconds)
        return _decide(text, results)

    async def _run_one(self, spec: GuardSpec, point: GuardPoint, text: str, context: GuardContext) -> GuardResult:
        start = time.perf_counter()
        try:
            verdict = await asyncio.wait_for(spec.guard.check(text, context), spec.timeout_s)
        except asyncio.TimeoutError:
            return _failure(spec, point, "timeout", spec.on_timeout,
                            f"no verdict within {spec.timeout_s:g} s", time.perf_counter() - start)
        except Exception as exc:          # a guard's bug or its backend's failure: its fail mode decides
            logger.warning("guard %s failed at %s for request %s: %r", spec.name, point.value, context.request_id,
                           exc)
            return _failure(spec, point, "error", spec.on_error, f"{type(exc).__name__}: {exc}"[:300],
                            time.perf_counter() - start)
        seconds = time.perf_counter() - start
        if verdict.action is Action.REDACT and not _spans_in(verdict.spans, len(text)):
            return _failure(spec, point, "error", spec.on_error, "redaction spans outside the text", seconds)
        return GuardResult(spec.name, point, verdict.action.value, verdict.action, verdict.reason, seconds, verdict)

    # ---------------------------------------------------------------- streams
    def stream_guard(self) -> StreamGuard | None:
        """A fresh ``StreamGuard`` for one streamed choice, at the tightest cadence and
        widest window of the stream-point guards; None when no guard runs on streams."""
        specs = self.at(GuardPoint.STREAM)
        if not specs:
            return None
        return StreamGuard(min(s.every_tokens for s in specs), max(s.window_chars for s in specs))

    async def check_stream(self, stream: StreamGuard, context: GuardContext, final: bool = False,
                           observe: Observer | None = None) -> tuple[GuardOutcome, Release | None]:
        """A due check of one streamed choice: the stream guards on ``stream.window()`` and,
        when ``final``, the output guards on the whole text. Blocked: the held chunks are
        dropped and ``(outcome, None)`` returned; else ``(outcome, stream.release(...))``."""
        outcomes, text = [], stream.text()
        if self.has(GuardPoint.STREAM):
            window = await self.run(GuardPoint.STREAM, stream.window(), context, observe)
            offset = stream.window_offset()
            window.spans = tuple(Span(s.start + offset, s.end + offset, s.label) for s in window.spans)
            outcomes.append(window)
        if final and not any(o.blocked for o in outcomes) and self.has(GuardPoint.OUTPUT):
            outcomes.append(await self.run(GuardPoint.OUTPUT, text, context, observe))
        outcome = combine(outcomes, text)
        if outcome.blocked:
            stream.block()
            return outcome, None
        return outcome, stream.release(outcome.spans)


def _failure(spec: GuardSpec, point: GuardPoint, kind: str, mode: str, reason: str, seconds: float) -> GuardResult:
    action = Action.ALLOW if mode == "open" else Action.BLOCK
    return GuardResult(spec.name, point, f"{kind}_{mode}", action, f"{kind} ({reason}); failing {mode}", seconds)


def _spans_in(spans: Sequence[Span], length: int) -> bool:
    return bool(spans) and all(0 <= s.start < s.end <= length for s in spans)


def _decide(text: str, results: list[GuardResult]) -> GuardOutcome:
    blocking = next((r for r in results if r.action is Action.BLOCK), None)
    spans = [s for r in results if r.action is Action.REDACT for s in r.verdict.spans]
    return _outcome(text, results, (blocking.reason, blocking.guard) if blocking else None, spans)


def _outcome(text: str, results: list[GuardResult], block: tuple[str, str | None] | None,
             spans: Sequence[Span]) -> GuardOutcome:
    """Block (``block`` = its reason and guard) wins; else the merged redactions; else allow."""
    if block is not None:
        return GuardOutcome(Action.BLOCK, text, (), block[0], block[1], results)
    merged = tuple(merge_spans(spans))
    if merged:
        return GuardOutcome(Action.REDACT, apply_spans(text, merged), merged, "redacted", None, results)
    return GuardOutcome(Action.ALLOW, text, (), "", None, results)
