"""Server and bench pieces that need no model: codec, protocol, metrics, auth, report."""
from __future__ import annotations

import math

import pytest

from kvserve.loadgen.report import percentile, summarize
from kvserve.loadgen.runner import RequestRecord
from kvserve.engine.step import SampledToken, SeqUpdate
from kvserve.errors import InvalidRequestError
from kvserve.sampling.params import SamplingParams
from kvserve.ipc import codec
from kvserve.server import json_body, protocol
from kvserve.engine.request import EngineRequest
from kvserve.engine.stats import EngineStats, SpeculationCounters
from kvserve.server.auth import KeyGrant, load_keys, match_key
from kvserve.server.metrics import ServerMetrics, parse_metrics


# ------------------------------------------------------------------- codec
def test_codec_round_trips_every_message():
    params = SamplingParams(n=2, max_tokens=7, temperature=0.5, stop=["x"], seed=3, logprobs=2,
                            logit_bias={50256: 100.0, 0: -2.5})
    messages = [
        codec.InitEngine({"model": None, "max_num_seqs": 4}),
        codec.EngineReady(100, 49152, 10, 16, 160, [2], "explained", 123),
        EngineRequest("r1", [1, 2, 3], params, frozenset([2]), 1, "tenant-a", cache_salt="tenant:tenant-a",
                      adapter_id="lora-1", use_prefix_cache=False, prefix_cache_grace_s=2.5,
                      num_speculative_tokens=3),
        EngineRequest("r2", [4], SamplingParams()),
        codec.AbortRequests(["r1", "r2"]),
        codec.StopSequences([4, 5]),
        codec.Shutdown(),
        codec.EngineStatsUpdate(EngineStats(kv_blocks_used=3, speculation=SpeculationCounters(
            True, 5, 3, 2, 1, 0, [2, 1]))),
        codec.StepOutputs([SeqUpdate(1, "r1", 0, [42], [SampledToken(42, -0.5, [(42, -0.5), (7, -1.0)])], None),
                           SeqUpdate(2, "r1", 1, [9], [SampledToken(9, -math.inf, [])], "length", 32)],
                          ["r1"], EngineStats(num_steps=1)),
        codec.RequestError("r3", 400, {"error": {"message": "m", "type": "t", "param": None, "code": "c"}}),
    ]
    buffer = codec.FrameBuffer()
    stream = b"".join(codec.encode(m) for m in messages)
    decoded = []
    for i in range(0, len(stream), 7):                # arbitrary split points
        decoded.extend(buffer.feed(stream[i:i + 7]))
    assert decoded == messages


def test_codec_refuses_unknown_and_corrupt_frames():
    with pytest.raises(codec.CodecError):
        codec.decode_payload(b"\xc1\xc1")
    with pytest.raises(codec.CodecError):
        codec.from_wire({"t": "Pickle", "x": 1})
    with pytest.raises(codec.CodecError):
        codec.to_wire(object())


# ---------------------------------------------------------------- protocol
def test_json_body_rules():
    assert json_body.parse_json_body(b'{"a": 1}') == {"a": 1}
    for body, code in [(b"\xff\xfe", "invalid_encoding"), (b'{"a": NaN}', "invalid_json"),
                       (b'{"a": Infinity}', "invalid_json"), (b'{"a": 1', "invalid_json"), (b"[1]", "invalid_json"),
                       (b'{"a":' * 5000 + b"1" + b"}" * 5000, "invalid_json")]:
        with pytest.raises(InvalidRequestError) as info:
            json_body.parse_json_body(body)
        assert info.value.code == code


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "temperature": True}, "temperature"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 10**30}, "max_tokens"),
    ({"prompt": "x", "top_k": 2**70}, "top_k"),
    ({"prompt": "x", "seed": 2**64}, "seed"),
    ({"prompt": "x", "n": 17}, "n"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "stop": ["a"] * 17}, "stop"),
    ({"prompt": "x", "stop": 5}, "stop"),
    ({"prompt": "x", "logit_bias": {"1": 500}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"one": 5}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": [5]}, "logit_bias"),
    ({"prompt": "x", "suffix": 5}, "suffix"),
    ({"prompt": "x", "best_of": 3}, "best_of"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "x", "frobnicate": 1}, "frobnicate"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({}, "prompt"),
])
def test_completion_fields_rejected_by_name(body, param):
    with pytest.raises(InvalidRequestError) as info:
        protocol.parse_completion(body)
    assert info.value.param == param


@pytest.mark.parametrize("body, param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools[0].function"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}},
     "response_format.type"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "max_completion_tokens": 4},
     "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "echo": True}, "echo"),
])
def test_chat_fields_rejected_by_name(body, param):
    with pytest.raises(InvalidRequestError) as info:
        protocol.parse_chat(body)
    assert info.value.param == param


