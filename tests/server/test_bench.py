"""kvserve bench: a short run of each workload against a real server
(the workloads' shapes: tests/model/test_bench_workloads.py)."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest

from kvserve.loadgen.report import summarize
from kvserve.loadgen.runner import ClientConfig, Runner
from kvserve.loadgen.workloads import build_workload


@pytest.mark.model
def test_bench_runs_every_workload_against_a_server(tokenizer):
    from benchmarks.server_process import ServerProcess
    with ServerProcess("--threads", "1", "--dtype", "float32", "--kv-cache-gib", "0.1",
                       "--max-num-seqs", "8") as server:
        for name, endpoint in (("random", "chat"), ("shared-prefix", "chat"), ("multi-turn", "chat"),
                               ("code", "completions")):
            requests = build_workload(name, tokenizer, 3, input_len=24, output_len=4, prefix_len=40, turns=2)
            runner = Runner(ClientConfig(server.url, endpoint=endpoint))
            asyncio.run(runner.run(requests, concurrency=2))
            s = summarize(runner.records)
            expected = sum(r.turns for r in requests)
            assert s["num_completed"] == expected and s["errors"] == {}, (name, s["errors"])
            assert s["output_tokens"] == 4 * expected                  # from usage, ignore_eos
            assert s["ttft_ms"]["count"] == expected and s["tpot_ms"]["p50"] > 0
            if name == "multi-turn":
                by_turn = {(r.request_id, r.turn): r for r in runner.records}
                for rid in range(3):
                    first, second = by_turn[(rid, 0)], by_turn[(rid, 1)]
                    assert second.prompt_tokens > first.prompt_tokens + first.output_tokens   # history resent
        rate = Runner(ClientConfig(server.url))
        asyncio.run(rate.run(build_workload("random", tokenizer, 4, 16, 3), rate=20.0, concurrency=2))
        assert summarize(rate.records)["num_completed"] == 4
        out = subprocess.run([sys.executable, "-m", "kvserve.cli", "bench", "--url", server.url, "--num-requests",
                              "3", "--input-len", "16", "--output-len", "3", "--concurrency", "1,2", "--warmup", "1",
                              "--slo-ttft-ms", "60000", "--no-progress"], capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        report = json.loads(out.stdout)
        assert [r["concurrency"] for r in report["results"]] == [1, 2]
        assert all(r["summary"]["goodput"]["fraction"] == 1.0 for r in report["results"])


@pytest.mark.model
def test_bench_ghost_workload_cancels_and_completes():
    """A few seconds of two typists (no service_tier, so it runs on any kvserve): keystrokes
    cancel in-flight requests, which the server aborts; pauses let some complete."""
    import httpx

    from benchmarks.server_process import ServerProcess
    with ServerProcess("--threads", "1", "--dtype", "float32", "--kv-cache-gib", "0.1",
                       "--max-num-seqs", "8") as server:
        out = subprocess.run([sys.executable, "-m", "kvserve.cli", "bench", "--url", server.url, "--workload", "ghost",
                              "--ghost-typists", "2", "--ghost-duration", "5", "--ghost-max-tokens", "2",
                              "--ghost-service-tier", "none", "--ghost-word-pause-prob", "0.25", "--seed", "1"],
                             capture_output=True, text=True, timeout=300)
        metrics = httpx.get(server.url + "/metrics", timeout=30).text
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["workload"] == "ghost" and report["ghost"]["service_tier"] is None
    s = report["results"][0]["summary"]
    assert s["num_errors"] == 0, s["errors"]
    assert s["num_cancelled"] > 0 and s["num_completed"] > 0
    assert s["num_requests"] == s["num_cancelled"] + s["num_completed"]
    assert s["cancellations_per_s"] > 0 and s["e2e_ms"]["p99"] > 0 and 0 <= s["goodput"]["fraction"] <= 1
    assert s["prompt_tokens"]["mean"] > 50 and s["cached_token_fraction"] > 0      # prompts extend each other
    assert set(s["budget"]) >= {"budget_ms", "queue", "prefill", "decode", "client_overhead"}
    aborted = [line for line in metrics.splitlines() if line.startswith("kvserve_requests_finished_total")
               and 'finish_reason="abort"' in line]
    assert aborted and float(aborted[0].split()[-1]) > 0                          # the server aborted them
