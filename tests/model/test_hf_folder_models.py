"""Tier 2: Hugging Face folders (config.json + safetensors + tokenizer.json) for Llama with an
untied head and Qwen2 with q/k/v biases: greedy ids equal transformers on the same weights."""
from __future__ import annotations

import pytest
import torch

from kvserve.sampling.params import SamplingParams
from tests.support.parity import compare_greedy
from tests.support.tiny_models import save_tiny_hf

pytestmark = pytest.mark.model

PROMPTS = ["The capital of France is", "def add(a, b):", "1, 2, 3,", "Hello 世界 🌍"]


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_hf_folder_matches_transformers(kind, tmp_path, model_path):
    from kvserve import LLM
    hf_model = save_tiny_hf(kind, tmp_path, model_path)
    llm = LLM(str(tmp_path), dtype="float32", kv_cache_bytes=32 * 2**20)
    assert llm.engine.model_config.architecture == kind
    assert llm.engine.model_config.attention_bias == (kind == "qwen2")
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ours = llm.generate(PROMPTS, greedy)
    reference, gaps = [], []
    hf_model.generation_config.eos_token_id = None
    with torch.inference_mode():
        for out in ours:
            ids = torch.tensor([out.prompt_token_ids])
            gen = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                                    output_logits=True, return_dict_in_generate=True,
                                    pad_token_id=2)
            reference.append(gen.sequences[0, ids.shape[1]:].tolist())
            top2 = torch.stack(gen.logits)[:, 0].float().log_softmax(-1).topk(2).values
            gaps.append((top2[:, 0] - top2[:, 1]).tolist())
    compare_greedy(reference, [o.outputs[0].token_ids for o in ours], gaps)
