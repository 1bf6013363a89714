"""Guard overhead: throughput and TTFT with the rules guard and with the model guard on
vs off, on the same requests, servers started one after another in the same run.

    .venv/bin/python benchmarks/guard_overhead.py [--concurrency 4,16] [--requests-per-client 6]
        [--configs off,rules,model] [--model-guard JSON] [--out benchmarks/guard_overhead.json]

Three server settings (``CONFIGS``), each its own ``kvserve serve --tenants FILE`` with one
tenant ``bench`` (the same tenants file but for the guards it lists, so auth and tenancy
cost the same in every setting):

- ``off``: no guard;
- ``rules``: a rules guard (the word BLOCKME, action block) at input, stream and output;
- ``model``: a model guard (``{"type": "model", ...}``: the served model is asked a
  classification prompt) at input and output, with a threshold it never reaches (see
  ``MODEL_GUARD``: the cost of asking, never a block; ``--model-guard`` replaces the table;
  if the server refuses to start with it, the next of ``MODEL_GUARD_FALLBACKS`` is tried,
  and the report says which one ran).

Requests: random-word chat prompts (~--input-len tokens), --output-len tokens each with
``ignore_eos``, greedy, streamed with usage; a fixed concurrency sweep (--concurrency), each
level --requests-per-client x concurrency requests after a short warm-up. No prompt holds
BLOCKME, so a guard should never fire: any refusal or content_filter is a false positive
and is reported. The server runs on --server-cpus (engine and HTTP process, --threads 1),
this process on --client-cpus.

Per setting and concurrency: output tok/s, TTFT p50/p99, e2e p50 (client side), outcomes,
and from /metrics the guard's own latency per point (kvserve_guard_latency_seconds) and its
decisions; ``guard_active`` is false when no decision was counted (the guard is not wired).
Ratios vs ``off``: output tok/s (higher is better), TTFT p50/p99 and e2e p50 (lower is better).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time

import httpx
import soak_report as rep
from bench_host import machine, pin_cpus, scrape_sync
from server_process import ServerProcess

from kvserve.loader import default_model_path
from kvserve.loadgen.outcomes import OutcomeRecord, send_classified
from kvserve.loadgen.report import percentile
from kvserve.loadgen.workloads import build_workload
from kvserve.tokenizer import Tokenizer

ADMIN_KEY, TENANT_KEY, GUARD = "guard-admin", "guard-bench", "g"
RULES_GUARD = {"type": "rules", "words": ["BLOCKME"], "action": "block", "points": ["input", "stream", "output"]}
# The model guard asks the served model the same question whatever it answers, so the cost
# is measured with a threshold it never reaches: SmolLM2-135M as its own guard rates these
# random-word prompts (and most outputs) "dangerous", and a block would end a request early
# and make the guard look cheaper than it is. Its default timeout_ms 2000 failing closed
# would do the same under load; here it waits. --model-guard sets any other table.
MODEL_GUARD = {"type": "model", "points": ["input", "output"], "threshold": 1000.0, "timeout_ms": 60000,
               "on_timeout": "open"}
MODEL_GUARD_FALLBACKS = ({**MODEL_GUARD, "points": ["input"]},)
CONFIGS = {"off": None, "rules": RULES_GUARD, "model": MODEL_GUARD}


def tenants_file(guard: dict | None) -> str:
    """The tenants file (YAML, written as JSON, which YAML reads) for one setting."""
    tenant = {"keys": [TENANT_KEY], "weight": 1.0, "guards": [GUARD] if guard else []}
    data = {"admin_keys": [ADMIN_KEY], "tenants": {"bench": tenant}}
    if guard:
        data["guards"] = {GUARD: guard}
    return json.dumps(data, indent=2)


async def run_level(base: str, requests, concurrency: int, timeout_s: float) -> list[OutcomeRecord]:
    """``requests`` at fixed ``concurrency`` (each worker sends its next as the last ends)."""
    queue = list(reversed(requests))
    records: list[OutcomeRecord] = []
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)

    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout_s, connect=30.0)) as client:
        async def worker():
            while queue:
                request = queue.pop()
                body = {"messages": request.messages, "max_tokens": request.max_tokens, "temperature": 0.0,
                        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
                record = OutcomeRecord("chat_stream", "bench", True, start=time.perf_counter())
                records.append(await send_classified(client, base + "/v1/chat/completions", body, record,
                                                     api_key=TENANT_KEY))
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return records


def figures(records: list[OutcomeRecord]) -> dict:
    """Output tok/s over the level, TTFT p50/p99, e2e p50 (ms), outcomes."""
    done = [r for r in records if r.outcome == "completed"]
    span = (max(r.end for r in records) - min(r.start for r in records)) if records else 0.0
    tokens = sum(r.completion_tokens or 0 for r in done)
    ttft = [r.ttft_s for r in done if r.ttft_s is not None]

    def ms(values, p):
        v = percentile(values, p)
        return round(v * 1000.0, 1) if v is not None else None
    return {"requests": len(records), "completed": len(done), "outcomes": rep.counts(records),
            "other_detail": rep.other_details(records), "seconds": round(span, 2), "output_tokens": tokens,
            "output_tokens_per_s": round(tokens / span, 2) if span else None,
            "ttft_ms_p50": ms(ttft, 50), "ttft_ms_p99": ms(ttft, 99), "e2e_ms_p50": ms([r.e2e_s for r in done], 50)}


def guard_latency(before: dict, after: dict) -> dict:
    """Mean guard latency (ms) per point from the histogram's _sum/_count increase."""
    def table(samples, suffix):
        return {l.get("point"): v for l, v in rep.series(samples, "kvserve_guard_latency_seconds" + suffix)
                if l.get("guard") == GUARD}
    sums, cnts = table(after, "_sum"), table(after, "_count")
    sums0, cnts0 = table(before, "_sum"), table(before, "_count")
    out = {}
    for point, count in cnts.items():
        n = count - cnts0.get(point, 0.0)
        if n:
            out[point] = {"checks": int(n), "mean_ms": round((sums[point] - sums0.get(point, 0.0)) / n * 1000.0, 3)}
    return out


