"""N-gram prompt lookup: propose the tokens that followed the latest earlier
occurrence of the sequence's last n tokens (prompt and output so far).

Strong where the answer copies its input (code edits, summaries, RAG answers).
Pure CPU work on token ids; the proposal is a point mass (no draft distribution),
so verification by matching the target's own samples is exact rejection sampling.
"""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from kvserve.speculative.proposer import Draft, ProposerContext


def propose_ngram(token_ids: list[int], num_tokens: int, ngram_max: int, ngram_min: int) -> list[int]:
    """Up to ``num_tokens`` ids continuing the longest suffix (``ngram_max`` down to
    ``ngram_min`` tokens) that also occurs earlier in ``token_ids``; the most recent
    earlier occurrence wins. ``[]`` when nothing matches."""
    total = len(token_ids)
    if num_tokens <= 0 or total < ngram_min + 1:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(ngram_max, total - 1), ngram_min - 1, -1):
        suffix = tokens[total - n:]
        # candidate starts i with tokens[i:i+n] == suffix and i + n < total (something follows)
        windows = sliding_window_view(tokens[:total - 1], n)           # starts 0 .. total-1-n
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start:start + num_tokens].tolist()
    return []


class NgramProposer:
    """Proposes each speculating sequence's lookahead tokens by prompt lookup (no model, no KV)."""

    uses_model = False           # no draft passes: lookahead costs only verification

    def __init__(self, ngram_max: int = 4, ngram_min: int = 1):
        self.ngram_max = ngram_max
        self.ngram_min = ngram_min
        self.pass_times: list[tuple[int, float]] = []      # no draft model: never any passes

    def propose(self, plan) -> dict[int, Draft]:
        """A point-mass Draft (at most ``num_lookahead_slots`` tokens, maybe none) per
        sequence with lookahead slots."""
        drafts = {}
        for s in plan.scheduled:
            if s.num_lookahead_slots > 0:
                tokens = list(s.prompt_token_ids) + list(s.output_token_ids)
                drafts[s.seq_id] = Draft(propose_ngram(tokens, s.num_lookahead_slots, self.ngram_max,
                                                       self.ngram_min))
        return drafts

    def on_step_done(self, plan, accepted_counts, finished_seq_ids) -> None:
        """Nothing to roll back: the proposer keeps no per-sequence state."""

    def forget(self, seq_ids) -> None:
        """No per-sequence state to drop."""

    def tracked_seq_ids(self) -> set[int]:
        return set()


def build_ngram(ctx: ProposerContext) -> NgramProposer:
    """The registry's builder for ``ngram``."""
    return NgramProposer(ctx.spec.ngram_max, ctx.spec.ngram_min)
