"""``kvserve serve --disaggregate``: the OpenAI API over a prefill engine and a decode engine.

One single-engine server (the reference) and one disaggregated server (threshold 64
tokens) start side by side. Greedy fp32 completions, whole and streamed, short and long
prompts, must be equal token for token; long prompts must be counted as disaggregated on
/metrics (and a repeated one skip the transfer); a client that disconnects during the
prefill / transfer or mid-stream must leave both engines' block accounting exact
(GET /admin/disagg: the driver's integrity check); and a drained shutdown must leave no
engine process behind.
"""
from __future__ import annotations

import concurrent.futures
import json
import os
import socket
import time

import httpx
import openai
import pytest

from benchmarks.server_process import ServerProcess
from kvserve.server.metrics import parse_metrics

COMMON = ("--threads", "1", "--dtype", "float32", "--kv-cache-gib", "0.1", "--no-warmup")
THRESHOLD, STAGING = 64, 64
DISAGG = ("--disaggregate", "--disagg-threshold-tokens", str(THRESHOLD), "--disagg-staging-blocks", str(STAGING))
PARAGRAPH = ("The river bends twice before it reaches the old mill, where the miller keeps a ledger of every "
             "sack of grain, every visitor and every storm that passed over the valley in forty years. ")


def long_prompt(tag: str) -> str:
    """About 200 tokens, different from the first block on (``tag`` leads)."""
    return f"{tag}. " + PARAGRAPH * 5 + "In one sentence, the ledger says"


@pytest.fixture(scope="module")
def servers():
    """(reference single-engine server, disaggregated server), started in parallel."""
    reference, disagg = ServerProcess(*COMMON), ServerProcess(*COMMON, *DISAGG)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        starts = [pool.submit(s.start) for s in (reference, disagg)]
        try:
            for start in starts:
                start.result()
        except BaseException:
            reference.stop(), disagg.stop()
            raise
    yield reference, disagg
    reference.stop()
    disagg.stop()


