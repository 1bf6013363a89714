"""Records and summaries of the ghost-text workload (``kvserve bench --workload ghost``).

Pure functions, testable without a server:

- :func:`parse_server_timing`: the server's ``Server-Timing`` header
  (``queue;dur=12.3, prefill;dur=45.6, ttft;dur=57.9, total;dur=120.4``, ms) as a dict;
- :func:`record_phases`: where one completed request's time went: ``queue``, ``prefill``
  (from the header), ``decode`` = total - ttft, ``client_overhead`` = client e2e - server total;
- :func:`summarize_ghost`: the JSON summary of a run: requests sent / completed / cancelled,
  cancellations per second, TTFT and e2e of completed requests, the latency budget spent
  phase by phase, goodput (completed requests within the budget) and the cached-token fraction.

A request completes only if it beats the typist's next keystroke, so completed requests'
latencies are censored by the pauses: when the server is slower than most pauses, e2e p99
of completed requests understates it. ``goodput.fraction_of_waited`` does not have that
bias: of the requests the typist waited at least the budget for (the next keystroke came
later, or never), the fraction answered within the budget.
"""
from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

from kvserve.loadgen.report import distribution, percentile

PHASES = ("queue", "prefill", "decode", "client_overhead")
_METRIC_SPLIT = re.compile(r',(?=(?:[^"]*"[^"]*")*[^"]*$)')      # commas outside quoted strings


@dataclass
class GhostRecord:
    """One inline-completion request, times in seconds of ``time.perf_counter``."""

    typist: int
    seq: int                                  # keystroke number of this typist
    start: float
    end: float = 0.0
    prompt_chars: int = 0
    cancelled: bool = False                   # a later keystroke (or the run's end) closed it
    error: str | None = None
    first_chunk: float | None = None          # streamed requests only
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    server_timing: dict[str, float] = field(default_factory=dict)   # ms, from Server-Timing
    gap_s: float | None = None                # planned time to the typist's next keystroke (None: last)

    @property
    def completed(self) -> bool:
        return not self.cancelled and self.error is None and self.end > 0

    @property
    def e2e_s(self) -> float:
        return self.end - self.start

    @property
    def ttft_s(self) -> float | None:
        return self.first_chunk - self.start if self.first_chunk is not None else None


def parse_server_timing(value: str | None) -> dict[str, float]:
    """``Server-Timing`` metrics with a numeric ``dur`` as ``{name: ms}``; {} when absent.

    Tolerates spaces, a ``desc`` parameter (quoted, commas inside), metrics without ``dur``
    (left out) and unparsable durations (left out); a repeated name keeps its last value."""
    out: dict[str, float] = {}
    if not value:
        return out
    for metric in _METRIC_SPLIT.split(value):
        name, *params = (part.strip() for part in metric.split(";"))
        if not name:
            continue
        for param in params:
            key, _, raw = param.partition("=")
            if key.strip().lower() != "dur":
                continue
            try:
                out[name] = float(raw.strip().strip('"'))
            except ValueError:
                pass
    return out


def record_phases(record: GhostRecord) -> dict[str, float]:
    """The phases (ms) of one completed request that its Server-Timing allows: ``queue``,
    ``prefill``, ``decode`` (total - ttft), ``client_overhead`` (client e2e - server total)."""
    timing = record.server_timing
    phases = {name: timing[name] for name in ("queue", "prefill") if name in timing}
    if "total" in timing and "ttft" in timing:
        phases["decode"] = timing["total"] - timing["ttft"]
    if "total" in timing:
        phases["client_overhead"] = record.e2e_s * 1000 - timing["total"]
    return phases


def _brief(values: list[float], budget_ms: float) -> dict:
    """count, mean, p50, p99 (ms) and the mean's share of the budget."""
    if not values:
        return {"count": 0}
    mean = sum(values) / len(values)
    return {"count": len(values), "mean": mean, "p50": percentile(values, 50), "p99": percentile(values, 99),
            "mean_share_of_budget": mean / budget_ms if budget_ms else None}


