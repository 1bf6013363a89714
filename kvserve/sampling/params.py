"""Per-request sampling parameters (vLLM-compatible names and defaults).

A ``SamplingParams`` is built by an API layer (or by a user of ``LLM``) and then
checked once with :meth:`SamplingParams.validate`, which the engine calls before
admitting the request. Building never raises, so API layers can construct,
adjust and then validate; every rejection is an
:class:`~kvserve.errors.InvalidRequestError` whose ``param`` names the field.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from kvserve.errors import InvalidRequestError

MAX_N = 16
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_ABS_PENALTY = 2.0
MAX_LOGIT_BIAS = 300            # entries in one logit_bias map (OpenAI's limit)
MAX_ABS_LOGIT_BIAS = 100.0      # each bias lies in [-100, 100] (OpenAI's range)


def _is_int(value: Any) -> bool:
    """True for a Python int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    """True for a Python int or float that is not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _fail(param: str, message: str) -> None:
    raise InvalidRequestError(message, param=param)


@dataclass
class SamplingParams:
    """How to pick the tokens of one request.

    Fields follow vLLM's ``SamplingParams``:

    - ``n``: completions per prompt (siblings share the prompt, sample independently).
    - ``max_tokens``: most tokens to generate; ``None`` = up to the context limit.
    - ``min_tokens``: EOS and ``stop_token_ids`` are masked until this many tokens exist.
    - ``temperature``: 0 means greedy (argmax); otherwise logits are divided by it.
    - ``top_p`` / ``top_k`` / ``min_p``: nucleus, top-k (0 or -1 = off) and min-p filters.
    - ``repetition_penalty``: HF/vLLM semantics over prompt + output tokens; positive
      logits are divided by it, negative ones multiplied.
    - ``presence_penalty`` / ``frequency_penalty``: OpenAI semantics over output tokens.
    - ``seed``: makes the request's draws reproducible whatever else is batched with it.
    - ``stop`` / ``stop_token_ids`` / ``include_stop_str_in_output`` / ``ignore_eos``:
      stopping rules, applied by the scheduler/detokeniser (not the sampler).
    - ``logprobs``: ``None`` = off; ``k >= 0`` = the chosen token's logprob plus the
      top-k alternatives, all under the model's raw distribution.
    - ``prompt_logprobs``: ``None`` = off; ``k >= 0`` = each prompt token's logprob (given
      the tokens before it) plus the top-k alternatives; the first token has none.
      Such a request bypasses the prefix cache (a cached prefix is never recomputed).
    - ``skip_special_tokens``: detokeniser option.
    - ``logit_bias``: ``{token id: bias}`` (OpenAI semantics, at most ``MAX_LOGIT_BIAS``
      entries, each bias in [-100, 100]); the bias is added to the model's logits before
      the penalties and the ``min_tokens`` mask. +100 all but forces a token, -100 all but
      bans it. Logprobs stay those of the raw model distribution.
    """

    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None

    def __post_init__(self) -> None:
        # Normalise harmless spellings only (a lone stop string, tuples); never raise here.
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, tuple):
            self.stop = list(self.stop)
        if isinstance(self.stop_token_ids, tuple):
            self.stop_token_ids = list(self.stop_token_ids)

    # ------------------------------------------------------------------ queries
    @property
    def is_greedy(self) -> bool:
        """True when tokens are chosen by argmax (``temperature == 0``)."""
        return self.temperature == 0

    @property
    def top_k_enabled(self) -> bool:
        """True when top-k filtering applies (``top_k > 0``)."""
        return self.top_k > 0

    @property
    def has_logit_bias(self) -> bool:
        """True when ``logit_bias`` holds at least one entry."""
        return bool(self.logit_bias)

    @property
    def has_penalties(self) -> bool:
        """True when any of the three penalties changes the logits."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    def clone(self, **changes: Any) -> "SamplingParams":
        """A copy with ``changes`` applied; list fields are copied, not shared."""
        new = dataclasses.replace(self, **changes)
        if new.stop is not None and new.stop is self.stop:
            new.stop = list(new.stop)
        if new.stop_token_ids is not None and new.stop_token_ids is self.stop_token_ids:
            new.stop_token_ids = list(new.stop_token_ids)
        if new.logit_bias is not None and new.logit_bias is self.logit_bias:
            new.logit_bias = dict(new.logit_bias)
        return new

    # --------------------------------------------------------------- validation
    def validate(self) -> None:
        """Check every field; raise ``InvalidRequestError(message, param=field)`` on the first bad one.

        Does not know the model: vocabulary bounds of ``stop_token_ids`` and
        ``logit_bias`` and the context limit for ``max_tokens`` are the engine's to check.
        """
        self._validate_counts()
        self._validate_distribution()
        self._validate_penalties()
        self._validate_stops()
        self._validate_logit_bias()
        self._validate_misc()

    def _validate_counts(self) -> None:
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            _fail("n", f"n must be an integer in [1, {MAX_N}], got {self.n!r}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens <= 0):
            _fail("max_tokens", f"max_tokens must be a positive integer or null, got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            _fail("min_tokens", f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            _fail("min_tokens", f"min_tokens ({self.min_tokens}) must not exceed "
                                f"max_tokens ({self.max_tokens})")

    def _validate_distribution(self) -> None:
        t = self.temperature
        if not _is_number(t) or not math.isfinite(t) or t < 0:
            _fail("temperature", f"temperature must be a finite number >= 0, got {t!r}")
        p = self.top_p
        if not _is_number(p) or not 0 < p <= 1:  # NaN fails the comparison
            _fail("top_p", f"top_p must be a number in (0, 1], got {p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            _fail("top_k", f"top_k must be an integer >= -1 (0 or -1 disables it), got {self.top_k!r}")
        m = self.min_p
        if not _is_number(m) or not 0 <= m <= 1:
            _fail("min_p", f"min_p must be a number in [0, 1], got {m!r}")

    def _validate_penalties(self) -> None:
        r = self.repetition_penalty
        if not _is_number(r) or not math.isfinite(r) or r <= 0:
            _fail("repetition_penalty", f"repetition_penalty must be a finite number > 0, got {r!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_number(v) or not -MAX_ABS_PENALTY <= v <= MAX_ABS_PENALTY:
                _fail(name, f"{name} must be a number in [-{MAX_ABS_PENALTY:g}, "
                            f"{MAX_ABS_PENALTY:g}], got {v!r}")

    def _validate_stops(self) -> None:
        if self.stop is not None:
            if not isinstance(self.stop, list):
                _fail("stop", f"stop must be a string, a list of strings or null, got {type(self.stop).__name__}")
            if len(self.stop) > MAX_STOP_STRINGS:
                _fail("stop", f"stop accepts at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
            for s in self.stop:
                if not isinstance(s, str) or not 1 <= len(s) <= MAX_STOP_STRING_CHARS:
                    _fail("stop", f"each stop string must be a non-empty string of at most "
                                  f"{MAX_STOP_STRING_CHARS} characters, got {s!r:.80}")
        if self.stop_token_ids is not None:
            if not isinstance(self.stop_token_ids, list):
                _fail("stop_token_ids", "stop_token_ids must be a list of integers >= 0 or null, "
                                        f"got {type(self.stop_token_ids).__name__}")
            for tid in self.stop_token_ids:
                if not _is_int(tid) or tid < 0:
                    _fail("stop_token_ids", f"stop_token_ids must be integers >= 0, got {tid!r}")

    def _validate_logit_bias(self) -> None:
        bias = self.logit_bias
        if bias is None:
            return
        if not isinstance(bias, dict):
            _fail("logit_bias", "logit_bias must be a map from token ids to biases or null, "
                                f"got {type(bias).__name__}")
        if len(bias) > MAX_LOGIT_BIAS:
            _fail("logit_bias", f"logit_bias accepts at most {MAX_LOGIT_BIAS} entries, got {len(bias)}")
        for tid, value in bias.items():
            if not _is_int(tid) or tid < 0:
                _fail("logit_bias", f"logit_bias keys must be token ids (integers >= 0), got {tid!r:.40}")
            if (not _is_number(value) or not math.isfinite(value)
                    or not -MAX_ABS_LOGIT_BIAS <= value <= MAX_ABS_LOGIT_BIAS):
                _fail("logit_bias", f"logit_bias values must be numbers in [-{MAX_ABS_LOGIT_BIAS:g}, "
                                    f"{MAX_ABS_LOGIT_BIAS:g}], got {value!r:.40} for token {tid}")

    def _validate_misc(self) -> None:
        if self.seed is not None and not _is_int(self.seed):
            _fail("seed", f"seed must be an integer or null, got {self.seed!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            _fail("logprobs", f"logprobs must be an integer in [0, {MAX_LOGPROBS}] or null, "
                              f"got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (not _is_int(self.prompt_logprobs)
                                                 or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            _fail("prompt_logprobs", f"prompt_logprobs must be an integer in [0, {MAX_LOGPROBS}] or null, "
                                     f"got {self.prompt_logprobs!r}")
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                _fail(name, f"{name} must be a boolean, got {getattr(self, name)!r}")
