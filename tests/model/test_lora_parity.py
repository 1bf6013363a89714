"""Tier 2: greedy outputs with LoRA adapters equal peft + transformers on the same fp32
base, for adapters of ranks 4 / 8 / 16, attention-only / MLP-only / all seven target
modules, several alphas, rsLoRA, safetensors and .bin; all adapters and base prompts
in one generate call, and each adapter alone. Also an adapter on a tiny random
Hugging Face folder model with an untied head, against peft on that model.

A divergence is tolerated only at a genuine near-tie (tests/support/parity.py).
"""
from __future__ import annotations

import pytest
import torch

from kvserve import LLM, LoRARequest
from kvserve.sampling.params import SamplingParams
from tests.support.lora_adapters import hf_base_model, make_adapter, peft_reference
from tests.support.parity import compare_greedy, top2_gaps_from_logprobs

pytestmark = pytest.mark.model

NEW_TOKENS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=2)
ADAPTERS = {   # name: make_adapter arguments
    "attn-r4": dict(r=4, alpha=8, targets=("q_proj", "k_proj", "v_proj", "o_proj"), seed=1, scale_b=2.0),
    "mlp-r8-bin": dict(r=8, alpha=32, targets=("gate_proj", "up_proj", "down_proj"), seed=2, safetensors=False),
    "all-r16-rslora": dict(r=16, alpha=4, use_rslora=True, seed=3, scale_b=1.5,
                           targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
}


@pytest.fixture(scope="module")
def parity_prompts(prompts) -> list[list[int]]:
    """16 prompts: 6 chat, 8 raw, the two shortest ~200-300-token source slices."""
    medium = sorted((p for p in prompts if 100 < len(p) < 400), key=len)[:2]
    chosen = prompts[:6] + prompts[10:18] + medium
    assert len(chosen) == 16 and min(map(len, chosen)) < 8 and max(map(len, chosen)) > 200
    return chosen


@pytest.fixture(scope="module")
def hf_base(hf_model_folder):
    model = hf_base_model(hf_model_folder)
    yield model
    del model


@pytest.fixture(scope="module")
def adapters(hf_base, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("lora_parity")
    return {name: make_adapter(hf_base, str(root / name), **kw) for name, kw in ADAPTERS.items()}


@pytest.fixture(scope="module")
def lora_llm(model_path):
    return LLM(model_path, dtype="float32", enable_lora=True, max_loras=4, max_lora_rank=16, kv_cache_bytes=256 * 2**20)


@pytest.fixture(scope="module")
def mixed(lora_llm, adapters, parity_prompts) -> dict[str | None, list]:
    """One generate call: every prompt under every adapter and under the base, interleaved."""
    names = [None, *adapters]
    jobs = [(name, p) for i, p in enumerate(parity_prompts) for name in names[i % 4:] + names[:i % 4]]
    loras = [LoRARequest(name, adapters[name]) if name else None for name, _p in jobs]
    outputs = lora_llm.generate([{"prompt_token_ids": p} for _n, p in jobs], GREEDY, lora_request=loras)
    by_name: dict[str | None, list] = {name: [] for name in names}
    for (name, _p), out in zip(jobs, outputs):
        by_name[name].append(out.outputs[0])
    return by_name


def check_against_peft(reference, outputs, label: str) -> None:
    """Greedy ids equal peft's (near-ties tolerated), logprobs of agreeing tokens close.
    ``reference``: ``peft_reference`` along ``outputs``."""
    gaps = []
    for _ids, logprobs in reference:
        top2 = logprobs.topk(2, dim=-1).values
        gaps.append((top2[:, 0] - top2[:, 1]).tolist())
    tolerated = compare_greedy([ids for ids, _ in reference], [o.token_ids for o in outputs], gaps)
    assert len(tolerated) <= 2, f"{label}: too many near-ties to be a real comparison"
    worst = 0.0
    for out, (ref_ids, ref_logprobs) in zip(outputs, reference):
        agree = next((p for p, (a, b) in enumerate(zip(ref_ids, out.token_ids)) if a != b), len(ref_ids))
        for pos in range(agree):
            token = out.token_ids[pos]
            worst = max(worst, abs(out.logprobs[pos][token] - ref_logprobs[pos, token].item()))
    print(f"{label}: max |logprob - peft logprob| = {worst:.2e}, near-ties {len(tolerated)}")
    assert worst < 1e-3, label


def test_adapters_change_the_outputs(mixed, adapters):
    """Otherwise the parity below would say little: each adapter changes most outputs."""
    base = [o.token_ids for o in mixed[None]]
    for name in adapters:
        changed = sum(o.token_ids != b for o, b in zip(mixed[name], base))
        assert changed >= 12, f"{name} changes only {changed} of {len(base)} outputs"


def test_base_rows_of_a_lora_engine_equal_the_plain_engine(mixed, llm, parity_prompts):
    plain = llm.generate([{"prompt_token_ids": p} for p in parity_prompts], GREEDY)
    gaps = [top2_gaps_from_logprobs(o.outputs[0].logprobs) for o in plain]
    compare_greedy([o.outputs[0].token_ids for o in plain], [o.token_ids for o in mixed[None]], gaps)


@pytest.mark.parametrize("name", list(ADAPTERS))
def test_adapter_in_the_mixed_batch_matches_peft(name, mixed, hf_base, adapters, parity_prompts):
    reference = peft_reference(hf_base, adapters[name], parity_prompts, [o.token_ids for o in mixed[name]])
    check_against_peft(reference, mixed[name], f"{name} (mixed)")


@pytest.mark.parametrize("name", list(ADAPTERS))
def test_adapter_alone_matches_peft(name, lora_llm, hf_base, adapters, parity_prompts):
    outputs = [o.outputs[0] for o in lora_llm.generate([{"prompt_token_ids": p} for p in parity_prompts], GREEDY,
                                                       use_prefix_cache=False,      # computed anew
                                                       lora_request=LoRARequest(name, adapters[name]))]
    reference = peft_reference(hf_base, adapters[name], parity_prompts, [o.token_ids for o in outputs])
    check_against_peft(reference, outputs, f"{name} (alone)")
    lora_llm.engine.check_integrity()
    assert lora_llm.engine.block_pool.num_used_blocks == 0


def test_adapter_on_an_untied_head_folder_model(tmp_path, model_path, parity_prompts):
    import transformers
    from transformers import AutoTokenizer
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                      rope_theta=10000.0, initializer_range=0.3, bos_token_id=1, eos_token_id=2,
                                      tie_word_embeddings=False)
    hf_model = transformers.LlamaForCausalLM(config).eval()
    folder, adapter = tmp_path / "model", str(tmp_path / "adapter")
    hf_model.save_pretrained(folder, safe_serialization=True)
    folder_name, file_name = str(model_path).rsplit("/", 1)
    AutoTokenizer.from_pretrained(folder_name, gguf_file=file_name).save_pretrained(folder)
    make_adapter(hf_model, adapter, r=8, alpha=16, seed=4, scale_b=3.0,
                 targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
    llm = LLM(str(folder), dtype="float32", enable_lora=True, max_loras=1, max_lora_rank=8, kv_cache_bytes=32 * 2**20)
    assert not llm.engine.model_config.tie_word_embeddings
    jobs = [(lora, p) for p in parity_prompts for lora in (None, LoRARequest("tiny", adapter))]
    outputs = llm.generate([{"prompt_token_ids": p} for _l, p in jobs], GREEDY, lora_request=[j[0] for j in jobs])
    adapted, base = [o.outputs[0] for o in outputs[1::2]], [o.outputs[0] for o in outputs[0::2]]
    reference = peft_reference(hf_model, adapter, parity_prompts, [o.token_ids for o in adapted])
    base_reference = peft_reference(hf_model, None, parity_prompts, [o.token_ids for o in base])
    check_against_peft(reference, adapted, "untied head adapter")
    check_against_peft(base_reference, base, "untied head base")
    changed = sum(a != b for (a, _), (b, _) in zip(reference, base_reference))
    assert changed >= 12, f"the adapter changes only {changed} outputs"
