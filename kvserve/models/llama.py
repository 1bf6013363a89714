"""Llama-family decoder (Llama, Mistral, Qwen2): a short composition of shared layers.

Runs on a flattened varlen batch: ``input_ids [T]``, ``positions [T]``; reads and
writes the paged KV cache through an attention backend.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.attention.metadata import AttentionMetadata
from kvserve.config import ModelConfig
from kvserve.models.layers import RMSNorm, RotaryEmbedding, SwiGLUMLP


class LlamaAttention(nn.Module):
    """Fused q/k/v projection (with optional Qwen2 biases), rotary, paged attention, output."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Parameter(torch.empty(self.q_size + 2 * self.kv_size, config.hidden_size),
                                     requires_grad=False)
        self.qkv_bias = (nn.Parameter(torch.zeros(self.q_size + 2 * self.kv_size), requires_grad=False)
                         if config.attention_bias else None)
        self.o_proj = nn.Parameter(torch.empty(config.hidden_size, self.q_size), requires_grad=False)

    def forward(self, x, positions, rotary, backend, k_cache, v_cache, meta):
        num_tokens = x.shape[0]
        qkv = F.linear(x, self.qkv_proj, self.qkv_bias)                  # [T, q + 2kv]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = rotary(positions, q, k)
        attn = backend.forward(q, k, v, k_cache, v_cache, meta)          # [T, H * D]
        return F.linear(attn, self.o_proj)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SwiGLUMLP(config.hidden_size, config.intermediate_size)

    def forward(self, x, positions, rotary, backend, k_cache, v_cache, meta):
        h = x + self.self_attn(self.input_layernorm(x), positions, rotary, backend, k_cache, v_cache, meta)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaForCausalLM(nn.Module):
    """The whole model. ``forward`` returns final hidden states; ``compute_logits``
    projects only the rows that are sampled."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Parameter(torch.empty(config.vocab_size, config.hidden_size),
                                         requires_grad=False)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = (None if config.tie_word_embeddings else
                        nn.Parameter(torch.empty(config.vocab_size, config.hidden_size), requires_grad=False))
        self.rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings,
                                      config.rope_theta, config.rope_scaling)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                backend, meta: AttentionMetadata) -> torch.Tensor:
        """input_ids/positions [T]; kv_cache [layers, 2, blocks, block_size, KVH, D] -> [T, hidden]."""
        x = F.embedding(input_ids, self.embed_tokens)
        for index, layer in enumerate(self.layers):
            x = layer(x, positions, self.rotary, backend, kv_cache[index, 0], kv_cache[index, 1], meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [S, hidden] -> logits [S, vocab] in fp32."""
        weight = self.embed_tokens if self.lm_head is None else self.lm_head
        return F.linear(hidden, weight).float()

    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy Hugging Face-named tensors in, fusing q/k/v and gate/up."""
        def take(name: str) -> torch.Tensor:
            if name not in tensors:
                raise KeyError(f"checkpoint lacks tensor {name}")
            return tensors[name]

        with torch.no_grad():
            self.embed_tokens.copy_(take("model.embed_tokens.weight"))
            self.norm.weight.copy_(take("model.norm.weight"))
            if self.lm_head is not None:
                self.lm_head.copy_(take("lm_head.weight"))
            for i, layer in enumerate(self.layers):
                p = f"model.layers.{i}."
                attn = layer.self_attn
                attn.qkv_proj.copy_(torch.cat([take(p + f"self_attn.{n}_proj.weight") for n in "qkv"]))
                if attn.qkv_bias is not None:
                    attn.qkv_bias.copy_(torch.cat([take(p + f"self_attn.{n}_proj.bias") for n in "qkv"]))
                attn.o_proj.copy_(take(p + "self_attn.o_proj.weight"))
                layer.mlp.gate_up_proj.copy_(torch.cat([take(p + "mlp.gate_proj.weight"),
                                                        take(p + "mlp.up_proj.weight")]))
                layer.mlp.down_proj.copy_(take(p + "mlp.down_proj.weight"))
                layer.input_layernorm.weight.copy_(take(p + "input_layernorm.weight"))
                layer.post_attention_layernorm.weight.copy_(take(p + "post_attention_layernorm.weight"))