def budget_breakdown(completed: list[GhostRecord], budget_ms: float) -> dict:
    """The budget spent phase by phase over completed requests (only those whose header
    names the phase count towards it)."""
    per_phase: dict[str, list[float]] = {name: [] for name in PHASES}
    for record in completed:
        for name, value in record_phases(record).items():
            per_phase[name].append(value)
    out = {"budget_ms": budget_ms, "server_timing_present": sum(1 for r in completed if r.server_timing)}
    out.update({name: _brief(values, budget_ms) for name, values in per_phase.items()})
    return out


def e2e_for_outputs_at_most(records: list[GhostRecord], max_tokens: int) -> dict:
    """e2e (ms) of completed requests that produced at most ``max_tokens`` tokens."""
    return distribution([r.e2e_s for r in records if r.completed and r.completion_tokens is not None
                         and r.completion_tokens <= max_tokens])


def cached_fraction(completed: list[GhostRecord]) -> float | None:
    """Prompt tokens served by the prefix cache / prompt tokens, over completed requests."""
    with_usage = [r for r in completed if r.prompt_tokens]
    prompt = sum(r.prompt_tokens for r in with_usage)
    return sum(r.cached_tokens or 0 for r in with_usage) / prompt if prompt else None


def summarize_ghost(records: list[GhostRecord], budget_ms: float = 200.0) -> dict:
    """The JSON summary of one ghost run (times in ms, rates per second of the run)."""
    completed = [r for r in records if r.completed]
    cancelled = [r for r in records if r.cancelled]
    errors = Counter(r.error for r in records if r.error is not None and not r.cancelled)
    duration = (max(r.end for r in records) - min(r.start for r in records)) if records else 0.0
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)
    within = [r for r in completed if r.e2e_s * 1000 <= budget_ms]
    waited = [r for r in records if r.gap_s is None or r.gap_s * 1000 >= budget_ms]      # errors count as misses
    waited_within = [r for r in waited if r.completed and r.e2e_s * 1000 <= budget_ms]
    server_ttft = [r.server_timing["ttft"] / 1000 for r in completed if "ttft" in r.server_timing]
    return {
        "num_requests": len(records),
        "num_completed": len(completed),
        "num_cancelled": len(cancelled),
        "num_errors": sum(errors.values()),
        "errors": dict(sorted(errors.items())),
        "duration_s": duration,
        "requests_per_s": per_s(len(records)),
        "cancellations_per_s": per_s(len(cancelled)),
        "completed_per_s": per_s(len(completed)),
        "ttft_ms": distribution([r.ttft_s for r in completed if r.ttft_s is not None]),
        "server_ttft_ms": distribution(server_ttft),
        "e2e_ms": distribution([r.e2e_s for r in completed]),
        "e2e_ms_outputs_le_8": e2e_for_outputs_at_most(completed, 8),
        "e2e_ms_outputs_le_16": e2e_for_outputs_at_most(completed, 16),
        "budget": budget_breakdown(completed, budget_ms),
        "goodput": {"budget_ms": budget_ms, "fraction": len(within) / len(completed) if completed else 0.0,
                    "requests_per_s": per_s(len(within)), "num_waited": len(waited),
                    "fraction_of_waited": len(waited_within) / len(waited) if waited else 0.0},
        "prompt_tokens": distribution([float(r.prompt_tokens) for r in completed if r.prompt_tokens], scale=1.0),
        "output_tokens": sum(r.completion_tokens or 0 for r in completed),
        "cached_token_fraction": cached_fraction(completed),
    }


def format_ghost_line(summary: dict) -> str:
    """One human-readable line of a ghost summary."""
    def g(key, p):
        v = summary[key].get(p)
        return f"{v:.0f}" if v is not None else "-"
    cached = summary["cached_token_fraction"]
    return (f"ghost: sent {summary['num_requests']} completed {summary['num_completed']} "
            f"cancelled {summary['num_cancelled']} ({summary['cancellations_per_s']:.1f}/s) errors "
            f"{summary['num_errors']}; e2e p50 {g('e2e_ms', 'p50')} p99 {g('e2e_ms', 'p99')} ms; "
            f"within {summary['goodput']['budget_ms']:.0f} ms {summary['goodput']['fraction']:.0%}; "
            f"cached {'-' if cached is None else f'{cached:.0%}'}")
