"""LoRA adapters made offline with ``peft`` on a Hugging Face model, for the tests.

``make_adapter`` wraps the base in a fresh PEFT LoRA with random A and non-zero random B
(``init_lora_weights=False``), saves the folder and unwraps the base again, so one base
model serves many adapters. ``peft_reference`` is the reference: the same folder loaded
by ``peft`` on the fp32 base, its greedy choices along our outputs.
"""
from __future__ import annotations

import os

import torch


def hf_base_model(model_path: str):
    """The default model (or an HF folder) in transformers, fp32, eval mode."""
    from transformers import AutoModelForCausalLM
    if model_path.endswith(".gguf"):
        folder, name = os.path.split(model_path)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    return model.eval()


def make_adapter(base, folder: str, r: int = 8, alpha: float = 16, targets=("q_proj", "v_proj"),
                 seed: int = 0, use_rslora: bool = False, scale_b: float = 1.0, safetensors: bool = True) -> str:
    """Save a random LoRA adapter for ``base`` into ``folder``; returns the folder.
    ``scale_b`` scales B (larger: outputs differ from the base sooner)."""
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(seed)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0,
                        init_lora_weights=False, use_rslora=use_rslora)
    model = get_peft_model(base, config)
    if scale_b != 1.0:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.mul_(scale_b)
    model.save_pretrained(folder, safe_serialization=safetensors)
    model.unload()                   # the base without LoRA layers again (weights untouched)
    return folder


def peft_reference(base, folder: str | None, prompts: list[list[int]], continuations: list[list[int]]):
    """peft's greedy choice and log-softmax at each position of ``continuations`` (ours),
    teacher-forced (``parity.teacher_forced``), for ``base`` with the adapter at ``folder``
    (None: the base alone)."""
    from peft import PeftModel

    from tests.support.parity import teacher_forced
    model = PeftModel.from_pretrained(base, folder).eval() if folder else base
    try:
        return teacher_forced(model, prompts, continuations)
    finally:
        if folder:
            model.unload()


# ---------------------------------------------------------------- synthetic (tier 1)
def tiny_model_config(num_layers: int = 2):
    """A small ModelConfig: hidden 8, 2 query heads and 1 KV head of 4, MLP 12."""
    from kvserve.config import ModelConfig
    return ModelConfig(architecture="llama", vocab_size=32, hidden_size=8, intermediate_size=12,
                       num_layers=num_layers, num_heads=2, num_kv_heads=1, head_dim=4, rms_norm_eps=1e-5,
                       rope_theta=10000.0, max_position_embeddings=64)


def synthetic_tensors(model_config, r: int = 2, targets=("q_proj", "v_proj"), layers=None, seed: int = 0,
                      prefix: str = "base_model.model.model.layers") -> dict:
    """PEFT-named random ``lora_A [r, in]`` / ``lora_B [out, r]`` tensors for ``model_config``."""
    from kvserve.lora.peft_format import module_shape
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(model_config.num_layers) if layers is None else layers:
        for module in targets:
            out_dim, in_dim = module_shape(model_config, module)
            part = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            stem = f"{prefix}.{layer}.{part}.{module}"
            tensors[f"{stem}.lora_A.weight"] = torch.randn(r, in_dim, generator=gen)
            tensors[f"{stem}.lora_B.weight"] = torch.randn(out_dim, r, generator=gen)
    return tensors


def write_adapter(folder, config: dict | None = None, tensors: dict | None = None, fmt: str = "safetensors") -> str:
    """Write a PEFT folder by hand: ``adapter_config.json`` (defaults r=2, alpha=4,
    q/v) updated with ``config``, and ``tensors`` as safetensors or ``.bin``."""
    import json
    os.makedirs(folder, exist_ok=True)
    full = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj", "v_proj"],
            "bias": "none", "use_rslora": False, "use_dora": False, "modules_to_save": None}
    full.update(config or {})
    with open(os.path.join(folder, "adapter_config.json"), "w", encoding="utf-8") as f:
        json.dump(full, f)
    if tensors is not None:
        tensors = {k: v.contiguous() for k, v in tensors.items()}
        if fmt == "safetensors":
            from safetensors.torch import save_file
            save_file(tensors, os.path.join(folder, "adapter_model.safetensors"))
        else:
            torch.save(tensors, os.path.join(folder, "adapter_model.bin"))
    return str(folder)


def synthetic_adapter(folder, model_config, r: int = 2, alpha: float = 4, targets=("q_proj", "v_proj"),
                      seed: int = 0, **config) -> str:
    """A consistent hand-written adapter (config and tensors agree)."""
    return write_adapter(folder, {"r": r, "lora_alpha": alpha, "target_modules": list(targets), **config},
                         synthetic_tensors(model_config, r, targets, seed=seed))


def hf_skeleton(model_config):
    """A randomly initialised transformers Llama with the projection shapes of
    ``model_config`` (a tiny vocabulary): enough for ``make_adapter`` to make adapters
    that fit that model, without loading its weights (seconds for the default GGUF)."""
    import transformers
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=model_config.hidden_size, intermediate_size=model_config.intermediate_size,
        num_hidden_layers=model_config.num_layers, num_attention_heads=model_config.num_heads,
        num_key_value_heads=model_config.num_kv_heads, head_dim=model_config.head_dim,
        max_position_embeddings=256)
    return transformers.LlamaForCausalLM(config).eval()