def test_fields_are_honoured():
    spec = protocol.parse_completion({
        "prompt": ["a", "b"], "max_tokens": 5, "temperature": 0.5, "top_p": 0.9, "top_k": 3, "min_p": 0.1,
        "presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.1, "seed": 7,
        "stop": "z", "n": 2, "logprobs": 3, "echo": False, "stream": True,
        "stream_options": {"include_usage": True}, "user": "u", "logit_bias": {"42": -100, "7": 2.5}})
    p = spec.params
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p, p.n, p.seed, p.logprobs) == \
        (5, 0.5, 0.9, 3, 0.1, 2, 7, 3)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.stop) == (0.5, -0.5, 1.1, ["z"])
    assert spec.stream and spec.include_usage and len(spec.prompts) == 2 and spec.user == "u"
    assert p.logit_bias == {42: -100.0, 7: 2.5}
    chat = protocol.parse_chat({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 9,
                                "logprobs": True, "top_logprobs": 4})
    assert chat.params.max_tokens == 9 and chat.params.logprobs == 4 and chat.max_tokens_param == \
        "max_completion_tokens"
    assert protocol.parse_chat({"messages": [{"role": "user", "content": "x"}]}).params.max_tokens is None
    ids = protocol.parse_completion({"prompt": [[1, 2], [3]]})
    assert [p.token_ids for p in ids.prompts] == [[1, 2], [3]]


# ------------------------------------------------------------ metrics, auth
def test_metrics_render_in_prometheus_format():
    m = ServerMetrics()
    m.ttft.observe(0.05)
    m.ttft.observe(100.0)
    m.finished.inc(finish_reason="stop")
    m.update_engine(EngineStats(kv_blocks_used=3, kv_blocks_total=10, num_preemptions=2, step_seconds=2.5,
                                step_cpu_seconds=2.0))
    samples = parse_metrics(m.render())
    assert samples["kvserve_engine_step_seconds_total"] == 2.5
    assert samples["kvserve_engine_step_cpu_seconds_total"] == 2.0
    assert samples['kvserve_time_to_first_token_seconds_bucket{le="0.06"}'] == 1
    assert samples['kvserve_time_to_first_token_seconds_bucket{le="+Inf"}'] == 2
    assert samples["kvserve_time_to_first_token_seconds_count"] == 2
    assert samples["kvserve_kv_blocks_used"] == 3 and samples["kvserve_preemptions_total"] == 2
    assert samples['kvserve_requests_finished_total{finish_reason="stop"}'] == 1
    assert "# TYPE kvserve_inter_token_latency_seconds histogram" in m.render()


def test_api_keys(tmp_path):
    path = tmp_path / "keys.txt"
    path.write_text("# key tenant\nk1 alice\nk2 bob\n")
    keys = load_keys("k0", str(path))
    assert keys == {"k0": KeyGrant("default"), "k1": KeyGrant("alice"), "k2": KeyGrant("bob")}
    assert match_key(keys, b"Bearer k2") == KeyGrant("bob")
    assert match_key(keys, b"bearer k1").tenant == "alice"
    for header in (None, b"", b"Bearer", b"Bearer k3", b"Basic k1", b"Bearer k1x"):
        assert match_key(keys, header) is None
    (tmp_path / "keys.json").write_text('{"j": "carol"}')
    assert load_keys(None, str(tmp_path / "keys.json")) == {"j": KeyGrant("carol")}


# ------------------------------------------------------------------ report
def test_percentiles_and_summary():
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([5], 99) == 5
    assert percentile([], 50) is None
    records = [RequestRecord(0, 0, start=0.0, end=1.0, chunk_times=[0.1, 0.5, 1.0], prompt_tokens=4,
                             output_tokens=10),
               RequestRecord(1, 0, start=0.0, end=2.0, chunk_times=[0.3, 2.0], prompt_tokens=4, output_tokens=5),
               RequestRecord(2, 0, start=0.5, end=0.6, error="http_503:server_overloaded")]
    s = summarize(records, slo_ttft_ms=200)
    assert s["num_completed"] == 2 and s["errors"] == {"http_503:server_overloaded": 1}
    assert s["duration_s"] == 2.0 and s["output_token_throughput"] == 7.5
    assert s["ttft_ms"]["p50"] == pytest.approx(200.0)
    assert s["tpot_ms"]["p50"] == pytest.approx((0.9 / 9 + 1.7 / 4) / 2 * 1000)
    assert s["goodput"]["requests_per_s"] == 0.5      # only request 0 met the TTFT SLO


def test_app_maps_unexpected_errors_to_500_without_trace_and_refuses_while_starting():
    from starlette.testclient import TestClient

    from kvserve.server.app import ServingContext, build_app
    from kvserve.server.state import AdmissionLimits, ServerState

    ctx = ServingContext(tokenizer=None, model_name="m", model_aliases=frozenset({"m"}),
                         state=ServerState(AdmissionLimits()), metrics=ServerMetrics())
    asgi = build_app(ctx)

    @asgi.app.get("/boom")
    async def boom():
        raise RuntimeError("secret internals")

    with TestClient(asgi, raise_server_exceptions=False) as c:
        r = c.get("/boom")
        assert r.status_code == 500 and "secret" not in r.text and "Traceback" not in r.text
        assert r.json()["error"]["code"] == "internal_error"
        r = c.post("/v1/completions", json={"prompt": "x"})
        assert r.status_code == 503 and r.headers["Retry-After"] == "1"
        assert r.json()["error"]["code"] == "server_starting"
        assert c.get("/ready").status_code == 503 and c.get("/health").status_code == 200
