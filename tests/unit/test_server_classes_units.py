"""Request classes and latency accounting on the HTTP side, without a model: service_tier,
key pinning, labelled histograms, Server-Timing, the codec's step start."""
from __future__ import annotations

import asyncio
import json

import pytest

from kvserve.engine.service_class import ServiceClass
from kvserve.errors import InvalidRequestError
from kvserve.ipc import codec
from kvserve.server import protocol
from kvserve.server.auth import AuthMiddleware, KeyGrant, load_keys
from kvserve.server.classes import choose_class, tier_for_class
from kvserve.server.engine_client import TrackedRequest
from kvserve.server.metrics import Histogram, ServerMetrics, parse_metrics
from kvserve.server.responses import ResponseBuilder
from kvserve.server.timing import (RequestTiming, combine_timings, format_server_timing,
                                   server_timing_comment)

CHAT_BODY = {"messages": [{"role": "user", "content": "x"}]}


# ---------------------------------------------------------------- protocol
@pytest.mark.parametrize("tier, expected", [
    (None, None), ("auto", ServiceClass.CHAT), ("default", ServiceClass.CHAT),
    ("flex", ServiceClass.BATCH), ("priority", ServiceClass.INTERACTIVE)])
def test_service_tier_accepted(tier, expected):
    assert protocol.parse_completion({"prompt": "x", "service_tier": tier}).service_class is expected
    assert protocol.parse_chat({**CHAT_BODY, "service_tier": tier}).service_class is expected
    assert protocol.parse_completion({"prompt": "x"}).service_class is None


@pytest.mark.parametrize("tier", ["scale", "Priority", "", "interactive", 1, True, ["flex"], {"a": 1}])
def test_service_tier_rejected_naming_the_values(tier):
    for parse, body in ((protocol.parse_completion, {"prompt": "x"}), (protocol.parse_chat, CHAT_BODY)):
        with pytest.raises(InvalidRequestError) as info:
            parse({**body, "service_tier": tier})
        assert info.value.param == "service_tier" and info.value.http_status == 400
        assert all(f'"{name}"' in info.value.message for name in ("auto", "default", "flex", "priority"))


def test_class_choice_and_reported_tier():
    assert choose_class(None, None) is ServiceClass.CHAT
    assert choose_class(None, ServiceClass.INTERACTIVE) is ServiceClass.INTERACTIVE
    assert choose_class(ServiceClass.BATCH, ServiceClass.INTERACTIVE) is ServiceClass.BATCH    # the pin wins
    assert [tier_for_class(c) for c in ServiceClass] == ["priority", "default", "flex"]


def test_bodies_and_chunks_carry_the_tier():
    builder = ResponseBuilder("chat", "chatcmpl-1", "m", speller=None, logprobs=None, n=1, service_tier="flex")
    assert builder.full([], 1, 0)["service_tier"] == "flex"
    assert builder.chunk(0, "hi")["service_tier"] == "flex"
    assert builder.usage_chunk(1, 1)["service_tier"] == "flex"
    assert "service_tier" not in ResponseBuilder("completion", "c", "m", None, None, 1).full([], 1, 0)


# -------------------------------------------------------------------- auth
def test_keys_file_third_column_pins_the_class(tmp_path):
    path = tmp_path / "keys.txt"
    path.write_text("# key tenant [class]\nk1 alice\nk2 bob batch\nk3 carol priority\nk4 dan chat\n")
    assert load_keys(None, str(path)) == {
        "k1": KeyGrant("alice"), "k2": KeyGrant("bob", ServiceClass.BATCH),
        "k3": KeyGrant("carol", ServiceClass.INTERACTIVE), "k4": KeyGrant("dan", ServiceClass.CHAT)}
    path.write_text("k1 alice turbo\n")
    with pytest.raises(ValueError, match=r"keys.txt:1: unknown service class 'turbo'"):
        load_keys(None, str(path))
    path.write_text("k1 alice batch extra\n")
    with pytest.raises(ValueError, match="KEY TENANT CLASS"):
        load_keys(None, str(path))


