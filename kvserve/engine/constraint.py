"""The seam for constrained decoding (structured output): what the runner needs from a
grammar engine to keep each constrained sequence's output inside its language.

The engine never imports an implementation (``kvserve.structured`` provides the
xgrammar one; ``kvserve/builder.py`` injects it). ``NullConstraints`` is the default:
requests that carry a ``StructuredSpec`` are refused at validation.

Lifecycle of one sequence's matcher, kept by ``ConstraintTracker``:

- created when the sequence first samples under its ``ScheduledSeq.structured`` spec;
- before every forward that samples it, synced to the sequence's output tokens (tokens
  sampled last step are accepted; a matcher that is lost, or out of step, is rebuilt by
  replaying the output, so preemption/recompute needs nothing special);
- it fills the allowed-token bitmask of each row sampled for it: the row after the last
  real token and, with lookahead (speculative) tokens, the row after each draft, which is
  filled after accepting the drafts before it; the drafts are rolled back afterwards;
- EOS is allowed only where the grammar may end; once it accepted EOS it is terminated
  and released; matchers of sequences that stopped sampling are dropped after a while.

The tracker never touches torch: masks are whatever the backend allocates.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

from kvserve.engine.structured_spec import StructuredSpec
from kvserve.errors import InvalidRequestError

logger = logging.getLogger("kvserve.engine")


class TokenMatcher(Protocol):
    """The grammar state of one sequence."""

    def fill_mask(self, bitmask: Any, row: int) -> None:
        """Write the tokens allowed next into row ``row`` of ``bitmask``."""

    def accept(self, token_id: int) -> bool:
        """Advance by one token; False (state unchanged) if the grammar rejects it."""

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens."""

    def is_terminated(self) -> bool:
        """True once the grammar accepted a stop token: nothing more may follow."""


class ConstraintBackend(Protocol):
    """A grammar engine: compiles specs and makes matchers and masks."""

    def validate(self, spec: StructuredSpec) -> None:
        """Compile ``spec`` (cached); raise ``InvalidRequestError`` naming the field if it cannot be."""

    def new_matcher(self, spec: StructuredSpec, stop_token_ids: frozenset[int]) -> TokenMatcher:
        """A fresh matcher at the start of ``spec``'s language."""

    def allocate_mask(self, num_rows: int) -> Any:
        """A bitmask of ``num_rows`` rows, every token allowed."""

    def to_bool(self, bitmask: Any, device) -> Any:
        """``bitmask`` as a bool tensor ``[rows, vocab]`` on ``device`` (True = allowed)."""


@dataclass
class ConstraintMasks:
    """Masks for some of a step's sampling rows: ``rows[i]`` is masked by ``allowed[i]``."""

    rows: list[int]
    allowed: Any              # bool tensor [len(rows), vocab]


@dataclass
class _State:
    matcher: TokenMatcher
    num_accepted: int = 0           # output tokens the matcher has consumed
    last_token: int | None = None   # the last of them (a cheap check that it is in step)
    last_step: int = 0
    broken: bool = False            # the output left the grammar (should not happen): unconstrained


