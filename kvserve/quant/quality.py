"""What a quantised setting loses, measured against a float reference engine.

Three figures, all teacher-forced on the reference's own greedy tokens (so every
setting is scored on the same positions):

- ``mean_abs_dlogprob``: mean |log p_q(t) - log p_ref(t)| of the reference's greedy tokens;
- ``top1_agreement``: the share of those positions where the setting's argmax is that token;
- ``perplexity``: exp(-mean log p(token)) over a fixed text (``tests/data/perplexity.txt``).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from kvserve.sampling.params import SamplingParams


@dataclass(frozen=True)
class QualityReport:
    """One setting's figures (see the module docstring) and what they were computed on."""

    mean_abs_dlogprob: float
    top1_agreement: float
    perplexity: float
    reference_perplexity: float
    positions: int

    def as_dict(self) -> dict:
        return asdict(self)


def greedy_continuations(llm, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """The reference's greedy tokens after each prompt (token ids)."""
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    return [list(o.outputs[0].token_ids) for o in outs]


def scored_positions(llm, sequences: list[list[int]], starts: list[int]) -> list[list[tuple[int, float, int]]]:
    """For each sequence, from position ``start`` on: (token, log p(token), argmax id)."""
    outs = llm.generate([{"prompt_token_ids": s} for s in sequences],
                        SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1))
    scored = []
    for seq, start, out in zip(sequences, starts, outs):
        rows = []
        for pos in range(max(start, 1), len(seq)):
            entry = out.prompt_logprobs[pos]
            top = max(entry, key=entry.get)
            rows.append((seq[pos], entry[seq[pos]], top))
        scored.append(rows)
    return scored


def perplexity(llm, text_ids: list[int]) -> float:
    """exp(-mean log p) of ``text_ids`` after its first token."""
    rows = scored_positions(llm, [text_ids], [1])[0]
    return math.exp(-sum(lp for _, lp, _ in rows) / len(rows))


def compare(reference, candidate, prompts: list[list[int]], continuations: list[list[int]],
            text_ids: list[int], reference_perplexity: float | None = None) -> QualityReport:
    """``candidate``'s figures against ``reference`` on the prompts + reference continuations."""
    sequences = [p + c for p, c in zip(prompts, continuations)]
    starts = [len(p) for p in prompts]
    ref = scored_positions(reference, sequences, starts)
    got = scored_positions(candidate, sequences, starts)
    pairs = [(r, g) for rs, gs in zip(ref, got) for r, g in zip(rs, gs)]
    dlp = sum(abs(r[1] - g[1]) for r, g in pairs) / len(pairs)
    agree = sum(g[2] == r[0] for r, g in pairs) / len(pairs)
    ref_ppl = reference_perplexity if reference_perplexity is not None else perplexity(reference, text_ids)
    return QualityReport(dlp, agree, perplexity(candidate, text_ids), ref_ppl, len(pairs))
