"""Tier 2: LoRA requests batched with each other and with base requests give what each
gives alone, also under preemption and chunked prefill, with more adapters waiting
than resident slots, with n > 1 siblings and with n-gram speculation; the prefix
cache never serves one adapter's KV to another (nor to a reload under the same name).

Adapters are made with peft on a randomly initialised transformers model of the
default model's shapes (tests/support/lora_adapters.py ``hf_skeleton``): their effect
on the real model is random but fixed, which is all these comparisons need; parity
with peft is tests/model/test_lora_parity.py.
"""
from __future__ import annotations

import itertools
import shutil

import pytest

from kvserve import LLM, LoRARequest
from kvserve.builder import kv_bytes_per_token
from kvserve.engine.request import EngineRequest
from kvserve.sampling.params import SamplingParams
from tests.support.lora_adapters import hf_skeleton, make_adapter
from tests.support.parity import compare_greedy, top2_gaps_from_logprobs

pytestmark = pytest.mark.model

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
SHORT = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)        # prefix-cache checks
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ADAPTERS = {  # name: make_adapter arguments (ranks 4-16, different target subsets)
    "a0": dict(r=4, alpha=8, targets=("q_proj", "v_proj"), seed=10, scale_b=2.0),
    "a1": dict(r=8, alpha=16, targets=ALL, seed=11),
    "a2": dict(r=16, alpha=16, targets=("gate_proj", "up_proj", "down_proj"), seed=12, scale_b=2.0),
    "a3": dict(r=8, alpha=8, targets=("o_proj", "down_proj"), seed=13, use_rslora=True, scale_b=2.0),
    "a4": dict(r=4, alpha=16, targets=ALL, seed=14, safetensors=False),
    "a5": dict(r=16, alpha=32, targets=("q_proj", "k_proj", "v_proj"), seed=15, scale_b=2.0),
}
REPETITIVE = ["the cat sat on the mat. the cat sat on the mat. the cat sat on the mat. the cat",
              "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16,"]
_ids = itertools.count()


@pytest.fixture(scope="module")
def adapters(lora_llm, tmp_path_factory) -> dict[str, str]:
    skeleton = hf_skeleton(lora_llm.engine.model_config)
    root = tmp_path_factory.mktemp("lora_batching")
    return {name: make_adapter(skeleton, str(root / name), **kw) for name, kw in ADAPTERS.items()}


@pytest.fixture(scope="module")
def jobs(prompts, tokenizer) -> list[tuple[str | None, list[int]]]:
    """10 (adapter name or None, prompt): every adapter and the base, prompts from 4 to
    ~260 tokens (two need several chunks of 64), two repetitive ones."""
    medium = sorted((p for p in prompts if 100 < len(p) < 400), key=len)[:2]
    pool = prompts[:3] + prompts[10:13] + medium + [tokenizer.encode(t) for t in REPETITIVE]
    names = [None, *ADAPTERS]
    return [(names[i % len(names)], p) for i, p in enumerate(pool)]


@pytest.fixture(scope="module")
def lora_llm(model_path):
    """The uncontended LoRA engine: every adapter fits a slot."""
    return LLM(model_path, dtype="float32", enable_lora=True, max_loras=6, max_lora_rank=16, kv_cache_bytes=256 * 2**20)


@pytest.fixture(scope="module")
def alone(lora_llm, adapters, jobs):
    """Each job in a generate call of its own."""
    return [lora_llm.generate([{"prompt_token_ids": p}], GREEDY,
                              lora_request=LoRARequest(name, adapters[name]) if name else None)[0].outputs[0]
            for name, p in jobs]


def lora_requests(jobs, adapters):
    return [LoRARequest(name, adapters[name]) if name else None for name, _p in jobs]


def compare(reference, outputs) -> None:
    gaps = [top2_gaps_from_logprobs(r.logprobs) for r in reference]
    compare_greedy([r.token_ids for r in reference], [o.token_ids for o in outputs], gaps)


