"""Tensor parallelism as a transform on a plain Llama-family model (Megatron's layout).

Rank ``r`` of ``tp`` keeps:

- attention: the q heads ``[r H/tp, (r+1) H/tp)`` and their KV heads — ``KVH/tp`` of them
  when ``tp`` divides the KV heads, else (``tp`` a multiple of ``KVH``, GQA with few KV
  heads) the one KV head its q heads read, replicated on ``tp/KVH`` ranks. The fused q/k/v
  projection keeps those rows (column parallel, biases too); ``o_proj`` keeps the matching
  input columns (row parallel): each rank's partial sum is all-reduced, one all-reduce.
- MLP: ``I/tp`` rows of gate and of up (column parallel), those columns of down (row
  parallel, one all-reduce).
- vocabulary: rows ``[r V', (r+1) V')`` of the embedding and of the head, ``V' = ceil(V/tp)``
  (the last rank's padded with zero rows): a token's embedding comes from the rank that
  holds its row (the others add zeros, one all-reduce) and the logits are all-gathered.

A mixture-of-experts block becomes expert-parallel (``expert_parallel.py``): each rank
keeps ``E/N`` experts, tokens reach them by all-to-all. Norms and rotary tables are
replicated. Each rank's KV cache holds only its KV heads, so
its bytes per token are ``2 x layers x (KVH/tp or 1) x head_dim x dtype bytes``. The
scheduler and its block ids are the same on every rank.
"""
from __future__ import annotations

import copy

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.config import ModelConfig
from kvserve.errors import InvalidRequestError
from kvserve.models.layers import SwiGLUMLP
from kvserve.models.llama import LlamaAttention, LlamaForCausalLM
from kvserve.models.projection import Projection
from kvserve.parallel.expert_parallel import ExpertParallelBlock
from kvserve.planner.kv_memory import kv_heads_per_gpu


def check_tensor_parallel(config: ModelConfig, tp: int) -> None:
    """Raise ``InvalidRequestError`` saying why ``config``'s model cannot be split ``tp`` ways."""
    def refuse(why: str):
        raise InvalidRequestError(f"tensor_parallel_size {tp} cannot split {config.name or config.architecture}: "
                                  f"{why}", param="tensor_parallel_size")
    if tp < 1:
        refuse("it must be >= 1")
    if tp == 1:
        return
    if config.moe is not None and config.moe.num_experts % tp:
        refuse(f"{config.moe.num_experts} experts do not split over {tp} ranks (expert parallelism)")
    if config.num_heads % tp:
        refuse(f"{config.num_heads} attention heads are not divisible by {tp}")
    try:
        kv_heads_per_gpu(config.num_kv_heads, tp)
    except ValueError:
        refuse(f"{config.num_kv_heads} KV heads neither divide by {tp} nor divide {tp} (GQA replication)")
    if config.intermediate_size % tp:
        refuse(f"MLP width {config.intermediate_size} is not divisible by {tp}")


