"""The cluster check's requests sized to the host, so that its time scales hold on every host.

The check against the local cluster (``benchmarks/fleet_sim_cluster.py``) has time scales that do
not move with the host: Ray's scaling decisions every ~6 s, 5 s demand windows, a replica start
of 8-18 s, a 135 s trace in phases of 35, 40 and 60 s, a probe stream of ten requests 0.25 s apart.
Its loads are fractions of one replica's planned capacity, so the autoscaler's decisions do
not move with the host either; but the number of requests in the trace does. With requests of
128 / 24 tokens a replica on the AVX-512 Xeon served 1.5-1.8 of them a second (69-81 in the
trace); on the AVX2 EPYC, three times slower, 0.57 (22-33), where the p99 is one request and
the probe's stream alone, 17 s of one replica's work, scaled the cluster up before the trace.

``shape_for_host`` shortens the prompts and outputs on a slow host, both by one factor, until a
request costs one replica ``1 / REFERENCE_REQUESTS_PER_S`` seconds at the planned capacity: the
trace holds as many requests and the probe's stream as much work, in replica-seconds, as on the
host the check was set on. It never lengthens them (a faster host keeps 128 / 24 and more
requests), and stops at ``MIN_SCALE``, where outputs of a few tokens would leave TPOT unmeasured.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

REFERENCE_LENGTHS = (128, 24)        # the trace's mean prompt / output tokens the check was set on
REFERENCE_REQUESTS_PER_S = 1.6       # ... and one replica's rate of them there (1.5-1.8 on the Xeon)
MIN_SCALE = 0.25                     # outputs of 6 tokens on the mean, prompts of 32
SINGLES_GAP_S = 3.0                  # the probe's one-at-a-time requests' spacing at scale 1


@dataclass(frozen=True)
class TraceShape:
    """The check's request lengths: the mean prompt and output tokens of the trace (and of the
    probe's stream), ``scale`` of ``REFERENCE_LENGTHS``; ``seconds_per_request``, what one such
    request costs a replica at its planned capacity."""

    prompt_tokens: int
    output_tokens: int
    scale: float
    seconds_per_request: float

    @property
    def singles_gap_s(self) -> float:
        """The spacing of the probe's one-at-a-time requests (``host_fit.probe_trace``), stretched
        as the outputs shrink: a slower host takes longer over each of its fixed prompts."""
        return SINGLES_GAP_S / self.scale

    def as_dict(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "output_tokens": self.output_tokens,
                "scale": round(self.scale, 3), "seconds_per_request": round(self.seconds_per_request, 4)}


def lengths_at(scale: float) -> tuple[int, int]:
    """``REFERENCE_LENGTHS`` times ``scale``, rounded, at least 8 prompt and 2 output tokens."""
    prompt, output = REFERENCE_LENGTHS
    return max(8, round(prompt * scale)), max(2, round(output * scale))


def shape_for_host(seconds_per_request: Callable[[int, int], float],
                   target_s: float = 1.0 / REFERENCE_REQUESTS_PER_S, iterations: int = 4) -> TraceShape:
    """The lengths at which a request costs a replica ``target_s`` (or as near as ``MIN_SCALE``
    allows): ``seconds_per_request(prompt, output)`` is the planned cost, ``prompt / C_p + output
    / C_d`` with the capacity planned at those lengths, so it is not proportional to them (a
    short prompt prefills at a lower rate); a few fixed-point steps on the scale settle it."""
    scale = 1.0
    cost = seconds_per_request(*lengths_at(scale))
    for _ in range(iterations):
        if cost <= target_s * 1.02 and (scale >= 1.0 or cost >= target_s * 0.98):
            break
        scale = min(1.0, max(MIN_SCALE, scale * target_s / cost))
        cost = seconds_per_request(*lengths_at(scale))
        if scale == MIN_SCALE:
            break
    return TraceShape(*lengths_at(scale), scale, cost)