def run_checked(llm: LLM, jobs, adapters) -> tuple[list, list[dict]]:
    """Run ``jobs`` in one batch stepping by hand: integrity after every step; returns the
    outputs and, per step, what was scheduled and the adapter counters before it ran."""
    for name in {n for n, _p in jobs if n}:
        llm.load_lora(LoRARequest(name, adapters[name]))
    trace, execute = [], llm.engine.runner.execute

    def spy(plan):
        trace.append({"items": [(s.adapter_key, s.start_position, s.num_tokens, len(s.prompt_token_ids))
                                for s in plan.scheduled], "adapters": llm.engine.stats().adapters})
        return execute(plan)

    llm.engine.runner.execute = spy
    order = []
    try:
        for name, prompt in jobs:
            request = EngineRequest(f"batch-{next(_ids)}", prompt, GREEDY, frozenset(llm.tokenizer.eos_token_ids),
                                    adapter_id=name)
            llm.add_request(request)
            order.append(request.request_id)
        done = {}
        while llm.engine.has_unfinished():
            for output in llm.processor.process(llm.engine.step()):
                done[output.request_id] = output
            llm.engine.check_integrity()
    finally:
        del llm.engine.runner.execute
    assert llm.engine.block_pool.num_used_blocks == 0
    return [done[r].outputs[0] for r in order], trace


def test_the_adapters_change_the_outputs(jobs, alone, lora_llm, adapters):
    prompt = jobs[0][1]
    outputs = lora_llm.generate([{"prompt_token_ids": prompt}] * 7, GREEDY,
                                lora_request=[None, *(LoRARequest(n, adapters[n]) for n in ADAPTERS)])
    assert len({tuple(o.outputs[0].token_ids) for o in outputs}) == 7     # base and 6 adapters differ
    assert outputs[0].outputs[0].token_ids == alone[0].token_ids


def test_mixed_batch_equals_each_request_alone(lora_llm, adapters, jobs, alone):
    outputs = lora_llm.generate([{"prompt_token_ids": p} for _n, p in jobs], GREEDY, use_prefix_cache=False,
                                lora_request=lora_requests(jobs, adapters))       # prefill mixed too
    compare(alone, [o.outputs[0] for o in outputs])
    lora_llm.engine.check_integrity()
    assert lora_llm.engine.block_pool.num_used_blocks == 0


def test_preemption_and_chunked_prefill(model_path, lora_llm, adapters, jobs, alone):
    engine = lora_llm.engine
    block = kv_bytes_per_token(engine.model_config, engine.dtype) * lora_llm.config.block_size
    tight = LLM(model_path, dtype="float32", enable_lora=True, max_loras=6, max_lora_rank=16, kv_cache_bytes=24 * block,
                max_num_batched_tokens=64)
    outputs, trace = run_checked(tight, jobs, adapters)
    compare(alone, outputs)
    assert tight.engine.stats().num_preemptions > 0
    chunked = [i for step in trace for i in step["items"] if i[0] and i[1] + i[2] < i[3]]
    assert chunked, "no adapter prompt was prefilled in chunks"
    assert max(len(step["items"]) for step in trace) >= 4


def test_more_adapters_waiting_than_slots(model_path, adapters, jobs, alone):
    few = LLM(model_path, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16, kv_cache_bytes=128 * 2**20)
    outputs, trace = run_checked(few, jobs, adapters)
    compare(alone, outputs)
    assert all(o.finish_reason == "length" for o in outputs)
    assert max(step["adapters"].num_waiting_for_slot for step in trace) > 0, "nobody waited for a slot"
    assert max(len({i[0] for i in step["items"]} - {None}) for step in trace) <= 2
    counters = few.engine.stats().adapters
    assert counters.num_slot_evictions > 0 and counters.num_host_evictions > 0    # host tier: 4 < 6
    assert counters.num_waiting_for_slot == 0 and counters.running_adapters == []


def test_n_siblings_with_an_adapter(lora_llm, adapters, jobs, alone):
    index = next(i for i, (name, _p) in enumerate(jobs) if name == "a1")
    name, prompt = jobs[index]
    params = SamplingParams(n=3, temperature=0, max_tokens=GREEDY.max_tokens, ignore_eos=True)
    out = lora_llm.generate([{"prompt_token_ids": prompt}], params, lora_request=LoRARequest(name, adapters[name]))[0]
    assert [o.token_ids for o in out.outputs] == [alone[index].token_ids] * 3
    sampled = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=8, ignore_eos=True)
    twice = [lora_llm.generate([{"prompt_token_ids": prompt}], sampled, lora_request=LoRARequest(name, adapters[name]))
             [0].outputs for _ in range(2)]
    assert [o.token_ids for o in twice[0]] == [o.token_ids for o in twice[1]]      # seeded: reproducible
    assert twice[0][0].token_ids != twice[0][1].token_ids                          # siblings differ
    lora_llm.engine.check_integrity()