def rank_model_config(config: ModelConfig, tp: int) -> ModelConfig:
    """What one rank holds, as a config: its attention and KV heads and MLP width (the KV
    cache of a rank is sized and allocated from this)."""
    return dataclasses.replace(config, num_heads=config.num_heads // tp,
                               num_kv_heads=kv_heads_per_gpu(config.num_kv_heads, tp),
                               intermediate_size=config.intermediate_size // tp)


def _rows(w: torch.Tensor | None, ranges: list[tuple[int, int]]) -> torch.Tensor | None:
    return None if w is None else torch.cat([w[a:b] for a, b in ranges]).contiguous()


def _projection(weight: torch.Tensor, bias: torch.Tensor | None) -> Projection:
    proj = Projection(weight.shape[0], weight.shape[1], bias=bias is not None)
    proj.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        proj.bias = nn.Parameter(bias, requires_grad=False)
    return proj


class RowParallel(Projection):
    """A projection whose input features are split across ranks: each rank's partial
    product is summed over the ranks (one all-reduce); a bias is added once, after it.
    A ``Projection`` itself, so packing and the layouts log treat it as one."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group):
        super().__init__(weight.shape[0], weight.shape[1])
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.row_bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.group = group

    partial_sums = True     # each rank's product is a partial sum (Projection's docstring)

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in / tp] -> this rank's partial product [T, out]."""
        return super().forward(x)

    def reduce_(self, y: torch.Tensor) -> torch.Tensor:
        """Partial products summed over the ranks (in place), plus the bias, once."""
        y = self.group.all_reduce_(y)
        return y if self.row_bias is None else y.add_(self.row_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in / tp] -> [T, out], the same on every rank."""
        return self.reduce_(self.partial(x))

    def accumulate_(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``out += x @ W.T`` (``out`` is the residual stream, the same on every rank)."""
        return out.add_(self.forward(x))


def _row_parallel(proj: Projection, lo: int, hi: int, group, quantization: str) -> RowParallel:
    """Input features ``[lo, hi)`` of ``proj`` as a row-parallel shard. With weight
    quantisation the whole weight is quantised first and its codes split, so each output
    channel keeps the scale of its whole row (as at TP=1), not one of its slice."""
    shard = RowParallel(proj.weight[:, lo:hi].contiguous(), proj.bias, group)
    if quantization != "none":
        from kvserve.quant.formats import as_format
        shard.quantized_weight = as_format(proj.weight, quantization).cols(lo, hi)
    return shard


def head_ranges(num_heads: int, num_kv_heads: int, rank: int, tp: int) -> tuple[int, int, int, int]:
    """Rank ``rank``'s attention heads: (first q head, q heads, first KV head, KV heads); the
    KV heads its q heads read, replicated across ranks when ``tp`` exceeds ``num_kv_heads``."""
    heads, kv_heads = num_heads // tp, kv_heads_per_gpu(num_kv_heads, tp)
    q0 = rank * heads
    kv0 = rank * kv_heads if num_kv_heads % tp == 0 else q0 // (num_heads // num_kv_heads)
    return q0, heads, kv0, kv_heads


def _shard_attention(attn: LlamaAttention, group, tp: int, quantization: str) -> None:
    d = attn.head_dim
    q0, heads, kv0, kv_heads = head_ranges(attn.num_heads, attn.num_kv_heads, group.rank, tp)
    q, kv = attn.q_size, attn.kv_size
    ranges = [(q0 * d, (q0 + heads) * d), (q + kv0 * d, q + (kv0 + kv_heads) * d),
              (q + kv + kv0 * d, q + kv + (kv0 + kv_heads) * d)]
    attn.qkv_proj = _projection(_rows(attn.qkv_proj.weight, ranges), _rows(attn.qkv_proj.bias, ranges))
    attn.o_proj = _row_parallel(attn.o_proj, q0 * d, (q0 + heads) * d, group, quantization)
    attn.num_heads, attn.num_kv_heads = heads, kv_heads
    attn.q_size, attn.kv_size = heads * d, kv_heads * d


def _shard_mlp(mlp: SwiGLUMLP, group, tp: int, quantization: str) -> None:
    inter = mlp.intermediate_size
    width = inter // tp
    lo = group.rank * width
    mlp.gate_up_proj = _projection(_rows(mlp.gate_up_proj.weight, [(lo, lo + width), (inter + lo, inter + lo + width)]),
                                   None)
    mlp.down_proj = _row_parallel(mlp.down_proj, lo, lo + width, group, quantization)
    mlp.intermediate_size = width


def _vocab_rows(table: torch.Tensor, rank: int, tp: int) -> tuple[torch.Tensor, int]:
    """Rank ``rank``'s rows of a ``[V, hidden]`` table, zero-padded to ``ceil(V / tp)``; and
    the first vocabulary id it holds."""
    per_rank = -(-table.shape[0] // tp)
    lo = rank * per_rank
    rows = table[lo:lo + per_rank]
    if rows.shape[0] < per_rank:
        rows = torch.cat((rows, rows.new_zeros(per_rank - rows.shape[0], table.shape[1])))
    return rows.contiguous(), lo


class TensorParallelModel(nn.Module):
    """One rank's shard of a Llama-family model. Every rank calls ``forward`` and
    ``compute_logits`` with the same inputs at the same time (the collectives inside pair
    up); the results are the same on every rank."""

    def __init__(self, model: LlamaForCausalLM, group, quantization: str = "none"):
        super().__init__()
        tp = group.world_size
        check_tensor_parallel(model.config, tp)
        self.config, self.group, self.model = model.config, group, model
        self.rank_config = rank_model_config(model.config, tp)
        head = model.lm_head.weight if model.lm_head is not None else model.embed_tokens
        head_rows, _ = _vocab_rows(head, group.rank, tp)
        table, self.vocab_start = _vocab_rows(model.embed_tokens, group.rank, tp)
        self.vocab_rows = min(table.shape[0], model.config.vocab_size - self.vocab_start)   # real rows held
        model.embed_tokens = nn.Parameter(table, requires_grad=False)
        model.lm_head = _projection(head_rows, None)       # untied on every rank: its own rows
        for layer in model.layers:
            _shard_attention(layer.self_attn, group, tp, quantization)
            if isinstance(layer.mlp, SwiGLUMLP):
                _shard_mlp(layer.mlp, group, tp, quantization)
            else:                                          # a mixture of experts: expert parallel
                layer.mlp = ExpertParallelBlock(layer.mlp, group)

    @property
    def rotary(self):
        return self.model.rotary

    @property
    def layers(self):
        """This rank's decoder layers (their projections are what quantisation transforms)."""
        return self.model.layers

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                backend, meta) -> torch.Tensor:
        """As ``LlamaForCausalLM.forward``, with this rank's KV heads in ``kv_cache``."""
        local = input_ids - self.vocab_start
        held = (local >= 0) & (local < self.vocab_rows)
        x = F.embedding(local.clamp(0, self.vocab_rows - 1), self.model.embed_tokens)
        x.mul_(held.unsqueeze(1).to(x.dtype))
        return self.model.forward_embedded(self.group.all_reduce_(x), positions, kv_cache, backend, meta)

    def truncated(self, num_layers: int) -> "TensorParallelModel":
        """A view running only this shard's first ``num_layers`` decoder layers (the
        self-draft); parameters and the group are shared, nothing is copied."""
        from kvserve.speculative.draft import truncated_model
        view = copy.copy(self)
        view._modules = dict(self._modules)
        view._modules["model"] = truncated_model(self.model, num_layers)
        return view

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [S, hidden] -> logits [S, vocab] in fp32 (each rank's rows, gathered)."""
        local = self.model.compute_logits(hidden)
        return self.group.all_gather(local, dim=-1)[:, :self.config.vocab_size]

    def pack_weights(self) -> dict[str, str]:
        """Lay this rank's projections out for its device (see ``Projection.pack``)."""
        return self.model.pack_weights()

    def weight_bytes(self) -> int:
        """Bytes of this rank's weights (packed copies included)."""
        return self.model.weight_bytes()

    def decode_read_bytes(self) -> int:
        """Weight bytes this rank streams per decode step."""
        return self.model.decode_read_bytes()

    def expert_parallel_blocks(self) -> dict[int, ExpertParallelBlock]:
        """Layer index -> its expert-parallel block (empty for a dense model)."""
        return {i: layer.mlp for i, layer in enumerate(self.model.layers)
                if isinstance(layer.mlp, ExpertParallelBlock)}
