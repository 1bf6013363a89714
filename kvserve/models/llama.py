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
from kvserve.models.layers import RMSNorm, RotaryEmbedding, SwiGLUMLP, apply_rotary_, put_param, take_tensors
from kvserve.models.projection import Projection, module_weight_bytes


class LlamaAttention(nn.Module):
    """Fused q/k/v projection (with optional Qwen2 biases), rotary, paged attention, output."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Projection(self.q_size + 2 * self.kv_size, config.hidden_size, bias=config.attention_bias)
        self.o_proj = Projection(config.hidden_size, self.q_size)

    def attend(self, x, rope, backend, k_cache, v_cache, step) -> torch.Tensor:
        """x [T, hidden] (normed) -> attention output before o_proj, [T, H * D].
        ``rope`` is the forward's (cos, sin); ``step`` the backend's prepared step."""
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)                                            # [T, q + 2kv]
        qk = qkv[:, :self.q_size + self.kv_size].view(num_tokens, self.num_heads + self.num_kv_heads,
                                                       self.head_dim)
        apply_rotary_(qk, *rope)                                          # q and k in one pass, in place
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, self.q_size + self.kv_size:].view(num_tokens, self.num_kv_heads, self.head_dim)
        return backend.forward(q, k, v, k_cache, v_cache, step)

    def forward(self, x, rope, backend, k_cache, v_cache, step) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        return self.o_proj(self.attend(x, rope, backend, k_cache, v_cache, step))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention, then pre-norm MLP. ``mlp`` is any module with
    ``accumulate_(out, x)`` and ``load_weights(tensors, prefix)`` (default: the dense
    SwiGLU; a mixture-of-experts block in ``kvserve.models.qwen2_moe``)."""

    def __init__(self, config: ModelConfig, mlp: nn.Module | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = mlp if mlp is not None else SwiGLUMLP(config.hidden_size, config.intermediate_size)

    def forward(self, x, rope, backend, k_cache, v_cache, step) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; ``x`` is updated in place (the residual
        stream: each projection accumulates into it, no add pass)."""
        attn = self.self_attn.attend(self.input_layernorm(x), rope, backend, k_cache, v_cache, step)
        self.self_attn.o_proj.accumulate_(x, attn)
        self.mlp.accumulate_(x, self.post_attention_layernorm(x))
        return x


class LlamaForCausalLM(nn.Module):
    """The whole model. ``forward`` returns final hidden states; ``compute_logits``
    projects only the rows that are sampled."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Parameter(torch.empty(config.vocab_size, config.hidden_size),
                                         requires_grad=False)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, self.make_mlp(config, i))
                                    for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = None if config.tie_word_embeddings else Projection(config.vocab_size, config.hidden_size)
        self._packed_tied_head: Projection | None = None     # CPU fp32 copy of a tied head (pack_weights)
        self.rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings,
                                      config.rope_theta, config.rope_scaling)

    def make_mlp(self, config: ModelConfig, layer: int) -> nn.Module:
        """The MLP of decoder layer ``layer``: the dense SwiGLU (subclasses override)."""
        return SwiGLUMLP(config.hidden_size, config.intermediate_size)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                backend, meta: AttentionMetadata) -> torch.Tensor:
        """input_ids/positions [T]; kv_cache [layers, 2, blocks, block_size, KVH, D] -> [T, hidden].

        What is the same for every layer (rotary cos/sin of the positions, the
        backend's attention layout) is computed once here."""
        x = F.embedding(input_ids, self.embed_tokens)                    # a fresh tensor: updated in place
        return self.forward_embedded(x, positions, kv_cache, backend, meta)

    def forward_embedded(self, x: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                         backend, meta: AttentionMetadata) -> torch.Tensor:
        """The decoder after the embedding lookup: token embeddings ``x [T, hidden]`` (a
        fresh tensor, updated in place) -> final hidden states ``[T, hidden]``. A
        vocabulary-parallel embedding (``kvserve.parallel``) enters here."""
        rope = self.rotary.cos_sin(positions, x.dtype)
        step = backend.prepare(meta, kv_cache)
        for index, layer in enumerate(self.layers):
            x = layer(x, rope, backend, kv_cache[index, 0], kv_cache[index, 1], step)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [S, hidden] -> logits [S, vocab] in fp32."""
        head = self.lm_head if self.lm_head is not None else self._packed_tied_head
        return (head(hidden) if head is not None else F.linear(hidden, self.embed_tokens)).float()

    def pack_weights(self) -> dict[str, str]:
        """Lay every projection out for the device and dtype the model now has (call
        once, after ``.to``); see ``kvserve.models.projection``. Returns the layouts
        chosen, by role. A tied vocabulary head gets its own packed copy on CPU fp32."""
        layouts = {}
        for name, module in self.named_modules():
            if isinstance(module, Projection):
                layouts[name.rsplit(".", 1)[-1]] = module.pack()
        table = self.embed_tokens
        if self.lm_head is None and table.device.type == "cpu" and table.dtype == torch.float32:
            head = Projection(*table.shape)
            head.weight = table
            layouts["lm_head"] = head.pack(onednn=True)
            self._packed_tied_head = head if head.layout == "onednn" else None
        return layouts

    def weight_bytes(self) -> int:
        """Bytes of all weights, packed copies included."""
        return module_weight_bytes(self)

    def decode_read_bytes(self) -> int:
        """Weight bytes one decode step streams: everything but the embedding table
        (it reads a row per token), unless that table is also the vocabulary head."""
        separate_head = self.lm_head is not None or self._packed_tied_head is not None
        table = self.embed_tokens.numel() * self.embed_tokens.element_size()
        return self.weight_bytes() - (table if separate_head else 0)

    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """Take Hugging Face-named tensors (no copy where no fusion is needed), fusing
        q/k/v and gate/up (each layer's MLP loads its own: ``mlp.load_weights``). Shapes
        are checked against the parameters they replace. A projection's tensors may be
        quantised weights (``kvserve.quant.formats``, which concatenate rows with
        ``cat``): they wait in ``Projection.quantized_weight``."""
        def take(*names: str):
            return take_tensors(tensors, *names)

        put_param(self, "embed_tokens", take("model.embed_tokens.weight"))
        put_param(self.norm, "weight", take("model.norm.weight"))
        if self.lm_head is not None:
            put_param(self.lm_head, "weight", take("lm_head.weight"))
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            attn = layer.self_attn
            put_param(attn.qkv_proj, "weight", take(*(p + f"self_attn.{n}_proj.weight" for n in "qkv")))
            if attn.qkv_proj.bias is not None:
                put_param(attn.qkv_proj, "bias", take(*(p + f"self_attn.{n}_proj.bias" for n in "qkv")))
            put_param(attn.o_proj, "weight", take(p + "self_attn.o_proj.weight"))
            layer.mlp.load_weights(tensors, p + "mlp.")
            put_param(layer.input_layernorm, "weight", take(p + "input_layernorm.weight"))
            put_param(layer.post_attention_layernorm, "weight", take(p + "post_attention_layernorm.weight"))
