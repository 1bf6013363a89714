"""Tier 2: the offline API's shapes, prompt kinds, stop strings and logprobs."""
from __future__ import annotations

import pytest

from kvserve.sampling.params import SamplingParams

pytestmark = pytest.mark.model


def test_prompt_kinds_give_the_same_tokens(llm, tokenizer):
    text = "The capital of France is"
    ids = tokenizer.encode(text)
    greedy = SamplingParams(temperature=0, max_tokens=8)
    by_text, by_ids, by_dict = llm.generate([text, {"prompt_token_ids": ids}, {"prompt": text}], greedy)
    assert by_text.prompt_token_ids == ids and by_text.prompt == text
    assert by_text.outputs[0].token_ids == by_ids.outputs[0].token_ids == by_dict.outputs[0].token_ids
    assert by_text.outputs[0].text == tokenizer.decode(by_text.outputs[0].token_ids)


def test_chat_messages(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=24))[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"          # the model ends its turn


def test_stop_string_truncates_and_finishes(llm):
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    full = llm.generate("1, 2, 3, 4, 5,", greedy)[0].outputs[0]
    assert " 9" in full.text
    stopped = llm.generate("1, 2, 3, 4, 5,", greedy.clone(stop=[" 9"]))[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == " 9"
    assert stopped.text == full.text[:full.text.index(" 9")]
    assert len(stopped.token_ids) < len(full.token_ids)
    assert llm.engine.block_pool.num_used_blocks == 0


def test_stop_token_ids_min_tokens_and_length(llm, tokenizer):
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    full = llm.generate("Once upon a time", greedy)[0].outputs[0]
    stop_id = full.token_ids[3]
    stopped = llm.generate("Once upon a time", greedy.clone(stop_token_ids=[stop_id]))[0].outputs[0]
    assert stopped.token_ids == full.token_ids[:full.token_ids.index(stop_id) + 1]
    assert stopped.finish_reason == "stop"
    assert full.finish_reason == "length" and len(full.token_ids) == 12
    eos_first = llm.chat([{"role": "user", "content": "Say OK."}],
                         SamplingParams(temperature=0, max_tokens=30, min_tokens=20))[0].outputs[0]
    assert len(eos_first.token_ids) >= 20


def test_logprobs_shape(llm):
    out = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=5, logprobs=3))[0].outputs[0]
    assert len(out.logprobs) == 5
    for token, entry in zip(out.token_ids, out.logprobs):
        assert token in entry and len(entry) >= 3
        assert entry[token] == max(entry.values())           # greedy picks the best
    assert out.cumulative_logprob == pytest.approx(sum(e[t] for t, e in zip(out.token_ids, out.logprobs)))



def test_the_step_clock_counts_the_steps_wall_and_cpu(llm):
    import torch
    before = llm.engine.stats()
    llm.generate("Count to ten:", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    after = llm.engine.stats()
    assert after.num_steps - before.num_steps >= 8
    wall = after.step_seconds - before.step_seconds
    cpu = after.step_cpu_seconds - before.step_cpu_seconds
    # every step was timed; the process's CPU in them is at most its threads' worth of the wall
    assert wall > 0 and 0 < cpu <= wall * (torch.get_num_threads() + 1) + 0.05
