"""Latency classes for code assistants (issue 14): ghost text under chat load, and the
batching window's latency / throughput trade for batch traffic.

    .venv/bin/python benchmarks/latency_classes.py [--only ghost|window] [--configs a,b,c,d]
                                                   [--windows 0,25,50,100,200] [--out FILE]

The real server (``kvserve serve``) runs pinned to --server-cpus with --threads engine
threads; this process (all clients) is pinned to --client-cpus.

1. Ghost text (``kvserve.loadgen.ghost``: typists cancelling and resending inline
   completions of <= 16 tokens on every keystroke) with --chat-clients chat clients in the
   background (multi-turn conversations, ~64-token answers, no service_tier = chat), for
   four server settings (CONFIGS below; flags are data, so adjust them there):
   (a) fcfs, no prefix cache, no speculation; (b) + prefix cache; (c) + n-gram speculation;
   (d) + classes (``--scheduling-policy slo``; the typists send service_tier "priority").
   Per setting: chat alone for --chat-alone-s, then chat + typists for --ghost-s, on the same
   server. Figures: interactive TTFT p50/p99 (from Server-Timing, or client-side with
   --ghost-stream), e2e p50/p99, the fraction within --budget-ms (of completed requests, and
   of the requests the typist waited at least the budget for), p99 e2e of completions of
   <= 8 tokens, the budget phase by phase, the cached-token fraction, and chat output
   tokens/s with the typists over chat alone.
2. Batching window: batch traffic only (service_tier "flex", Poisson arrivals at
   --batch-rate, at most --batch-clients in flight, non-streamed so Server-Timing is read),
   server ``--scheduling-policy slo --batch-window-ms W`` for each W: mean / p50 queue wait
   (Server-Timing ``queue``) and output tokens/s, as ratios to W = 0.

Flags the server does not know (``kvserve serve --help``) are dropped and listed in the
report (``dropped_flags``); a service_tier the server refuses (HTTP 400 on a probe request)
is not sent, and the report says so (``service_tier_sent``). Prints one JSON object.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import subprocess
import sys
import time

import httpx
from serving_common import KVServe, emit_report, pin_self, ratio

from kvserve.loadgen.ghost import GhostConfig, GhostRunner, completions_url, read_ghost_file
from kvserve.loadgen.ghost_report import GhostRecord, parse_server_timing, summarize_ghost
from kvserve.loadgen.report import distribution, percentile
from kvserve.loadgen.runner import ClientConfig, Runner
from kvserve.loadgen.workloads import build_workload
from kvserve.loader import default_model_path
from kvserve.tokenizer import Tokenizer

# Server settings: each option a tuple (flag, value...). ghost_tier: what the typists send.
CONFIGS = {
    "a": {"label": "fcfs, no prefix cache, no speculation", "ghost_tier": None,
          "flags": [("--scheduling-policy", "fcfs"), ("--no-prefix-cache",)]},
    "b": {"label": "+ prefix cache", "ghost_tier": None,
          "flags": [("--scheduling-policy", "fcfs")]},
    "c": {"label": "+ speculation (ngram)", "ghost_tier": None,
          "flags": [("--scheduling-policy", "fcfs"), ("--speculative", "ngram")]},
    "d": {"label": "+ classes (slo, typists send priority)", "ghost_tier": "priority",
          "flags": [("--scheduling-policy", "slo"), ("--speculative", "ngram")]},
}
WINDOW_FLAGS = [("--scheduling-policy", "slo"), ("--batch-window-ms", "{w}")]
BATCH_TIER = "flex"


def serve_flags() -> set[str]:
    """The options ``kvserve serve`` accepts (from its --help)."""
    out = subprocess.run([sys.executable, "-m", "kvserve.cli", "serve", "--help"], capture_output=True,
                         text=True, check=True)
    return set(re.findall(r"--[a-z0-9][a-z0-9-]*", out.stdout))


def server_args(options, known: set[str], dropped: list[str], **fmt) -> list[str]:
    """Flatten ``options``, leaving out (and noting in ``dropped``) flags the server lacks."""
    args = []
    for option in options:
        option = tuple(part.format(**fmt) for part in option)
        if option[0] in known:
            args.extend(option)
        elif " ".join(option) not in dropped:
            dropped.append(" ".join(option))
    return args


def base_args(args) -> list[str]:
    return ["--threads", str(args.threads), "--dtype", "float32", "--kv-cache-gib", str(args.kv_cache_gib),
            "--max-num-seqs", str(args.max_num_seqs), "--max-queued-requests", "1024"]


def tier_accepted(url: str, tier: str | None) -> bool:
    """Whether the server takes ``service_tier: tier`` (None: nothing to check)."""
    if tier is None:
        return True
    body = {"prompt": "def f():", "max_tokens": 1, "temperature": 0, "service_tier": tier}
    return httpx.post(completions_url(url), json=body, timeout=120).status_code == 200


# ------------------------------------------------------------ chat in the background
async def chat_for(url: str, requests, clients: int, seconds: float) -> dict:
    """Chat conversations from ``clients`` workers for ``seconds``; output tokens/s inside the
    window: ``usage`` of the requests that finished in it, plus the text chunks (about one
    token each) streamed before the cut of those still running at its end."""
    runner = Runner(ClientConfig(url, endpoint="chat", temperature=0.0, ignore_eos=True))
    started = time.perf_counter()
    task = asyncio.create_task(runner.run(requests, concurrency=clients))
    await asyncio.sleep(seconds)
    ended = time.perf_counter()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    done = [r for r in runner.records if r.error is None and r.output_tokens is not None and r.end <= ended]
    finished = {id(r) for r in done}
    cut = [r for r in runner.records if r.error is None and id(r) not in finished]
    tokens = sum(r.output_tokens for r in done)
    partial = sum(1 for r in cut for t in r.chunk_times if t <= ended)
    return {"seconds": ended - started, "completed": len(done), "cut_off": len(cut),
            "output_tokens": tokens + partial, "output_tokens_of_cut_off": partial,
            "output_tokens_per_s": (tokens + partial) / (ended - started),
            "errors": sum(1 for r in runner.records if r.error is not None),
            "tpot_ms_p50": distribution([r.tpot_s for r in done if r.tpot_s is not None]).get("p50")}


async def chat_and_ghost(url: str, chat_requests, clients: int, ghost: GhostConfig, text: str) -> tuple:
    """Chat for ``ghost.duration_s`` with the typists running alongside."""
    chat = asyncio.create_task(chat_for(url, chat_requests, clients, ghost.duration_s))
    records = await GhostRunner(ghost, url, text).run()
    return await chat, records


def ghost_figures(records: list[GhostRecord], budget_ms: float, streamed: bool) -> dict:
    """The per-setting figures of the interactive class."""
    s = summarize_ghost(records, budget_ms)
    ttft = s["ttft_ms"] if streamed else s["server_ttft_ms"]
    return {
        "sent": s["num_requests"], "completed": s["num_completed"], "cancelled": s["num_cancelled"],
        "errors": s["errors"], "cancellations_per_s": s["cancellations_per_s"],
        "ttft_source": "client (streamed)" if streamed else "server (Server-Timing ttft)",
        "ttft_ms_p50": ttft.get("p50"), "ttft_ms_p99": ttft.get("p99"),
        "e2e_ms_p50_le_16_tokens": s["e2e_ms_outputs_le_16"].get("p50"),
        "e2e_ms_p99_le_16_tokens": s["e2e_ms_outputs_le_16"].get("p99"),
        "e2e_ms_p99_le_8_tokens": s["e2e_ms_outputs_le_8"].get("p99"),
        "fraction_within_budget": s["goodput"]["fraction"], "budget_ms": budget_ms,
        "fraction_of_waited_within_budget": s["goodput"]["fraction_of_waited"],
        "cached_token_fraction": s["cached_token_fraction"], "summary": s,
    }


def measure_config(name: str, args, known: set[str], dropped: list[str], chat_requests, text: str) -> dict:
    """One server setting: chat alone, then chat + typists, on one server."""
    config = CONFIGS[name]
    flags = server_args(config["flags"], known, dropped)
    entry = {"config": name, "label": config["label"], "server_flags": flags}
    with KVServe(*base_args(args), *flags, cpus=args.server_cpus) as server:
        tier = config["ghost_tier"] if tier_accepted(server.url, config["ghost_tier"]) else None
        entry["service_tier_wanted"], entry["service_tier_sent"] = config["ghost_tier"], tier
        ghost = GhostConfig(typists=args.typists, duration_s=args.ghost_s, max_tokens=args.ghost_max_tokens,
                            keystrokes_per_s=args.keystrokes_per_s,
                            service_tier=tier, stream=args.ghost_stream, budget_ms=args.budget_ms, seed=args.seed)
        warm = GhostConfig(typists=1, duration_s=2.0, max_tokens=2, service_tier=tier, seed=args.seed + 1)
        asyncio.run(chat_for(server.url, chat_requests[-4:], 2, 3.0))
        asyncio.run(GhostRunner(warm, server.url, text).run())
        alone = asyncio.run(chat_for(server.url, chat_requests, args.chat_clients, args.chat_alone_s))
        with_ghost, records = asyncio.run(chat_and_ghost(server.url, chat_requests, args.chat_clients, ghost, text))
        entry["step_time"] = server_step_time(server.url)
    entry["ghost"] = ghost_figures(records, args.budget_ms, args.ghost_stream)
    entry["chat_alone"], entry["chat_with_ghost"] = alone, with_ghost
    entry["chat_throughput_with_ghost_over_alone"] = ratio(with_ghost["output_tokens_per_s"],
                                                           alone["output_tokens_per_s"])
    g = entry["ghost"]
    print(f"[{name}] ghost e2e p50/p99 {g['e2e_ms_p50_le_16_tokens']}/{g['e2e_ms_p99_le_16_tokens']} ms, "
          f"within budget {g['fraction_within_budget']:.2f}, chat ratio "
          f"{entry['chat_throughput_with_ghost_over_alone']}", file=sys.stderr)
    return entry


def server_step_time(url: str) -> dict | None:
    """The engine's measured step-time fit t = a + b x tokens, from /metrics (ms)."""
    from kvserve.server.metrics import parse_metrics
    samples = parse_metrics(httpx.get(url.rstrip("/") + "/metrics", timeout=10).text)
    fixed, per_token = samples.get("kvserve_step_time_fixed_seconds"), samples.get("kvserve_step_time_per_token_seconds")
    if fixed is None or per_token is None:
        return None
    return {"fixed_ms": 1000 * fixed, "per_token_ms": 1000 * per_token}


