"""Tier 2: bad input raises a typed error with a clear message, and leaves nothing behind."""
from __future__ import annotations

import pytest

from kvserve import LLM
from kvserve.errors import ContextLengthExceededError, InvalidRequestError, ModelLoadError
from kvserve.sampling.params import SamplingParams

pytestmark = pytest.mark.model


@pytest.mark.parametrize("params, param", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=-3), "max_tokens"),
    (dict(temperature=-0.5), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(n=0), "n"),
])
def test_invalid_sampling_params(llm, params, param):
    with pytest.raises(InvalidRequestError) as info:
        llm.generate("Hello", SamplingParams(**params))
    assert info.value.param == param
    assert param in info.value.message
    assert not llm.engine.has_unfinished()


def test_prompt_longer_than_context(llm):
    too_long = [100] * (llm.engine.max_model_len + 5)
    with pytest.raises(ContextLengthExceededError) as info:
        llm.generate([too_long], SamplingParams(max_tokens=1))
    assert info.value.code == "context_length_exceeded"
    assert str(llm.engine.max_model_len) in info.value.message


def test_prompt_plus_max_tokens_beyond_context_is_not_clamped(llm):
    prompt = [100] * (llm.engine.max_model_len - 10)
    with pytest.raises(ContextLengthExceededError) as info:
        llm.generate([prompt], SamplingParams(max_tokens=20))
    assert info.value.param == "max_tokens"


def test_one_bad_request_rejects_the_batch_without_side_effects(llm):
    with pytest.raises(InvalidRequestError):
        llm.generate(["fine", "also fine"], [SamplingParams(max_tokens=2), SamplingParams(top_p=2.0)])
    assert not llm.engine.has_unfinished()
    assert llm.engine.block_pool.num_used_blocks == 0


@pytest.mark.parametrize("prompt", [[], [-1, 5], [10**9]])
def test_bad_token_ids(llm, prompt):
    with pytest.raises(InvalidRequestError):
        llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=2))


def test_corrupt_gguf(tmp_path, model_path):
    corrupt = tmp_path / "corrupt.gguf"
    with open(model_path, "rb") as src, open(corrupt, "wb") as dst:
        dst.write(src.read(2 * 2**20))          # header and a little data, then nothing
    with pytest.raises(ModelLoadError):
        LLM(str(corrupt))
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a gguf file at all" * 100)
    with pytest.raises(ModelLoadError):
        LLM(str(garbage))


def test_engine_still_works_after_errors(llm):
    out = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=4))
    assert len(out[0].outputs[0].token_ids) == 4
