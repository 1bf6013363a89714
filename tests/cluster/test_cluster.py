"""The cluster tier: `kvserve cluster serve` with 2 replicas on a local Ray Serve (127.0.0.1
only), through the OpenAI SDK: the same answers as the single server, streamed and not; a
conversation stays on the replica holding its prefix, a LoRA adapter's too, and the adapter's
unrelated requests go where it sits in a slot; cold requests spread; a non-streamed answer
longer than the replicas' keep-alive beat comes back whole; under pressure
the degradation ladder sheds batch requests only; the ingress's /metrics carries each
replica's series with a ``replica`` label, their sums and the router's decisions; an engine
killed mid-run ends its streams cleanly, later requests go elsewhere, and the replica rejoins."""
from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import openai
import pytest

from benchmarks.cluster_processes import busiest, engine_processes
from benchmarks.server_process import ServerProcess
from kvserve.cluster.keepalive import BEAT_S
from kvserve.cluster.ray_runtime import ray_listen_addresses
from kvserve.server.metrics import parse_metrics

pytestmark = [pytest.mark.cluster, pytest.mark.model]

MODEL = "SmolLM2-135M-Instruct"
FLAGS = ("--threads", "1", "--dtype", "float32", "--kv-cache-gib", "0.05", "--max-num-seqs", "4")
LOOPBACK = {"127.0.0.1", "::ffff:127.0.0.1"}


@pytest.fixture(scope="module")
def adapter(tmp_path_factory, model_path) -> str:
    """A PEFT LoRA adapter of the default model (q/v, rank 8), made offline."""
    from tests.support.lora_adapters import hf_base_model, make_adapter
    return make_adapter(hf_base_model(model_path), str(tmp_path_factory.mktemp("sql")), r=8)


@pytest.fixture(scope="module")
def cluster(adapter):
    # a chat TTFT SLO no CPU meets and 1 s dwells: the degradation ladder climbs during the module;
    # one LoRA slot per replica, the adapter "sql" loaded on both (host memory) at start
    with ServerProcess(*FLAGS, "--replicas", "2", "--router", "kv_aware", "--router-weights", "request=32",
                       "--lora-modules", f"sql={adapter}", "--max-loras", "1", "--chat-ttft-slo", "0.05",
                       "--ladder-dwell-s", "1", command=("cluster", "serve"), startup_timeout_s=420) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=cluster.base_url, api_key="unused", max_retries=0, timeout=300)


def _chat(client, messages, **kw):
    return client.chat.completions.with_raw_response.create(model=MODEL, messages=messages, temperature=0, **kw)


def test_ray_listens_on_loopback_only(cluster):
    assert "kvserve: Ray node address 127.0.0.1" in cluster.log_tail(100_000)
    addresses = ray_listen_addresses()
    assert addresses and addresses <= LOOPBACK, addresses


def test_answers_equal_the_single_server_streamed_and_not(client):
    prompts = [[{"role": "user", "content": q}] for q in ("What is the capital of France?", "Name a colour.",
                                                          "Write one word about the sea.")]
    whole = [_chat(client, p, max_tokens=24).parse().choices[0].message.content for p in prompts]
    streamed = []
    for p in prompts:
        chunks = client.chat.completions.create(model=MODEL, messages=p, temperature=0, max_tokens=24, stream=True)
        streamed.append("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))
    with ServerProcess(*FLAGS) as single:
        one = openai.OpenAI(base_url=single.base_url, api_key="unused", max_retries=0, timeout=300)
        reference = [_chat(one, p, max_tokens=24).parse().choices[0].message.content for p in prompts]
    assert whole == streamed == reference


def test_a_conversation_stays_with_its_prefix(client):
    messages = [{"role": "system", "content": "You answer questions about European geography in one sentence."},
                {"role": "user", "content": "What is the capital of Italy?"}]
    replicas, cached = [], []
    for turn in range(3):
        raw = _chat(client, messages, max_tokens=12)
        reply = raw.parse()
        replicas.append(raw.headers["x-kvserve-replica"])
        cached.append(reply.usage.prompt_tokens_details.cached_tokens)
        messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                     {"role": "user", "content": "And the capital of Portugal?"}]
        time.sleep(1.0)                     # replicas report their cached blocks every 0.5 s
    assert len(set(replicas)) == 1, replicas
    assert cached[0] == 0 and cached[1] > 0 and cached[2] > cached[1], cached


