"""Serving benchmark: kvserve vs llama.cpp's llama-server, and kvserve's HTTP path vs its offline engine.

Same GGUF file, same requests (random-word prompts of --input-len tokens, --output-len
tokens each with ignore_eos, greedy, /v1/completions, streamed), at each concurrency
level; llama-server gets as many parallel slots as the level (kvserve: --max-num-seqs).
Servers are pinned to --server-cpus with --threads torch/ggml threads, the client to
--client-cpus. Then the offline engine runs the highest level's requests all at once,
pinned like the server, for the HTTP path's overhead.

    bash benchmarks/serving_build_llama_server.sh          # once: builds .venv/bin/llama-server
    .venv/bin/python benchmarks/serving_vs_llamacpp.py --out benchmarks/serving_vs_llamacpp.json

Prints (and writes) one JSON object: per level, both servers' TTFT/TPOT p50/p99 and output
tokens/s, kvserve/llama ratios, and output tokens per server CPU-second (robust to other
load on a shared machine); then offline vs server throughput at the top level.
"""
from __future__ import annotations

import argparse
import os
import sys

from serving_common import (KVServe, LlamaServer, bench, default_llama_server, emit_report, offline, pin_self,
                            ratio)

from kvserve.loadgen.workloads import build_workload
from kvserve.loader import default_model_path
from kvserve.tokenizer import Tokenizer

FIGURES = (("ttft_ms", "p50"), ("ttft_ms", "p99"), ("tpot_ms", "p50"), ("tpot_ms", "p99"))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--levels", default="1,4,16,64")
    p.add_argument("--requests-per-level", default="4,8,16,64", help="requests sent at each level")
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--threads", type=int, default=1, help="engine torch threads / llama-server -t")
    p.add_argument("--server-cpus", default="0")
    p.add_argument("--client-cpus", default="1")
    p.add_argument("--llama-server", default=default_llama_server())
    p.add_argument("--skip-llama", action="store_true")
    p.add_argument("--skip-offline", action="store_true")
    p.add_argument("--kv-cache-gib", type=float, default=0.75)
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def compact(summary: dict) -> dict:
    out = {f"{key[:-3]}_{p}_ms": summary[key].get(p) for key, p in FIGURES}
    out.update({k: summary.get(k) for k in ("num_completed", "num_errors", "output_tokens", "duration_s",
                                            "output_token_throughput", "server_cpu_s", "output_tokens_per_cpu_s")})
    return out


def run_level(args, concurrency: int, requests, warmup, model_path: str) -> dict:
    entry = {"concurrency": concurrency, "num_requests": len(requests)}
    server = KVServe("--threads", str(args.threads), "--dtype", "float32", "--kv-cache-gib", str(args.kv_cache_gib),
                     "--max-num-seqs", str(concurrency), "--max-queued-requests", "1024", cpus=args.server_cpus)
    with server:
        entry["kvserve"] = compact(bench(server.url, requests, concurrency, warmup, pids=server.pids()))
    print(f"c={concurrency} kvserve: {entry['kvserve']}", file=sys.stderr)
    if not args.skip_llama:
        ctx = 1 << (args.input_len + args.output_len + 64).bit_length()
        with LlamaServer(args.llama_server, model_path, concurrency, ctx, args.threads, args.server_cpus) as llama:
            entry["llama_server"] = compact(bench(llama.url, requests, concurrency, warmup, pids=llama.pids()))
        print(f"c={concurrency} llama-server: {entry['llama_server']}", file=sys.stderr)
        k, l = entry["kvserve"], entry["llama_server"]
        entry["ratio_kvserve_over_llama"] = {
            name: ratio(k[name], l[name]) for name in (*(f"{key[:-3]}_{p}_ms" for key, p in FIGURES),
                                                       "output_token_throughput", "output_tokens_per_cpu_s")}
    return entry


def main(argv=None) -> int:
    args = parse_args(argv)
    pin_self(args.client_cpus)
    model_path = default_model_path()
    tokenizer = Tokenizer.load(model_path)
    levels = [int(x) for x in args.levels.split(",")]
    counts = [int(x) for x in args.requests_per_level.split(",")]
    everything = build_workload("random", tokenizer, max(counts), args.input_len, args.output_len, chat=False)
    warmup = build_workload("random", tokenizer, 2, args.input_len, 8, chat=False, seed=1)
    report = {"benchmark": "serving_vs_llamacpp", "model": os.path.basename(model_path),
              "input_len": args.input_len, "output_len": args.output_len, "threads": args.threads,
              "server_cpus": args.server_cpus, "client_cpus": args.client_cpus, "levels": []}
    for concurrency, count in zip(levels, counts):
        report["levels"].append(run_level(args, concurrency, everything[:count], warmup, model_path))
    top = report["levels"][-1]
    if not args.skip_offline:
        off = offline(everything[:counts[-1]], args.threads, int(args.kv_cache_gib * 2**30), levels[-1],
                      args.server_cpus)
        server = top["kvserve"]
        report["http_overhead"] = {
            "concurrency": levels[-1], "offline": off,
            "server_output_token_throughput": server["output_token_throughput"],
            "server_fraction_of_offline": ratio(server["output_token_throughput"], off["output_token_throughput"]),
            "server_fraction_of_offline_per_cpu_s": ratio(server["output_tokens_per_cpu_s"],
                                                          off["output_tokens_per_cpu_s"]),
        }
    emit_report(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
