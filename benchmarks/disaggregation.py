"""Decode latency of running streams while long prompts arrive: unified vs disaggregated.

Same requests, same driver (``kvserve.disagg.DisaggregatedEngines``, two engine processes), two
layouts measured in one run on the default model (fp32):

- ``unified``: every request stays on the decode engine (threshold above any prompt), which
  runs with 2 threads (the prefill engine idles);
- ``disaggregated``: prompts of >= 256 uncached tokens are prefilled on the prefill engine
  (1 thread) and their KV blocks moved; the decode engine (1 thread) only decodes.

Workload: ``--streams`` (8) streams of 32-token prompts and 96 output tokens start at t=0;
while they decode, bursts of ``--burst`` (2) long prompts (``--long`` 960 tokens, 8 output
tokens) arrive every ``--every`` (1.5) s, ``--bursts`` (3) times. TPOT = the gaps between a
stream's consecutive tokens (after its first), over all streams; reported p50/p99 with the
long prompts' TTFT and the output tokens/s of the whole run.

    .venv/bin/python benchmarks/disaggregation.py [--out benchmarks/disaggregation.json]
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_host import emit  # noqa: E402


def workload(args) -> tuple[list, list]:
    """(streams, bursts): streams as (request id, prompt, max tokens); bursts as (offset s, requests)."""
    rng = random.Random(0)
    tokens = lambda n: [rng.randrange(200, 40000) for _ in range(n)]       # noqa: E731  plain text ids
    streams = [(f"stream-{i}", tokens(32), args.stream_tokens) for i in range(args.streams)]
    bursts = [((b + 1) * args.every, [(f"long-{b}-{j}", tokens(args.long), 8) for j in range(args.burst)])
              for b in range(args.bursts)]
    return streams, bursts


def run_layout(args, threshold: int, decode_threads: int, prefill_threads: int) -> dict:
    from kvserve.disagg.driver import DisaggConfig, DisaggregatedEngines
    from kvserve.engine.request import EngineRequest
    from kvserve.sampling.params import SamplingParams
    common = {"model": None, "dtype": "float32", "max_num_seqs": 64, "max_num_batched_tokens": 1024,
              "kv_cache_bytes": 512 * 2**20}
    streams, bursts = workload(args)
    arrivals: dict[str, list[float]] = {}
    sent: dict[str, float] = {}
    with DisaggregatedEngines(common, DisaggConfig(threshold_tokens=threshold),
                              prefill_config={"num_threads": prefill_threads},
                              decode_config={"num_threads": decode_threads}) as engines:
        def send(rid, prompt, max_tokens):
            params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
            engines.add_request(EngineRequest(rid, prompt, params))
            sent[rid], arrivals[rid] = time.perf_counter(), []
        started = time.perf_counter()
        for stream in streams:
            send(*stream)
        pending = list(bursts)
        while engines.has_unfinished() or pending:
            now = time.perf_counter() - started
            while pending and pending[0][0] <= now:
                for request in pending.pop(0)[1]:
                    send(*request)
            for update in engines.poll(timeout_s=0.005):
                if update.new_token_ids:
                    arrivals[update.request_id].extend([time.perf_counter()] * len(update.new_token_ids))
        elapsed = time.perf_counter() - started
        counters = engines.counters
    gaps = [b - a for rid, _, _ in streams for a, b in zip(arrivals[rid], arrivals[rid][1:]) if b > a]
    ttfts = [arrivals[rid][0] - sent[rid] for _, requests in bursts for rid, _, _ in requests]
    quantile = lambda xs, q: statistics.quantiles(xs, n=100)[q - 1]     # noqa: E731
    return {"threshold_tokens": threshold, "decode_threads": decode_threads, "prefill_threads": prefill_threads,
            "tpot_p50_ms": round(quantile(gaps, 50) * 1e3, 1), "tpot_p99_ms": round(quantile(gaps, 99) * 1e3, 1),
            "tpot_max_ms": round(max(gaps) * 1e3, 1),
            "long_ttft_p50_s": round(statistics.median(ttfts), 3), "long_ttft_max_s": round(max(ttfts), 3),
            "output_tokens_per_s": round(sum(len(v) for v in arrivals.values()) / elapsed, 1),
            "seconds": round(elapsed, 2), "disaggregated_requests": counters.num_disaggregated,
            "blocks_moved": counters.blocks_received}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--stream-tokens", type=int, default=96)
    parser.add_argument("--long", type=int, default=960)
    parser.add_argument("--burst", type=int, default=2)
    parser.add_argument("--bursts", type=int, default=3)
    parser.add_argument("--every", type=float, default=1.5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    unified = run_layout(args, threshold=10**9, decode_threads=2, prefill_threads=1)
    disaggregated = run_layout(args, threshold=256, decode_threads=1, prefill_threads=1)
    result = {"model": "SmolLM2-135M-Instruct (fp32)", "workload": vars(args) | {"out": None},
              "unified": unified, "disaggregated": disaggregated,
              "tpot_p99_ratio": round(disaggregated["tpot_p99_ms"] / unified["tpot_p99_ms"], 3),
              "throughput_ratio": round(disaggregated["output_tokens_per_s"] / unified["output_tokens_per_s"], 3)}
    emit(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
