"""Model architecture numbers, read from a checkpoint's own metadata."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class MoEConfig:
    """Mixture-of-experts numbers of a sparse decoder (Qwen2-MoE's config.json keys).

    A layer is sparse unless it is listed in ``mlp_only_layers`` or its 1-based index is
    not a multiple of ``decoder_sparse_step``; dense layers use ``ModelConfig.intermediate_size``.
    ``shared_expert_intermediate_size`` 0 means no shared expert.
    """

    num_experts: int
    top_k: int                               # num_experts_per_tok
    expert_intermediate_size: int            # moe_intermediate_size
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = False             # renormalise the top-k softmax weights to sum 1
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def is_sparse(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` (0-based) has the sparse MoE block."""
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama-family decoder-only transformer.

    Filled by a loader from the checkpoint (GGUF metadata or config.json), never
    guessed from a file name. ``head_dim`` may differ from hidden/heads.
    """

    architecture: str               # registry key, e.g. "llama", "qwen2", "mistral", "qwen2_moe"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False    # Qwen2-style q/k/v biases
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Optional rope scaling, as in HF config "rope_scaling" (e.g. llama3 type).
    rope_scaling: dict | None = field(default=None, compare=False, hash=False)
    name: str = ""
    moe: MoEConfig | None = None    # sparse MLP layers (None: every layer dense)
