"""The simulator against the real engine on the same short trace.

``run_engine_trace`` plays an open-loop trace (arrival times, prompt and output lengths) into a
real kvserve engine on this machine in real time: each request is added when its arrival time
has passed, the engine steps while it has work, and each request's first-token and finish
times are read off the wall clock. ``simulate_trace`` runs the same requests through one
simulated replica with the engine's limits (``max_num_seqs``, ``max_num_batched_tokens``) and
step times from the hardware entry ``kvserve profile`` measured on this machine. Compared:
TTFT p50 / p99 and TPOT p50.
"""
from __future__ import annotations

import time
from dataclasses import replace

import numpy as np

from kvserve.autoscale.capacity import ReplicaCapacity
from kvserve.fleetsim.fleet import FleetSim
from kvserve.fleetsim.log import RequestLog
from kvserve.fleetsim.prompt_ids import add_prefix_groups, prompt_token_ids
from kvserve.fleetsim.replica import BatchReplica
from kvserve.fleetsim.scenario import ModelTraffic, Scenario
from kvserve.fleetsim.sizing import ColdStartLayers, ReplicaSizing


def make_trace(num_requests: int, rate_per_s: float, prompt_mean: float, output_mean: float,
               seed: int = 0, prefix_groups: int = 0, prefix_tokens: int = 0) -> RequestLog:
    """Poisson arrivals at ``rate_per_s``; log-normal lengths (sigma 0.5) around the means; with
    ``prefix_groups``, every prompt starts with one of that many shared ``prefix_tokens``-token
    prefixes (``prompt_ids.add_prefix_groups``)."""
    rng = np.random.default_rng(seed)
    log = trace_log(rng, np.cumsum(rng.exponential(1.0 / rate_per_s, num_requests)), prompt_mean, output_mean)
    return add_prefix_groups(log, rng, prefix_groups, prefix_tokens) if prefix_groups else log


def trace_log(rng, arrivals, prompt_mean: float, output_mean: float) -> RequestLog:
    """A one-model log of requests at ``arrivals``: log-normal prompt and output lengths (sigma
    0.5) around the means, drawn from ``rng``, clipped to [8, 2048] and [2, 512]."""
    n = len(arrivals)
    prompts = np.clip(np.rint(rng.lognormal(np.log(prompt_mean) - 0.125, 0.5, n)), 8, 2048)
    outputs = np.clip(np.rint(rng.lognormal(np.log(output_mean) - 0.125, 0.5, n)), 2, 512)
    return RequestLog(np.asarray(arrivals), np.zeros(n), np.zeros(n), prompts, outputs)


def run_engine_trace(llm, trace: RequestLog, vocab_size: int) -> RequestLog:
    """Play ``trace`` into ``llm``'s engine in real time, each prompt's ids from ``prompt_ids``
    (shared prefixes where the trace has groups); fills and returns a copy of the log, with the
    prompt tokens the engine's prefix cache served."""
    from kvserve.engine.request import EngineRequest
    from kvserve.sampling.params import SamplingParams
    log = trace.fresh()
    engine, pending, start = llm.engine, 0, time.perf_counter()
    while pending < len(log) or engine.has_unfinished():
        now = time.perf_counter() - start
        while pending < len(log) and log.arrival[pending] <= now:
            ids = prompt_token_ids(log, pending, vocab_size)
            params = SamplingParams(temperature=0, max_tokens=log.output[pending], ignore_eos=True)
            engine.add_request(EngineRequest(str(pending), ids, params))
            pending += 1
        if not engine.has_unfinished():
            time.sleep(max(0.0, log.arrival[pending] - now))
            continue
        updates = engine.step()
        done = time.perf_counter() - start
        for u in updates:
            request = int(u.request_id)
            if u.new_token_ids and np.isnan(log.first_token_s[request]):
                log.first_token(request, done)
                log.cached_tokens[request] = u.num_cached_tokens
            if u.finish_reason is not None:
                log.finish(request, done)
    return log


def simulate_trace(trace: RequestLog, cost, max_num_seqs: int, max_batched_tokens: int,
                   kv_tokens: int, replica_factory=BatchReplica) -> RequestLog:
    """The same requests through one always-on simulated replica with the engine's limits
    (``replica_factory``: e.g. ``SchedulerReplica`` with its prefix cache)."""
    sizing = ReplicaSizing("engine", 1, max_num_seqs, max_batched_tokens, kv_tokens, cost,
                           ReplicaCapacity(1.0, 1.0), 0.0, ColdStartLayers(0.0, 0.0, 0.0, 0.0))
    log = trace.fresh()
    scenario = Scenario(name="trace", models=(ModelTraffic("engine", "smollm2-135m"),),
                        duration_s=max(trace.arrival) + 1.0, budget_usd_month=0.0)
    sim = FleetSim(replace(scenario, policies=("always_on",)), "always_on", [sizing], log,
                   {"engine": None}, [0.0], [0.0], replica_factory)
    sim.run()
    return log


def compare(measured: RequestLog, simulated: RequestLog) -> dict:
    """TTFT p50 / p99 and TPOT p50, measured vs simulated, and their ratios (simulated / measured);
    with the share of prompt tokens a prefix cache served on each side."""
    out = {}
    for name, log in (("measured", measured), ("simulated", simulated)):
        arr = log.arrays()
        out[name] = {"p50_ttft_s": float(np.nanpercentile(arr["ttft_s"], 50)),
                     "p99_ttft_s": float(np.nanpercentile(arr["ttft_s"], 99)),
                     "p50_tpot_s": float(np.nanpercentile(arr["tpot_s"], 50)),
                     "cached_prompt_share": round(float(arr["cached_tokens"].sum() / arr["prompt"].sum()), 4)}
    out["ratio"] = {k: round(out["simulated"][k] / out["measured"][k], 3)
                    for k in ("p50_ttft_s", "p99_ttft_s", "p50_tpot_s")}
    return out