def sdk(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


def complete(server, prompt: str, stream: bool, **extra) -> tuple[str, str]:
    """(text, finish reason) of one greedy completion, whole or streamed."""
    kwargs = {"model": "SmolLM2-135M-Instruct", "prompt": prompt, "max_tokens": 12, "temperature": 0, **extra}
    if not stream:
        choice = sdk(server).completions.create(**kwargs).choices[0]
        return choice.text, choice.finish_reason
    text, reason = "", None
    for chunk in sdk(server).completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            text += choice.text
            reason = choice.finish_reason or reason
    return text, reason


def disagg_counters(server) -> dict[str, float]:
    samples = parse_metrics(httpx.get(server.url + "/metrics", timeout=30).text)
    return {name: value for name, value in samples.items() if name.startswith("kvserve_disagg_")}


def settled_status(server, timeout_s: float = 60.0) -> dict:
    """GET /admin/disagg once no request is in flight anywhere (HTTP process and driver)."""
    deadline = time.monotonic() + timeout_s
    while True:
        status = httpx.get(server.url + "/admin/disagg", timeout=30).json()
        if status["in_flight"] == 0 and not any(status["requests"].values()):
            return status
        assert time.monotonic() < deadline, f"requests still held: {status}"
        time.sleep(0.1)


def assert_exact(status: dict) -> None:
    """Both engines: integrity ok, nothing in use, free + cached-only == total, no export
    pending; the staging area: every slot free."""
    assert status["ok"], status
    for name, report in status["engines"].items():
        assert report["num_used_blocks"] == 0 and report["num_pending_exports"] == 0, (name, report)
        assert report["num_free_blocks"] + report["num_cached_only_blocks"] == report["num_blocks"], (name, report)
    assert status["transfer"]["reserved"] == [] and status["transfer"]["num_free_blocks"] == STAGING


def test_completions_equal_single_engine_and_long_prompts_disaggregate(servers):
    reference, disagg = servers
    before = disagg_counters(disagg)
    cases = [("Hello, my name is", False), ("Hello, my name is", True),
             (long_prompt("Alpha"), False), (long_prompt("Beta"), True)]
    for prompt, stream in cases:
        assert complete(disagg, prompt, stream) == complete(reference, prompt, stream), (prompt[:20], stream)
    after = disagg_counters(disagg)
    routed = 'kvserve_disagg_requests_total{route="%s"}'
    assert after[routed % "disaggregated"] - before[routed % "disaggregated"] == 2
    assert after[routed % "unified"] - before[routed % "unified"] == 2
    sent = after["kvserve_disagg_kv_blocks_sent_total"] - before["kvserve_disagg_kv_blocks_sent_total"]
    received = after["kvserve_disagg_kv_blocks_received_total"] - before["kvserve_disagg_kv_blocks_received_total"]
    assert sent >= 2 * 10 and received == sent
    # the same long prompt again: the decode engine caches its blocks, nothing moves
    assert complete(disagg, long_prompt("Alpha"), True) == complete(reference, long_prompt("Alpha"), True)
    again = disagg_counters(disagg)
    assert again[routed % "unified"] - after[routed % "unified"] == 1
    assert again["kvserve_disagg_kv_blocks_sent_total"] == after["kvserve_disagg_kv_blocks_sent_total"]
    assert_exact(settled_status(disagg))


def test_chat_and_stop_strings_equal_single_engine(servers):
    reference, disagg = servers
    messages = [{"role": "user", "content": long_prompt("Gamma")}]
    chat = [sdk(s).chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, max_tokens=12,
                                           temperature=0).choices[0].message.content for s in servers]
    assert chat[1] == chat[0]
    # a stop string ends the request in the HTTP process: the driver must forget it, not count an abort
    aborted = disagg_counters(disagg)["kvserve_disagg_requests_aborted_total"]
    text, _ = complete(reference, long_prompt("Delta"), False, max_tokens=24)
    stop = text.strip().split()[1] if len(text.split()) > 1 else text.strip()[:2]
    for stream in (False, True):
        assert complete(disagg, long_prompt("Delta"), stream, max_tokens=24, stop=[stop]) == \
            complete(reference, long_prompt("Delta"), stream, max_tokens=24, stop=[stop])
    assert_exact(settled_status(disagg))
    assert disagg_counters(disagg)["kvserve_disagg_requests_aborted_total"] == aborted


def _send_stream_request(server, prompt: str, max_tokens: int) -> socket.socket:
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                       "stream": True}).encode()
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=60)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body) + body)
    return sock


def test_client_disconnects_leave_both_engines_exact(servers):
    _, disagg = servers
    aborted = disagg_counters(disagg)["kvserve_disagg_requests_aborted_total"]
    # gone while its prompt is routed, prefilled or moved (no token yet)
    early = [_send_stream_request(disagg, long_prompt(f"Early {i}"), 64) for i in range(3)]
    time.sleep(0.3)
    for sock in early:
        sock.close()
    # gone mid-stream, after its first tokens
    late = _send_stream_request(disagg, long_prompt("Late"), 400)
    received = b""
    while received.count(b"data: ") < 3:
        chunk = late.recv(65536)
        assert chunk, received
        received += chunk
    late.close()
    status = settled_status(disagg)
    assert_exact(status)
    assert status["counters"]["num_aborted"] - aborted >= 3, status["counters"]
    # and the pair still serves
    assert complete(disagg, long_prompt("After"), False)[1] == "length"
    assert_exact(settled_status(disagg))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:          # a zombie has exited
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def test_drained_shutdown_leaves_no_engine_process(servers):
    _, disagg = servers
    pids = httpx.get(disagg.url + "/admin/disagg", timeout=30).json()["pids"]
    assert set(pids) == {"prefill", "decode"} and all(_alive(p) for p in pids.values())
    assert httpx.get(disagg.url + "/health", timeout=10).json()["engine_pid"] == pids["decode"]
    assert disagg.stop() == 0
    deadline = time.monotonic() + 30
    while any(_alive(p) for p in pids.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids.values()), pids
