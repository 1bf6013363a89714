"""Qwen2-MoE (Hugging Face ``Qwen2MoeForCausalLM``): the Llama-family decoder of
``kvserve.models.llama`` (Qwen2's attention with q/k/v biases, RMSNorm, rotary, paged KV
through the same attention backend) whose MLP, in the layers the config makes sparse,
is a mixture of experts:

- router: ``softmax(x @ W_gate.T)`` in fp32, the top ``k`` probabilities kept and, when
  ``norm_topk_prob``, renormalised to sum 1 (Qwen2-MoE's default leaves them as they are);
- routed experts: SwiGLU MLPs of ``moe_intermediate_size``, tokens grouped by expert
  (``kvserve.models.moe``), the weighted outputs summed per token;
- shared expert: a SwiGLU of ``shared_expert_intermediate_size`` on every token, scaled by
  ``sigmoid(x @ w_shared_gate.T)`` and added to the routed sum.

Layers in ``mlp_only_layers`` (or off the ``decoder_sparse_step`` grid) keep a dense
SwiGLU of ``intermediate_size``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.config import MoEConfig, ModelConfig
from kvserve.models.layers import SwiGLUMLP, put_param, take_tensors
from kvserve.models.llama import LlamaForCausalLM
from kvserve.models.moe import GroupedExperts, LocalDispatcher
from kvserve.models.projection import module_weight_bytes


def topk_route(x: torch.Tensor, router: torch.Tensor, top_k: int, norm_topk_prob: bool
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen2-MoE's routing as Hugging Face computes it: softmax of ``x @ router.T`` in fp32,
    the top ``top_k``, renormalised to sum 1 when ``norm_topk_prob``. Returns (ids [T, k]
    int64, weights [T, k] in x's dtype)."""
    probs = F.softmax(F.linear(x, router), dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights /= weights.sum(dim=-1, keepdim=True)
    return ids, weights.to(x.dtype)


class Qwen2MoeSparseBlock(nn.Module):
    """Router + grouped routed experts + sigmoid-gated shared expert, on ``x [T, hidden]``.

    ``dispatcher`` (default :class:`LocalDispatcher`) groups rows by expert and sums them
    back; an expert-parallel version swaps it (and the experts this rank holds).
    ``expert_load`` holds the rows each expert received in the last forward (int64
    ``[num_experts]``; None before the first), for a metric to read."""

    def __init__(self, hidden_size: int, moe: MoEConfig):
        super().__init__()
        self.top_k, self.norm_topk_prob = moe.top_k, moe.norm_topk_prob
        self.router = nn.Parameter(torch.empty(moe.num_experts, hidden_size), requires_grad=False)
        self.experts = GroupedExperts(moe.num_experts, hidden_size, moe.expert_intermediate_size)
        self.shared_expert = None
        self.shared_expert_gate = None
        if moe.shared_expert_intermediate_size:
            self.shared_expert = SwiGLUMLP(hidden_size, moe.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Parameter(torch.empty(1, hidden_size), requires_grad=False)
        self.dispatcher = LocalDispatcher(moe.num_experts)
        self.expert_load: torch.Tensor | None = None
        self.expert_tokens_total: torch.Tensor | None = None      # rows per expert since start

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (topk_ids [T, k] int64, topk_weights [T, k] in x's dtype)."""
        return topk_route(x, self.router, self.top_k, self.norm_topk_prob)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] (normed) -> the MLP's output [T, hidden]."""
        ids, weights = self.route(x)
        grouped = self.dispatcher.dispatch(x, ids, weights)
        self.expert_load = grouped.counts
        self.expert_tokens_total = grouped.counts if self.expert_tokens_total is None \
            else self.expert_tokens_total + grouped.counts
        out = self.dispatcher.combine(self.experts(grouped.hidden, grouped.counts.tolist()), grouped)
        if self.shared_expert is not None:
            out += torch.sigmoid(F.linear(x, self.shared_expert_gate)) * self.shared_expert(x)
        return out

    def accumulate_(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``out += moe(x)`` in place (the residual stream)."""
        return out.add_(self(x))

    def load_weights(self, tensors: dict, prefix: str) -> None:
        """Take ``{prefix}gate``, ``experts.{e}.*``, ``shared_expert.*`` and
        ``shared_expert_gate`` (Hugging Face's Qwen2-MoE names)."""
        put_param(self, "router", take_tensors(tensors, prefix + "gate.weight"))
        self.experts.load_weights(tensors, prefix + "experts.")
        if self.shared_expert is not None:
            self.shared_expert.load_weights(tensors, prefix + "shared_expert.")
            put_param(self, "shared_expert_gate", take_tensors(tensors, prefix + "shared_expert_gate.weight"))


class Qwen2MoeForCausalLM(LlamaForCausalLM):
    """``LlamaForCausalLM`` with :class:`Qwen2MoeSparseBlock` MLPs in the sparse layers."""

    def make_mlp(self, config: ModelConfig, layer: int) -> nn.Module:
        """A sparse block where ``config.moe`` says so, else the dense SwiGLU."""
        if config.moe is None:
            raise ValueError("a qwen2_moe model needs ModelConfig.moe")
        if config.moe.is_sparse(layer):
            return Qwen2MoeSparseBlock(config.hidden_size, config.moe)
        return super().make_mlp(config, layer)

    def sparse_blocks(self) -> dict[int, Qwen2MoeSparseBlock]:
        """Layer index -> its sparse block."""
        return {i: layer.mlp for i, layer in enumerate(self.layers) if isinstance(layer.mlp, Qwen2MoeSparseBlock)}

    def expert_load(self) -> dict[int, torch.Tensor]:
        """Layer index -> rows per expert in the last forward (layers not run yet left out)."""
        return {i: block.expert_load for i, block in self.sparse_blocks().items() if block.expert_load is not None}

    def decode_read_bytes(self) -> int:
        """Weight bytes one single-token decode step streams: as for Llama, but of each
        sparse layer's routed experts only the ``top_k`` a token is sent to."""
        unread = 0
        for block in self.sparse_blocks().values():
            experts = block.experts.experts
            unread += sum(module_weight_bytes(e) for e in experts) * (len(experts) - block.top_k) // len(experts)
        return super().decode_read_bytes() - unread
