"""The guard interface: one ``check(text, context) -> Verdict`` run at three points.

    request ──▶ INPUT guards ──▶ engine ──▶ STREAM guards (every N tokens, sliding window)
                 │ block: 400                    │ block: stop, finish_reason "content_filter"
                 ▼ redact: the prompt changes    ▼
                                              OUTPUT guards (the whole text at the end)

A guard is stateless with respect to the texts it sees: it gets one text of one tenant
and a ``GuardContext`` naming that tenant, and returns a ``Verdict``. It never keeps a
text for a later call, so no tenant's text reaches a check made for another tenant (the
model guard also salts its prefix cache with the tenant, see ``classifiers.py``).

Redaction is expressed as character spans of the checked text (``Span``), not as a new
text: spans from several guards compose (``merge_spans``), and the stream helper can
redact the part of a window that is still held back.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Iterable, Protocol, Sequence, runtime_checkable

from kvserve.errors import InvalidRequestError


class GuardPoint(str, enum.Enum):
    """Where a guard runs; the value is its name in configuration and metrics."""

    INPUT = "input"      # the prompt, before admission
    STREAM = "stream"    # a window of the output, every N generated tokens
    OUTPUT = "output"    # the whole output, once it ended


class Action(str, enum.Enum):
    """What a guard decided about one text."""

    ALLOW = "allow"
    BLOCK = "block"
    REDACT = "redact"


@dataclass(frozen=True)
class Span:
    """Characters ``[start, end)`` of a checked text and what they are (``label``: "email",
    "card", "api_key", "word", ...); redaction replaces them with ``[REDACTED:label]``."""

    start: int
    end: int
    label: str


@dataclass(frozen=True)
class Verdict:
    """One guard's decision on one text.

    - ``action``: allow, block or redact.
    - ``reason``: a short human sentence (for the audit log and a 400's message); never
      the matched text itself.
    - ``detail``: labels of what was found (``("email", "card")``) or the model's verdict.
    - ``spans``: for redact, the character ranges to replace (of the text checked).
    - ``score``: a number the guard computed (the model guard's logprob margin), or None.
    """

    action: Action
    reason: str = ""
    detail: tuple[str, ...] = ()
    spans: tuple[Span, ...] = ()
    score: float | None = None

    @classmethod
    def allow(cls, reason: str = "", score: float | None = None) -> "Verdict":
        return cls(Action.ALLOW, reason, score=score)

    @classmethod
    def block(cls, reason: str, detail: Iterable[str] = (), score: float | None = None) -> "Verdict":
        return cls(Action.BLOCK, reason, tuple(detail), score=score)

    @classmethod
    def redact(cls, spans: Sequence[Span], reason: str = "") -> "Verdict":
        """Redact ``spans``; no spans is an allow."""
        if not spans:
            return cls.allow(reason)
        labels = tuple(dict.fromkeys(s.label for s in spans))
        return cls(Action.REDACT, reason or "redacted " + ", ".join(labels), labels, tuple(spans))


@dataclass(frozen=True)
class GuardContext:
    """Whose text a guard checks, and where. ``tenant`` is the authenticated tenant (None
    without auth): the model guard uses it as its prefix-cache namespace. ``request_id``
    is the response id (for logs and engine request ids)."""

    tenant: str | None
    request_id: str
    point: GuardPoint = GuardPoint.INPUT


@runtime_checkable
class Guard(Protocol):
    """A check on text.

    ``name`` names it in metrics and the audit log; ``points`` are the points it may run
    at (its configuration narrows them). ``check`` must not keep ``text`` after it
    returns, and must not block the event loop for long (run heavy work in a thread or
    another process); the caller bounds it with a timeout and cancels it on expiry.
    """

    name: str
    points: frozenset[GuardPoint]

    async def check(self, text: str, context: GuardContext) -> Verdict:
        """The verdict on ``text`` (a prompt, an output window or a whole output)."""
        ...


class ContentPolicyViolation(InvalidRequestError):
    """An input a guard blocked: HTTP 400, code ``content_policy_violation``."""

    code = "content_policy_violation"


# ------------------------------------------------------------------- spans
def redaction_label(label: str) -> str:
    """The text that replaces a redacted span."""
    return f"[REDACTED:{label}]"


def merge_spans(spans: Iterable[Span]) -> list[Span]:
    """Spans sorted by start, overlapping ones merged (the first one's label wins)."""
    merged: list[Span] = []
    for span in sorted(spans, key=lambda s: (s.start, -s.end)):
        if span.end <= span.start:
            continue
        if merged and span.start < merged[-1].end:
            last = merged[-1]
            merged[-1] = Span(last.start, max(last.end, span.end), last.label)
        else:
            merged.append(span)
    return merged


def apply_spans(text: str, spans: Iterable[Span]) -> str:
    """``text`` with every span (merged first) replaced by ``[REDACTED:label]``."""
    parts, pos = [], 0
    for span in merge_spans(spans):
        parts.append(text[pos:span.start])
        parts.append(redaction_label(span.label))
        pos = span.end
    parts.append(text[pos:])
    return "".join(parts)


def join_segments(segments: Sequence[str], sep: str = "\n") -> str:
    """Several texts (a chat's message contents) as one text to check."""
    return sep.join(segments)


def redact_segments(segments: Sequence[str], spans: Iterable[Span], sep: str = "\n") -> list[str]:
    """Apply spans found in ``join_segments(segments, sep)`` back to each segment (a span
    that crosses a separator is cut at it), so a chat's messages can be redacted in place."""
    merged = merge_spans(spans)
    out, offset = [], 0
    for segment in segments:
        end = offset + len(segment)
        local = [Span(max(s.start, offset) - offset, min(s.end, end) - offset, s.label)
                 for s in merged if s.start < end and s.end > offset]
        out.append(apply_spans(segment, local))
        offset = end + len(sep)
    return out
