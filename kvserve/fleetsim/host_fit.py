"""The host as a running cluster's engines see it: how much slower they step than the profile,
and what the serving path adds to every first token.

``kvserve profile`` times the engine alone. Inside the local Ray cluster the same engine shares
the host with its replica actor, the ingress, Ray's proxy and Ray's own processes, and every
streamed token crosses those processes: on a two-core machine its steps run slower than the
profile says, and every request's first token pays the hops. Both are measured in place, before
a trace, by a probe through the running cluster (``probe_trace``: requests one at a time, then a
full batch at once) that the simulator also plays:

- ``slowdown`` = the one-at-a-time requests' median TPOT measured / simulated on the profile
  (the step times' factor: every rate of the hardware entry divided by it, ``slowed``);
- ``seq_extra_s`` = what each sequence of a step costs beyond the profile's figure, from the
  batch's median TPOT (``kvserve profile --quick`` fits its per-sequence cost on short contexts,
  and an error there is an error on every step of a busy replica); the two are solved together;
- ``path_latency_s`` = the median of (measured TTFT - simulated TTFT on the fitted entry) over
  the one-at-a-time requests (no queueing on either side): the ingress / proxy / actor hops.

The simulator then plays the trace on the fitted entry, its requests reaching the replica
``path_latency_s`` after they are sent (``cluster_check.simulate_autoscaled``). The fit reads the
probe only, never the trace it is compared with.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import numpy as np

from kvserve.fleetsim.log import RequestLog
from kvserve.planner.hardware import HardwareSpec


def probe_trace(batch: int, prompt_tokens: int = 128, output_tokens: int = 24, one_at_a_time: int = 4,
                gap_s: float = 3.0) -> RequestLog:
    """``one_at_a_time`` requests ``gap_s`` apart (each done before the next is sent), then
    ``batch`` requests at once; all of ``prompt_tokens`` / ``output_tokens``."""
    arrivals = [i * gap_s for i in range(one_at_a_time)] + [one_at_a_time * gap_s] * batch
    n = len(arrivals)
    return RequestLog(arrivals, [0] * n, [0] * n, [prompt_tokens] * n, [output_tokens] * n)


def slowed(hw: HardwareSpec, factor: float, seq_extra_s: float = 0.0) -> HardwareSpec:
    """``hw`` with every rate divided by ``factor`` and every host overhead multiplied by it, and
    ``seq_extra_s`` more per sequence in a step."""
    return dataclasses.replace(
        hw, name=f"{hw.name} (x{factor:.2f} slower in place)", mem_bandwidth=hw.mem_bandwidth / factor,
        flops={k: v / factor for k, v in hw.flops.items()}, step_overhead_s=hw.step_overhead_s * factor,
        seq_overhead_s=hw.seq_overhead_s * factor + seq_extra_s, request_overhead_s=hw.request_overhead_s * factor)


@dataclass(frozen=True)
class HostFit:
    """The probe's fit (the module docstring); the medians it came from, in seconds."""

    slowdown: float
    seq_extra_s: float
    path_latency_s: float
    measured_tpot_s: float          # one-at-a-time requests
    profile_tpot_s: float           # the same, simulated on the profile
    measured_batch_tpot_s: float    # the batch's requests
    fitted_batch_tpot_s: float      # the same, simulated on the fit
    measured_ttft_s: float          # one-at-a-time requests
    slowed_ttft_s: float            # the same, simulated on the fit

    def as_dict(self) -> dict:
        return {k: round(v, 5) for k, v in dataclasses.asdict(self).items()}


def _tpot(log: RequestLog, one_at_a_time: int) -> tuple[float, float]:
    """Median TPOT of the one-at-a-time requests and of the batch."""
    tpot = log.arrays()["tpot_s"]
    return float(np.median(tpot[:one_at_a_time])), float(np.median(tpot[one_at_a_time:]))


def fit_host(measured: RequestLog, simulate: Callable[[float, float], RequestLog], one_at_a_time: int,
             rounds: int = 3) -> HostFit:
    """Fit ``HostFit`` from the probe's measured log and ``simulate(slowdown, seq_extra_s)``, the
    same probe simulated on the hardware entry ``slowed`` by those; the first ``one_at_a_time``
    requests are the unqueued ones, the rest one batch of ``B``. A decode step's time is about
    ``slowdown x profile + sequences x seq_extra_s``, so the two medians (one sequence, ``B``
    sequences) give both by a 2 x 2 solve; ``rounds`` Newton steps on that Jacobian absorb what
    the approximation leaves (prefill steps in the medians)."""
    got = measured.arrays()
    if np.isnan(got["ttft_s"]).any():
        raise RuntimeError("the probe was not fully served: the cluster is not healthy")
    batch = len(measured) - one_at_a_time
    target = np.array(_tpot(measured, one_at_a_time))
    profile = np.array(_tpot(simulate(1.0, 0.0), one_at_a_time))
    jacobian = np.array([[profile[0], 1.0], [profile[1], float(batch)]])
    slowdown, extra = 1.0, 0.0
    for _ in range(rounds + 1):
        residual = target - np.array(_tpot(simulate(slowdown, extra), one_at_a_time))
        step = np.linalg.solve(jacobian, residual)
        slowdown, extra = slowdown + float(step[0]), extra + float(step[1])
        if extra < 0:                          # the batch is no dearer than the profile says: one factor
            slowdown, extra = slowdown * target[0] / _tpot(simulate(slowdown, 0.0), one_at_a_time)[0], 0.0
    fitted = simulate(slowdown, extra)
    sim_ttft = fitted.arrays()["ttft_s"][:one_at_a_time]
    measured_ttft = got["ttft_s"][:one_at_a_time]
    path = max(0.0, float(np.median(measured_ttft - sim_ttft)))
    return HostFit(slowdown, extra, path, float(target[0]), float(profile[0]), float(target[1]),
                   _tpot(fitted, one_at_a_time)[1], float(np.median(measured_ttft)), float(np.median(sim_ttft)))
