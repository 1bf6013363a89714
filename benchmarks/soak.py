"""Soak: hours-like load at a multiple of the measured capacity, with mixed tenants,
streaming, cancellations and guard hits; every request must end in exactly one outcome.

    .venv/bin/python benchmarks/soak.py [--duration-s 1800] [--window-s 300]
        [--capacity-probe-s 60] [--load-factor 2.0] [--out benchmarks/soak.json] [--seed 0]

1. ``kvserve serve`` on 127.0.0.1 with its own tenants file in a temp dir
   (``soak_mix.tenants_toml``: heavy / light / ghost (interactive) / batch tenants, a
   rules guard blocking BLOCKME at input, stream and output, an admin key for /metrics),
   the engine pinned to --engine-cpus with --threads 1, a small KV cache
   (--kv-cache-gib) and queue (--max-queued-requests), and --audit-log in the temp dir.
   This process (all clients) runs on --client-cpus.
2. Capacity, on a first server: a closed loop at --probe-concurrency for
   --capacity-probe-s (the ``probe`` tenant, no guards or limits; the soak's mix without
   guard hits or cancellations; a 429/503 waits its Retry-After): requests completed in
   the window per second. Tenant heavy's ``tokens_per_min`` is then set from it
   (--heavy-limit-fraction of heavy's share of the tokens served at capacity, so 429s
   happen; or --heavy-tokens-per-min).
3. Soak, on a fresh server with that file: Poisson arrivals at --load-factor x capacity for
   --duration-s with the mix of ``soak_mix.KINDS`` (chat streamed and not, completions,
   interactive inline completions, batch, ~5% BLOCKME inputs, ~5% prompts that make the
   model say "blockme", ~10% client cancellations). Every request is classified in exactly
   one outcome (``kvserve.loadgen.outcomes``): completed / rate_limited / overloaded /
   content_filter / input_blocked / client_abort / other (must be 0).
   Server RSS (HTTP + engine process, /proc VmRSS) and a few gauges every --rss-interval-s.
4. End: wait until the server is idle, then /metrics: kvserve_kv_integrity_ok = 1 and
   kvserve_kv_blocks_used = 0. Cross-checks: the audit log's lines and
   kvserve_tenant_requests_total against the requests sent.

Report (printed and written to --out): outcomes overall, per kind and per --window-s
window (with p50/p99 TTFT and e2e of admitted interactive requests), RSS after warm-up
(--warmup-fraction of the run) and at the end (growth goal <= 5%), the checks and ``pass``.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import tempfile
import time

import httpx
import soak_report as rep
from bench_host import machine, pin_cpus, scrape as scrape_admin
from process_memory import RssSampler
from serving_common import emit_report
from server_process import ServerProcess
from soak_mix import ADMIN_KEY, GUARD_NAME, MAIN_TENANTS, RequestMix, key_of, tenant_share, tenants_toml

from kvserve.loader import default_model_path
from kvserve.loadgen.outcomes import OutcomeRecord, send_classified
from kvserve.tokenizer import Tokenizer


def scrape(client: httpx.AsyncClient, base: str):
    """/metrics with the soak's admin key, parsed ({} when it cannot be read)."""
    return scrape_admin(client, base, ADMIN_KEY)


GAUGES = ("kvserve_num_requests_in_flight", "kvserve_num_requests_queued", "kvserve_num_requests_running",
          "kvserve_num_requests_waiting", "kvserve_kv_blocks_used", "kvserve_preemptions_total")


def server_args(args, tenants_path: str, audit_path: str) -> list[str]:
    """``kvserve serve`` flags of the probe and the soak server."""
    return ["--tenants", tenants_path, "--audit-log", audit_path, "--engine-cpus", args.engine_cpus,
            "--http-cpus", args.http_cpus, "--threads", "1", "--dtype", "float32",
            "--kv-cache-gib", str(args.kv_cache_gib), "--max-num-seqs", str(args.max_num_seqs),
            "--max-queued-requests", str(args.max_queued_requests), "--retry-after", "1",
            *(["--prefix-cache-grace-s", str(args.prefix_cache_grace_s)] if args.prefix_cache_grace_s is not None
              else [])]


