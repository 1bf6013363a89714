"""Gather-free paged attention for short query runs (decodes, short chunks) on CPU.

Padded decode attention copies every sequence's blocks into a workspace and then
runs SDPA on it: two or three passes over the KV bytes, plus padding. For a few
query rows per sequence that copy dominates. Here each query row ``(token, head)``
lists the cache rows it attends (``slot * kv_heads + kv_head`` in the cache viewed
as ``[slots * kv_heads, head_dim]``) as one sparse CSR row, and

    scores  = sampled_addmm(pattern, q, K^T)      only the listed dot products
    probs   = softmax per row                     via a padded buffer, per source
    output  = embedding_bag(columns, V, probs)    weighted sum of the listed V rows

so K and V are read in place, once, with no padding. The pattern is built once per
step (:func:`build_ragged_plan`) and shared by every layer.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class RaggedSource:
    """Query rows that share a layout: ``token_rows[i]`` attends the first ``lens[i]``
    positions of ``block_ids[i]`` (or of ``block_ids[0]`` when it has a single row)."""

    token_rows: torch.Tensor   # [Q] int64 rows of the flat batch
    block_ids: torch.Tensor    # [Q or 1, B] int64 block table(s)
    lens: torch.Tensor         # [Q] int64 positions attended, >= 1


@dataclass
class RaggedPlan:
    """Per-step layout of :func:`ragged_attention`, shared by all layers."""

    token_index: torch.Tensor               # [Q] rows of the flat batch, in plan order
    pattern: torch.Tensor                   # sparse CSR [Q * H, slots * KVH], values unused
    columns: torch.Tensor                   # [nnz] cache row of each (query row, position)
    offsets: torch.Tensor                   # [Q * H] start of each query row in ``columns``
    dense_index: torch.Tensor               # [nnz] place of each score in ``dense``
    dense_blocks: list[tuple[int, int, int]]  # (offset, rows, width) softmax rectangles in ``dense``
    dense: torch.Tensor                     # softmax buffer; padding stays -inf, scores land at dense_index


def build_ragged_plan(sources: list[RaggedSource], num_heads: int, num_kv_heads: int,
                      block_size: int, num_cache_rows: int, dtype: torch.dtype) -> RaggedPlan:
    """Lay out the sparse pattern for ``sources``; ``num_cache_rows`` is
    ``num_blocks * block_size * num_kv_heads`` (rows of the cache viewed as ``[-1, D]``),
    ``dtype`` the cache's."""
    device = sources[0].token_rows.device
    kv_head = torch.arange(num_heads, device=device) // (num_heads // num_kv_heads)     # [H]
    in_block = torch.arange(block_size, device=device)
    rows, columns, row_lens, dense_index, dense_blocks = [], [], [], [], []
    dense_size = 0
    for src in sources:
        q = src.token_rows.numel()
        width = int(src.lens.max())
        slots = (src.block_ids[:, :, None] * block_size + in_block).flatten(1)[:, :width]   # [Q or 1, S]
        cols = (slots[:, None, :] * num_kv_heads + kv_head[None, :, None]).expand(q, num_heads, width)
        valid = (torch.arange(width, device=device) < src.lens[:, None])[:, None, :].expand(q, num_heads, width)
        index = valid.reshape(-1).nonzero().squeeze(1)          # row-major: (query, head, position)
        columns.append(cols.reshape(-1).index_select(0, index))
        dense_index.append(index + dense_size)
        dense_blocks.append((dense_size, q * num_heads, width))
        dense_size += q * num_heads * width
        row_lens.append(src.lens.repeat_interleave(num_heads))
        rows.append(src.token_rows)
    columns_t = torch.cat(columns)
    lens_t = torch.cat(row_lens)
    crow = torch.zeros(lens_t.numel() + 1, dtype=torch.int64, device=device)
    torch.cumsum(lens_t, 0, out=crow[1:])
    with warnings.catch_warnings():          # "sparse CSR support is in beta": we rely on CPU kernels only
        warnings.simplefilter("ignore")
        pattern = torch.sparse_csr_tensor(crow, columns_t, torch.zeros(columns_t.numel(), dtype=dtype, device=device),
                                          (lens_t.numel(), num_cache_rows), check_invariants=False)
    return RaggedPlan(token_index=torch.cat(rows), pattern=pattern, columns=columns_t, offsets=crow[:-1],
                      dense_index=torch.cat(dense_index), dense_blocks=dense_blocks,
                      dense=torch.full((dense_size,), float("-inf"), dtype=dtype, device=device))


def ragged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     plan: RaggedPlan, scale: float) -> torch.Tensor:
    """q [T, H, D] (all rows of the batch); k/v_cache [blocks, block_size, KVH, D]
    -> attention output [Q, H, D] of the plan's rows ``plan.token_index``."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    queries = q.index_select(0, plan.token_index).view(-1, head_dim)                  # [Q * H, D]
    keys = k_cache.view(-1, head_dim)
    # Written into the pattern's own values (out=): no copy of the pattern per layer.
    scores = torch.sparse.sampled_addmm(plan.pattern, queries, keys.t(), beta=0.0, alpha=scale,
                                        out=plan.pattern).values()                  # [nnz]
    dense = plan.dense.index_copy_(0, plan.dense_index, scores)     # every layer writes the same places
    probs = [torch.softmax(dense[o:o + r * w].view(r, w), dim=-1).view(-1) for o, r, w in plan.dense_blocks]
    weights = (probs[0] if len(probs) == 1 else torch.cat(probs)).index_select(0, plan.dense_index)
    out = F.embedding_bag(plan.columns, v_cache.view(-1, head_dim), plan.offsets, mode="sum",
                          per_sample_weights=weights)                                 # [Q * H, D]
    return out.view(-1, num_heads, head_dim)
