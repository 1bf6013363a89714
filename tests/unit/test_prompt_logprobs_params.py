"""Tier 1: prompt_logprobs validation (the values against HF: tests/model/test_prompt_logprobs.py)."""
from __future__ import annotations

import pytest

from kvserve.sampling.params import SamplingParams


def test_prompt_logprobs_validation():
    from kvserve.errors import InvalidRequestError
    for bad in (-1, 21, 1.5, True):
        with pytest.raises(InvalidRequestError) as err:
            SamplingParams(prompt_logprobs=bad).validate()
        assert err.value.param == "prompt_logprobs"