class ConstraintTracker:
    """Per-sequence matchers for the runner (see the module docstring)."""

    def __init__(self, backend: ConstraintBackend, idle_steps: int = 512):
        self.backend = backend
        self.idle_steps = idle_steps    # a matcher unused this many steps is dropped (rebuilt on need)
        self._states: dict[int, _State] = {}
        self._step = 0
        self.mask_seconds = 0.0         # host time spent syncing matchers and filling masks
        self.mask_steps = 0             # steps that had constrained rows

    @property
    def num_matchers(self) -> int:
        return len(self._states)

    def validate(self, spec: StructuredSpec | None) -> None:
        if spec is not None:
            self.backend.validate(spec)

    def masks(self, to_sample: Sequence, device) -> ConstraintMasks | None:
        """Masks for the sampling rows of ``to_sample`` (ScheduledSeqs in row order, each
        giving ``1 + len(lookahead_token_ids)`` rows); None when none is constrained."""
        self._step += 1
        plan: list[tuple[Any, int]] = []         # (seq, first row)
        row = 0
        for s in to_sample:
            if getattr(s, "structured", None) is not None:
                plan.append((s, row))
            row += 1 + len(s.lookahead_token_ids)
        self._collect()
        if not plan:
            return None
        started = time.perf_counter()
        try:
            return self._masks(plan, device)
        finally:
            self.mask_seconds += time.perf_counter() - started
            self.mask_steps += 1

    def _masks(self, plan: list, device) -> ConstraintMasks | None:
        num_rows = sum(1 + len(s.lookahead_token_ids) for s, _ in plan)
        bitmask = self.backend.allocate_mask(num_rows)
        rows: list[int] = []
        for s, first in plan:
            state = self._synced(s)
            if state.broken or state.matcher.is_terminated():
                continue               # ended (EOS accepted; ignore_eos goes on unconstrained)
            offset = len(rows)
            rows.extend(self._fill(state, s.lookahead_token_ids, bitmask, offset, first))
        if not rows:
            return None
        allowed = self.backend.to_bool(bitmask, device)[:len(rows)]
        return ConstraintMasks(rows, allowed)

    def is_terminated(self, seq_id: int) -> bool:
        state = self._states.get(seq_id)
        return state is not None and state.matcher.is_terminated()

    def release(self, seq_ids) -> None:
        """Drop the matchers of sequences that ended."""
        for seq_id in seq_ids:
            self._states.pop(seq_id, None)

    # ------------------------------------------------------------ internals
    def _fill(self, state: _State, drafts: list[int], bitmask, offset: int, first: int) -> list[int]:
        """Fill the rows of one sequence (bitmask rows from ``offset``); returns their batch rows."""
        rows = []
        accepted = 0
        for j in range(len(drafts) + 1):
            if state.matcher.is_terminated():
                break                  # a draft was the stop token: nothing follows it
            state.matcher.fill_mask(bitmask, offset + j)
            rows.append(first + j)
            if j == len(drafts) or not state.matcher.accept(drafts[j]):
                break                  # later rows are never accepted: left unconstrained
            accepted += 1
        if accepted:
            state.matcher.rollback(accepted)
        return rows

    def _synced(self, s) -> _State:
        """The sequence's matcher, advanced over its output tokens (rebuilt if out of step)."""
        output = s.output_token_ids
        state = self._states.get(s.seq_id)
        if state is not None and (state.num_accepted > len(output) or
                                  (state.num_accepted and output[state.num_accepted - 1] != state.last_token)):
            state = None
        if state is None:
            state = _State(self.backend.new_matcher(s.structured, s.eos_token_ids))
            self._states[s.seq_id] = state
        state.last_step = self._step
        for token in output[state.num_accepted:]:
            if state.broken or not state.matcher.accept(token):
                if not state.broken:
                    logger.warning("sequence %d: token %d is outside its grammar; unconstrained from here",
                                   s.seq_id, token)
                state.broken = True
            state.num_accepted += 1
            state.last_token = token
        return state

    def _collect(self) -> None:
        """Drop matchers that are terminated or unused for ``idle_steps`` steps."""
        stale = [k for k, st in self._states.items()
                 if st.matcher.is_terminated() or self._step - st.last_step > self.idle_steps]
        for k in stale:
            del self._states[k]


class NullConstraints:
    """No grammar engine: constrained requests are refused, nothing is masked."""

    def validate(self, spec: StructuredSpec | None) -> None:
        if spec is not None:
            raise InvalidRequestError("structured output is not available on this engine (xgrammar is not "
                                      "installed)", param="response_format")

    def masks(self, to_sample: Sequence, device) -> ConstraintMasks | None:
        return None

    def is_terminated(self, seq_id: int) -> bool:
        return False

    def release(self, seq_ids) -> None:
        return None
