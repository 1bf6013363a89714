"""Pure-torch paged attention: the CPU reference backend that runs anywhere.

KV cache per layer: ``[num_blocks, block_size, kv_heads, head_dim]`` for K and V.
Grouped-query attention without repeating KV: for chunks SDPA's ``enable_gqa``; for
decodes the ``group = heads // kv_heads`` query heads of one KV head are folded into
the query-length axis of a batched call.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kvserve.attention.metadata import AttentionMetadata


class TorchPagedAttention:
    """Backend ``"torch"``: scaled_dot_product_attention over gathered paged KV."""

    name = "torch"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int):
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.group = num_heads // num_kv_heads
        self.scale = head_dim ** -0.5
        self._workspaces: list[torch.Tensor | None] = [None, None]    # reused K / V gather buffers

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """q [T, H, D], k/v [T, KVH, D]; writes k/v into the cache; returns [T, H * D]."""
        num_tokens = q.shape[0]
        k_flat = k_cache.view(-1, self.num_kv_heads, self.head_dim)   # [slots, KVH, D]
        v_flat = v_cache.view(-1, self.num_kv_heads, self.head_dim)
        k_flat.index_copy_(0, meta.slot_mapping, k)
        v_flat.index_copy_(0, meta.slot_mapping, v)
        out = torch.empty(num_tokens, self.num_heads, self.head_dim, dtype=q.dtype, device=q.device)
        for chunk in meta.prefills:
            rows = slice(chunk.token_start, chunk.token_start + chunk.num_tokens)
            if chunk.start_position == 0:
                keys, values = k[rows], v[rows]                          # [n, KVH, D]
            else:
                context_len = chunk.start_position + chunk.num_tokens
                keys = k_cache[chunk.block_ids].view(-1, self.num_kv_heads, self.head_dim)[:context_len]
                values = v_cache[chunk.block_ids].view(-1, self.num_kv_heads, self.head_dim)[:context_len]
            out[rows] = self._chunk_attention(q[rows], keys, values, chunk.mask)
        for group in meta.decode_groups:
            out[group.token_index] = self._decode_attention(q[group.token_index], k_cache, v_cache, group)
        return out.view(num_tokens, self.num_heads * self.head_dim)

    def _chunk_attention(self, q, keys, values, mask):
        """q [n, H, D], keys/values [ctx, KVH, D], mask [n, ctx] or None (plain causal,
        the chunk starts at position 0) -> [n, H, D]."""
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0), keys.transpose(0, 1).unsqueeze(0),
            values.transpose(0, 1).unsqueeze(0), attn_mask=mask, is_causal=mask is None,
            scale=self.scale, enable_gqa=True)                              # [1, H, n, D]
        return o[0].transpose(0, 1)

    def _decode_attention(self, q, k_cache, v_cache, group):
        """q [D, H, hd] for single-token sequences -> [D, H, hd].

        Blocks are gathered with index_select into reused workspaces (fresh large
        buffers cost page faults on every call), then one batched SDPA call."""
        num_seqs = q.shape[0]
        ctx = group.max_blocks * k_cache.shape[1]
        keys = self._gather(k_cache, group.block_ids, 0).view(num_seqs, ctx, self.num_kv_heads, self.head_dim)
        values = self._gather(v_cache, group.block_ids, 1).view(num_seqs, ctx, self.num_kv_heads, self.head_dim)
        qg = q.view(num_seqs, self.num_kv_heads, self.group, self.head_dim)
        o = F.scaled_dot_product_attention(qg, keys.transpose(1, 2), values.transpose(1, 2),
                                           attn_mask=group.mask, scale=self.scale)
        return o.reshape(num_seqs, self.num_heads, self.head_dim)

    def _gather(self, cache: torch.Tensor, block_ids: torch.Tensor, slot: int) -> torch.Tensor:
        """cache [blocks, bs, KVH, hd] rows ``block_ids`` -> [len(block_ids), bs * KVH * hd] in workspace ``slot``."""
        flat = cache.view(cache.shape[0], -1)
        need = block_ids.numel() * flat.shape[1]
        ws = self._workspaces[slot]
        if ws is None or ws.numel() < need or ws.dtype != cache.dtype or ws.device != cache.device:
            ws = torch.empty(int(need * 1.25), dtype=cache.dtype, device=cache.device)
            self._workspaces[slot] = ws
        out = ws[:need].view(block_ids.numel(), flat.shape[1])
        return torch.index_select(flat, 0, block_ids, out=out)