def server_for(args, guard: dict | None, tmp: str, name: str) -> tuple[ServerProcess, str]:
    """A (not yet started) server for one setting, its YAML tenants file written to ``tmp``."""
    text = tenants_file(guard)
    path = os.path.join(tmp, f"tenants-{name}.yaml")
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    flags = ["--tenants", path, "--engine-cpus", args.server_cpus, "--http-cpus", args.server_cpus,
             "--threads", "1", "--dtype", "float32", "--kv-cache-gib", str(args.kv_cache_gib),
             "--max-num-seqs", str(max(args.levels)), "--max-queued-requests", "1024"]
    return ServerProcess(*flags, startup_timeout_s=600.0), text


def run_levels(args, name: str, url: str, requests) -> list[dict]:
    """Every concurrency level on one server."""
    levels = []
    for c in args.levels:
        subset = requests[:c * args.requests_per_client]
        level = figures(asyncio.run(run_level(url, subset, c, args.request_timeout_s)))
        levels.append({"concurrency": c, **level})
        print(f"[{name}] c{c}: {level['output_tokens_per_s']} tok/s, TTFT p50 {level['ttft_ms_p50']} ms",
              file=sys.stderr)
    return levels


def measure(args, name: str, guard: dict | None, requests, warmup, tmp: str) -> dict:
    """One setting: start, warm up, every concurrency level, guard metrics, stop."""
    entry = {"config": name, "guard": guard}
    server, entry["tenants_file"] = server_for(args, guard, tmp, name)
    try:
        server.start()
    except (RuntimeError, TimeoutError) as exc:
        server.__exit__(None, None, None)          # stop, delete its log
        entry["error"] = f"server did not start: {str(exc)[-1500:]}"
        return entry
    try:
        asyncio.run(run_level(server.url, warmup, len(warmup), args.request_timeout_s))
        before = scrape_sync(server.url, ADMIN_KEY)
        entry["levels"] = run_levels(args, name, server.url, requests)
        after = scrape_sync(server.url, ADMIN_KEY)
        decisions = rep.guard_decisions(before, after)
        entry["guard_decisions"], entry["guard_latency"] = decisions, guard_latency(before, after)
        entry["guard_active"] = any(k.startswith(GUARD + "/") for k in decisions) if guard else None
        finished = [sum(v for _l, v in rep.series(m, "kvserve_requests_finished_total")) for m in (before, after)]
        entry["engine_requests_finished"] = int(finished[1] - finished[0])
    finally:
        server.__exit__(None, None, None)
    return entry


