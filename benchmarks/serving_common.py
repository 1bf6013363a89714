"""Shared pieces of the serving benchmarks: pinned server processes, CPU-time accounting,
the offline baseline, and one bench run through kvserve.loadgen's runner.

Every figure is measured in the same run as its baseline. On a shared machine the
wall-clock figures move with other load, so each run also reports output tokens per
CPU-second of the server's own processes (read from /proc), which does not.
"""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from kvserve.loadgen.report import summarize
from kvserve.loadgen.runner import ClientConfig, Runner
from server_process import ServerProcess, free_port

CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pids: list[int]) -> float:
    """user + system CPU seconds used so far by these processes."""
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])          # utime, stime
    return total / CLK_TCK


def default_llama_server() -> str:
    return os.path.join(ROOT, ".venv", "bin", "llama-server")


class LlamaServer:
    """llama.cpp's llama-server on the same GGUF file, pinned, with ``slots`` parallel slots."""

    def __init__(self, binary: str, model_path: str, slots: int, ctx_per_slot: int, threads: int, cpus: str):
        self.port = free_port()
        self.command = ["taskset", "-c", cpus, binary, "-m", model_path, "--host", "127.0.0.1",
                        "--port", str(self.port), "-t", str(threads), "-tb", str(threads), "-np", str(slots),
                        "-c", str(slots * ctx_per_slot), "--no-webui", "--log-disable"]
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "LlamaServer":
        self.process = subprocess.Popen(self.command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.process.returncode}")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise TimeoutError("llama-server did not become healthy")

    def pids(self) -> list[int]:
        return [self.process.pid]

    def __exit__(self, *exc) -> None:
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()


class KVServe(ServerProcess):
    """``kvserve serve`` pinned to ``cpus``; pids() = HTTP process + engine process."""

    def pids(self) -> list[int]:
        return [self.process.pid, self.engine_pid()]


def bench(url: str, requests, concurrency: int, warmup, endpoint: str = "completions",
          model: str | None = None, pids: list[int] | None = None) -> dict:
    """One fixed-concurrency run (after a warm-up); the summary plus server CPU seconds."""
    config = ClientConfig(url, model, endpoint, temperature=0.0, ignore_eos=True)
    if warmup:
        asyncio.run(Runner(config).run(warmup, concurrency=len(warmup)))
    cpu_before = cpu_seconds(pids) if pids else None
    runner = Runner(config)
    asyncio.run(runner.run(requests, concurrency=concurrency))
    summary = summarize(runner.records)
    if pids:
        summary["server_cpu_s"] = cpu_seconds(pids) - cpu_before
        summary["output_tokens_per_cpu_s"] = summary["output_tokens"] / max(summary["server_cpu_s"], 1e-9)
    return summary


OFFLINE_SCRIPT = r"""
import json, sys, time
from kvserve import LLM, SamplingParams
spec = json.loads(sys.stdin.read())
llm = LLM(None, dtype="float32", num_threads=spec["threads"], kv_cache_bytes=spec["kv_bytes"],
          max_num_seqs=spec["max_num_seqs"])
llm.generate(spec["prompts"][:2], SamplingParams(max_tokens=4, temperature=0))
params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in spec["max_tokens"]]
wall, cpu = time.perf_counter(), time.process_time()
outs = llm.generate(spec["prompts"], params)
wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
tokens = sum(len(o.outputs[0].token_ids) for o in outs)
print(json.dumps({"output_tokens": tokens, "duration_s": wall, "cpu_s": cpu,
                  "output_token_throughput": tokens / wall, "output_tokens_per_cpu_s": tokens / cpu}))
"""


def offline(requests, threads: int, kv_bytes: int, max_num_seqs: int, cpus: str) -> dict:
    """The offline engine (kvserve.LLM) on the same prompts, all at once, pinned like the server."""
    spec = {"prompts": [r.prompt for r in requests], "max_tokens": [r.max_tokens for r in requests],
            "threads": threads, "kv_bytes": kv_bytes, "max_num_seqs": max_num_seqs}
    out = subprocess.run(["taskset", "-c", cpus, sys.executable, "-c", OFFLINE_SCRIPT], input=json.dumps(spec),
                         capture_output=True, text=True, check=True, cwd=ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])


def pin_self(cpus: str) -> None:
    from kvserve.server.launcher import pin_cpus
    os.sched_setaffinity(0, set(pin_cpus(cpus)))


def ratio(a, b):
    return a / b if a is not None and b else None


def emit_report(report: dict, out: str | None) -> None:
    """Print the report as JSON and, with ``out``, write the same text to that file."""
    text = json.dumps(report, indent=2)
    print(text)
    if out:
        with open(out, "w", encoding="utf-8") as f:
            f.write(text + "\n")
