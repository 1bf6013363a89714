"""Tiny random-initialised Hugging Face folders (``config`` -> ``save_pretrained``, no
downloads) beside the default model's tokenizer, for architecture tests."""
from __future__ import annotations

import torch


def save_tiny_hf(kind: str, folder, model_path, heads: int = 4, kv_heads: int = 2, hidden: int = 64,
                 intermediate: int = 128, tied: bool | None = None, seed: int = 0):
    """Save a 2-layer ``kind`` ("llama": untied head by default; "qwen2": tied head and q/k/v
    biases drawn large enough to matter), weights drawn from ``seed``, to ``folder``; returns
    the transformers model."""
    import transformers
    from transformers import AutoTokenizer
    cls, cfg_cls, default_tied = {
        "llama": (transformers.LlamaForCausalLM, transformers.LlamaConfig, False),
        "qwen2": (transformers.Qwen2ForCausalLM, transformers.Qwen2Config, True),
    }[kind]
    torch.manual_seed(seed)
    config = cfg_cls(vocab_size=49152, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=2,
                     num_attention_heads=heads, num_key_value_heads=kv_heads,
                     max_position_embeddings=256 if hidden <= 64 else 512, rope_theta=10000.0,
                     initializer_range=0.3, bos_token_id=1, eos_token_id=2,
                     tie_word_embeddings=default_tied if tied is None else tied)
    model = cls(config).eval()
    if kind == "qwen2":   # make the biases matter
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)
    model.save_pretrained(folder, safe_serialization=True)
    folder_name, file_name = str(model_path).rsplit("/", 1)
    AutoTokenizer.from_pretrained(folder_name, gguf_file=file_name).save_pretrained(folder)
    return model