def retry_after_s(value: str | None, default: float = 1.0) -> float:
    """Seconds of a Retry-After header (``default`` when absent or not a number)."""
    try:
        return max(0.1, float(value)) if value else default
    except ValueError:
        return default


def endpoint_url(base: str, endpoint: str) -> str:
    """The generation route of ``endpoint`` ("chat" or "completions")."""
    return base + ("/v1/chat/completions" if endpoint == "chat" else "/v1/completions")


def new_record(plan) -> OutcomeRecord:
    """An empty record of ``plan``, its start time now."""
    return OutcomeRecord(plan.kind, plan.tenant, plan.stream, start=time.perf_counter())


async def send_plan(client: httpx.AsyncClient, base: str, plan, record: OutcomeRecord | None = None
                    ) -> OutcomeRecord:
    """Send one planned request (into ``record``, or a new one); the classified record."""
    record = record or new_record(plan)
    return await send_classified(client, endpoint_url(base, plan.endpoint), plan.body, record,
                                 api_key=key_of(plan.tenant), cancel_after_chunks=plan.cancel_after_chunks,
                                 abort_after_s=plan.abort_after_s)


# ------------------------------------------------------------------ phases
async def probe_capacity(client, base: str, mix: RequestMix, concurrency: int, seconds: float) -> dict:
    """Closed loop at ``concurrency`` for ``seconds``: requests completed inside the window per
    second of it (requests still running at its end finish but are not counted)."""
    await asyncio.gather(*(send_plan(client, base, mix.next_probe()) for _ in range(2)))   # warm-up
    records: list[OutcomeRecord] = []
    started = time.perf_counter()
    deadline = started + seconds

    async def worker():
        while time.perf_counter() < deadline:
            record = await send_plan(client, base, mix.next_probe())
            records.append(record)
            if record.outcome in ("overloaded", "rate_limited"):      # honour Retry-After, do not spin
                await asyncio.sleep(retry_after_s(record.retry_after))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    done = [r for r in records if r.outcome == "completed" and r.end <= deadline]
    tokens = sum(r.completion_tokens or 0 for r in done)
    used = [(r.prompt_tokens or 0) + (r.completion_tokens or 0) for r in records if r.outcome == "completed"]
    return {"concurrency": concurrency, "seconds": seconds, "sent": len(records),
            "completed_in_window": len(done), "outcomes": rep.counts(records),
            "requests_per_s": len(done) / seconds, "output_tokens_per_s": tokens / seconds,
            "tokens_per_completed_request": sum(used) / len(used) if used else 0.0,
            "tail_s": round(time.perf_counter() - deadline, 1)}


async def sample_loop(client, base: str, sampler: RssSampler, interval_s: float, gauges: list, stop: asyncio.Event):
    """RSS and a few gauges every ``interval_s`` until ``stop`` is set."""
    while not stop.is_set():
        now = time.perf_counter()
        sampler.sample(now)
        metrics = await scrape(client, base)
        gauges.append({"t": now, **{name: metrics.get(name) for name in GAUGES}})
        try:
            await asyncio.wait_for(stop.wait(), interval_s)
        except asyncio.TimeoutError:
            pass


async def open_loop(client, base: str, mix: RequestMix, rate: float, duration_s: float, seed: int,
                    drain_timeout_s: float) -> tuple[list[OutcomeRecord], float]:
    """Poisson arrivals at ``rate``/s for ``duration_s`` (absolute schedule, no drift); waits for
    every request to end (at most ``drain_timeout_s`` after the last send). Returns the records
    and the start time."""
    rng, records, pending = random.Random(seed + 1), [], set()
    t0 = time.perf_counter()
    next_at = t0 + rng.expovariate(rate)
    while next_at - t0 < duration_s:
        await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
        plan = mix.next()
        records.append(new_record(plan))
        task = asyncio.create_task(send_plan(client, base, plan, records[-1]))
        pending.add(task)
        task.add_done_callback(pending.discard)
        next_at += rng.expovariate(rate)
    if pending:
        _done, late = await asyncio.wait(set(pending), timeout=drain_timeout_s)
        for task in late:
            task.cancel()
        await asyncio.gather(*late, return_exceptions=True)
    return records, t0


