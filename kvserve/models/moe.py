"""Mixture-of-experts building blocks: expert dispatch/combine and grouped expert compute.

A sparse MLP runs in four steps on a flat batch of ``T`` tokens, each routed to ``k``
experts (``topk_ids [T, k]``, ``topk_weights [T, k]``):

1. ``dispatch``: the ``T * k`` (token, expert) pairs are sorted by expert id (a stable
   argsort), and the tokens' hidden rows gathered in that order, so each expert's rows
   are one contiguous slice; ``counts[e]`` rows go to expert ``e``.
2. the experts: one fused gate/up GEMM and one down GEMM per expert over its slice
   (a loop over experts, never over tokens; an expert with no rows is skipped).
3. ``combine``: each row is scaled by its routing weight and summed back into its
   token's output with one ``index_add_``.

:class:`LocalDispatcher` does 1 and 3 on this process. It is the seam an
expert-parallel version replaces: its ``dispatch`` would send each row to the rank
that owns the expert (an all-to-all, with ``counts`` of the local experts), and its
``combine`` send the results back before the same ``index_add_``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kvserve.models.layers import SwiGLUMLP


@dataclass
class Dispatched:
    """Hidden rows grouped by expert, and what ``combine`` needs to put them back.

    ``hidden [R, H]``: rows in expert order (``R = T * k`` locally); ``counts [E]``:
    rows per expert (int64, on the rows' device); ``token_index [R]``: the token each
    row came from; ``weights [R]``: its routing weight; ``num_tokens``: ``T``."""

    hidden: torch.Tensor
    counts: torch.Tensor
    token_index: torch.Tensor
    weights: torch.Tensor
    num_tokens: int


class LocalDispatcher:
    """Groups (token, expert) pairs by expert on this process (no communication)."""

    def __init__(self, num_experts: int):
        self.num_experts = num_experts

    def dispatch(self, hidden: torch.Tensor, topk_ids: torch.Tensor,
                 topk_weights: torch.Tensor) -> Dispatched:
        """hidden [T, H], topk_ids / topk_weights [T, k] -> rows sorted by expert id.
        Within an expert, rows keep token order (stable sort)."""
        top_k = topk_ids.shape[1]
        flat_ids = topk_ids.reshape(-1)
        order = torch.argsort(flat_ids, stable=True)
        token_index = torch.div(order, top_k, rounding_mode="floor")
        counts = torch.bincount(flat_ids, minlength=self.num_experts)
        return Dispatched(hidden=hidden.index_select(0, token_index), counts=counts,
                          token_index=token_index, weights=topk_weights.reshape(-1)[order],
                          num_tokens=hidden.shape[0])

    def combine(self, expert_out: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        """expert_out [R, H] (in ``dispatched``'s row order) -> [T, H]: each token's
        expert outputs weighted by their routing weights and summed (``expert_out`` is
        scaled in place)."""
        out = expert_out.new_zeros(dispatched.num_tokens, expert_out.shape[1])
        expert_out.mul_(dispatched.weights[:, None])
        return out.index_add_(0, dispatched.token_index, expert_out)


class GroupedExperts(nn.Module):
    """``num_experts`` SwiGLU experts (fused gate/up, then down, each a ``Projection``),
    run one GEMM pair per expert over that expert's contiguous group of rows."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.experts = nn.ModuleList(SwiGLUMLP(hidden_size, intermediate_size) for _ in range(num_experts))

    def __len__(self) -> int:
        return len(self.experts)

    def forward(self, grouped: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """grouped [R, H] (rows of expert 0, then expert 1, ...), counts [E] -> [R, H]."""
        if len(counts) != len(self.experts) or sum(counts) != grouped.shape[0]:
            raise ValueError(f"counts {counts} do not describe {grouped.shape[0]} rows "
                             f"over {len(self.experts)} experts")
        outputs, start = [], 0
        for expert, rows in zip(self.experts, counts):
            if rows:
                outputs.append(expert(grouped[start:start + rows]))
            start += rows
        return torch.cat(outputs) if outputs else grouped.new_empty(grouped.shape)

    def load_weights(self, tensors: dict, prefix: str) -> None:
        """Take ``{prefix}{e}.gate_proj / up_proj / down_proj`` for every expert ``e``."""
        for index, expert in enumerate(self.experts):
            expert.load_weights(tensors, f"{prefix}{index}.")

