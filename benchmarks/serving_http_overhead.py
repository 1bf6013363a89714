"""The HTTP path's cost: server throughput at concurrency 64 vs the offline engine on the same requests.

Alternates offline and server runs (offline, server, offline, server, ...: --rounds pairs)
so that slow changes in other load on a shared machine hit both sides alike, and reports
the ratio of the medians. Both are pinned to --server-cpus with --threads engine threads;
the client runs on --client-cpus. Also reports output tokens per CPU-second (server: HTTP
process + engine process; offline: the process), which other load does not move.

    .venv/bin/python benchmarks/serving_http_overhead.py --out benchmarks/serving_http_overhead.json
"""
from __future__ import annotations

import argparse
import statistics
import sys

from serving_common import KVServe, bench, emit_report, offline, pin_self, ratio

from kvserve.loadgen.workloads import build_workload
from kvserve.loader import default_model_path
from kvserve.tokenizer import Tokenizer


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--kv-cache-gib", type=float, default=0.75)
    p.add_argument("--server-cpus", default="0")
    p.add_argument("--client-cpus", default="1")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    pin_self(args.client_cpus)
    tokenizer = Tokenizer.load(default_model_path())
    requests = build_workload("random", tokenizer, args.concurrency, args.input_len, args.output_len, chat=False)
    warmup = build_workload("random", tokenizer, 2, args.input_len, 8, chat=False, seed=1)
    kv_bytes = int(args.kv_cache_gib * 2**30)
    offline_runs, server_runs = [], []
    server = KVServe("--threads", str(args.threads), "--dtype", "float32", "--kv-cache-gib", str(args.kv_cache_gib),
                     "--max-num-seqs", str(args.concurrency), "--max-queued-requests", "1024", cpus=args.server_cpus)
    with server:
        pids = server.pids()
        for _ in range(args.rounds):
            offline_runs.append(offline(requests, args.threads, kv_bytes, args.concurrency, args.server_cpus))
            s = bench(server.url, requests, args.concurrency, warmup, pids=pids)
            server_runs.append({"output_token_throughput": s["output_token_throughput"],
                                "output_tokens_per_cpu_s": s["output_tokens_per_cpu_s"],
                                "num_errors": s["num_errors"], "server_cpu_s": s["server_cpu_s"],
                                "duration_s": s["duration_s"]})
            print(f"offline {offline_runs[-1]} server {server_runs[-1]}", file=sys.stderr)

    def median(runs, key):
        return statistics.median(r[key] for r in runs)
    report = {"benchmark": "serving_http_overhead", "concurrency": args.concurrency, "input_len": args.input_len,
              "output_len": args.output_len, "threads": args.threads, "offline_runs": offline_runs,
              "server_runs": server_runs,
              "server_fraction_of_offline": ratio(median(server_runs, "output_token_throughput"),
                                                  median(offline_runs, "output_token_throughput")),
              "server_fraction_of_offline_per_cpu_s": ratio(median(server_runs, "output_tokens_per_cpu_s"),
                                                            median(offline_runs, "output_tokens_per_cpu_s"))}
    emit_report(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