async def wait_idle(client, base: str, timeout_s: float) -> tuple[dict, float]:
    """Poll /metrics until nothing is in flight, running or waiting and no KV block is used
    (then one more second for the engine's idle integrity check); the last scrape and the wait."""
    started = time.perf_counter()
    metrics: dict = {}
    while time.perf_counter() - started < timeout_s:
        metrics = await scrape(client, base)
        busy = [metrics.get(n) for n in ("kvserve_num_requests_in_flight", "kvserve_num_requests_running",
                                         "kvserve_num_requests_waiting", "kvserve_kv_blocks_used")]
        if metrics and not any(busy):
            await asyncio.sleep(1.0)
            return {**await scrape(client, base), "idle_reached": True}, time.perf_counter() - started
        await asyncio.sleep(0.5)
    return {**metrics, "idle_reached": False}, time.perf_counter() - started


def http_client(args) -> httpx.AsyncClient:
    """One connection pool for every request (open loop: never the bottleneck)."""
    limits = httpx.Limits(max_connections=2048, max_keepalive_connections=128)
    return httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(args.request_timeout_s, connect=30.0))


async def run_probe(args, url: str, mix: RequestMix) -> dict:
    """The capacity probe on its own server."""
    async with http_client(args) as client:
        probe = await probe_capacity(client, url, mix, args.probe_concurrency, args.capacity_probe_s)
    print(f"[soak] capacity {probe['requests_per_s']:.2f} req/s ({probe['output_tokens_per_s']:.1f} tok/s)",
          file=sys.stderr)
    return probe


async def run_load(args, url: str, mix: RequestMix, sampler: RssSampler, rate: float) -> dict:
    """The open-loop soak and the idle check; the raw material of the report."""
    async with http_client(args) as client:
        before = await scrape(client, url)
        print(f"[soak] offering {rate:.2f} req/s for {args.duration_s:.0f} s", file=sys.stderr)
        stop, gauges = asyncio.Event(), []
        sampling = asyncio.create_task(sample_loop(client, url, sampler, args.rss_interval_s, gauges, stop))
        records, t0 = await open_loop(client, url, mix, rate, args.duration_s, args.seed,
                                      args.request_timeout_s + 30.0)
        load_end = time.perf_counter()
        after, idle_wait_s = await wait_idle(client, url, args.idle_timeout_s)
        sampler.sample()
        stop.set()
        await sampling
    return {"rate": rate, "records": records, "t0": t0, "load_end": load_end, "before": before,
            "after": after, "idle_wait_s": idle_wait_s, "audit_skip": 0, "gauges": gauges}


def heavy_limit(args, probe: dict) -> dict:
    """Tenant heavy's tokens_per_min: the flag, or (0 = auto) --heavy-limit-fraction of the
    tokens heavy's share of the mix would be served at the measured capacity."""
    if args.heavy_tokens_per_min:
        return {"tokens_per_min": args.heavy_tokens_per_min, "how": "--heavy-tokens-per-min"}
    served_per_min = probe["requests_per_s"] * probe["tokens_per_completed_request"] * 60.0
    share = tenant_share("heavy")
    value = max(1024, int(args.heavy_limit_fraction * share * served_per_min))
    return {"tokens_per_min": value, "how": f"auto: {args.heavy_limit_fraction} x heavy's share of the mix "
            f"({share:.3f}) x tokens served per minute at capacity ({served_per_min:.0f})"}


def write_tenants(tmp: str, name: str, heavy_tokens_per_min: int) -> tuple[str, str]:
    """The tenants file ``tenants-<name>.toml`` in ``tmp``: (path, text)."""
    text = tenants_toml(heavy_tokens_per_min)
    path = os.path.join(tmp, f"tenants-{name}.toml")
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return path, text


