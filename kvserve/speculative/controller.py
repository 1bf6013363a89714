"""Adaptive speculation: how many draft tokens each sequence gets, and whether a step
speculates at all, from measured acceptance and a measured step-time model.

Pure Python (the scheduler calls it; no torch). The arithmetic:

- acceptance ``alpha`` of a sequence = P(next draft accepted | previous accepted),
  estimated from its own verifications (a geometric MLE with a weak prior);
- with ``k`` drafts a step yields ``E(k) = (1 - alpha^(k+1)) / (1 - alpha)`` tokens;
- forward time ``t(T) = a + b * T`` for ``T`` tokens in the step (least squares over
  recent steps), draft time ``k * (c + d * S)`` for ``k`` draft passes over ``S``
  sequences (zero for n-gram);
- each sequence takes the ``k`` maximising ``E(k) / (its share of the step + b * k)``;
  the step speculates only if ``sum E / t_on >= (1 + min_gain) * S / t_off``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.engine.step_time import LinearTimeModel

PRIOR_ALPHA = 0.6           # acceptance assumed before a sequence has any verification
PRIOR_WEIGHT = 2.0          # pseudo-verifications behind that prior
PROBE_EVERY = 16            # a sequence at k = 0 retries k = 1 after this many steps


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens per verification step with ``k`` drafts: ``(1 - alpha^(k+1)) / (1 - alpha)``."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


@dataclass
class SpecStats:
    """Speculation counters (engine-wide, or one request's)."""

    num_proposed: int = 0             # draft tokens put up for verification
    num_accepted: int = 0             # of those, accepted
    num_verifications: int = 0        # sequence-steps that verified >= 1 draft
    num_rejections: int = 0           # of those, ones that ended at a rejected draft
    accepted_per_position: list[int] = field(default_factory=list)   # [i]: verifications accepting draft i
    num_steps_on: int = 0             # engine steps where some sequence speculated
    num_steps_off: int = 0            # decode steps where speculation was switched off by cost

    def record(self, proposed: int, accepted: int) -> None:
        if proposed <= 0:
            return
        self.num_proposed += proposed
        self.num_accepted += accepted
        self.num_verifications += 1
        self.num_rejections += int(accepted < proposed)
        if len(self.accepted_per_position) < proposed:
            self.accepted_per_position.extend([0] * (proposed - len(self.accepted_per_position)))
        for i in range(accepted):
            self.accepted_per_position[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_proposed if self.num_proposed else 0.0

    @property
    def alpha(self) -> float:
        """Per-position acceptance (maximum likelihood under a constant rate):
        accepted / (accepted + rejections)."""
        total = self.num_accepted + self.num_rejections
        return self.num_accepted / total if total else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Draft tokens accepted per verification (tokens per step is this + 1)."""
        return self.num_accepted / self.num_verifications if self.num_verifications else 0.0

    def as_dict(self) -> dict:
        return {"num_proposed": self.num_proposed, "num_accepted": self.num_accepted,
                "num_verifications": self.num_verifications, "num_rejections": self.num_rejections,
                "alpha": self.alpha,
                "accepted_per_position": list(self.accepted_per_position),
                "acceptance_rate": self.acceptance_rate, "mean_accepted_length": self.mean_accepted_length,
                "num_steps_on": self.num_steps_on, "num_steps_off": self.num_steps_off}


def _best_k(alpha: float, share: float, per_draft: float, limit: int) -> int:
    """The k in ``[0, limit]`` maximising tokens per second, ``E(k) / (share + per_draft * k)``."""
    best_k, best_rate = 0, 1.0 / max(share, 1e-12)
    for k in range(1, limit + 1):
        rate = expected_tokens(alpha, k) / max(share + per_draft * k, 1e-12)
        if rate > best_rate:
            best_k, best_rate = k, rate
    return best_k


@dataclass
class _SeqState:
    accepted: int = 0
    rejections: int = 0
    steps_at_zero: int = 0

    @property
    def alpha(self) -> float:
        return (self.accepted + PRIOR_ALPHA * PRIOR_WEIGHT) / (self.accepted + self.rejections + PRIOR_WEIGHT)


class SpecController:
    """Chooses draft counts per step; learns from verification outcomes and step times."""

    def __init__(self, k_max: int, min_gain: float = 0.05, max_batch_size: int | None = None,
                 uses_draft_model: bool = False, adaptive: bool = True,
                 forward_time: LinearTimeModel | None = None):
        """``forward_time``: the engine's step-time model (the engine observes every step);
        None: a model of its own, fed through ``observe_step``."""
        self.k_max = k_max
        self.min_gain = min_gain
        self.max_batch_size = max_batch_size
        self.uses_draft_model = uses_draft_model
        self.adaptive = adaptive                   # False: full k for every candidate, every step
        self.forward_time = forward_time or LinearTimeModel()   # target forward seconds vs tokens
        self.draft_time = LinearTimeModel()        # one draft pass seconds vs sequences
        self.stats = SpecStats()
        self._seqs: dict[int, _SeqState] = {}

    # ---------------------------------------------------------------- planning
    def plan(self, candidates: list[tuple[int, int]], base_tokens: int) -> dict[int, int]:
        """Draft counts for ``candidates`` ``(seq_id, most drafts allowed)`` in a step
        that already computes ``base_tokens`` tokens; sequences left out get none."""
        candidates = [(sid, limit) for sid, limit in candidates if limit > 0]
        if not candidates:
            return {}
        if not self.adaptive:
            self.stats.num_steps_on += 1
            return {sid: min(limit, self.k_max) for sid, limit in candidates}
        num_seqs = len(candidates)
        if self.max_batch_size is not None and num_seqs > self.max_batch_size:
            self.stats.num_steps_off += 1
            return {}
        fit = self.forward_time.coefficients()
        if fit is None:                           # nothing measured yet: explore at full k
            self.stats.num_steps_on += 1
            return {sid: min(limit, self.k_max) for sid, limit in candidates}
        a, b = fit
        c, d = (self.draft_time.coefficients() or (0.0, 0.0)) if self.uses_draft_model else (0.0, 0.0)
        share = (a + b * base_tokens) / num_seqs          # each sequence's part of the plain step
        draft_per_pass = (c / num_seqs + d) if self.uses_draft_model else 0.0
        chosen: dict[int, int] = {}
        probes: dict[int, int] = {}         # written-off sequences re-measured with one draft
        gain_tokens = 0.0
        for sid, limit in candidates:
            state = self._seqs.setdefault(sid, _SeqState())
            best_k = _best_k(state.alpha, share, b + draft_per_pass, min(limit, self.k_max))
            # Re-measure only sequences written off for their acceptance (they would not
            # speculate even alone), not ones the batch's cost keeps at zero.
            if best_k == 0 and _best_k(state.alpha, a + b, b + c + d, min(limit, self.k_max)) == 0:
                state.steps_at_zero += 1
                if state.steps_at_zero >= PROBE_EVERY:      # re-measure a sequence written off
                    state.steps_at_zero = 0
                    probes[sid] = 1
                continue
            if best_k:
                chosen[sid] = best_k
                gain_tokens += expected_tokens(state.alpha, best_k)
        if not chosen:
            self.stats.num_steps_off += 1
            return probes
        extra = sum(chosen.values())
        k_passes = max(chosen.values())
        t_off = a + b * base_tokens
        t_on = t_off + b * extra + (k_passes * (c + d * len(chosen)) if self.uses_draft_model else 0.0)
        tokens_on = gain_tokens + (num_seqs - len(chosen))
        if tokens_on / max(t_on, 1e-12) < (1.0 + self.min_gain) * num_seqs / max(t_off, 1e-12):
            self.stats.num_steps_off += 1
            return probes
        self.stats.num_steps_on += 1
        return {**chosen, **probes}

    # ---------------------------------------------------------------- learning
    def observe_step(self, num_tokens: int, forward_s: float) -> None:
        """One target forward over ``num_tokens`` tokens took ``forward_s`` seconds (only
        for a controller with its own model: the engine feeds the shared one)."""
        if num_tokens > 0:
            self.forward_time.observe(num_tokens, forward_s)

    def observe_draft_pass(self, num_seqs: int, seconds: float) -> None:
        """One draft-model pass over ``num_seqs`` sequences took ``seconds``."""
        if num_seqs > 0:
            self.draft_time.observe(num_seqs, seconds)

    def observe_verification(self, seq_id: int, proposed: int, accepted: int) -> None:
        """A sequence verified ``proposed`` drafts and ``accepted`` of them."""
        if proposed <= 0:
            return
        state = self._seqs.setdefault(seq_id, _SeqState())
        state.accepted += accepted
        state.rejections += int(accepted < proposed)
        state.steps_at_zero = 0
        self.stats.record(proposed, accepted)

    def forget(self, seq_id: int) -> None:
        """Drop a finished sequence's acceptance history."""
        self._seqs.pop(seq_id, None)

    def tracked_seq_ids(self) -> set[int]:
        """Sequences with an acceptance history (each is forgotten when it ends)."""
        return set(self._seqs)
