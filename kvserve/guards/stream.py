"""Holding back one streamed choice's output until a guard has passed it.

    released (sent to the client)        pending (held back: text and SSE chunks)
    ─────────────────────────────────┬──────────────────────────────┐
                      ◀── window_chars ──▶◀──── since the last check ──▶
                      └───────────── window() ─────────────────────────┘

Every ``every_tokens`` generated tokens (and at the end) a check is due: the guards see
``window()`` — the last ``window_chars`` released characters plus everything pending —
so a pattern split across deltas, or across the last check's boundary, is seen whole.
If the check passes, ``release`` hands back the held chunks (or, when a guard redacted
part of the pending text, the redacted text to send instead); if it blocks, ``block``
drops them: blocked text never reaches the client. Text released at an earlier check
cannot be recalled: a pattern straddling a check boundary stops the stream when it
completes, but its first part has already gone out.

One ``StreamGuard`` per streamed choice (per completion index), never shared. Pure,
synchronous bookkeeping: the caller runs the guards (``GuardSet.check_stream``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

from kvserve.guards.base import Span, apply_spans


@dataclass
class Release:
    """What a passed check lets out: the held chunks (``items``, as fed), the pending
    text as it may be shown (``text``), and whether a guard changed it (``redacted``:
    then send ``text`` instead of ``items``)."""

    items: list[Any] = field(default_factory=list)
    text: str = ""
    redacted: bool = False


class StreamGuard:
    """The held-back state of one streamed choice (see the module docstring)."""

    def __init__(self, every_tokens: int, window_chars: int):
        if every_tokens < 1 or window_chars < 0:
            raise ValueError(f"every_tokens must be >= 1 and window_chars >= 0, got {every_tokens}, {window_chars}")
        self.every_tokens, self.window_chars = every_tokens, window_chars
        self._released: list[str] = []
        self._released_chars = 0
        self._tail = ""                    # the last window_chars released characters
        self._pending: list[str] = []
        self._items: list[Any] = []
        self._tokens_since_check = 0
        self.num_checks = 0
        self.stopped = False               # blocked: nothing more is released

    # --------------------------------------------------------------- feeding
    def feed(self, text: str, num_tokens: int, item: Any = None, final: bool = False) -> bool:
        """Hold back a delta's ``text`` (``num_tokens`` tokens) and, if given, the chunk
        built from it (``item``). True when a check is due: ``every_tokens`` tokens since
        the last check, or ``final`` (the choice ended). Always False once stopped."""
        if self.stopped:
            return False
        if text:
            self._pending.append(text)
        if item is not None:
            self._items.append(item)
        self._tokens_since_check += num_tokens
        return final or self._tokens_since_check >= self.every_tokens

    @property
    def pending(self) -> str:
        """Text held back since the last check."""
        return "".join(self._pending)

    @property
    def has_pending(self) -> bool:
        return bool(self._pending or self._items)

    def window(self) -> str:
        """The last ``window_chars`` released characters plus all pending text."""
        return self._tail + self.pending

    def window_offset(self) -> int:
        """Where ``window()`` starts in ``text()`` (to shift a window's spans)."""
        return self._released_chars - len(self._tail)

    def text(self) -> str:
        """The whole output so far: released text (as released) plus pending text."""
        return "".join(self._released) + self.pending

    # -------------------------------------------------------------- deciding
    def release(self, spans: Iterable[Span] = (), offset: int = 0) -> Release:
        """The check passed: hand back what was held. ``spans`` (in the coordinates of a
        text starting at ``offset`` of ``text()``) redact the pending part they cover."""
        pending = self.pending
        start = self._released_chars
        local = [Span(max(s.start + offset - start, 0), min(s.end + offset - start, len(pending)), s.label)
                 for s in spans]
        shown = apply_spans(pending, [s for s in local if s.end > s.start])
        release = Release(self._items, shown, shown != pending)
        self._released.append(shown)
        self._released_chars += len(shown)
        self._tail = (self._tail + shown)[-self.window_chars:] if self.window_chars else ""
        self._pending, self._items = [], []
        self._tokens_since_check = 0
        self.num_checks += 1
        return release

    def block(self) -> list[Any]:
        """The check failed: drop everything held (returned, never to be sent) and stop."""
        dropped = self._items
        self._pending, self._items = [], []
        self.stopped = True
        self.num_checks += 1
        return dropped

