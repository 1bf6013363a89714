"""Tier 1: the attention backend and the in-place layer kernels against naive references."""
from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from kvserve.attention import AttentionMetadata, DecodeGroup, PrefillChunk, get_backend
from kvserve.attention import torch_paged
from kvserve.attention.ragged import RaggedSource, build_ragged_plan, ragged_attention
from kvserve.models.layers import RMSNorm, RotaryEmbedding, SwiGLUMLP, apply_rotary_
from kvserve.models.projection import Projection

H, KVH, D, BS, NUM_BLOCKS = 6, 2, 32, 4, 96


def _tables(lengths, seed):
    """Disjoint, shuffled block tables covering each length."""
    free = list(range(NUM_BLOCKS))
    random.Random(seed).shuffle(free)
    return [[free.pop() for _ in range(-(-n // BS))] for n in lengths]


def _reference(q, k_cache, v_cache, rows):
    """rows: (flat row, block table, number of positions attended) -> [T, H, D] in float64."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    for row, table, n in rows:
        slots = torch.tensor([table[p // BS] * BS + p % BS for p in range(n)])
        keys = k_cache.reshape(-1, KVH, D)[slots].double()
        values = v_cache.reshape(-1, KVH, D)[slots].double()
        for h in range(H):
            w = torch.softmax(keys[:, h // (H // KVH)] @ q[row, h].double() * D ** -0.5, dim=0)
            out[row, h] = w @ values[:, h // (H // KVH)]
    return out


def _metadata(seqs, tables, device="cpu"):
    """seqs: (start, num_tokens) per sequence -> (metadata, reference rows, slots),
    built the way the model runner lays out a step (one padded decode group)."""
    prefills, rows, slots = [], [], []
    decode = []
    row = 0
    for (start, n), table in zip(seqs, tables):
        slots += [table[p // BS] * BS + p % BS for p in range(start, start + n)]
        rows += [(row + i, table, start + i + 1) for i in range(n)]
        if n == 1:
            decode.append((row, table, start + 1))
        else:
            mask = None
            if start > 0:
                mask = torch.arange(start + n)[None, :] <= torch.arange(start, start + n)[:, None]
            prefills.append(PrefillChunk(row, n, start, torch.tensor(table), mask))
        row += n
    groups = []
    if decode:
        max_blocks = max(len(t) for _, t, _ in decode)
        ids = [b for _, t, _ in decode for b in t + [0] * (max_blocks - len(t))]
        lens = torch.tensor([n for _, _, n in decode])
        mask = (torch.arange(max_blocks * BS)[None, :] < lens[:, None])[:, None, None, :]
        groups.append(DecodeGroup(torch.tensor([r for r, _, _ in decode]), torch.tensor(ids), max_blocks, mask))
    meta = AttentionMetadata(slot_mapping=torch.tensor(slots), prefills=prefills, decode_groups=groups)
    return meta, rows, row


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backend_matches_naive_attention(dtype, monkeypatch):
    """Chunks from 0, long chunks after 0 (cut into query pieces), short chunks and
    decodes; fp32 takes the ragged path, bf16 the padded SDPA path."""
    monkeypatch.setattr(torch_paged, "QUERY_PIECE", 8)
    torch.manual_seed(0)
    seqs = [(0, 13), (9, 21), (30, 3), (0, 1), (17, 1), (55, 1), (40, 1), (5, 2)]
    tables = _tables([s + n for s, n in seqs], seed=1)
    meta, rows, num_tokens = _metadata(seqs, tables)
    kv_cache = torch.randn(1, 2, NUM_BLOCKS, BS, KVH, D).to(dtype)
    q = torch.randn(num_tokens, H, D).to(dtype)
    k = torch.randn(num_tokens, KVH, D).to(dtype)
    v = torch.randn(num_tokens, KVH, D).to(dtype)
    backend = get_backend("torch", H, KVH, D)
    step = backend.prepare(meta, kv_cache)
    assert (step.ragged is not None) == (dtype == torch.float32)
    out = backend.forward(q, k, v, kv_cache[0, 0], kv_cache[0, 1], step).view(num_tokens, H, D)
    ref = _reference(q, kv_cache[0, 0], kv_cache[0, 1], rows)      # after the backend's KV writes
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert torch.allclose(out.double(), ref, atol=tol, rtol=0), (out.double() - ref).abs().max()


def test_ragged_attention_rows_and_lengths():
    """Each query row attends exactly its first ``lens`` positions, any block order."""
    torch.manual_seed(2)
    lengths = [1, 4, 5, 17, 40]
    tables = _tables(lengths, seed=3)
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    k_cache = torch.randn(NUM_BLOCKS, BS, KVH, D)
    v_cache = torch.randn(NUM_BLOCKS, BS, KVH, D)
    q = torch.randn(7, H, D)
    token_rows = torch.tensor([6, 0, 3, 2, 5])
    plan = build_ragged_plan([RaggedSource(token_rows[:2], padded[:2], torch.tensor(lengths[:2])),
                              RaggedSource(token_rows[2:], padded[2:], torch.tensor(lengths[2:]))],
                             H, KVH, BS, k_cache.numel() // D, torch.float32)
    for _ in range(2):      # the plan is reused by every layer
        out = ragged_attention(q, k_cache, v_cache, plan, D ** -0.5)
        ref = _reference(q, k_cache, v_cache, [(int(r), t, n) for r, t, n in zip(token_rows, tables, lengths)])
        assert torch.allclose(out.double(), ref[token_rows], atol=1e-5, rtol=0)


def test_rotary_in_place_is_bit_exact():
    """apply_rotary_ equals Hugging Face's q * cos + rotate_half(q) * sin exactly (fp32),
    also on a strided view of a fused q/k buffer."""
    torch.manual_seed(3)
    rope = RotaryEmbedding(D, 64, 10000.0)
    positions = torch.tensor([0, 5, 63, 17])
    fused = torch.randn(4, (H + KVH) * D + 11)
    x = fused[:, :(H + KVH) * D].view(4, H + KVH, D)
    cos, sin = rope.cos[positions].unsqueeze(1), rope.sin[positions].unsqueeze(1)
    half = D // 2
    expected = x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin
    tail = fused[:, -11:].clone()
    apply_rotary_(x, *rope.cos_sin(positions, torch.float32))
    assert torch.equal(x, expected)
    assert torch.equal(fused[:, -11:], tail)


def test_rmsnorm_and_swiglu_match_reference():
    torch.manual_seed(4)
    norm = RMSNorm(48, 1e-5)
    norm.weight.data = torch.randn(48)
    x = torch.randn(5, 48)
    ref = norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    assert torch.allclose(norm(x), ref, atol=1e-6, rtol=1e-6)
    mlp = SwiGLUMLP(48, 20)
    gate_up_w, down_w = torch.randn(40, 48), torch.randn(48, 20)
    mlp.gate_up_proj.weight.data, mlp.down_proj.weight.data = gate_up_w, down_w
    gate, up = F.linear(x, gate_up_w).split(20, dim=-1)
    assert torch.equal(mlp.activation(x), F.silu(gate) * up)
    assert torch.allclose(mlp(x), F.linear(F.silu(gate) * up, down_w), atol=1e-5, rtol=1e-5)
    layouts = {module.pack() for module in mlp.modules() if isinstance(module, Projection)}
    assert layouts <= {"in_out", "onednn"}               # packed for CPU fp32: the same map
    assert torch.allclose(mlp(x), F.linear(F.silu(gate) * up, down_w), atol=1e-5, rtol=1e-5)
