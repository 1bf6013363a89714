"""The cluster tier, rung 4 of the degradation ladder: `kvserve cluster serve --fallback-model`
deploys a second EngineReplica deployment (here the same default model: no other weights
exist offline, and it still proves the path). With a chat TTFT SLO no CPU meets the ladder
climbs to ``overflow_chat``; then a chat request sent while the fleet's one decode slot is
taken is served by the fallback (``x-kvserve-served-by: fallback``), while chat requests
with a free slot and interactive requests stay on the fleet and batch requests are still
shed; the ingress's /metrics carries the rung, its engagements, the pressure (the fleet's
KV use among it), the overflowed count and the fallback replica's own series."""
from __future__ import annotations

import threading
import time

import httpx
import pytest

from benchmarks.server_process import ServerProcess
from kvserve.server.metrics import parse_metrics

pytestmark = [pytest.mark.cluster, pytest.mark.model]

MODEL = "SmolLM2-135M-Instruct"
RUNG = "x-kvserve-degradation"
SERVED_BY = "x-kvserve-served-by"


@pytest.fixture(scope="module")
def cluster():
    # one fleet replica with one decode slot, so "beyond what the fleet takes" is one request in flight
    with ServerProcess("--threads", "1", "--dtype", "float32", "--kv-cache-gib", "0.05", "--max-num-seqs", "1",
                       "--replicas", "1", "--fallback-model", "default", "--fallback-replicas", "1",
                       "--chat-ttft-slo", "0.05", "--ladder-dwell-s", "1",
                       command=("cluster", "serve"), startup_timeout_s=420) as proc:
        yield proc


def _post(cluster, content: str, **extra) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 4, **extra}
    return httpx.post(cluster.base_url + "/chat/completions", json=body, timeout=180)


def _hold_the_fleet(cluster, started: threading.Event, out: list) -> None:
    """An interactive stream that keeps the fleet's only slot busy (interactive never overflows)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Count from one to a hundred."}],
            "max_tokens": 128, "ignore_eos": True, "temperature": 0, "stream": True, "service_tier": "priority"}
    with httpx.stream("POST", cluster.base_url + "/chat/completions", json=body, timeout=180) as r:
        lines = []
        for line in r.iter_lines():
            if line.startswith("data:"):
                lines.append(line)
                if len(lines) == 4:          # generating: its prompt's blocks are in the fleet's KV
                    started.set()
        out.append((r.headers.get(SERVED_BY), lines))
    started.set()


def test_chat_beyond_the_fleet_overflows_to_the_fallback_model(cluster):
    deadline, rung, fleet_replicas = time.monotonic() + 90, "", set()
    while time.monotonic() < deadline and not rung.startswith("4;"):
        r = _post(cluster, "Say something.")         # one at a time: a slot is free, the fleet serves it
        assert r.status_code == 200 and r.headers[SERVED_BY] == "fleet", r.text
        fleet_replicas.add(r.headers["x-kvserve-replica"])
        rung = r.headers[RUNG]
    assert rung == "4; overflow_chat" and len(fleet_replicas) == 1
    assert _post(cluster, "Say something.").headers[SERVED_BY] == "fleet"    # engaged, but a slot is free

    started, held = threading.Event(), []
    holder = threading.Thread(target=_hold_the_fleet, args=(cluster, started, held))
    holder.start()
    assert started.wait(120)
    overflowed = _post(cluster, "Name a colour.")
    assert overflowed.status_code == 200, overflowed.text
    assert overflowed.headers[SERVED_BY] == "fallback" and overflowed.headers[RUNG] == "4; overflow_chat"
    assert overflowed.headers["x-kvserve-replica"] not in fleet_replicas
    assert overflowed.json()["model"] == MODEL and overflowed.json()["choices"][0]["message"]["content"]
    interactive = _post(cluster, "Name a colour.", service_tier="priority")     # never overflowed: it queues
    assert interactive.status_code == 200 and interactive.headers[SERVED_BY] == "fleet"
    batch = _post(cluster, "Name a colour.", service_tier="flex")               # rung 3 still in force
    assert batch.status_code == 503 and batch.json()["error"]["code"] == "server_degraded"
    holder.join(timeout=180)
    assert held and held[0][0] == "fleet" and held[0][1][-1] == "data: [DONE]"

    samples = parse_metrics(httpx.get(cluster.url + "/metrics", timeout=60).text)
    fallback_replica = overflowed.headers["x-kvserve-replica"]
    own = f'replica="{fallback_replica}",deployment="fallback"'
    finished = [v for k, v in samples.items() if k.startswith(f"kvserve_requests_finished_total{{{own},")]
    assert sum(finished) >= 1                                                        # the fallback's own series
    assert samples[f'kvserve_cluster_replicas{{deployment="fallback",replica="{fallback_replica}"}}'] == 1
    assert samples['kvserve_degradation_rung{name="overflow_chat"}'] == 4
    assert samples['kvserve_degradation_engagements_total{name="overflow_chat"}'] >= 1
    assert samples['kvserve_degradation_engagements_total{name="shed_batch"}'] >= 1
    assert samples["kvserve_degradation_overflowed_total"] >= 1
    assert samples['kvserve_degradation_pressure{signal="chat_queue_wait"}'] >= 1
    assert samples['kvserve_degradation_pressure{signal="kv_usage"}'] > 0      # the fleet's KV reached the ladder