def test_keys_json_object_form(tmp_path):
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"a": "alice", "b": {"tenant": "bob", "service_class": "flex"},
                                "c": {"tenant": "carol"}, "d": {"tenant": "dan", "service_class": None}}))
    assert load_keys(None, str(path)) == {"a": KeyGrant("alice"), "b": KeyGrant("bob", ServiceClass.BATCH),
                                          "c": KeyGrant("carol"), "d": KeyGrant("dan")}
    for bad in ({"a": 5}, {"a": {"service_class": "batch"}}, {"a": {"tenant": "t", "extra": 1}},
                {"a": {"tenant": "t", "service_class": 3}}, {"a": {"tenant": "t", "service_class": "gold"}}):
        path.write_text(json.dumps(bad))
        with pytest.raises(ValueError):
            load_keys(None, str(path))


def _scope_state(keys: dict, key: str | None) -> dict:
    """The scope state the middleware hands the app for a request with this key."""
    seen = {}

    async def app(scope, receive, send):
        seen.update(scope["state"])

    async def send(message):
        seen.setdefault("status", message.get("status"))

    headers = [(b"authorization", f"Bearer {key}".encode())] if key else []
    scope = {"type": "http", "path": "/v1/completions", "headers": headers}
    asyncio.run(AuthMiddleware(app, keys)(scope, None, send))
    return seen


def test_middleware_puts_the_pinned_class_in_the_scope():
    keys = {"plain": "alice", "pinned": KeyGrant("bob", ServiceClass.BATCH)}
    assert _scope_state(keys, "plain") == {"tenant": "alice", "service_class": None}
    assert _scope_state(keys, "pinned") == {"tenant": "bob", "service_class": ServiceClass.BATCH}
    assert _scope_state(keys, "wrong")["status"] == 401
    assert _scope_state({}, None) == {"tenant": None, "service_class": None}     # auth off


# ----------------------------------------------------------------- metrics
def test_unlabelled_histogram_renders_as_before():
    h = Histogram("h_seconds", "help", buckets=(0.1, 1.0))
    assert h.render() == ['h_seconds_bucket{le="0.1"} 0', 'h_seconds_bucket{le="1.0"} 0',
                          'h_seconds_bucket{le="+Inf"} 0', "h_seconds_sum 0.0", "h_seconds_count 0"]
    h.observe(0.05)
    h.observe(2.0)
    assert h.render() == ['h_seconds_bucket{le="0.1"} 1', 'h_seconds_bucket{le="1.0"} 1',
                          'h_seconds_bucket{le="+Inf"} 2', "h_seconds_sum 2.05", "h_seconds_count 2"]


def test_labelled_histogram_renders_per_label_set():
    h = Histogram("h_seconds", "help", buckets=(0.1,))
    h.observe(0.05, **{"class": "batch"})
    h.observe(0.5, **{"class": "chat"})
    h.observe(0.01, **{"class": "batch"})
    assert h.render() == ['h_seconds_bucket{class="batch",le="0.1"} 2', 'h_seconds_bucket{class="batch",le="+Inf"} 2',
                          'h_seconds_sum{class="batch"} 0.060000000000000005', 'h_seconds_count{class="batch"} 2',
                          'h_seconds_bucket{class="chat",le="0.1"} 0', 'h_seconds_bucket{class="chat",le="+Inf"} 1',
                          'h_seconds_sum{class="chat"} 0.5', 'h_seconds_count{class="chat"} 1']


