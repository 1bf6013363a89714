"""What the fleet must serve: a fixed context x concurrency, or traffic with SLOs."""
from __future__ import annotations

import math
from dataclasses import dataclass

from kvserve.planner.errors import ImpossibleInputError, PlannerInputError


@dataclass(frozen=True)
class LengthDist:
    """A token-length distribution summarised by mean and 99th percentile.

    Parsed from ``"512"`` (fixed), ``"16-1024"`` (uniform) or ``"512:4096"`` (mean:p99).
    """

    mean: float
    p99: float
    text: str

    @staticmethod
    def parse(text: str | int | float, param: str) -> "LengthDist":
        s = str(text).strip()
        try:
            if "-" in s:
                lo, hi = (float(x) for x in s.split("-", 1))
                if lo > hi:
                    raise ValueError
                return LengthDist((lo + hi) / 2, lo + 0.99 * (hi - lo), f"uniform {lo:g}-{hi:g}")
            if ":" in s:
                mean, p99 = (float(x) for x in s.split(":", 1))
                if p99 < mean:
                    raise ValueError
                return LengthDist(mean, p99, f"mean {mean:g}, p99 {p99:g}")
            value = float(s)
            return LengthDist(value, value, f"{value:g}")
        except ValueError as exc:
            raise PlannerInputError(f"--{param.replace('_', '-')} {s!r}: use N, LO-HI (uniform) or MEAN:P99",
                                    param=param) from exc


@dataclass(frozen=True)
class Workload:
    """Context mode: ``context`` tokens per sequence x ``concurrency`` sequences.
    Traffic mode (``rps`` set): requests/s with prompt/output lengths and SLOs."""

    context: int = 4096
    concurrency: int = 1
    prompt: LengthDist | None = None
    output: LengthDist | None = None
    rps: float | None = None
    peak_to_mean: float = 1.0
    ttft_p99_s: float | None = None
    tpot_s: float | None = None
    headroom: float = 0.2

    @property
    def traffic_mode(self) -> bool:
        return self.rps is not None

    def prompt_tokens(self) -> LengthDist:
        """Prompt lengths (context mode: the context minus a mean output, or the context)."""
        if self.prompt is not None:
            return self.prompt
        out = self.output.mean if self.output else 0
        value = max(1.0, self.context - out)
        return LengthDist(value, value, f"{value:g}")

    def output_tokens(self) -> LengthDist:
        return self.output or LengthDist(256, 256, "256")

    def validate(self, max_context: int) -> None:
        """Refuse impossible or meaningless workloads with a message naming the flag."""
        if self.context < 1 or self.concurrency < 1:
            raise PlannerInputError("--context and --concurrency must be at least 1", param="context")
        if self.context > max_context:
            raise ImpossibleInputError(f"--context {self.context:,} exceeds the model's context window of "
                                       f"{max_context:,} tokens", param="context")
        for name, dist in (("prompt_tokens", self.prompt), ("output_tokens", self.output)):
            if dist is not None and (dist.mean < 1 or not math.isfinite(dist.p99)):
                raise PlannerInputError(f"--{name.replace('_', '-')} must be at least 1 token", param=name)
        if self.rps is not None and not (self.rps > 0 and math.isfinite(self.rps)):
            raise PlannerInputError("--rps must be a positive number", param="rps")
        if self.peak_to_mean < 1:
            raise ImpossibleInputError("--peak-to-mean below 1: a peak cannot be under the mean",
                                       param="peak_to_mean")
        if not 0 <= self.headroom < 1:
            raise PlannerInputError("--headroom must be in [0, 1)", param="headroom")
        for name in ("ttft_p99_s", "tpot_s"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise PlannerInputError(f"{name} must be positive", param=name)


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding: acceptance rate ``alpha`` per drafted token, ``k`` drafted
    tokens per step, and ``draft_cost`` = one draft forward / one target decode step (c)."""

    alpha: float
    k: int
    draft_cost: float = 0.05

    def validate(self) -> None:
        if not 0 <= self.alpha <= 1:
            raise ImpossibleInputError(f"--spec-alpha {self.alpha} is not a probability in [0, 1]",
                                       param="spec_alpha")
        if self.k < 1:
            raise PlannerInputError("--spec-k must be at least 1", param="spec_k")
        if self.draft_cost < 0:
            raise PlannerInputError("--spec-draft-cost cannot be negative", param="spec_draft_cost")
