"""Sampling: per-request parameters (``params``, pure Python) and the batched sampler
(``sampler``, torch). The sampler's names load lazily, so code that only needs
``SamplingParams`` (the scheduler, the HTTP process) never imports torch."""
from __future__ import annotations

from kvserve.sampling.params import (MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_N,
                                     MAX_STOP_STRINGS, SamplingParams)

_SAMPLER_NAMES = ("Sampler", "SamplerOutput", "SamplingRow", "apply_logit_bias", "apply_penalties",
                  "process_logits")

__all__ = ["MAX_LOGIT_BIAS", "MAX_LOGPROBS", "MAX_N", "MAX_STOP_STRINGS", "SamplingParams", *_SAMPLER_NAMES]


def __getattr__(name: str):
    if name in _SAMPLER_NAMES:
        from kvserve.sampling import sampler
        return getattr(sampler, name)
    raise AttributeError(name)
