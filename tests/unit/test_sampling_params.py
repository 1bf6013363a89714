"""SamplingParams validation: every rejection is typed and names its field."""
from __future__ import annotations

import math

import pytest

from kvserve.errors import InvalidRequestError
from kvserve.sampling import MAX_LOGPROBS, MAX_N, MAX_STOP_STRINGS, SamplingParams

NAN = math.nan
INF = math.inf

INVALID = [
    # (field changes, expected .param)
    ({"n": 0}, "n"),
    ({"n": MAX_N + 1}, "n"),
    ({"n": 2.0}, "n"),
    ({"n": True}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -5}, "max_tokens"),
    ({"max_tokens": 3.5}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 17, "max_tokens": 16}, "min_tokens"),
    ({"min_tokens": 1.0}, "min_tokens"),
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": NAN}, "temperature"),
    ({"temperature": INF}, "temperature"),
    ({"temperature": "1"}, "temperature"),
    ({"temperature": True}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.01}, "top_p"),
    ({"top_p": -0.5}, "top_p"),
    ({"top_p": NAN}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": 1.5}, "top_k"),
    ({"top_k": False}, "top_k"),
    ({"min_p": -0.01}, "min_p"),
    ({"min_p": 1.5}, "min_p"),
    ({"min_p": NAN}, "min_p"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": -1.0}, "repetition_penalty"),
    ({"repetition_penalty": NAN}, "repetition_penalty"),
    ({"repetition_penalty": INF}, "repetition_penalty"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"presence_penalty": -2.01}, "presence_penalty"),
    ({"presence_penalty": NAN}, "presence_penalty"),
    ({"frequency_penalty": -3.0}, "frequency_penalty"),
    ({"frequency_penalty": NAN}, "frequency_penalty"),
    ({"frequency_penalty": None}, "frequency_penalty"),
    ({"logprobs": -1}, "logprobs"),
    ({"logprobs": MAX_LOGPROBS + 1}, "logprobs"),
    ({"logprobs": 2.0}, "logprobs"),
    ({"logprobs": True}, "logprobs"),
    ({"stop": ["x"] * (MAX_STOP_STRINGS + 1)}, "stop"),
    ({"stop": [""]}, "stop"),
    ({"stop": ["a" * 257]}, "stop"),
    ({"stop": [3]}, "stop"),
    ({"stop": {"a": 1}}, "stop"),
    ({"stop_token_ids": [1, -1]}, "stop_token_ids"),
    ({"stop_token_ids": [1.0]}, "stop_token_ids"),
    ({"stop_token_ids": [True]}, "stop_token_ids"),
    ({"stop_token_ids": 5}, "stop_token_ids"),
    ({"seed": 1.5}, "seed"),
    ({"seed": "7"}, "seed"),
    ({"seed": True}, "seed"),
    ({"ignore_eos": 1}, "ignore_eos"),
    ({"include_stop_str_in_output": "yes"}, "include_stop_str_in_output"),
    ({"skip_special_tokens": None}, "skip_special_tokens"),
]


@pytest.mark.parametrize("changes,param", INVALID, ids=[f"{p}-{i}" for i, (_, p) in enumerate(INVALID)])
def test_invalid_values_raise_with_param(changes, param):
    params = SamplingParams(**changes)  # building never raises
    with pytest.raises(InvalidRequestError) as info:
        params.validate()
    assert info.value.param == param
    assert param in info.value.message
    assert info.value.to_dict()["error"]["param"] == param


def test_defaults_are_vllm_compatible_and_valid():
    p = SamplingParams()
    p.validate()
    assert (p.n, p.max_tokens, p.min_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == \
        (1, 16, 0, 1.0, 1.0, 0, 0.0)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, 0.0)
    assert p.seed is None and p.stop is None and p.stop_token_ids is None and p.logprobs is None
    assert not p.ignore_eos and not p.include_stop_str_in_output and p.skip_special_tokens
    assert not p.is_greedy


@pytest.mark.parametrize("changes", [
    {"n": MAX_N}, {"max_tokens": None, "min_tokens": 1000}, {"max_tokens": 1},
    {"min_tokens": 16, "max_tokens": 16}, {"temperature": 0}, {"temperature": 2},
    {"top_p": 1}, {"top_p": 1e-6}, {"top_k": -1}, {"top_k": 50}, {"min_p": 0}, {"min_p": 1},
    {"repetition_penalty": 1.3}, {"presence_penalty": -2}, {"frequency_penalty": 2.0},
    {"seed": -3}, {"seed": 2**70}, {"logprobs": 0}, {"logprobs": MAX_LOGPROBS},
    {"stop": ["a" * 256] * MAX_STOP_STRINGS}, {"stop_token_ids": [0, 7]}, {"stop_token_ids": []},
])
def test_edge_values_are_accepted(changes):
    SamplingParams(**changes).validate()


def test_is_greedy_and_stop_string_normalised():
    assert SamplingParams(temperature=0.0).is_greedy
    assert not SamplingParams(temperature=1e-6).is_greedy
    assert SamplingParams(stop="###").stop == ["###"]


def test_clone_applies_changes_and_copies_lists():
    p = SamplingParams(stop=["a"], stop_token_ids=[1], seed=3)
    q = p.clone(temperature=0.0)
    assert q.temperature == 0.0 and q.seed == 3 and p.temperature == 1.0
    q.stop.append("b")
    q.stop_token_ids.append(2)
    assert p.stop == ["a"] and p.stop_token_ids == [1]
    with pytest.raises(TypeError):
        p.clone(not_a_field=1)