def test_ngram_speculation_with_adapters(model_path, adapters, jobs, alone):
    spec = LLM(model_path, dtype="float32", enable_lora=True, max_loras=6, max_lora_rank=16, kv_cache_bytes=128 * 2**20,
               speculative="ngram")
    spec.engine.speculator.controller.adaptive = False          # speculate at full k every step
    outputs = spec.generate([{"prompt_token_ids": p} for _n, p in jobs], GREEDY,
                            lora_request=lora_requests(jobs, adapters))
    compare(alone, [o.outputs[0] for o in outputs])
    with_adapter = [o for o, (name, _p) in zip(outputs, jobs) if name]
    assert sum(o.num_draft_tokens for o in with_adapter) > 0
    assert sum(o.num_accepted_draft_tokens for o in with_adapter) > 0
    spec.engine.check_integrity()


# --------------------------------------------------------------- prefix cache
def cached(llm, prompt, lora) -> tuple[int, list[int]]:
    out = llm.generate([{"prompt_token_ids": prompt}], SHORT, lora_request=[lora])[0]
    return out.num_cached_tokens, out.outputs[0].token_ids


@pytest.fixture
def fresh_prompt(tokenizer):
    """A 50-odd-token prompt no other test runs (nothing cached for it yet)."""
    return tokenizer.encode(f"Fresh prompt {next(_ids)}: " + "a list of colours: red, green, blue, " * 5)


def test_prefix_cache_never_crosses_adapters(lora_llm, adapters, fresh_prompt):
    a0, a1 = (LoRARequest(n, adapters[n]) for n in ("a0", "a1"))
    assert cached(lora_llm, fresh_prompt, a0)[0] == 0
    assert cached(lora_llm, fresh_prompt, a1)[0] == 0          # same prompt, other adapter: no hit
    assert cached(lora_llm, fresh_prompt, None)[0] == 0        # nor the base
    hit, _tokens = cached(lora_llm, fresh_prompt, a0)
    assert hit >= len(fresh_prompt) // 16 * 16 - 16             # the same adapter does hit


def test_reloaded_name_never_hits_the_old_blocks(lora_llm, adapters, fresh_prompt, tmp_path):
    folder = str(tmp_path / "swap")
    shutil.copytree(adapters["a2"], folder)
    lora_llm.engine.load_adapter("swap", folder)
    assert cached(lora_llm, fresh_prompt, LoRARequest("swap", folder))[0] == 0
    shutil.rmtree(folder)
    shutil.copytree(adapters["a3"], folder)                     # other files, same path and name
    lora_llm.engine.unload_adapter("swap")
    lora_llm.engine.load_adapter("swap", folder)
    hit, tokens = cached(lora_llm, fresh_prompt, LoRARequest("swap", folder))
    assert hit == 0
    twin_hit, twin_tokens = cached(lora_llm, fresh_prompt, LoRARequest("a3", adapters["a3"]))
    assert twin_hit > 0 and twin_tokens == tokens               # identical content, other name: shared
    lora_llm.engine.unload_adapter("swap")


def test_load_lora_reloads_a_name_given_a_new_path(lora_llm, adapters, fresh_prompt):
    first = cached(lora_llm, fresh_prompt, LoRARequest("moving", adapters["a4"]))[1]
    loads = lora_llm.engine.stats().adapters.num_disk_loads
    again = cached(lora_llm, fresh_prompt, LoRARequest("moving", adapters["a4"]))
    assert lora_llm.engine.stats().adapters.num_disk_loads == loads         # same path: not read again
    assert again[0] > 0 and again[1] == first
    assert cached(lora_llm, fresh_prompt, LoRARequest("a4", adapters["a4"]))[1] == first
    moved = cached(lora_llm, fresh_prompt, LoRARequest("moving", adapters["a5"]))     # new path: reload
    assert lora_llm.engine.stats().adapters.num_disk_loads > loads
    assert moved[0] == 0 and moved[1] != first
    assert moved[1] == cached(lora_llm, fresh_prompt, LoRARequest("a5", adapters["a5"]))[1]
    listed = {a["name"]: a for a in lora_llm.engine.list_adapters()}
    assert listed["moving"]["path"] == adapters["a5"] and listed["moving"]["id"] == listed["a5"]["id"]
    lora_llm.engine.unload_adapter("moving")