def measure_model(args, requests, warmup, tmp: str) -> dict:
    """The model guard's setting, falling back to simpler tables if the server refuses one."""
    tried = []
    for guard in (args.model_guard, *MODEL_GUARD_FALLBACKS):
        entry = measure(args, "model", guard, requests, warmup, tmp)
        if "error" not in entry:
            entry["refused_guard_tables"] = tried
            return entry
        tried.append({"guard": guard, "error": entry["error"]})
    return {"config": "model", "error": "the server refused every model guard table tried", "tried": tried}


def add_ratios(entries: list[dict]) -> None:
    """Each level's figures as ratios to the ``off`` setting at the same concurrency."""
    off = next((e for e in entries if e["config"] == "off" and "levels" in e), None)
    if off is None:
        return
    base = {lv["concurrency"]: lv for lv in off["levels"]}
    for entry in entries:
        for level in entry.get("levels", []):
            b = base.get(level["concurrency"])
            level["vs_off"] = {key: (round(level[key] / b[key], 3) if level.get(key) and b and b.get(key) else None)
                               for key in ("output_tokens_per_s", "ttft_ms_p50", "ttft_ms_p99", "e2e_ms_p50")}


def summary(entries: list[dict]) -> dict:
    """config -> "c<N>" -> the ratios vs off (the table to read first)."""
    return {e["config"]: ({f"c{lv['concurrency']}": lv.get("vs_off") for lv in e["levels"]} if "levels" in e
                          else {"error": e.get("error")}) for e in entries}


def notes(entries: list[dict]) -> list[str]:
    """What the run could not show."""
    out = []
    off = next((e for e in entries if e["config"] == "off" and "levels" in e), None)
    for e in entries:
        if "error" in e:
            out.append(f"{e['config']}: {e['error'][:300]}")
        elif e.get("guard_active") is False:
            out.append(f"{e['config']}: the guard made no decision (kvserve_guard_decisions_total did not move): "
                       "it is not wired into this server, so its figures are those of no guard")
        if off is not None and "levels" in e and e is not off:
            e["extra_engine_requests_vs_off"] = e["engine_requests_finished"] - off["engine_requests_finished"]
        for level in e.get("levels", []):
            if level["completed"] != level["requests"]:
                out.append(f"{e['config']} c{level['concurrency']}: {level['requests'] - level['completed']} "
                           f"request(s) did not complete: {level['outcomes']} (false positives?)")
    return out


def parse_args(argv=None):
    here = os.path.dirname(os.path.abspath(__file__))
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", default="4,16", help="comma-separated concurrency levels")
    p.add_argument("--requests-per-client", type=int, default=6, help="requests per level = this x concurrency")
    p.add_argument("--configs", default="off,rules,model")
    p.add_argument("--model-guard", type=json.loads, default=MODEL_GUARD, help="the model guard's table (JSON)")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--kv-cache-gib", type=float, default=0.5)
    p.add_argument("--server-cpus", default="0")
    p.add_argument("--client-cpus", default="1")
    p.add_argument("--request-timeout-s", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.path.join(here, "guard_overhead.json"))
    args = p.parse_args(argv)
    args.levels = [int(c) for c in args.concurrency.split(",") if c]
    return args


def main(argv=None) -> int:
    """Every setting in turn on the same requests; print and write the report."""
    args = parse_args(argv)
    pin_cpus(args.client_cpus)
    tokenizer = Tokenizer.load(default_model_path())
    count = max(args.levels) * args.requests_per_client
    requests = build_workload("random", tokenizer, count, args.input_len, args.output_len, spread=0.25,
                              chat=True, seed=args.seed)
    for r in requests:
        r.max_tokens = args.output_len                # the same length everywhere
    warmup = build_workload("random", tokenizer, 2, 16, 4, chat=True, seed=args.seed + 1)
    entries = []
    with tempfile.TemporaryDirectory(prefix="kvserve-guards-") as tmp:
        for name in [c for c in args.configs.split(",") if c]:
            if name == "model":
                entries.append(measure_model(args, requests, warmup, tmp))
            else:
                entries.append(measure(args, name, CONFIGS[name], requests, warmup, tmp))
    add_ratios(entries)
    report = {"benchmark": "guard_overhead", "command": [sys.executable, *sys.argv], "machine": machine(),
              "settings": {k: v for k, v in vars(args).items()}, "notes": notes(entries),
              "ratios_vs_off": summary(entries), "configs": entries}
    text = json.dumps(report, indent=2)
    print(text)
    with open(args.out, "w", encoding="utf-8") as f:
        f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