# ------------------------------------------------------------------ report
def checks_and_pass(report: dict) -> None:
    """Fill ``report["checks"]`` and ``report["pass"]`` (every check true)."""
    acc, kv, rss = report["accounting"], report["kv"], report["rss"]
    checks = {
        "sent_equals_sum_of_outcomes": acc["sent"] == acc["sum_of_outcomes"],
        "no_other_outcome": report["outcomes"]["other"] == 0,
        "audit_lines_equal_sent": report["audit_log"].get("lines") == acc["sent"],
        "metrics_tenant_requests_equal_sent": report["metrics_tenant_requests"]["total"] == acc["sent"],
        "kv_integrity_ok": kv["integrity_ok"] == 1,
        "kv_blocks_used_zero": kv["blocks_used"] == 0,
        "rss_growth_within_goal": rss.get("growth_fraction") is not None
                                  and rss["growth_fraction"] <= rss["goal_max_growth"],
        "server_alive": report["server_alive"],
    }
    report["checks"], report["pass"] = checks, all(checks.values())
    seen = report["outcomes"]
    report["coverage"] = {name: seen[name] > 0 for name in
                          ("rate_limited", "overloaded", "content_filter", "input_blocked", "client_abort")}


def kv_state(before: dict, after: dict) -> dict:
    """The KV pool once idle (the last scrape of ``wait_idle``) and the preemptions of the soak."""
    return {"idle_reached": bool(after.get("idle_reached")), "integrity_ok": after.get("kvserve_kv_integrity_ok"),
            "blocks_used": after.get("kvserve_kv_blocks_used"), "blocks_cached": after.get("kvserve_kv_blocks_cached"),
            "blocks_total": after.get("kvserve_kv_blocks_total"),
            "preemptions": rep.counter_delta(before, after, "kvserve_preemptions_total")}


def build_report(args, raw: dict, sampler: RssSampler, audit_path: str, server: ServerProcess) -> dict:
    """The JSON report from the phases' raw results."""
    records, t0, before, after = raw["records"], raw["t0"], raw["before"], raw["after"]
    outcomes = rep.counts(records)
    sent_span = (records[-1].start - t0) if records else 0.0
    audit = rep.audit_summary(audit_path, MAIN_TENANTS, raw["audit_skip"])
    tenant_metrics = rep.tenant_requests(before, after, MAIN_TENANTS)
    decisions = rep.guard_decisions(before, after)
    report = {
        "offered_rate_per_s": round(raw["rate"], 3),
        "achieved_send_rate_per_s": round(len(records) / sent_span, 3) if sent_span else None,
        "load_seconds": round(raw["load_end"] - t0, 1), "idle_wait_s": round(raw["idle_wait_s"], 1),
        "sent": len(records), "outcomes": outcomes, "other_detail": rep.other_details(records),
        "overloaded_codes": rep.overloaded_codes(records), "refusal_headers": rep.refusal_headers(records),
        "outcomes_by_kind": rep.by_kind(records),
        "accounting": {"sent": len(records), "sum_of_outcomes": sum(outcomes.values()),
                       "unaccounted": len(records) - sum(outcomes.values())},
        "audit_log": {**audit, "server_minus_client": rep.compare(outcomes, audit.get("outcomes") or {})},
        "metrics_tenant_requests": tenant_metrics,
        "guards": {"decisions": decisions, "active": any(k.startswith(GUARD_NAME + "/") for k in decisions)},
        "kv": kv_state(before, after),
        "rss": rep.rss(sampler.samples, t0, args.duration_s, args.warmup_fraction, args.rss_goal),
        "interactive_completed_overall": rep.latency(rep.admitted_interactive(records)),
        "windows": rep.windows(records, t0, args.window_s, args.duration_s),
        "gauges": [{"t_s": round(g["t"] - t0, 1), **{k.replace("kvserve_", ""): v for k, v in g.items() if k != "t"}}
                   for g in raw["gauges"]],
        "server_alive": server.process.poll() is None,
    }
    checks_and_pass(report)
    return report


