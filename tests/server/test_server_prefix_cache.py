"""The prefix cache over HTTP: usage.prompt_tokens_details.cached_tokens, tenant isolation,
the admin reset, the per-request opt-out and the /metrics names (the request fields and
codec messages without a server: tests/unit/test_prefix_cache_protocol.py).

One server for the module (two tenants, tiny KV budget, one-token outputs).
"""
from __future__ import annotations

import itertools

import httpx
import pytest

from benchmarks.server_process import ServerProcess

ALICE = "pc-key-alice"
BOB = "pc-key-bob"
MODEL = "SmolLM2-135M-Instruct"
_unique = itertools.count()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text(f"{ALICE} alice\n{BOB} bob\n")
    with ServerProcess("--api-keys-file", str(keys), "--threads", "1", "--dtype", "float32", "--kv-cache-gib", "0.1",
                       "--max-num-seqs", "8") as proc:
        yield proc


def _prompt() -> str:
    """A long prompt (several full KV blocks) no other test has sent."""
    return f"Prefix cache check number {next(_unique)}. " + "The quick brown fox jumps over the lazy dog. " * 12


def _post(server, path: str, key: str | None, body: dict | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(server.url + path, headers=headers, json=body if body is not None else {}, timeout=120)


def _cached(server, key: str, prompt: str, kind: str = "completion", **extra) -> int:
    if kind == "completion":
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, **extra}
        r = _post(server, "/v1/completions", key, body)
    else:
        body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 1, **extra}
        r = _post(server, "/v1/chat/completions", key, body)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.model
def test_repeat_from_the_same_key_is_cached(server):
    prompt = _prompt()
    assert _cached(server, ALICE, prompt) == 0
    assert _cached(server, ALICE, prompt) > 0
    chat_prompt = _prompt()
    _cached(server, ALICE, chat_prompt, "chat")
    assert _cached(server, ALICE, chat_prompt, "chat") > 0