# ------------------------------------------------------------ batching window
async def _batch_one(client: httpx.AsyncClient, url: str, body: dict, record: GhostRecord) -> None:
    try:
        response = await client.post(url, json=body)
        record.server_timing = parse_server_timing(response.headers.get("server-timing"))
        if response.status_code == 200:
            usage = response.json().get("usage") or {}
            record.prompt_tokens, record.completion_tokens = usage.get("prompt_tokens"), usage.get("completion_tokens")
        else:
            record.error = f"http_{response.status_code}"
    except httpx.HTTPError as exc:
        record.error = type(exc).__name__
    finally:
        record.end = time.perf_counter()


async def batch_traffic(url: str, prompts: list[str], rate: float, clients: int, max_tokens: int,
                        tier: str | None, seconds: float, seed: int) -> list[GhostRecord]:
    """Poisson arrivals at ``rate``/s for ``seconds`` (at most ``clients`` in flight), non-streamed."""
    rng, gate, tasks, records = random.Random(seed), asyncio.Semaphore(clients), [], []
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)

    async def one(client, body, record):
        async with gate:
            record.start = time.perf_counter()
            await _batch_one(client, completions_url(url), body, record)

    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=30.0), limits=limits) as client:
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            body = {"prompt": prompts[len(records) % len(prompts)], "max_tokens": max_tokens, "temperature": 0,
                    "ignore_eos": True, **({"service_tier": tier} if tier else {})}
            records.append(GhostRecord(0, len(records), time.perf_counter()))
            tasks.append(asyncio.create_task(one(client, body, records[-1])))
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks)
    return records