def test_class_metrics_in_the_metrics_body():
    m = ServerMetrics()
    m.classes.observe_ttft(ServiceClass.INTERACTIVE, 0.03)
    m.classes.observe_queue(ServiceClass.BATCH, 0.5)
    m.classes.observe_end(ServiceClass.INTERACTIVE, 0.02)
    m.classes.observe_end(ServiceClass.BATCH, None)
    samples = parse_metrics(m.render())
    assert samples['kvserve_class_time_to_first_token_seconds_count{class="interactive"}'] == 1
    assert samples['kvserve_class_time_to_first_token_seconds_bucket{class="interactive",le="0.04"}'] == 1
    assert samples['kvserve_class_queue_time_seconds_sum{class="batch"}'] == 0.5
    assert samples['kvserve_class_time_per_output_token_seconds_count{class="interactive"}'] == 1
    assert 'kvserve_class_time_per_output_token_seconds_count{class="batch"}' not in samples
    assert [samples[f'kvserve_class_requests_finished_total{{class="{c}"}}'] for c in
            ("interactive", "chat", "batch")] == [1, 0, 1]
    assert samples["kvserve_time_to_first_token_seconds_count"] == 0       # the unlabelled ones still render


def test_time_per_output_token_of_the_longest_completion():
    tracked = TrackedRequest("r", asyncio.Queue(), 0, 3, arrival=0.0, first_token_time=1.0)
    assert tracked.time_per_output_token() is None
    tracked.tokens_per_index, tracked.last_token_time = {0: 1}, {0: 1.0}
    assert tracked.time_per_output_token() is None                         # one token: no TPOT
    tracked.tokens_per_index, tracked.last_token_time = {0: 5, 1: 3}, {0: 1.8, 1: 1.5}
    assert tracked.time_per_output_token() == pytest.approx(0.2)


# ------------------------------------------------------------ Server-Timing
def test_phases_and_header():
    timing = RequestTiming(arrival=10.0, scheduled_at=10.0123, first_token=10.0579, finish=10.1204)
    phases = timing.phases_ms()
    assert list(phases) == ["queue", "prefill", "ttft", "total"]
    assert format_server_timing(phases) == "queue;dur=12.3, prefill;dur=45.6, ttft;dur=57.9, total;dur=120.4"
    assert format_server_timing(phases, ("queue", "ttft")) == "queue;dur=12.3, ttft;dur=57.9"
    assert server_timing_comment(phases) == b": server-timing total;dur=120.4\n\n"


def test_phases_known_so_far_and_clamped():
    assert RequestTiming(5.0).phases_ms() == {}
    assert server_timing_comment({}) == b""
    assert RequestTiming(5.0, scheduled_at=5.5).phases_ms() == {"queue": 500.0}
    assert RequestTiming(5.0, finish=5.25).phases_ms() == {"total": 250.0}          # failed before scheduling
    skewed = RequestTiming(5.0, scheduled_at=4.9, first_token=5.2, finish=5.1).phases_ms()
    assert skewed == {"queue": 0.0, "prefill": pytest.approx(200.0), "ttft": pytest.approx(200.0),
                      "total": pytest.approx(200.0)}
    late = RequestTiming(5.0, scheduled_at=5.3, first_token=5.2).phases_ms()          # scheduled after the token
    assert late["queue"] + late["prefill"] == pytest.approx(late["ttft"])


def test_combine_over_prompts():
    parts = [(1.2, 1.5, 2.0), (1.1, 1.6, 2.4)]
    assert combine_timings(1.0, parts) == RequestTiming(1.0, 1.1, 1.5, 2.4)
    assert combine_timings(1.0, [(1.2, 1.5, 2.0), (None, None, None)]) == RequestTiming(1.0, 1.2, 1.5, None)
    assert combine_timings(1.0, [(1.2, None, None)], now=3.0).finish == 3.0
    assert combine_timings(1.0, [], now=3.0) == RequestTiming(1.0, None, None, 3.0)


def test_step_outputs_carry_the_step_start():
    message = codec.StepOutputs([], ["r1"], step_start=1234.5)
    assert codec.decode_payload(codec.encode(message)[codec.FRAME_HEADER.size:]).step_start == 1234.5
    assert codec.decode_payload(codec.encode(codec.StepOutputs([]))[codec.FRAME_HEADER.size:]).step_start == 0.0
