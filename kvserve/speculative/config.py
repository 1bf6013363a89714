"""Speculative decoding settings and the ``--speculative`` spelling."""
from __future__ import annotations

from dataclasses import dataclass

from kvserve.errors import InvalidRequestError

METHODS = ("ngram", "draft", "self")        # the registry's names (kvserve.speculative.registry)


@dataclass(frozen=True)
class SpeculativeConfig:
    """How the engine speculates.

    - ``method``: ``"ngram"`` (prompt lookup), ``"draft"`` (a separate draft model
      sharing the target's tokenizer, ``draft_model`` = .gguf or HF folder, its own
      KV indexed by the same block ids) or ``"self"`` (the target's first
      ``draft_layers`` layers plus its final norm and head, reading the target's own
      KV for those layers).
    - ``num_speculative_tokens``: the most draft tokens per sequence per step (k_max).
    - ``ngram_max`` / ``ngram_min``: longest and shortest suffix the n-gram proposer matches.
    - ``min_gain``: speculate in a step only if the step-time model predicts at least
      ``1 + min_gain`` times the tokens per second of not speculating.
    - ``max_batch_size``: never speculate when more sequences than this decode in a
      step (``None``: the step-time model alone decides).
    - ``adaptive``: False = every eligible sequence takes ``num_speculative_tokens``
      every step, whatever the cost model predicts (fixed-k speculation).
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    draft_model: str | None = None
    draft_layers: int | None = None
    ngram_max: int = 4
    ngram_min: int = 1
    min_gain: float = 0.05
    max_batch_size: int | None = None
    adaptive: bool = True

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise InvalidRequestError(f"speculative method must be one of {METHODS}, got {self.method!r}",
                                      param="speculative")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise InvalidRequestError("num_speculative_tokens must be in [1, 16]",
                                      param="num_speculative_tokens")
        if self.method == "draft" and not self.draft_model:
            raise InvalidRequestError("draft speculation needs a draft model: draft:<path>", param="speculative")
        if self.method == "self" and (self.draft_layers is None or self.draft_layers < 1):
            raise InvalidRequestError("self speculation needs a layer count >= 1: self:<layers>",
                                      param="speculative")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise InvalidRequestError("need 1 <= ngram_min <= ngram_max", param="ngram_min")
        if not self.min_gain >= 0.0:
            raise InvalidRequestError("min_gain must be >= 0", param="min_gain")

    @classmethod
    def parse(cls, spec: str, **overrides) -> "SpeculativeConfig":
        """``ngram``, ``draft:<model path>`` or ``self:<layers>`` (the CLI spelling)."""
        method, _, arg = spec.partition(":")
        if method == "ngram" and not arg:
            return cls(method="ngram", **overrides)
        if method == "draft" and arg:
            return cls(method="draft", draft_model=arg, **overrides)
        if method == "self" and arg.isdigit():
            return cls(method="self", draft_layers=int(arg), **overrides)
        raise InvalidRequestError(f"--speculative must be ngram, draft:<model> or self:<layers>; got {spec!r}",
                                  param="speculative")


def speculative_config(value) -> SpeculativeConfig | None:
    """``EngineConfig.speculative`` as a SpeculativeConfig: None or "" (off), a
    SpeculativeConfig, a dict of its fields, or the CLI spelling."""
    if value is None or value == "" or isinstance(value, SpeculativeConfig):
        return value or None
    if isinstance(value, dict):
        return SpeculativeConfig(**value)
    return SpeculativeConfig.parse(str(value))