def window_point(w: int, args, known: set[str], dropped: list[str], prompts: list[str]) -> dict:
    """Batch traffic on a server with batching window ``w`` ms."""
    flags = server_args(WINDOW_FLAGS, known, dropped, w=w)
    with KVServe(*base_args(args), *flags, cpus=args.server_cpus) as server:
        tier = BATCH_TIER if tier_accepted(server.url, BATCH_TIER) else None
        asyncio.run(batch_traffic(server.url, prompts[:2], 4.0, 2, 4, tier, 1.0, args.seed + 1))
        records = asyncio.run(batch_traffic(server.url, prompts, args.batch_rate, args.batch_clients,
                                            args.batch_max_tokens, tier, args.window_s, args.seed))
    ok = [r for r in records if r.error is None and r.completion_tokens is not None]
    duration = max(r.end for r in records) - min(r.start for r in records)
    queue = [r.server_timing["queue"] for r in ok if "queue" in r.server_timing]
    point = {"batch_window_ms": w, "server_flags": flags, "service_tier_sent": tier, "sent": len(records),
             "completed": len(ok), "duration_s": duration,
             "output_tokens_per_s": sum(r.completion_tokens for r in ok) / duration if duration else 0.0,
             "queue_ms_mean": sum(queue) / len(queue) if queue else None,
             "queue_ms_p50": percentile(queue, 50), "queue_ms_count": len(queue),
             "e2e_ms": distribution([r.e2e_s for r in ok])}
    print(f"[window {w}] {point['output_tokens_per_s']:.1f} tok/s, queue mean {point['queue_ms_mean']}",
          file=sys.stderr)
    return point