def notes(report: dict) -> list[str]:
    """Plain-language remarks on what the run could not show."""
    out = []
    if not report["guards"]["active"]:
        out.append("no guard decision in /metrics: the guards are not wired into this server "
                   "(kvserve_guard_decisions_total did not move); BLOCKME inputs were not blocked")
    for name, seen in report["coverage"].items():
        if not seen:
            out.append(f"no '{name}' outcome was seen in this run")
    if not report["metrics_tenant_requests"]["series_present"]:
        out.append("kvserve_tenant_requests_total has no series for the soak's tenants")
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration-s", type=float, default=1800.0, help="seconds of open-loop load")
    p.add_argument("--window-s", type=float, default=300.0, help="report window length")
    p.add_argument("--capacity-probe-s", type=float, default=60.0, help="seconds of the closed-loop probe")
    p.add_argument("--load-factor", type=float, default=2.0, help="offered rate / measured capacity")
    p.add_argument("--probe-concurrency", type=int, default=16)
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "soak.json"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--engine-cpus", default="0")
    p.add_argument("--http-cpus", default="0")
    p.add_argument("--client-cpus", default="1")
    p.add_argument("--kv-cache-gib", type=float, default=0.25,
                   help="small (with the prefix cache's 30 s grace, preemption happens)")
    p.add_argument("--prefix-cache-grace-s", type=float, default=None,
                   help="passed to the server when given (its default: 30 s)")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-queued-requests", type=int, default=8, help="small, so overload gives 503s")
    p.add_argument("--heavy-tokens-per-min", type=int, default=0,
                   help="tenant heavy's token limit (429s); 0: from the capacity probe (--heavy-limit-fraction)")
    p.add_argument("--heavy-limit-fraction", type=float, default=0.5,
                   help="auto limit: this fraction of heavy's share of the tokens served at capacity")
    p.add_argument("--request-timeout-s", type=float, default=300.0, help="client timeout of one request")
    p.add_argument("--idle-timeout-s", type=float, default=120.0, help="wait for idle at the end, at most")
    p.add_argument("--rss-interval-s", type=float, default=10.0)
    p.add_argument("--warmup-fraction", type=float, default=0.2, help="RSS baseline point (fraction of the run)")
    p.add_argument("--rss-goal", type=float, default=0.05, help="most RSS growth after warm-up")
    return p.parse_args(argv)


def soak_phase(args, tmp: str, mix: RequestMix, probe: dict, head: dict) -> dict:
    """Start the soak's server (heavy's limit from the probe), run the load, build the report."""
    limit = heavy_limit(args, probe)
    tenants_path, tenants = write_tenants(tmp, "soak", limit["tokens_per_min"])
    audit_path = os.path.join(tmp, "audit.jsonl")
    flags = server_args(args, tenants_path, audit_path)
    head = {**head, "server_flags": flags, "tenants_file": tenants, "heavy_limit": limit}
    with ServerProcess(*flags, startup_timeout_s=600.0) as server:
        engine_pid = server.engine_pid()
        sampler = RssSampler(server.process.pid, {server.process.pid: "http", engine_pid: "engine"})
        raw = asyncio.run(run_load(args, server.url, mix, sampler, args.load_factor * probe["requests_per_s"]))
        report = {**head, "capacity": probe, **build_report(args, raw, sampler, audit_path, server)}
        report["notes"] = notes(report)
        if not report["pass"]:
            report["server_log_tail"] = server.log_tail(3000)
    return report


def main(argv=None) -> int:
    """Probe on one server, soak on a second; print and write the report; exit 0 on a pass."""
    args = parse_args(argv)
    pin_cpus(args.client_cpus)
    mix = RequestMix(Tokenizer.load(default_model_path()), args.seed)
    head = {"benchmark": "soak", "command": [sys.executable, *sys.argv], "machine": machine(),
            "settings": vars(args)}
    with tempfile.TemporaryDirectory(prefix="kvserve-soak-") as tmp:
        path, _text = write_tenants(tmp, "probe", args.heavy_tokens_per_min or 10**6)
        flags = server_args(args, path, os.path.join(tmp, "probe-audit.jsonl"))
        with ServerProcess(*flags, startup_timeout_s=600.0) as server:
            probe = asyncio.run(run_probe(args, server.url, mix))
            log_tail = server.log_tail(3000)
        if probe["requests_per_s"] <= 0:
            report = {**head, "capacity": probe, "error": "the capacity probe completed no request",
                      "pass": False, "server_log_tail": log_tail}
        else:
            report = soak_phase(args, tmp, mix, probe, head)
    emit_report(report, args.out)
    return 0 if report["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
