"""Speculative rejection sampling (Leviathan et al. 2023; Chen et al. 2023), batched.

For drafts ``d_0 .. d_{n-1}`` proposed from distributions ``q_i`` and the target's
distributions ``p_0 .. p_n`` at the same positions (``p_i`` conditioned on
``d_0 .. d_{i-1}``): accept ``d_i`` with probability ``min(1, p_i(d_i) / q_i(d_i))``
while every earlier draft was accepted; at the first rejection ``i`` emit a token
from the residual ``norm(max(p_i - q_i, 0))``; if all ``n`` are accepted emit a
bonus token from ``p_n``. Every emitted token is then distributed exactly as the
target would have sampled it, whatever ``q`` is.
"""
from __future__ import annotations

import torch


def rejection_sample(target_probs: torch.Tensor, draft_probs: torch.Tensor, draft_tokens: torch.Tensor,
                     num_drafts: torch.Tensor, generator: torch.Generator | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept/reject a batch of drafts.

    ``target_probs`` ``[B, K + 1, V]``, ``draft_probs`` ``[B, K, V]``, ``draft_tokens``
    ``[B, K]`` (long), ``num_drafts`` ``[B]`` (long, ``<= K``; a row's positions past
    its count are ignored). Returns ``(num_accepted [B], final_token [B])``: the row
    emits ``draft_tokens[b, :num_accepted[b]]`` followed by ``final_token[b]``.
    """
    batch, k_max, vocab = draft_probs.shape
    device = target_probs.device
    if k_max == 0:
        return (torch.zeros(batch, dtype=torch.long, device=device),
                _sample(target_probs[:, 0], generator))
    p_draft = target_probs[:, :k_max].gather(2, draft_tokens[:, :, None]).squeeze(2)    # [B, K]
    q_draft = draft_probs.gather(2, draft_tokens[:, :, None]).squeeze(2)                # [B, K]
    uniform = torch.rand(batch, k_max, device=device, generator=generator)
    # u < p/q  <=>  u * q < p  (q > 0 for a token that was drawn from q)
    accept = uniform * q_draft < p_draft
    valid = torch.arange(k_max, device=device)[None, :] < num_drafts[:, None]
    accept &= valid
    num_accepted = accept.long().cumprod(dim=1).sum(dim=1)                              # [B]
    rows = torch.arange(batch, device=device)
    p_at = target_probs[rows, num_accepted]                                             # [B, V]
    all_accepted = num_accepted >= num_drafts
    q_at = draft_probs[rows, num_accepted.clamp(max=k_max - 1)]                         # [B, V]
    residual = (p_at - q_at).clamp_min(0.0)
    mass = residual.sum(dim=-1, keepdim=True)
    # p == q at a rejection has probability 0; fall back to p rather than divide by 0.
    residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), p_at)
    final_dist = torch.where(all_accepted[:, None], p_at, residual)
    return num_accepted, _sample(final_dist, generator)


def _sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of ``probs`` ``[B, V]`` by the exponential race (argmax p / E)."""
    noise = torch.empty_like(probs).exponential_(generator=generator).clamp_min_(torch.finfo(probs.dtype).tiny)
    return (probs / noise).argmax(dim=-1)
