"""Quantisation benchmark: what each weight / KV setting buys, against its own bound and
against llama.cpp's llama-server on the same GGUF, in one run.

1. bs=1 decode, in-process, one thread, pinned to --server-cpus: tokens/s per weight
   setting (none = fp32, int8, int4), each as a fraction of its own bandwidth bound
   (weight bytes one decode step reads / this machine's measured copy bandwidth).
2. KV capacity per KV dtype in 1 GiB: bytes/token, tokens and sequences at full context
   (8,192) from the arithmetic the engine prints (tests/model confirm it by filling a pool).
3. Serving at each --levels concurrency (random prompts of --input-len tokens,
   --output-len tokens each, greedy, streamed /v1/completions): llama-server once, then
   kvserve per weight setting; ratios kvserve / llama-server of output tokens/s.

    bash benchmarks/serving_build_llama_server.sh       # once
    .venv/bin/python benchmarks/quantization.py --out benchmarks/quantization.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys

from serving_common import ROOT, LlamaServer, bench, default_llama_server, emit_report, pin_self, ratio
from serving_vs_llamacpp import KVServe, compact

from kvserve.loader import default_model_path
from kvserve.loadgen.workloads import build_workload
from kvserve.tokenizer import Tokenizer

DECODE_SCRIPT = r"""
import json, sys, time, torch
from kvserve import LLM, SamplingParams
from kvserve.engine.bandwidth import measure_copy_bandwidth
spec = json.loads(sys.stdin.read())
llm = LLM(None, num_threads=1, dtype="float32", quantization=spec["quantization"],
          kv_cache_bytes=256 * 2**20, enable_prefix_cache=False)
prompt = {"prompt": "Write a short story about a lighthouse keeper who"}
llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0))
def run(n):
    t = time.perf_counter(); llm.generate([prompt], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    return time.perf_counter() - t
short = min(run(1) for _ in range(3)); long = min(run(1 + spec["tokens"]) for _ in range(3))
step_s = (long - short) / spec["tokens"]
bandwidth = measure_copy_bandwidth(torch.device("cpu"))
read = llm.engine.decode_read_bytes
print(json.dumps({"quantization": spec["quantization"], "decode_ms_per_token": step_s * 1e3,
                  "decode_tokens_per_s": 1 / step_s, "weight_bytes": llm.engine.runner.model.weight_bytes(),
                  "decode_read_bytes": read, "copy_bandwidth_gb_s": bandwidth / 1e9,
                  "bound_ms_per_token": read / bandwidth * 1e3,
                  "fraction_of_bound": (read / bandwidth) / step_s}))
"""

CAPACITY_SCRIPT = r"""
import json, sys
from kvserve import LLM
out = []
for kv in ("auto", "int8", "fp8_e4m3", "fp8_e5m2"):
    llm = LLM(None, num_threads=1, dtype="float32", kv_cache_dtype=kv, kv_cache_bytes=2**30)
    plan = llm.engine.kv_plan
    out.append({"kv_cache_dtype": kv, "bytes_per_token": plan.bytes_per_token, "num_blocks": plan.num_blocks,
                "max_tokens": plan.max_tokens, "max_seqs_at_full_context": plan.max_seqs_at_full_context,
                "explanation": plan.explanation})
print(json.dumps(out))
"""


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--settings", default="none,int8,int4")
    p.add_argument("--levels", default="1,4,16,64")
    p.add_argument("--requests-per-level", default="4,8,16,64")
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--decode-tokens", type=int, default=48)
    p.add_argument("--server-cpus", default="0")
    p.add_argument("--client-cpus", default="1")
    p.add_argument("--kv-cache-gib", type=float, default=0.75)
    p.add_argument("--llama-server", default=default_llama_server())
    p.add_argument("--skip-serving", action="store_true")
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def in_process(script: str, spec: dict, cpus: str):
    out = subprocess.run(["taskset", "-c", cpus, sys.executable, "-c", script], input=json.dumps(spec),
                         capture_output=True, text=True, check=True, cwd=ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])


def serving_level(args, settings, concurrency, requests, warmup, model_path) -> dict:
    """llama-server, then kvserve per setting, at one concurrency."""
    entry = {"concurrency": concurrency, "num_requests": len(requests)}
    ctx = 1 << (args.input_len + args.output_len + 64).bit_length()
    with LlamaServer(args.llama_server, model_path, concurrency, ctx, 1, args.server_cpus) as llama:
        entry["llama_server"] = compact(bench(llama.url, requests, concurrency, warmup, pids=llama.pids()))
    for setting in settings:
        server = KVServe("--threads", "1", "--kv-cache-gib", str(args.kv_cache_gib), "--dtype", "float32",
                         "--quantization", setting, "--max-num-seqs", str(concurrency),
                         "--max-queued-requests", "1024", cpus=args.server_cpus)
        with server:
            got = compact(bench(server.url, requests, concurrency, warmup, pids=server.pids()))
        got["ratio_output_token_throughput_vs_llama"] = ratio(got["output_token_throughput"],
                                                               entry["llama_server"]["output_token_throughput"])
        entry[f"kvserve_{setting}"] = got
        print(f"c={concurrency} {setting}: {got['output_token_throughput']:.1f} tok/s "
              f"({got['ratio_output_token_throughput_vs_llama']:.2f}x llama-server)", file=sys.stderr)
    return entry


def main(argv=None) -> int:
    args = parse_args(argv)
    pin_self(args.client_cpus)
    settings = args.settings.split(",")
    model_path = default_model_path()
    report = {"benchmark": "quantization", "model": os.path.basename(model_path), "threads": 1,
              "cpu": platform.processor() or platform.machine(), "server_cpus": args.server_cpus,
              "decode_bs1": [in_process(DECODE_SCRIPT, {"quantization": s, "tokens": args.decode_tokens},
                                        args.server_cpus) for s in settings]}
    report["kv_capacity_1gib"] = in_process(CAPACITY_SCRIPT, {}, args.server_cpus)
    for row in report["decode_bs1"]:
        print(f"bs=1 {row['quantization']}: {row['decode_tokens_per_s']:.1f} tok/s, "
              f"{row['fraction_of_bound']:.2f} of its bound", file=sys.stderr)
    if not args.skip_serving:
        tokenizer = Tokenizer.load(model_path)
        counts = [int(x) for x in args.requests_per_level.split(",")]
        everything = build_workload("random", tokenizer, max(counts), args.input_len, args.output_len, chat=False)
        warmup = build_workload("random", tokenizer, 2, args.input_len, 8, chat=False, seed=1)
        report["input_len"], report["output_len"] = args.input_len, args.output_len
        report["serving"] = [serving_level(args, settings, c, everything[:n], warmup, model_path)
                             for c, n in zip((int(x) for x in args.levels.split(",")), counts)]
    emit_report(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
