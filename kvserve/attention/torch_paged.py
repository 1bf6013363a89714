"""Pure-torch paged attention: the reference backend that runs anywhere.

KV cache per layer: ``[num_blocks, block_size, kv_heads, head_dim]`` for K and V.

- Multi-token chunks: SDPA with native GQA. A chunk starting at 0 is plain causal
  over its own K/V; a later chunk gathers its blocks and is cut into pieces of query
  rows, each attending only the keys up to its last row (so the masked upper
  triangle is mostly skipped), with a float mask built once per step.
- Single-token sequences and short chunks (speculative verification), on CPU in
  fp32/fp64: :mod:`kvserve.attention.ragged`, straight from the paged cache.
  Elsewhere: groups of similar context length gather their blocks into reused
  workspaces and run one batched SDPA, the query heads of one KV head folded into
  the query axis instead of repeating KV.
- An 8-bit cache (:class:`kvserve.engine.kv.quantized.QuantizedKV`) is quantised as
  it is written and dequantised as blocks are gathered into the workspaces; it always
  takes the gather paths (never the ragged one), and a chunk from 0 attends its own
  K/V as stored (dequantised), so every read sees the same values.

``prepare`` derives everything that is the same for every layer once per forward.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvserve.attention.metadata import AttentionMetadata, DecodeGroup, PrefillChunk
from kvserve.attention.ragged import RaggedPlan, RaggedSource, build_ragged_plan, ragged_attention
from kvserve.engine.kv.quantized import QuantizedKV

RAGGED_MAX_QUERIES = 4     # chunks this short go to the ragged path (CPU): measured break-even
QUERY_PIECE = 256          # query rows per SDPA call for a chunk that starts after 0


@dataclass
class ChunkPlan:
    """One multi-token chunk on the SDPA path; ``pieces`` (start > 0 only) are
    ``(first row, end row, float mask [rows, start + end row])`` within the chunk."""

    chunk: PrefillChunk
    pieces: list[tuple[int, int, torch.Tensor]] = field(default_factory=list)


@dataclass
class PreparedStep:
    """Per-forward state derived from :class:`AttentionMetadata`, shared by all layers."""

    meta: AttentionMetadata
    chunks: list[ChunkPlan] = field(default_factory=list)
    ragged: RaggedPlan | None = None
    padded_groups: list[DecodeGroup] = field(default_factory=list)


class TorchPagedAttention:
    """Backend ``"torch"``: SDPA over gathered paged KV, ragged sparse attention for decodes on CPU."""

    name = "torch"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int):
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.group = num_heads // num_kv_heads
        self.scale = head_dim ** -0.5
        self._workspaces: list[torch.Tensor | None] = [None, None]    # reused K / V gather buffers

    def prepare(self, meta: AttentionMetadata, kv_cache: torch.Tensor) -> PreparedStep:
        """Once per forward: kv_cache ``[layers, 2, blocks, block_size, KVH, D]`` (a tensor
        or a QuantizedKV) -> the step's per-layer plan (ragged pattern, chunk masks and pieces)."""
        ragged_ok = (kv_cache.device.type == "cpu" and not isinstance(kv_cache, QuantizedKV)
                     and kv_cache.dtype in (torch.float32, torch.float64))
        block_size = kv_cache.shape[3]
        step = PreparedStep(meta)
        sources: list[RaggedSource] = []
        for chunk in meta.prefills:
            if ragged_ok and chunk.num_tokens <= RAGGED_MAX_QUERIES:
                first = chunk.start_position + 1
                sources.append(RaggedSource(
                    torch.arange(chunk.token_start, chunk.token_start + chunk.num_tokens, device=kv_cache.device),
                    chunk.block_ids[None, :],
                    torch.arange(first, first + chunk.num_tokens, device=kv_cache.device)))
            else:
                step.chunks.append(ChunkPlan(chunk, self._pieces(chunk, kv_cache.dtype)))
        for group in meta.decode_groups:
            if ragged_ok:
                lens = group.mask.reshape(group.mask.shape[0], -1).sum(-1)
                sources.append(RaggedSource(group.token_index, group.block_ids.view(-1, group.max_blocks), lens))
            else:
                step.padded_groups.append(group)
        if sources:
            step.ragged = build_ragged_plan(sources, self.num_heads, self.num_kv_heads, block_size,
                                            kv_cache[0, 0].numel() // self.head_dim, kv_cache.dtype)
        return step

    @staticmethod
    def _pieces(chunk: PrefillChunk, dtype: torch.dtype) -> list[tuple[int, int, torch.Tensor]]:
        """Query pieces of a chunk after 0, each with its additive float mask (none for a
        chunk from 0: plain causal SDPA)."""
        if chunk.start_position == 0:
            return []
        n, start = chunk.num_tokens, chunk.start_position
        allowed = chunk.mask
        if allowed is None:
            allowed = torch.arange(start + n, device=chunk.block_ids.device)[None, :] <= \
                torch.arange(start, start + n, device=chunk.block_ids.device)[:, None]
        float_mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(
            ~allowed, float("-inf"))
        return [(r0, min(n, r0 + QUERY_PIECE), float_mask[r0:r0 + QUERY_PIECE, :start + min(n, r0 + QUERY_PIECE)]
                 .contiguous()) for r0 in range(0, n, QUERY_PIECE)]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, step: PreparedStep) -> torch.Tensor:
        """q [T, H, D], k/v [T, KVH, D] (views are fine); writes k/v into the cache;
        returns [T, H * D]. ``step`` comes from :meth:`prepare`. With a QuantizedKV
        plane, ``k``/``v`` are replaced by their stored (dequantised) values."""
        num_tokens = q.shape[0]
        slots = step.meta.slot_mapping
        if isinstance(k_cache, QuantizedKV):
            k, v = k_cache.write(slots, k), v_cache.write(slots, v)
        else:
            k_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, slots, k)
            v_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, slots, v)
        out = torch.empty(num_tokens, self.num_heads, self.head_dim, dtype=q.dtype, device=q.device)
        for plan in step.chunks:
            chunk = plan.chunk
            rows = slice(chunk.token_start, chunk.token_start + chunk.num_tokens)
            if chunk.start_position == 0:
                out[rows] = self._chunk_attention(q[rows], k[rows], v[rows], None)
                continue
            keys = self._gather(k_cache, chunk.block_ids, 0).view(-1, self.num_kv_heads, self.head_dim)
            values = self._gather(v_cache, chunk.block_ids, 1).view(-1, self.num_kv_heads, self.head_dim)
            for r0, r1, mask in plan.pieces:
                end = chunk.start_position + r1
                piece = slice(chunk.token_start + r0, chunk.token_start + r1)
                out[piece] = self._chunk_attention(q[piece], keys[:end], values[:end], mask)
        if step.ragged is not None:
            out.index_copy_(0, step.ragged.token_index,
                            ragged_attention(q, k_cache, v_cache, step.ragged, self.scale))
        for group in step.padded_groups:
            out[group.token_index] = self._decode_attention(q[group.token_index], k_cache, v_cache, group)
        return out.view(num_tokens, self.num_heads * self.head_dim)

    def _chunk_attention(self, q, keys, values, mask):
        """q [n, H, D], keys/values [ctx, KVH, D], mask [n, ctx] (float, additive) or
        None (plain causal, ``ctx == n``) -> [n, H, D]."""
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0), keys.transpose(0, 1).unsqueeze(0),
            values.transpose(0, 1).unsqueeze(0), attn_mask=mask, is_causal=mask is None,
            scale=self.scale, enable_gqa=True)                              # [1, H, n, D]
        return o[0].transpose(0, 1)

    def _decode_attention(self, q, k_cache, v_cache, group):
        """q [D, H, hd] for single-token sequences -> [D, H, hd] (padded SDPA path).

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

    def _gather(self, cache, block_ids: torch.Tensor, slot: int) -> torch.Tensor:
        """cache [blocks, bs, KVH, hd] rows ``block_ids`` -> [len(block_ids), bs * KVH * hd] in
        workspace ``slot`` (in the compute dtype: a QuantizedKV plane is dequantised there)."""
        row = cache.shape[1] * cache.shape[2] * cache.shape[3]
        need = block_ids.numel() * row
        ws = self._workspaces[slot]
        if ws is None or ws.numel() < need or ws.dtype != cache.dtype or ws.device != cache.device:
            ws = torch.empty(int(need * 1.25), dtype=cache.dtype, device=cache.device)
            self._workspaces[slot] = ws
        out = ws[:need].view(block_ids.numel(), row)
        if isinstance(cache, QuantizedKV):
            return cache.gather(block_ids, out)
        return torch.index_select(cache.view(cache.shape[0], -1), 0, block_ids, out=out)
