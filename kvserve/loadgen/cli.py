"""``kvserve bench``: drive any OpenAI-compatible URL and report TTFT/TPOT/ITL/E2E, throughput,
goodput and errors as JSON (see docs/server.md)."""
from __future__ import annotations

import asyncio
import json
import sys


def register(subparsers) -> None:
    """Add the ``bench`` subcommand."""
    p = subparsers.add_parser("bench", help="load-test an OpenAI-compatible server",
                              description="Load generator for OpenAI-compatible servers.")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (with or without /v1)")
    p.add_argument("--model", default=None, help="model id to send (default: the server's first /v1/models)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--endpoint", choices=("chat", "completions"), default="chat")
    p.add_argument("--workload", choices=("random", "shared-prefix", "multi-turn", "code", "ghost"),
                   default="random", help="ghost: typists asking for inline completions (the --ghost-* options)")
    p.add_argument("--num-requests", type=int, default=64, help="requests (conversations for multi-turn)")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens (mean)")
    p.add_argument("--output-len", type=int, default=128, help="max_tokens (mean)")
    p.add_argument("--len-spread", type=float, default=0.0, help="lengths uniform in mean*[1-s, 1+s]")
    p.add_argument("--prefix-len", type=int, default=512, help="shared-prefix: system prompt tokens")
    p.add_argument("--turns", type=int, default=3, help="multi-turn: turns per conversation")
    p.add_argument("--code-dir", default=None, help="code: source tree (default: the Python stdlib)")
    p.add_argument("--concurrency", default="1", help="comma list for a sweep, e.g. 1,4,16,64")
    p.add_argument("--request-rate", type=float, default=None,
                   help="Poisson arrivals at this many requests/s (concurrency then caps in-flight)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="do not send ignore_eos (for servers that reject it)")
    p.add_argument("--warmup", type=int, default=2, help="requests sent and discarded before each run")
    p.add_argument("--slo-ttft-ms", type=float, default=None)
    p.add_argument("--slo-tpot-ms", type=float, default=None)
    p.add_argument("--slo-e2e-ms", type=float, default=None)
    p.add_argument("--tokenizer", default=None, help="model file/folder whose tokenizer sizes the prompts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout (s)")
    p.add_argument("--out", default=None, help="write the JSON results here (default: stdout)")
    p.add_argument("--export-dataset", default=None,
                   help="also write the workload as aiperf single_turn JSONL (text, output_length)")
    p.add_argument("--no-progress", action="store_true")
    from kvserve.loadgen.ghost import add_ghost_arguments
    add_ghost_arguments(p)
    p.set_defaults(func=run)


def _first_model(url: str, api_key: str | None) -> str | None:
    import httpx
    base = url.rstrip("/")
    base = base if base.endswith("/v1") else base + "/v1"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        data = httpx.get(base + "/models", headers=headers, timeout=30).json()
        return data["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError):
        return None


def export_dataset(requests, path: str) -> None:
    """The workload as aiperf ``single_turn`` JSONL (first turns only)."""
    with open(path, "w", encoding="utf-8") as f:
        for r in requests:
            text = r.prompt if r.prompt is not None else r.messages[-1]["content"]
            f.write(json.dumps({"text": text, "output_length": r.max_tokens}, ensure_ascii=False) + "\n")


async def run_sweep(args, requests, warmup, model: str | None) -> list[dict]:
    from kvserve.loadgen.report import summarize
    from kvserve.loadgen.runner import ClientConfig, Runner
    config = ClientConfig(args.url, model, args.endpoint, args.api_key, args.temperature, args.ignore_eos,
                          args.timeout)
    results = []
    levels = [int(c) for c in str(args.concurrency).split(",") if c]
    for concurrency in levels:
        if warmup:
            await Runner(config).run(warmup, concurrency=min(concurrency, len(warmup)))
        progress = _progress(args, sum(r.turns for r in requests), concurrency)
        runner = Runner(config, progress)
        await runner.run(requests, concurrency=concurrency, rate=args.request_rate, seed=args.seed)
        if progress is not None:
            progress.close()
        summary = summarize(runner.records, args.slo_ttft_ms, args.slo_tpot_ms, args.slo_e2e_ms)
        results.append({"concurrency": concurrency, "request_rate": args.request_rate, "summary": summary})
    return results


def _progress(args, total: int, concurrency: int):
    if args.no_progress:
        return None
    from tqdm import tqdm
    return tqdm(total=total, desc=f"c={concurrency}", unit="req", file=sys.stderr, leave=False)


def run(args) -> int:
    if args.workload == "ghost":
        from kvserve.loadgen.ghost import run_ghost_cli
        return run_ghost_cli(args, args.model or _first_model(args.url, args.api_key))
    from kvserve.loadgen.report import emit_json, format_table
    from kvserve.loadgen.workloads import build_workload
    from kvserve.loader import resolve_model_path
    from kvserve.tokenizer import Tokenizer

    tokenizer = Tokenizer.load(resolve_model_path(args.tokenizer))
    common = dict(input_len=args.input_len, output_len=args.output_len, spread=args.len_spread,
                  chat=args.endpoint == "chat", prefix_len=args.prefix_len, turns=args.turns,
                  code_dir=args.code_dir)
    requests = build_workload(args.workload, tokenizer, args.num_requests, seed=args.seed, **common)
    warmup = build_workload(args.workload, tokenizer, args.warmup, seed=args.seed + 1, **common) \
        if args.warmup else []
    if args.export_dataset:
        export_dataset(requests, args.export_dataset)
    model = args.model or _first_model(args.url, args.api_key)
    results = asyncio.run(run_sweep(args, requests, warmup, model))
    report = {"url": args.url, "model": model, "endpoint": args.endpoint, "workload": args.workload,
              "num_requests": args.num_requests, "input_len": args.input_len, "output_len": args.output_len,
              "results": results}
    print(format_table(results), file=sys.stderr)
    emit_json(report, args.out)
    return 0 if all(r["summary"]["num_completed"] for r in results) else 1
