"""Cross-check ``kvserve bench`` against an independent tool, NVIDIA's aiperf.

Default (a quiet machine): the two clients take turns on ONE kvserve server with the
SAME requests at the same concurrency: a warm-up, then kvserve bench, aiperf, kvserve
bench, aiperf; each tool's figure is the mean of its two runs. Requests are random-word
chat prompts of about --input-len tokens asking for about --output-len tokens (ignore_eos),
lengths spread by --spread so that requests do not move in lock-step waves, whose TTFT
flips between one and two engine steps. The server runs without its prefix cache (the
prompts repeat), so both tools see identical server work and any difference is the
clients' measurement. aiperf's TTFT p50, inter-token latency p50 (its name for TPOT) and
output token throughput must match kvserve bench's within 10%; both count tokens from
the server's ``usage``.

``--side-by-side`` (a shared machine, where runs one after the other see different load):
both clients drive the server at the same time, each with its own requests from the same
distribution. With equal lengths their request waves lock into a fixed phase, and once
TTFT is as short as a prefill step the client that lands second measures about one more
step of TTFT; use it only where load, not the engine, sets TTFT.

    bash benchmarks/serving_setup_aiperf.sh               # once: aiperf in .venv/aiperf-env
    .venv/bin/python benchmarks/serving_aiperf_check.py --out benchmarks/serving_aiperf_check.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from serving_common import ROOT, KVServe, bench, emit_report, pin_self

from kvserve.loadgen.cli import export_dataset
from kvserve.loadgen.workloads import build_workload
from kvserve.loader import default_model_path
from kvserve.tokenizer import Tokenizer

TOLERANCE = 0.10


def default_aiperf() -> str:
    for path in (os.path.join(ROOT, ".venv", "aiperf-env", "bin", "aiperf"),
                 os.path.join(ROOT, ".venv", "bin", "aiperf")):
        if os.path.exists(path):
            return path
    return "aiperf"


def hf_tokenizer_folder(model_path: str, folder: str) -> str:
    """The GGUF's tokenizer saved as a Hugging Face folder (aiperf loads tokenizers that way)."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(os.path.dirname(model_path), gguf_file=os.path.basename(model_path))
    tok.save_pretrained(folder)
    return folder


def run_aiperf(args, url: str, dataset: str, count: int, tokenizer_dir: str, artifacts: str) -> dict:
    command = ["taskset", "-c", args.client_cpus, args.aiperf, "profile", "--model", args.model, "--url", url,
               "--endpoint-type", "chat", "--streaming", "--input-file", dataset,
               "--custom-dataset-type", "single_turn", "--concurrency", str(args.concurrency),
               "--request-count", str(count), "--use-server-token-count",
               "--extra-inputs", "ignore_eos:true", "--extra-inputs", "temperature:0",
               "--tokenizer", tokenizer_dir, "--artifact-dir", artifacts, "--ui-type", "none",
               # keep aiperf's own footprint small on a 2-core machine
               "--workers-max", "1", "--record-processors", "1", "--no-server-metrics", "--no-gpu-telemetry"]
    # No HF_HUB_OFFLINE here: with it aiperf 0.13 looks a local tokenizer folder up in the hub cache.
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"aiperf failed ({done.returncode}):\n{done.stdout[-6000:]}")
    with open(os.path.join(artifacts, "profile_export_aiperf.json"), encoding="utf-8") as f:
        data = json.load(f)
    return {"ttft_p50_ms": data["time_to_first_token"]["p50"], "tpot_p50_ms": data["inter_token_latency"]["p50"],
            "output_token_throughput": data["output_token_throughput"]["avg"],
            "num_completed": data["request_count"]["avg"], "output_tokens": data["total_output_tokens"]["avg"]}


def kvserve_figures(summary: dict) -> dict:
    return {"ttft_p50_ms": summary["ttft_ms"]["p50"], "tpot_p50_ms": summary["tpot_ms"]["p50"],
            "output_token_throughput": summary["output_token_throughput"],
            "num_completed": summary["num_completed"], "output_tokens": summary["output_tokens"]}



