"""Architecture registry keyed by the checkpoint's declared architecture."""
from __future__ import annotations

from kvserve.config import ModelConfig
from kvserve.errors import ModelLoadError
from kvserve.models.llama import LlamaForCausalLM
from kvserve.models.qwen2_moe import Qwen2MoeForCausalLM

ARCHITECTURES = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,     # Llama with q/k/v biases (config.attention_bias)
    "qwen2_moe": Qwen2MoeForCausalLM,   # Qwen2 with mixture-of-experts MLPs (config.moe)
}


def build_model(config: ModelConfig):
    """Instantiate the model class registered for ``config.architecture``."""
    cls = ARCHITECTURES.get(config.architecture)
    if cls is None:
        raise ModelLoadError(f"unsupported architecture {config.architecture!r}; "
                             f"supported: {sorted(ARCHITECTURES)}", param="model")
    return cls(config)
