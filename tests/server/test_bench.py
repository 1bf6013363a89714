"""kvserve bench: workloads (no server) and a short run of each against a real server."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest

from kvserve.loadgen.report import summarize
from kvserve.loadgen.runner import ClientConfig, Runner
from kvserve.loadgen.workloads import build_workload


def test_workloads_have_the_asked_shapes(tokenizer):
    rand = build_workload("random", tokenizer, 5, input_len=50, output_len=7, spread=0.2, chat=False, seed=3)
    assert len(rand) == 5 and all(r.prompt and 35 <= r.input_tokens <= 70 and 5 <= r.max_tokens <= 9 for r in rand)
    assert [r.prompt for r in rand] == [r.prompt for r in build_workload("random", tokenizer, 5, 50, 7, 0.2,
                                                                         chat=False, seed=3)]
    shared = build_workload("shared-prefix", tokenizer, 3, input_len=10, output_len=4, prefix_len=100)
    assert len({r.messages[0]["content"] for r in shared}) == 1 and shared[0].input_tokens > 100
    turns = build_workload("multi-turn", tokenizer, 2, input_len=10, output_len=4, turns=3)
    assert all(r.turns == 3 and len(r.followups) == 2 for r in turns)
    code = build_workload("code", tokenizer, 3, input_len=60, output_len=4, chat=False)
    assert all(r.prompt and r.input_tokens == 60 for r in code)


@pytest.mark.model
def test_bench_runs_every_workload_against_a_server(tokenizer):
    from benchmarks.server_process import ServerProcess
    with ServerProcess("--threads", "1", "--kv-cache-gib", "0.1", "--max-num-seqs", "8") as server:
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
