"""Shared transformer layers: RMSNorm, rotary embeddings, SwiGLU MLP, and the helpers
that move Hugging Face-named checkpoint tensors into them.

Tensors are flattened across requests: ``[num_tokens, ...]`` (varlen, no padding).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.models.projection import Projection


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, computed in fp32 (as Hugging Face does)."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:   # [T, hidden] -> [T, hidden]
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)      # same ops, fewer temporaries
        dtype = x.dtype
        x32 = x.float()
        variance = x32.pow(2).mean(-1, keepdim=True)
        return self.weight * (x32 * torch.rsqrt(variance + self.eps)).to(dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2], with Llama-3 style scaling when configured."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type"))
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        inv_freq = torch.where(medium, smoothed, scaled)
    elif kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind not in (None, "default"):
        raise ValueError(f"unsupported rope scaling {kind!r}")
    return inv_freq


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding (rotate_half), cos/sin precomputed per position."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None = None):
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]            # [P, head_dim/2]
        emb = torch.cat((freqs, freqs), dim=-1)                     # [P, head_dim]
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> (cos, sin), each [T, 1, head_dim / 2] in ``dtype``: once per
        forward, shared by every layer (both halves of the tables are equal)."""
        half = self.cos.shape[-1] // 2
        return (self.cos[positions, :half].unsqueeze(1).to(dtype),
                self.sin[positions, :half].unsqueeze(1).to(dtype))

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q [T, H, D], k [T, KVH, D], positions [T] -> rotated (q, k) (new tensors)."""
        cos_sin = self.cos_sin(positions, q.dtype)
        q, k = q.clone(), k.clone()
        apply_rotary_(q, *cos_sin)
        apply_rotary_(k, *cos_sin)
        return q, k


def apply_rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [T, N, D] in place (a strided view is fine); cos/sin [T, 1, D / 2].

    Same products and sums as Hugging Face's ``x * cos + rotate_half(x) * sin``:
    ``[x1 * c - x2 * s, x2 * c + x1 * s]``, so fp32 results are bit-identical."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    x1_sin = x1 * sin
    x1.mul_(cos).sub_(x2 * sin)
    x2.mul_(cos).add_(x1_sin)
    return x


class SwiGLUMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), gate and up fused into one matrix."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Projection(2 * intermediate_size, hidden_size)
        self.down_proj = Projection(hidden_size, intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:    # [T, hidden] -> [T, hidden]
        return self.down_proj(self.activation(x))

    def accumulate_(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``out += mlp(x)`` in place (the residual stream: down_proj accumulates into it)."""
        return self.down_proj.accumulate_(out, self.activation(x))

    def load_weights(self, tensors: dict, prefix: str) -> None:
        """Take ``{prefix}gate_proj`` + ``up_proj`` (fused) and ``down_proj`` weights."""
        put_param(self.gate_up_proj, "weight", take_tensors(tensors, prefix + "gate_proj.weight",
                                                            prefix + "up_proj.weight"))
        put_param(self.down_proj, "weight", take_tensors(tensors, prefix + "down_proj.weight"))

    def activation(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate(x)) * up(x), computed in place in the gate half of one fresh
        [T, 2 * inter] buffer; returns that (row-strided) half, [T, inter]."""
        gate_up = self.gate_up_proj(x)                     # [T, 2 * inter]
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return F.silu(gate, inplace=True).mul_(up)


def take_tensors(tensors: dict, *names: str):
    """The checkpoint tensor ``names[0]``, or ``names`` concatenated along rows (a fused
    projection). Quantised weights (``kvserve.quant.formats``) concatenate with their own
    ``cat``. KeyError names the missing tensors."""
    missing = [n for n in names if n not in tensors]
    if missing:
        raise KeyError(f"checkpoint lacks tensors {missing}")
    parts = [tensors[n] for n in names]
    if len(parts) == 1:
        return parts[0]
    quantized = [p for p in parts if not isinstance(p, torch.Tensor)]
    return type(quantized[0]).cat(parts) if quantized else torch.cat(parts)


def put_param(module: nn.Module, attr: str, value) -> None:
    """Replace ``module.<attr>`` by ``value`` (no copy when contiguous), after checking its
    shape. A loader's quantised weight waits in ``Projection.quantized_weight`` and leaves
    an empty float parameter behind."""
    old = getattr(module, attr)
    if old.shape != value.shape:
        raise ValueError(f"{attr}: checkpoint shape {tuple(value.shape)} != model {tuple(old.shape)}")
    if not isinstance(value, torch.Tensor):     # a loader's quantised weight (kvserve.quant)
        module.quantized_weight = value
        value = torch.empty(0)
    setattr(module, attr, nn.Parameter(value.contiguous(), requires_grad=False))
