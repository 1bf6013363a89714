"""Model architecture numbers, read from a checkpoint's own metadata."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama-family decoder-only transformer.

    Filled by a loader from the checkpoint (GGUF metadata or config.json), never
    guessed from a file name. ``head_dim`` may differ from hidden/heads.
    """

    architecture: str               # registry key, e.g. "llama", "qwen2", "mistral"
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
