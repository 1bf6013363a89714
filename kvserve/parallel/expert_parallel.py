"""Expert parallelism for a mixture-of-experts block, inside a tensor-parallel replica.

With ``N`` ranks, rank ``r`` keeps experts ``[r E/N, (r+1) E/N)`` (and a replica of the
router and of the shared expert); attention and dense layers stay tensor-parallel
(``tensor_parallel.py``), so the block's input ``x [T, H]`` is the same on every rank.
One sparse layer:

1. every rank routes all ``T`` tokens (the router is ``T x H x E`` FLOPs: cheap), so each
   knows every (token, expert) pair — no exchange of counts is needed;
2. rank ``r`` dispatches only its slice of tokens ``[r T', (r+1) T')`` (``T' = ceil(T/N)``):
   its pairs sorted by expert, so the rows bound for each rank are contiguous;
3. **all-to-all** (dispatch): each rank receives the rows of its experts from every rank,
   regroups them expert-major and runs one GEMM pair per local expert;
4. **all-to-all** (combine): results go back to the rank that sent them, which weights
   and sums them per token (the same ``index_add_`` as one process) and adds the shared
   expert of its slice;
5. all-gather of the slices: ``[T, H]`` again on every rank.

Per forward the block records the global rows per expert (``expert_load``, kept in
``load_history``) and the seconds its three collectives took (``comm_seconds``), for the
load-imbalance and all-to-all tail metrics (the last 4,096 forwards).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.models.moe import LocalDispatcher
from kvserve.models.qwen2_moe import topk_route


def expert_owner_counts(counts: torch.Tensor, world_size: int) -> torch.Tensor:
    """Rows per expert ``[E]`` -> rows per owning rank ``[N]`` (experts contiguous per rank)."""
    return counts.view(world_size, -1).sum(dim=1)


def expert_major_order(received: torch.Tensor) -> torch.Tensor:
    """Row permutation from source-major to expert-major order. ``received [N, El]``: rows
    received from each source rank for each local expert, laid out (source, expert)."""
    starts = torch.cumsum(received.reshape(-1), 0) - received.reshape(-1)
    starts = starts.view_as(received)
    blocks = [torch.arange(int(starts[s, e]), int(starts[s, e] + received[s, e]))
              for e in range(received.shape[1]) for s in range(received.shape[0])]
    return torch.cat(blocks) if blocks else torch.zeros(0, dtype=torch.int64)


class ExpertParallelBlock(nn.Module):
    """A Qwen2-MoE sparse block whose routed experts are spread over ``group``'s ranks
    (this rank's ``E / N`` of them kept, the others dropped)."""

    def __init__(self, block, group):
        super().__init__()
        num_experts, world = len(block.experts), group.world_size
        if num_experts % world:
            raise ValueError(f"{num_experts} experts do not split over {world} ranks")
        self.group, self.top_k, self.norm_topk_prob = group, block.top_k, block.norm_topk_prob
        self.num_experts, self.local_experts = num_experts, num_experts // world
        self.first_expert = group.rank * self.local_experts
        self.router = block.router
        self.shared_expert, self.shared_expert_gate = block.shared_expert, block.shared_expert_gate
        self.experts = block.experts                              # keep this rank's experts only
        self.experts.experts = nn.ModuleList(
            block.experts.experts[self.first_expert:self.first_expert + self.local_experts])
        self.dispatcher = LocalDispatcher(num_experts)
        self.expert_load: torch.Tensor | None = None              # global rows per expert, last forward
        self.load_history: list[torch.Tensor] = []                # per forward: ``expert_load`` (last 4,096)
        self.expert_tokens_total: torch.Tensor | None = None      # global rows per expert since start
        self.comm_seconds: list[float] = []                       # per forward: its collectives' seconds

    def _slice(self, num_tokens: int, rank: int) -> tuple[int, int]:
        per_rank = -(-num_tokens // self.group.world_size)
        return min(rank * per_rank, num_tokens), min((rank + 1) * per_rank, num_tokens)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] (normed, the same on every rank) -> the MLP's output [T, hidden]."""
        group, world = self.group, self.group.world_size
        comm_before = group.comm_seconds
        ids, weights = topk_route(x, self.router, self.top_k, self.norm_topk_prob)    # all T tokens
        self.expert_load = torch.bincount(ids.reshape(-1), minlength=self.num_experts)
        self.load_history.append(self.expert_load)
        self.expert_tokens_total = self.expert_load if self.expert_tokens_total is None \
            else self.expert_tokens_total + self.expert_load
        del self.load_history[:-4096]
        per_source = torch.stack([torch.bincount(ids[slice(*self._slice(x.shape[0], s))].reshape(-1),
                                                 minlength=self.num_experts) for s in range(world)])
        lo, hi = self._slice(x.shape[0], group.rank)
        mine = self.dispatcher.dispatch(x[lo:hi], ids[lo:hi], weights[lo:hi])
        local = slice(self.first_expert, self.first_expert + self.local_experts)
        received = per_source[:, local]                                       # [N, El]
        bound = -(-x.shape[0] // world) * world * self.top_k       # rows any rank sends, either way
        rows = group.all_to_all(mine.hidden, expert_owner_counts(mine.counts, world).tolist(),
                                received.sum(dim=1).tolist(), max_rows=bound)
        order = expert_major_order(received)
        out_rows = torch.empty_like(rows)
        out_rows[order] = self.experts(rows[order], received.sum(dim=0).tolist())
        back = group.all_to_all(out_rows, received.sum(dim=1).tolist(),
                                expert_owner_counts(mine.counts, world).tolist(), max_rows=bound)
        out = self.dispatcher.combine(back, mine)                             # [hi - lo, H]
        if self.shared_expert is not None:
            xs = x[lo:hi]
            out += torch.sigmoid(F.linear(xs, self.shared_expert_gate)) * self.shared_expert(xs)
        padded = out.new_zeros(-(-x.shape[0] // world), out.shape[1])
        padded[:out.shape[0]] = out
        gathered = group.all_gather(padded, dim=0)[:x.shape[0]]
        self.comm_seconds.append(group.comm_seconds - comm_before)
        del self.comm_seconds[:-4096]
        return gathered

    def accumulate_(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``out += moe(x)`` in place (the residual stream)."""
        return out.add_(self(x))