def test_an_adapters_requests_follow_its_prefix_and_its_slot(client):
    """LoRA-aware routing: the router resolves the request's model ("sql") to the adapter's
    identity, so an adapter conversation's blocks match (its turns stay and hit the cache),
    and unrelated requests for the adapter go where it is resident in a slot."""
    messages = [{"role": "system", "content": "You translate questions into SQL in one line."},
                {"role": "user", "content": "Count the rows of table users."}]
    replicas, cached = [], []
    for _turn in range(3):
        raw = client.chat.completions.with_raw_response.create(model="sql", messages=messages, temperature=0,
                                                               max_tokens=12)
        reply = raw.parse()
        replicas.append(raw.headers["x-kvserve-replica"])
        cached.append(reply.usage.prompt_tokens_details.cached_tokens)
        messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                     {"role": "user", "content": "And of table orders?"}]
        time.sleep(1.0)
    assert len(set(replicas)) == 1 and cached[1] > 0 and cached[2] > cached[1], (replicas, cached)
    elsewhere = []
    for i in range(3):
        raw = client.chat.completions.with_raw_response.create(
            model="sql", messages=[{"role": "user", "content": f"Unrelated request {i * 41}: list tables."}],
            temperature=0, max_tokens=2)
        elsewhere.append(raw.headers["x-kvserve-replica"])
        time.sleep(0.6)
    assert set(elsewhere) == {replicas[0]}, (replicas[0], elsewhere)


