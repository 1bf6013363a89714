"""Tier 2: a mixture-of-experts model (Qwen2-MoE) through the real engine equals Hugging Face
transformers on the same weights.

A tiny random ``Qwen2MoeForCausalLM`` (3 layers, the middle one dense through
``mlp_only_layers``; 8 experts, top-2, a sigmoid-gated shared expert, q/k/v biases) is saved
with ``save_pretrained`` (safetensors, fp32) beside a byte-level tokenizer.json, then loaded by
kvserve's offline ``LLM`` from that folder: paged KV, the torch attention backend, the
registry's ``qwen2_moe`` class. 20 prompts of 1..200 tokens run in one ``generate`` call; their
greedy ids must equal ``transformers``' ``generate`` (a divergence only at a near-tie), and the
chosen tokens' logprobs must agree within 1e-4. Both of Qwen2-MoE's top-k normalisations run.
"""
from __future__ import annotations

import json

import pytest
import torch

from kvserve.sampling.params import SamplingParams
from tests.support.parity import compare_greedy

pytestmark = pytest.mark.model

NEW_TOKENS = 8
PROMPT_LENGTHS = [1, 2, 3, 4, 5, 7, 9, 11, 13, 17, 21, 29, 34, 47, 55, 76, 89, 120, 150, 200]
VOCAB = 258            # 256 byte tokens + <s> + </s>
LOGPROB_TOLERANCE = 1e-4


def _save_byte_tokenizer(folder) -> None:
    """A byte-level BPE with no merges: ids 0..255 are bytes, 256 <s>, 257 </s>."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {char: i for i, char in enumerate(alphabet)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<s>", "</s>")])
    assert backend.get_vocab_size() == VOCAB
    backend.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": False}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def _save_tiny_moe(folder, norm_topk_prob: bool):
    """Save a random Qwen2-MoE to ``folder``; returns the transformers model (eval, fp32)."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM
    torch.manual_seed(0)
    config = Qwen2MoeConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                            shared_expert_intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                            num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
                            norm_topk_prob=norm_topk_prob, mlp_only_layers=[1], max_position_embeddings=256,
                            rope_theta=10000.0, initializer_range=0.3, bos_token_id=256, eos_token_id=257,
                            tie_word_embeddings=False, dtype="float32")
    model = Qwen2MoeForCausalLM(config).eval()
    with torch.no_grad():      # routing, shared gate and biases far from their zero/near-zero init
        for name, param in model.named_parameters():
            if name.endswith(("mlp.gate.weight", "shared_expert_gate.weight", "_proj.bias")):
                param.normal_(std=0.5)
    model.save_pretrained(folder, safe_serialization=True)
    _save_byte_tokenizer(folder)
    return model


def _prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]


def _hf_greedy(model, prompts):
    """Per prompt: (greedy ids, log-softmax of each step's logits [N, V])."""
    model.generation_config.eos_token_id = None
    results = []
    with torch.inference_mode():
        for ids in prompts:
            ids_t = torch.tensor([ids])
            out = model.generate(ids_t, attention_mask=torch.ones_like(ids_t), max_new_tokens=NEW_TOKENS,
                                 do_sample=False, output_logits=True, return_dict_in_generate=True,
                                 pad_token_id=257)
            logprobs = torch.stack(out.logits)[:, 0].float().log_softmax(-1)
            results.append((out.sequences[0, len(ids):].tolist(), logprobs))
    return results


@pytest.fixture(scope="module", params=[False, True], ids=["raw-topk", "norm-topk"])
def moe_run(request, tmp_path_factory):
    """(kvserve outputs of the 20 prompts in one batch, HF reference, kvserve's model)."""
    from kvserve import LLM
    folder = tmp_path_factory.mktemp("qwen2_moe")
    hf_model = _save_tiny_moe(folder, norm_topk_prob=request.param)
    llm = LLM(str(folder), dtype="float32", kv_cache_bytes=8 * 2**20, max_num_seqs=32,
              max_num_batched_tokens=256, num_threads=1)
    prompts = _prompts()
    greedy = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=1)
    ours = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy)
    return ours, _hf_greedy(hf_model, prompts), llm


def test_config_and_model_class(moe_run):
    _, _, llm = moe_run
    config = llm.engine.model_config
    assert config.architecture == "qwen2_moe" and config.attention_bias
    assert config.moe is not None and (config.moe.num_experts, config.moe.top_k) == (8, 2)
    assert [config.moe.is_sparse(i) for i in range(3)] == [True, False, True]
    model = llm.engine.runner.model
    assert type(model).__name__ == "Qwen2MoeForCausalLM"
    assert sorted(model.sparse_blocks()) == [0, 2]


def test_greedy_ids_and_logprobs_match_transformers(moe_run):
    ours, reference, _ = moe_run
    gaps = [(lp.topk(2, dim=-1).values[:, 0] - lp.topk(2, dim=-1).values[:, 1]).tolist() for _, lp in reference]
    tolerated = compare_greedy([ids for ids, _ in reference], [o.outputs[0].token_ids for o in ours], gaps)
    assert len(tolerated) <= 2, "too many near-ties to be a real comparison"
    worst = 0.0
    for out, (ref_ids, ref_logprobs) in zip(ours, reference):
        mine = out.outputs[0]
        agree = next((p for p, (a, b) in enumerate(zip(ref_ids, mine.token_ids)) if a != b), len(ref_ids))
        for pos in range(agree):
            token = mine.token_ids[pos]
            worst = max(worst, abs(mine.logprobs[pos][token] - ref_logprobs[pos, token].item()))
    print(f"max |logprob - transformers logprob| = {worst:.2e}")
    assert worst < LOGPROB_TOLERANCE


def test_expert_load_is_recorded(moe_run):
    _, _, llm = moe_run
    load = llm.engine.runner.model.expert_load()
    assert sorted(load) == [0, 2]
    for counts in load.values():
        assert counts.shape == (8,) and counts.dtype == torch.int64
        assert int(counts.sum()) % 2 == 0 and int(counts.sum()) > 0     # top-2: two rows per token
    llm.engine.check_integrity()
    assert llm.engine.block_pool.num_used_blocks == 0


def test_lora_is_refused_for_moe(moe_run):
    from kvserve import LLM
    from kvserve.errors import InvalidRequestError
    _, _, llm = moe_run
    with pytest.raises(InvalidRequestError, match="mixture-of-experts") as refused:
        LLM(llm.config.model, dtype="float32", kv_cache_bytes=2**20, enable_lora=True, num_threads=1)
    assert refused.value.param == "enable_lora"
