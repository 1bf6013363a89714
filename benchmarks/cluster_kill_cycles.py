"""Engines killed mid-run, again and again, on a 2-replica cluster: each cycle starts four long
streams, kills the busiest engine (SIGKILL), and while Ray Serve replaces its replica sends a
short chat every ``--interval-s`` for ``--probe-s`` seconds, each in its own thread with a
``--timeout-s`` client timeout. Reports every request's outcome: a request that hangs (the
client times out) or fails is a fault of the cluster's serving path (docs/cluster.md, keep-alives).

    .venv/bin/python benchmarks/cluster_kill_cycles.py [--cycles 6] [--out FILE]
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402

from benchmarks.bench_host import emit, machine  # noqa: E402
from benchmarks.cluster_processes import busiest, engine_processes  # noqa: E402
from benchmarks.server_process import ServerProcess  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
FLAGS = ("--threads", "1", "--dtype", "float32", "--kv-cache-gib", "0.05", "--max-num-seqs", "4", "--replicas", "2")


def _post(url: str, body: dict, timeout_s: float, out: list) -> None:
    started = time.monotonic()
    try:
        response = httpx.post(url + "/chat/completions", json=body, timeout=timeout_s)
        out.append((str(response.status_code), time.monotonic() - started))
    except httpx.TimeoutException:
        out.append(("timeout", time.monotonic() - started))
    except httpx.HTTPError as exc:
        out.append((type(exc).__name__, time.monotonic() - started))


def _kill_mid_run(url: str) -> None:
    """Four long streams; once each has its first tokens, the busiest engine is killed."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Count from one to a hundred."}],
            "max_tokens": 200, "temperature": 0, "stream": True, "ignore_eos": True}
    started = [threading.Event() for _ in range(4)]

    def stream(i: int) -> None:
        with httpx.stream("POST", url + "/chat/completions", json=body, timeout=180) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    started[i].set()
    threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for event in started:
        event.wait(120)
    os.kill(busiest(engine_processes()).pid, signal.SIGKILL)
    for t in threads:
        t.join(200)


def cycle(url: str, args, offset: int) -> list:
    """One kill, then the probe requests sent while the replica is replaced: (outcome, seconds)."""
    while len(engine_processes()) != 2:
        time.sleep(1)
    _kill_mid_run(url)
    outcomes: list = []
    threads, end, i = [], time.monotonic() + args.probe_s, offset
    while time.monotonic() < end:
        body = {"model": MODEL, "messages": [{"role": "user", "content": f"Unrelated question {i % 8 * 37}: why?"}],
                "max_tokens": 2}
        threads.append(threading.Thread(target=_post, args=(url, body, args.timeout_s, outcomes)))
        threads[-1].start()
        i += 1
        time.sleep(args.interval_s)
    for t in threads:
        t.join(args.timeout_s + 10)
    return outcomes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cycles", type=int, default=6)
    parser.add_argument("--probe-s", type=float, default=90.0)
    parser.add_argument("--interval-s", type=float, default=0.3)
    parser.add_argument("--timeout-s", type=float, default=60.0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    per_cycle = []
    with ServerProcess(*FLAGS, command=("cluster", "serve"), startup_timeout_s=420) as cluster:
        for n in range(args.cycles):
            outcomes = cycle(cluster.base_url, args, 10_000 * n)
            per_cycle.append({"requests": len(outcomes), "outcomes": dict(Counter(o for o, _ in outcomes)),
                              "max_s": round(max((s for _, s in outcomes), default=0.0), 3)})
    total = Counter()
    for c in per_cycle:
        total.update(c["outcomes"])
    emit({"benchmark": "cluster_kill_cycles", "machine": machine(), "cycles": per_cycle,
          "requests": sum(total.values()), "outcomes": dict(total), "hung": total.get("timeout", 0)}, args.out)


if __name__ == "__main__":
    main()