def mean_figures(runs: list[dict]) -> dict:
    """The mean of each figure over one tool's runs."""
    return {key: sum(run[key] for run in runs) / len(runs) for key in runs[0]}


def wait_until_busy(url: str, timeout_s: float = 600.0) -> None:
    """Block until the server has a request in flight (aiperf's profiling phase began)."""
    from kvserve.server.metrics import parse_metrics
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if parse_metrics(httpx.get(url + "/metrics", timeout=10).text).get("kvserve_num_requests_in_flight", 0):
            return
        time.sleep(0.02)
    raise TimeoutError("aiperf sent nothing")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--aiperf", default=default_aiperf())
    p.add_argument("--model", default="SmolLM2-135M-Instruct")
    p.add_argument("--concurrency", type=int, default=4, help="each client's concurrency")
    p.add_argument("--num-requests", type=int, default=32, help="each client's requests")
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=96)
    p.add_argument("--spread", type=float, default=0.5,
                   help="lengths uniform in mean x (1 +- spread): unequal outputs keep requests from moving in waves")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--server-cpus", default="0")
    p.add_argument("--client-cpus", default="1")
    p.add_argument("--side-by-side", action="store_true", help="both clients at once (shared machines)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    pin_self(args.client_cpus)
    model_path = default_model_path()
    tokenizer = Tokenizer.load(model_path)
    theirs = build_workload("random", tokenizer, args.num_requests, args.input_len, args.output_len, args.spread,
                            seed=0)
    ours = (build_workload("random", tokenizer, args.num_requests, args.input_len, args.output_len, args.spread,
                           seed=1) if args.side_by_side else theirs)
    warmup = build_workload("random", tokenizer, args.concurrency, args.input_len, 8, seed=2)
    with tempfile.TemporaryDirectory() as tmp:
        dataset = os.path.join(tmp, "dataset.jsonl")
        export_dataset(theirs, dataset)
        tokenizer_dir = hf_tokenizer_folder(model_path, os.path.join(tmp, "tokenizer"))
        # Taking turns repeats the same prompts: without the prefix cache every run does the same work.
        cache = [] if args.side_by_side else ["--no-prefix-cache"]
        server = KVServe("--threads", str(args.threads), "--dtype", "float32",
                         "--max-num-seqs", str(2 * args.concurrency),
                         "--kv-cache-gib", "0.5", *cache, cpus=args.server_cpus)
        with server:
            if args.side_by_side:
                with ThreadPoolExecutor(1) as pool:
                    pending = pool.submit(run_aiperf, args, server.url, dataset, args.num_requests, tokenizer_dir,
                                          os.path.join(tmp, "aiperf"))
                    wait_until_busy(server.url)
                    mine = kvserve_figures(bench(server.url, ours, args.concurrency, [], endpoint="chat"))
                    aiperf = pending.result()
                rounds = None
            else:
                rounds = {"kvserve_bench": [], "aiperf": []}
                bench(server.url, warmup, args.concurrency, [], endpoint="chat")
                for turn in range(2):
                    rounds["kvserve_bench"].append(
                        kvserve_figures(bench(server.url, ours, args.concurrency, [], endpoint="chat")))
                    rounds["aiperf"].append(run_aiperf(args, server.url, dataset, args.num_requests, tokenizer_dir,
                                                       os.path.join(tmp, f"aiperf{turn}")))
                mine, aiperf = (mean_figures(rounds[k]) for k in ("kvserve_bench", "aiperf"))
    diffs = {k: aiperf[k] / mine[k] - 1 for k in ("ttft_p50_ms", "tpot_p50_ms", "output_token_throughput")}
    report = {"benchmark": "serving_aiperf_check", "mode": "side_by_side" if args.side_by_side else "turns",
              "concurrency_each": args.concurrency, "num_requests_each": args.num_requests,
              "input_len": args.input_len, "output_len": args.output_len, "spread": args.spread,
              "kvserve_bench": mine, "aiperf": aiperf, "relative_difference": diffs, "tolerance": TOLERANCE,
              "agree": all(abs(d) <= TOLERANCE for d in diffs.values()), "rounds": rounds}
    emit_report(report, args.out)
    return 0 if report["agree"] else 1


if __name__ == "__main__":
    sys.exit(main())
