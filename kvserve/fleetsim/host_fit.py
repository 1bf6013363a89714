"""The host as a running cluster's engines see it: how much slower they step than the profile,
and what the serving path adds to every first token.

``kvserve profile`` times the engine alone. Inside the local Ray cluster the same engine shares
the host with its replica actor, the ingress, Ray's proxy and Ray's own processes, and every
streamed token crosses those processes: on a two-core machine its steps run slower than the
profile says, and every request's first token pays the hops. Both are measured in place, before
a trace, by a probe through the running cluster (``probe_trace``: requests one at a time, then a
full batch at once) that the simulator also plays:

- ``slowdown`` = the probe's median TPOT measured / simulated on the profile (the step times'
  factor: every rate of the hardware entry divided by it, ``slowed``);
- ``path_latency_s`` = the median of (measured TTFT - simulated TTFT on the slowed entry) over
  the one-at-a-time requests (no queueing on either side): the ingress / proxy / actor hops.

The simulator then plays the trace on the slowed entry, its requests reaching the replica
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


def slowed(hw: HardwareSpec, factor: float) -> HardwareSpec:
    """``hw`` with every rate divided by ``factor`` and every host overhead multiplied by it."""
    return dataclasses.replace(
        hw, name=f"{hw.name} (x{factor:.2f} slower in place)", mem_bandwidth=hw.mem_bandwidth / factor,
        flops={k: v / factor for k, v in hw.flops.items()}, step_overhead_s=hw.step_overhead_s * factor,
        seq_overhead_s=hw.seq_overhead_s * factor, request_overhead_s=hw.request_overhead_s * factor)


@dataclass(frozen=True)
class HostFit:
    """The probe's fit (the module docstring); the medians it came from, in seconds."""

    slowdown: float
    path_latency_s: float
    measured_tpot_s: float
    profile_tpot_s: float
    measured_ttft_s: float          # one-at-a-time requests
    slowed_ttft_s: float            # the same, simulated on the slowed entry

    def as_dict(self) -> dict:
        return {k: round(v, 4) for k, v in dataclasses.asdict(self).items()}


def fit_host(measured: RequestLog, simulate: Callable[[float], RequestLog], one_at_a_time: int) -> HostFit:
    """Fit ``HostFit`` from the probe's measured log and ``simulate(slowdown)``, the same probe
    simulated with the hardware entry slowed by that factor; the first ``one_at_a_time``
    requests are the unqueued ones."""
    got = measured.arrays()
    if np.isnan(got["ttft_s"]).any():
        raise RuntimeError("the probe was not fully served: the cluster is not healthy")
    profile_tpot = float(np.median(simulate(1.0).arrays()["tpot_s"]))
    measured_tpot = float(np.median(got["tpot_s"]))
    slowdown = max(1e-3, measured_tpot / profile_tpot)
    sim_ttft = simulate(slowdown).arrays()["ttft_s"][:one_at_a_time]
    measured_ttft = got["ttft_s"][:one_at_a_time]
    path = max(0.0, float(np.median(measured_ttft - sim_ttft)))
    return HostFit(slowdown, path, measured_tpot, profile_tpot, float(np.median(measured_ttft)),
                   float(np.median(sim_ttft)))
