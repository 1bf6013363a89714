"""Request classes and latency accounting end to end: service_tier, key pinning,
Server-Timing (whole body and streamed), per-class metrics.

One server for the module (API keys on, one pinned to batch); short prompts, max_tokens <= 4.
"""
from __future__ import annotations

import httpx
import pytest

from benchmarks.server_process import ServerProcess
from kvserve.server.metrics import parse_metrics

pytestmark = pytest.mark.model

USER_KEY = "classes-user-key"            # tenant "alice", not pinned
BATCH_KEY = "classes-batch-key"          # tenant "bulk", pinned to batch
BODY = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text(f"{USER_KEY} alice\n{BATCH_KEY} bulk batch\n")
    with ServerProcess("--api-keys-file", str(keys), "--threads", "1", "--dtype", "float32", "--kv-cache-gib", "0.1",
                       "--max-num-seqs", "8") as proc:
        yield proc


def _post(server, body: dict, key: str = USER_KEY, path: str = "/v1/completions") -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=120)


def _metrics(server) -> dict[str, float]:
    return parse_metrics(httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {USER_KEY}"},
                                   timeout=30).text)


def _timing(header: str) -> dict[str, float]:
    """``queue;dur=1.0, ttft;dur=2.0`` -> {"queue": 1.0, "ttft": 2.0}."""
    phases = {}
    for item in header.split(","):
        name, _, dur = item.strip().partition(";dur=")
        phases[name] = float(dur)
    return phases


def test_whole_body_has_every_phase(server):
    r = _post(server, BODY)
    assert r.status_code == 200 and r.json()["service_tier"] == "default"
    phases = _timing(r.headers["server-timing"])
    assert list(phases) == ["queue", "prefill", "ttft", "total"]
    assert all(v >= 0 for v in phases.values())
    assert phases["queue"] + phases["prefill"] == pytest.approx(phases["ttft"], abs=0.25)
    assert phases["ttft"] <= phases["total"]


def test_stream_headers_have_ttft_and_the_stream_ends_with_the_total(server):
    body = {**BODY, "stream": True, "stream_options": {"include_usage": True}, "service_tier": "flex"}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {USER_KEY}"}) as r:
        assert r.status_code == 200
        phases = _timing(r.headers["server-timing"])
        lines = [line for line in r.iter_lines() if line]
    assert {"queue", "prefill", "ttft"} <= set(phases) and all(v >= 0 for v in phases.values())
    assert lines[-1] == "data: [DONE]"
    assert lines[-2].startswith(": server-timing total;dur=")
    total = float(lines[-2].rpartition("=")[2])
    assert total >= phases["ttft"]
    chunks = [line for line in lines[:-2] if line.startswith("data: ")]
    assert chunks and all('"service_tier":"flex"' in chunk for chunk in chunks)       # the usage chunk too


def test_priority_is_echoed_and_counted_as_interactive(server):
    r = _post(server, {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "service_tier": "priority"},
              path="/v1/chat/completions")
    assert r.status_code == 200 and r.json()["service_tier"] == "priority"
    samples = _metrics(server)
    assert samples['kvserve_class_time_to_first_token_seconds_count{class="interactive"}'] >= 1
    assert samples['kvserve_class_queue_time_seconds_count{class="interactive"}'] >= 1
    assert samples['kvserve_class_requests_finished_total{class="interactive"}'] >= 1
    assert samples['kvserve_class_time_per_output_token_seconds_count{class="interactive"}'] >= 1


def test_bad_service_tier_is_a_400_naming_it(server):
    r = _post(server, {**BODY, "service_tier": "platinum"})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "service_tier" and "priority" in error["message"]


def test_a_key_pinned_to_batch_runs_flex_whatever_it_asks(server):
    for tier in (None, "priority", "default"):
        body = BODY if tier is None else {**BODY, "service_tier": tier}
        r = _post(server, body, key=BATCH_KEY)
        assert r.status_code == 200 and r.json()["service_tier"] == "flex"
    samples = _metrics(server)
    assert samples['kvserve_class_requests_finished_total{class="batch"}'] >= 3
