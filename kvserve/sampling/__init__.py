"""Sampling: per-request parameters and the batched sampler."""
from __future__ import annotations

from kvserve.sampling.params import (MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_N,
                                     MAX_STOP_STRINGS, SamplingParams)
from kvserve.sampling.sampler import (Sampler, SamplerOutput, SamplingRow,
                                      apply_logit_bias, apply_penalties, process_logits)

__all__ = [
    "MAX_LOGIT_BIAS", "MAX_LOGPROBS", "MAX_N", "MAX_STOP_STRINGS", "SamplingParams",
    "Sampler", "SamplerOutput", "SamplingRow", "apply_logit_bias", "apply_penalties",
    "process_logits",
]
