"""Overload on a 2-replica cluster, degradation ladder on vs off: Poisson arrivals at 3x the
measured capacity for 60 s, mixed classes (interactive, chat, batch), streamed. Reports per
class what it got (served, refused, TTFT p50/p99) and goodput: requests served within their
class's SLO per second. Same arrival sequence in both runs; loopback only.

    .venv/bin/python benchmarks/cluster_overload.py [--seconds 60 --load 3] [--out benchmarks/cluster_overload.json]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402

from benchmarks.bench_host import emit, machine  # noqa: E402
from benchmarks.server_process import ServerProcess  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
# class: (share of arrivals, service_tier, max_tokens, TTFT SLO in seconds)
CLASSES = {"interactive": (0.2, "priority", 8, 1.0), "chat": (0.5, "default", 32, 2.0), "batch": (0.3, "flex", 96, 30.0)}
FLAGS = ["--threads", "1", "--dtype", "float32", "--kv-cache-gib", "0.25", "--max-num-seqs", "8", "--replicas", "2"]


def arrivals(rate: float, seconds: float, seed: int) -> list[tuple[float, str, int]]:
    """(send time, class, index) of a Poisson process with the class mix."""
    rng, t, out = random.Random(seed), 0.0, []
    names, weights = list(CLASSES), [CLASSES[c][0] for c in CLASSES]
    while True:
        t += rng.expovariate(rate)
        if t >= seconds:
            return out
        out.append((t, rng.choices(names, weights)[0], len(out)))


async def one(client: httpx.AsyncClient, url: str, kind: str, index: int) -> dict:
    _share, tier, max_tokens, _slo = CLASSES[kind]
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"Request {index}: describe a {kind} task."}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True, "service_tier": tier}
    started, first, status, rung = time.perf_counter(), None, None, None
    try:
        async with client.stream("POST", url, json=body) as r:
            status, rung = r.status_code, r.headers.get("x-kvserve-degradation")
            async for line in r.aiter_lines():
                if line.startswith("data: {") and '"content"' in line and first is None:
                    first = time.perf_counter()
    except httpx.HTTPError as exc:
        status = f"error:{type(exc).__name__}"
    return {"class": kind, "status": status, "rung": rung,
            "ttft_s": (first - started) if first else None, "e2e_s": time.perf_counter() - started}


async def drive(base_url: str, schedule: list, timeout_s: float) -> list[dict]:
    # no connection cap: httpx's default (100) would queue the open loop's requests FIFO in
    # this client, in front of the ingress's class-ordered queue, and count the wait as TTFT
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        start, tasks = time.perf_counter(), []
        for at, kind, index in schedule:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            tasks.append(asyncio.create_task(one(client, base_url + "/chat/completions", kind, index)))
        return await asyncio.gather(*tasks)


async def capacity(base_url: str, seconds: float) -> float:
    """Requests/s a closed loop of 16 mixed-class clients completes."""
    done, stop = 0, time.perf_counter() + seconds
    rng = random.Random(1)

    async def loop(client):
        nonlocal done
        while time.perf_counter() < stop:
            kind = rng.choices(list(CLASSES), [CLASSES[c][0] for c in CLASSES])[0]
            if (await one(client, base_url + "/chat/completions", kind, done))["status"] == 200:
                done += 1
    async with httpx.AsyncClient(timeout=120) as client:
        await asyncio.gather(*(loop(client) for _ in range(16)))
    return done / seconds


def summarise(records: list[dict], seconds: float) -> dict:
    out = {}
    for kind, (_share, _tier, _max_tokens, slo) in CLASSES.items():
        mine = [r for r in records if r["class"] == kind]
        served = [r for r in mine if r["status"] == 200 and r["ttft_s"] is not None]
        ttfts = sorted(r["ttft_s"] for r in served)
        out[kind] = {"sent": len(mine), "served": len(served), "refused_503": sum(r["status"] == 503 for r in mine),
                     "other": len(mine) - len(served) - sum(r["status"] == 503 for r in mine),
                     "ttft_p50_s": round(ttfts[len(ttfts) // 2], 3) if ttfts else None,
                     "ttft_p99_s": round(ttfts[int(0.99 * (len(ttfts) - 1))], 3) if ttfts else None,
                     "goodput_per_s": round(sum(r["ttft_s"] <= slo for r in served) / seconds, 3)}
    out["rungs_seen"] = sorted({r["rung"] for r in records if r["rung"]})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--load", type=float, default=3.0)
    parser.add_argument("--probe-seconds", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    report = {"benchmark": "cluster_overload", "machine": machine(), "settings": vars(args), "classes": CLASSES}
    runs = {}
    for name, extra in (("ladder_off", ["--no-ladder"]), ("ladder_on", ["--chat-ttft-slo", "2.0", "--ladder-dwell-s", "5"])):
        with ServerProcess(*FLAGS, *extra, command=("cluster", "serve"), startup_timeout_s=600) as server:
            if "capacity_per_s" not in report:
                report["capacity_per_s"] = round(asyncio.run(capacity(server.base_url, args.probe_seconds)), 3)
                report["schedule"] = arrivals(args.load * report["capacity_per_s"], args.seconds, args.seed)
            records = asyncio.run(drive(server.base_url, report["schedule"], 120.0))
        runs[name] = summarise(records, args.seconds)
        print(json.dumps({name: runs[name]}), flush=True)
    report["schedule"] = len(report["schedule"])
    report["runs"] = runs
    emit(report, args.out)


if __name__ == "__main__":
    main()
