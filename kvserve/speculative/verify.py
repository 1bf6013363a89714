"""Verification of drafts inside the runner's one batched forward pass.

Every speculating sequence contributes ``n + 1`` sampling rows (its last real token
and its ``n`` drafts); row ``j`` is sampled exactly as a non-speculative step would
sample the token at that position: penalties see the drafts before it as output,
seeded rows draw the noise of that output position. The accepted prefix is where
the drafts equal those samples, then the first sample that differs (or the bonus
token). For point-mass proposals (n-gram, greedy or seed-coupled drafts) that is
exact rejection sampling and reproduces the non-speculative tokens one for one.
Unseeded sampled rows with a draft *distribution* use textbook rejection sampling
(:mod:`kvserve.speculative.rejection`), which accepts more often.
"""
from __future__ import annotations

import torch

from kvserve.engine.lookahead import LookaheadGroup
from kvserve.engine.step import SampledToken
from kvserve.sampling.sampler import SamplingRow, process_logits, raw_logprobs, sampling_probs
from kvserve.speculative.rejection import rejection_sample


def target_distributions(raw: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """The distribution each row's token is drawn from, ``[R, V]``: one-hot at the
    processed argmax for greedy rows; the sampler's ``sampling_probs`` otherwise."""
    processed = process_logits(raw.float(), rows)
    probs = torch.zeros_like(processed)
    greedy = [i for i, r in enumerate(rows) if r.params.is_greedy]
    sampled = [i for i, r in enumerate(rows) if not r.params.is_greedy]
    if greedy:
        probs[greedy] = torch.nn.functional.one_hot(processed[greedy].argmax(dim=-1),
                                                    processed.shape[1]).to(probs.dtype)
    if sampled:
        probs[sampled] = sampling_probs(processed[sampled], [rows[i] for i in sampled])
    return probs


class Verifier:
    """The runner's verifier while speculating: samples every row, then settles each
    group's lookahead tokens. Draft distributions for this step's unseeded sampled rows
    come from the speculator (``set_draft_probs``), never through the plan."""

    def __init__(self, sampler, seed: int = 0, device: torch.device | str = "cpu"):
        self.sampler = sampler
        self.generator = torch.Generator(device=device)      # rejection-sampling draws
        self.generator.manual_seed(seed)
        self._draft_probs: dict[int, torch.Tensor] = {}

    def set_draft_probs(self, probs: dict[int, torch.Tensor]) -> None:
        """This step's draft distributions ``[n, V]`` by seq id (replacing the last step's)."""
        self._draft_probs = dict(probs)

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow], groups: list[LookaheadGroup]
                 ) -> tuple[list[SampledToken], dict[int, list[SampledToken]], dict[int, SampledToken]]:
        """``(per-row samples, accepted tokens by seq_id, final token by seq_id)``."""
        out = self.sampler(logits, rows)
        samples = [SampledToken(t, lp, top) for t, lp, top in zip(out.token_ids, out.logprobs, out.top_logprobs)]
        accepted: dict[int, list[SampledToken]] = {}
        final: dict[int, SampledToken] = {}
        rejection = [g for g in groups
                     if self._draft_probs.get(g.seq_id) is not None and _is_unseeded_sampled(rows[g.first_row])]
        rejection_ids = {g.seq_id for g in rejection}
        for g in groups:
            if g.seq_id in rejection_ids:
                continue
            count = 0
            for j, draft in enumerate(g.token_ids):
                if samples[g.first_row + j].token_id != draft:
                    break
                count += 1
            accepted[g.seq_id] = samples[g.first_row:g.first_row + count]
            final[g.seq_id] = samples[g.first_row + count]
        if rejection:
            probs = [self._draft_probs[g.seq_id] for g in rejection]
            _rejection_groups(logits, rows, rejection, probs, self.generator, accepted, final)
        return samples, accepted, final


def _is_unseeded_sampled(row: SamplingRow) -> bool:
    return not row.params.is_greedy and row.params.seed is None


def _rejection_groups(logits, rows, groups, draft_probs, generator, accepted, final) -> None:
    """Textbook rejection sampling for groups whose drafts came from a distribution."""
    k_max = max(len(g.token_ids) for g in groups)
    vocab = logits.shape[1]
    device = logits.device
    target = torch.zeros(len(groups), k_max + 1, vocab, device=device)
    draft = torch.zeros(len(groups), k_max, vocab, device=device)
    tokens = torch.zeros(len(groups), k_max, dtype=torch.long, device=device)
    for b, (g, probs) in enumerate(zip(groups, draft_probs)):
        n = len(g.token_ids)
        span = list(range(g.first_row, g.first_row + n + 1))
        target[b, :n + 1] = target_distributions(logits[span], [rows[i] for i in span])
        draft[b, :n] = probs[:n]
        tokens[b, :n] = torch.tensor(g.token_ids, dtype=torch.long, device=device)
    num_drafts = torch.tensor([len(g.token_ids) for g in groups], dtype=torch.long, device=device)
    num_accepted, final_tokens = rejection_sample(target, draft, tokens, num_drafts, generator)
    for b, g in enumerate(groups):
        a = int(num_accepted[b])
        chosen = g.token_ids[:a] + [int(final_tokens[b])]
        span = list(range(g.first_row, g.first_row + a + 1))
        lps, tops = raw_logprobs(logits[span].float(), [rows[i] for i in span],
                                 torch.tensor(chosen, dtype=torch.long, device=device))
        toks = [SampledToken(t, lp, top) for t, lp, top in zip(chosen, lps, tops)]
        accepted[g.seq_id] = toks[:-1]
        final[g.seq_id] = toks[-1]