@pytest.mark.model
def test_streaming_usage_chunk_reports_cached_tokens(server):
    prompt = _prompt()
    _cached(server, ALICE, prompt)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {ALICE}"}) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line.startswith("data: {")]
    import json
    usage = [json.loads(line[6:]) for line in lines if '"usage"' in line][-1]["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] > 0


@pytest.mark.model
def test_another_tenant_does_not_hit_the_cache(server):
    prompt = _prompt()
    _cached(server, ALICE, prompt)
    assert _cached(server, ALICE, prompt) > 0
    assert _cached(server, BOB, prompt) == 0


@pytest.mark.model
def test_admin_reset_empties_the_cache(server):
    assert _post(server, "/admin/reset_prefix_cache", None).status_code == 401
    assert _post(server, "/admin/reset_prefix_cache", "wrong-key").status_code == 401
    prompt = _prompt()
    _cached(server, ALICE, prompt)
    assert _cached(server, ALICE, prompt) > 0
    r = _post(server, "/admin/reset_prefix_cache", ALICE)
    assert r.status_code == 200, r.text
    assert r.json() == {"reset": True}
    assert _cached(server, ALICE, prompt) == 0


@pytest.mark.model
def test_use_prefix_cache_false_opts_out(server):
    prompt = _prompt()
    _cached(server, ALICE, prompt)
    assert _cached(server, ALICE, prompt) > 0
    assert _cached(server, ALICE, prompt, use_prefix_cache=False) == 0
    r = _post(server, "/v1/completions", ALICE, {"model": MODEL, "prompt": prompt, "max_tokens": 1,
                                                 "use_prefix_cache": "no"})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "use_prefix_cache"


@pytest.mark.model
def test_metrics_expose_the_prefix_cache(server):
    prompt = _prompt()
    _cached(server, ALICE, prompt)
    _cached(server, ALICE, prompt)
    r = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {ALICE}"}, timeout=30)
    assert r.status_code == 200
    for name in ("kvserve_prefix_cache_queries_total", "kvserve_prefix_cache_hit_tokens_total",
                 "kvserve_prefix_cache_hit_rate", "kvserve_prefix_cache_evicted_blocks_total",
                 "kvserve_prefix_cache_blocks", "kvserve_kv_blocks_cached"):
        assert f"# TYPE {name} " in r.text, name
    from kvserve.server.metrics import parse_metrics
    samples = parse_metrics(r.text)
    assert samples["kvserve_prefix_cache_queries_total"] >= 2
    assert samples["kvserve_prefix_cache_hit_tokens_total"] > 0


def _prefill_ms(server, key: str, prompt: str) -> tuple[float, int]:
    """(prefill ms from Server-Timing, cached tokens) of a one-token completion."""
    r = _post(server, "/v1/completions", key, {"model": MODEL, "prompt": prompt, "max_tokens": 1})
    assert r.status_code == 200, r.text
    phases = dict(part.strip().split(";dur=") for part in r.headers["server-timing"].split(","))
    return float(phases["prefill"]), r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.model
def test_probing_another_tenants_prompt_times_like_a_miss(server):
    """Bob probing prompts Alice has cached: cached_tokens 0 and a prefill as long as an
    uncached prompt's, not as short as his own cached prompt's (medians of 5)."""
    import statistics
    probe, own_cached, miss = [], [], []
    for _ in range(5):
        alices, bobs = _prompt() * 2, _prompt() * 2
        _cached(server, ALICE, alices)
        ms, cached = _prefill_ms(server, BOB, alices)
        assert cached == 0
        probe.append(ms)
        ms, cached = _prefill_ms(server, BOB, bobs)
        assert cached == 0
        miss.append(ms)
        ms, cached = _prefill_ms(server, BOB, bobs)
        assert cached > 0
        own_cached.append(ms)
    probe_ms, miss_ms, hit_ms = (statistics.median(x) for x in (probe, miss, own_cached))
    print(f"prefill ms medians: probe {probe_ms:.1f}, own miss {miss_ms:.1f}, own hit {hit_ms:.1f}")
    assert hit_ms < 0.6 * miss_ms                          # a hit is visible in the timing ...
    assert probe_ms > 0.75 * miss_ms                       # ... and another tenant's prompt is not a hit


def test_a_closed_loop_replay_continues_each_conversation_from_the_servers_answers(server):
    """``replay.replay_trace(turn_gap_s=)`` over HTTP: a later turn goes out the gap after its
    previous answer, carrying the ids the server answered with (``return_token_ids``), so the
    server's cache serves its whole history, to the block (answers span blocks; ids the replay
    made up instead of the server's would miss from the previous prompt's end on)."""
    import asyncio

    from kvserve.fleetsim.log import DONE
    from kvserve.fleetsim.replay import replay_trace
    from kvserve.fleetsim.sched_replica import BLOCK_SIZE
    from kvserve.fleetsim.validate import make_trace
    gap_s = 0.2
    trace = make_trace(10, 4.0, 40, 36, seed=5, turns=3.0, turn_gap_s=gap_s)
    follow_ups = [r for r in range(len(trace)) if trace.parent[r] >= 0]
    assert len(follow_ups) >= 4
    log, _ = asyncio.run(replay_trace(server.url, trace, 49_152, MODEL, seed=next(_unique), turn_gap_s=gap_s,
                                      headers={"Authorization": f"Bearer {ALICE}"}))
    assert all(s == DONE for s in log.status), log.status             # every request answered
    for r in follow_ups:
        parent = trace.parent[r]
        assert log.arrival[r] >= max(trace.arrival[r], log.finish_s[parent] + gap_s)
        history = trace.prompt[parent] + trace.output[parent]
        assert log.cached_tokens[r] == (history - 1) // BLOCK_SIZE * BLOCK_SIZE, (r, log.cached_tokens[r])