def window_curve(args, known: set[str], dropped: list[str], prompts: list[str]) -> dict:
    points = [window_point(int(w), args, known, dropped, prompts) for w in args.windows.split(",") if w]
    base = next((p for p in points if p["batch_window_ms"] == 0), points[0] if points else None)
    for p in points:
        p["queue_ms_mean_over_w0"] = ratio(p["queue_ms_mean"], base["queue_ms_mean"])
        p["queue_ms_p50_over_w0"] = ratio(p["queue_ms_p50"], base["queue_ms_p50"])
        p["output_tokens_per_s_over_w0"] = ratio(p["output_tokens_per_s"], base["output_tokens_per_s"])
    return {"rate_per_s": args.batch_rate, "clients": args.batch_clients, "max_tokens": args.batch_max_tokens,
            "seconds": args.window_s, "points": points}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", choices=("ghost", "window"), default=None)
    p.add_argument("--configs", default="a,b,c,d", help="ghost settings to run (of a,b,c,d)")
    p.add_argument("--windows", default="0,25,50,100,200", help="batch windows (ms) for the curve")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--server-cpus", default="0")
    p.add_argument("--client-cpus", default="1")
    p.add_argument("--kv-cache-gib", type=float, default=0.5)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--typists", type=int, default=3)
    p.add_argument("--ghost-s", type=float, default=45.0, help="seconds of chat + typists per setting")
    p.add_argument("--chat-alone-s", type=float, default=30.0, help="seconds of chat alone per setting")
    p.add_argument("--ghost-max-tokens", type=int, default=8)
    p.add_argument("--keystrokes-per-s", type=float, default=6.0, help="each typist's typing speed")
    p.add_argument("--ghost-stream", action="store_true", help="stream ghost requests (client-side TTFT)")
    p.add_argument("--ghost-file", default=None)
    p.add_argument("--budget-ms", type=float, default=200.0)
    p.add_argument("--chat-clients", type=int, default=3)
    p.add_argument("--chat-input-len", type=int, default=192, help="tokens per user turn")
    p.add_argument("--chat-output-len", type=int, default=64)
    p.add_argument("--batch-rate", type=float, default=1.5, help="batch arrivals per second")
    p.add_argument("--batch-clients", type=int, default=8, help="batch requests in flight at most")
    p.add_argument("--batch-max-tokens", type=int, default=32)
    p.add_argument("--window-s", type=float, default=35.0, help="seconds of batch traffic per window")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    p.add_argument("--merge-into", default=None, metavar="FILE",
                   help="start from this earlier report and replace only the parts run now")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    pin_self(args.client_cpus)
    known, dropped = serve_flags(), []
    tokenizer = Tokenizer.load(default_model_path())
    report = {"benchmark": "latency_classes", "server_cpus": args.server_cpus, "client_cpus": args.client_cpus,
              "settings": vars(args), "dropped_flags": dropped}
    if args.merge_into:
        with open(args.merge_into, encoding="utf-8") as f:
            earlier = json.load(f)
        report = {**earlier, "settings_" + (args.only or "all"): vars(args), "dropped_flags": dropped}
    if args.only in (None, "ghost"):
        text = read_ghost_file(args.ghost_file)
        chat = build_workload("multi-turn", tokenizer, 400, args.chat_input_len, args.chat_output_len,
                              spread=0.25, turns=3, seed=args.seed)
        report["ghost"] = [measure_config(name, args, known, dropped, chat, text)
                           for name in args.configs.split(",") if name]
    if args.only in (None, "window"):
        prompts = [r.prompt for r in build_workload("random", tokenizer, 64, 128, 1, spread=0.25, chat=False,
                                                    seed=args.seed)]
        report["window"] = window_curve(args, known, dropped, prompts)
    emit_report(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
