"""LoRA adapters made offline with ``peft`` on a Hugging Face model, for the tests.

``make_adapter`` wraps the base in a fresh PEFT LoRA with random A and non-zero random B
(``init_lora_weights=False``), saves the folder and unwraps the base again, so one base
model serves many adapters. ``peft_greedy`` is the reference: the same folder loaded
by ``peft`` on the fp32 base, greedy.
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


def peft_greedy(base, folder: str | None, prompts: list[list[int]], max_new_tokens: int):
    """Greedy ids and per-step log-softmax of ``base`` with the adapter at ``folder``
    (None: the base alone), one prompt at a time."""
    from peft import PeftModel
    model = PeftModel.from_pretrained(base, folder).eval() if folder else base
    results = []
    try:
        with torch.inference_mode():
            for ids in prompts:
                out = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=max_new_tokens,
                                     do_sample=False, output_logits=True, return_dict_in_generate=True,
                                     pad_token_id=0, eos_token_id=None,
                                     attention_mask=torch.ones(1, len(ids), dtype=torch.long))
                logprobs = torch.log_softmax(torch.stack(out.logits, dim=0)[:, 0].float(), dim=-1)
                results.append((out.sequences[0, len(ids):].tolist(), logprobs))
    finally:
        if folder:
            model.unload()
    return results