def _cold_replicas(cluster, count: int, max_tokens: int = 2, offset: int = 0) -> list[str]:
    seen = []
    for i in range(offset, offset + count):
        body = {"model": MODEL, "messages": [{"role": "user", "content": f"Unrelated question {i * 37}: why?"}],
                "max_tokens": max_tokens}
        r = httpx.post(cluster.base_url + "/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        seen.append(r.headers["x-kvserve-replica"])
    return seen


def _serve_on_both(cluster, attempts: int = 5) -> None:
    """Requests four at a time until both replicas have served (the router spreads the load);
    their prompts are none of the other tests' (cached where they ran, such a prompt would be
    routed back there when a later test wants requests to spread)."""
    seen: set[str] = set()
    for attempt in range(attempts):
        threads = [threading.Thread(target=lambda i=i: seen.update(
            _cold_replicas(cluster, 1, 16, offset=1000 + 4 * attempt + i))) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if len(seen) == 2:
            return
    raise AssertionError(f"only {seen} served")


def test_cold_requests_spread(cluster):
    assert len(set(_cold_replicas(cluster, 4))) == 2


def test_a_non_streamed_answer_longer_than_a_beat_comes_back_whole(cluster):
    """Its head comes only when its generation is done: the replica sends keep-alives meanwhile
    (cluster/keepalive.py), which the ingress skips; the answer is the replica's, whole."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Keep-alive test: tell a long story."}],
            "max_tokens": 256, "temperature": 0, "ignore_eos": True}
    started = time.monotonic()
    r = httpx.post(cluster.base_url + "/chat/completions", json=body, timeout=120)
    took_s = time.monotonic() - started
    assert r.status_code == 200 and r.headers["x-kvserve-replica"], r.text
    assert r.json()["usage"]["completion_tokens"] == 256
    assert took_s > BEAT_S, f"{took_s:.2f} s: too short to have sent a keep-alive"


def _replica_label(sample: str) -> str:
    return sample.split('replica="', 1)[1].split('"', 1)[0]


def test_the_ingress_metrics_label_each_replica_and_count_decisions(cluster):
    same = {"model": MODEL, "messages": [{"role": "user", "content": "Metrics test: name three rivers."}],
            "max_tokens": 2}
    for _ in range(2):                   # the second is routed to the first's prefix (predicted or reported)
        assert httpx.post(cluster.base_url + "/chat/completions", json=same, timeout=120).status_code == 200
    _serve_on_both(cluster)              # (alone, the chat template's shared prefix keeps one-by-one requests on one)
    r = httpx.get(cluster.url + "/metrics", timeout=60)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    samples = parse_metrics(r.text)
    replicas = {_replica_label(s) for s in samples if s.startswith("kvserve_generation_tokens_total{")}
    assert len(replicas) == 2, replicas
    per_replica = [samples[f'kvserve_generation_tokens_total{{replica="{name}"}}'] for name in replicas]
    assert all(tokens > 0 for tokens in per_replica)
    assert samples["kvserve_cluster_generation_tokens_total"] == sum(per_replica)
    for name in replicas:
        assert f'kvserve_num_requests_running{{replica="{name}"}}' in samples
        assert samples[f'kvserve_cluster_replicas{{replica="{name}"}}'] == 1
        assert samples[f'kvserve_replica_breaker_state{{replica="{name}",state="closed"}}'] == 1
    decisions = {s: v for s, v in samples.items() if s.startswith("kvserve_router_decisions_total{")}
    assert all('policy="kv_aware"' in s for s in decisions) and sum(decisions.values()) >= 4, decisions
    assert samples['kvserve_router_decisions_total{policy="kv_aware",reason="prefix"}'] >= 1
    assert samples['kvserve_router_decision_cached_tokens_count{policy="kv_aware"}'] >= 4
    assert samples['kvserve_router_decision_cached_tokens_sum{policy="kv_aware"}'] > 0
    ages = samples["kvserve_router_stats_age_seconds_count"]     # Ray Serve recorded the replicas' stats
    assert ages >= 2 and 0 < samples["kvserve_router_stats_age_seconds_sum"] / ages < 10


def test_the_ladder_sheds_batch_requests_only(cluster):
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Say something."}], "max_tokens": 4}
    deadline, rung = time.monotonic() + 60, ""
    while time.monotonic() < deadline and not rung.startswith("3;"):
        r = httpx.post(cluster.base_url + "/chat/completions", json=chat, timeout=120)
        assert r.status_code == 200, r.text
        rung = r.headers["x-kvserve-degradation"]
    assert rung == "3; shed_batch"
    batch = httpx.post(cluster.base_url + "/chat/completions", json={**chat, "service_tier": "flex"}, timeout=120)
    assert batch.status_code == 503 and batch.json()["error"]["code"] == "server_degraded"
    assert batch.headers["retry-after"] and batch.headers["x-kvserve-degradation"] == "3; shed_batch"
    interactive = httpx.post(cluster.base_url + "/chat/completions", json={**chat, "service_tier": "priority"},
                             timeout=120)
    assert interactive.status_code == 200


def _stream(cluster, i: int, lines: list) -> None:
    """One long streamed chat; its ``data:`` lines are appended to ``lines`` as they arrive."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"Count from one to a hundred, {i}."}],
            "max_tokens": 200, "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", cluster.base_url + "/chat/completions", json=body, timeout=180) as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                lines.append(line)


def test_an_engine_killed_mid_run(cluster):
    engines = engine_processes()
    assert len(engines) == 2
    results: list[list[str]] = [[] for _ in range(4)]
    threads = [threading.Thread(target=_stream, args=(cluster, i, results[i])) for i in range(4)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 120
    while not all(len(lines) >= 2 for lines in results) and time.monotonic() < deadline:
        time.sleep(0.05)                             # every stream has its first tokens: all are mid-run
    os.kill(busiest(engines).pid, signal.SIGKILL)
    for t in threads:
        t.join(timeout=200)
    assert not any(t.is_alive() for t in threads)                              # nothing hangs
    for lines in results:                                                      # each ends cleanly
        assert lines[-1] == "data: [DONE]"
    errored = [lines for lines in results if any('"error"' in line for line in lines)]
    assert errored, "the killed engine's streams end with an error event"
    _cold_replicas(cluster, 4)                       # later requests all succeed (retried elsewhere)
    scrape = httpx.get(cluster.url + "/metrics", timeout=60)      # a dead or replaced replica is left out
    assert scrape.status_code == 200 and "kvserve_cluster_replicas{" in scrape.text
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:               # Ray Serve restarts the replica; it takes traffic again
        if len(engine_processes()) == 2 and len(set(_cold_replicas(cluster, 4))) == 2:
            return
        time.sleep(5)
    pytest.fail("the replica did not rejoin")
