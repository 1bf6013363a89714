"""Tier 1: the server side of multi-LoRA without a model or a server process: the
--lora-modules forms, model selection, model cards and route bodies (server/lora.py),
the codec messages, the engine client's ordered control answers, the engine loop's
adapter commands, the admin key, and the LoRA metrics. End to end:
tests/server/test_server_lora.py."""
from __future__ import annotations

import asyncio
import socket

import pytest

from kvserve.engine.stats import AdapterCounters, EngineStats
from kvserve.errors import AdapterLoadError, AdapterNotFoundError, InvalidRequestError
from kvserve.ipc import codec
from kvserve.server import lora
from kvserve.server.errors import ModelNotFoundError, ServiceUnavailableError
from kvserve.server.metrics import ServerMetrics, parse_metrics

BASE = "SmolLM2-135M-Instruct"
ALIASES = frozenset({BASE, "HuggingFaceTB/" + BASE, "/models/x:y.gguf"})
DESCRIPTION = {"name": "a", "path": "/ad/a", "id": "f" * 32, "rank": 8, "lora_alpha": 16.0,
               "target_modules": ["q_proj"], "tier": "host", "created": 1700000000}


# ------------------------------------------------------------ --lora-modules
def test_lora_modules_accept_both_forms():
    assert lora.parse_lora_module("a=/x/y") == lora.LoRAModule("a", "/x/y")
    assert lora.parse_lora_module("a=/x=y") == lora.LoRAModule("a", "/x=y")
    assert lora.parse_lora_module('{"name": "b", "path": "/p", "base_model_name": "m"}') == \
        lora.LoRAModule("b", "/p", "m")
    items = ["a=/x", '{"name": "b", "path": "/p", "base_model_name": "%s"}' % BASE]
    assert lora.lora_modules_config(items, ALIASES) == {"a": "/x", "b": "/p"}
    assert lora.lora_modules_config(None, ALIASES) == {}


@pytest.mark.parametrize("items, words", [
    (["a"], "expected name=path"), (["=/x"], "expected name=path"), (["a="], "expected name=path"),
    (['{"name": "a"}'], "expected"), (['{"name": "a", "path": "/p", "rank": 8}'], "unknown key 'rank'"),
    (['{"name": 1, "path": "/p"}'], "expected"), (["{oops"], "not valid JSON"),
    (["a=/x", "a=/y"], "given twice"), ([f"{BASE}=/x"], "is a name of the base model"),
    (['{"name": "a", "path": "/p", "base_model_name": "other"}'], "is not the model this server serves"),
])
def test_bad_lora_modules_are_refused_by_name(items, words):
    with pytest.raises(ValueError) as err:
        lora.lora_modules_config(items, ALIASES)
    assert words in str(err.value)


def test_serve_flags_become_engine_config_fields():
    from kvserve.cli import build_parser
    from kvserve.server.cli import lora_config
    parse = build_parser().parse_args
    off = lora_config(parse(["serve"]), ALIASES)
    assert off == {"enable_lora": False, "max_loras": 4, "max_cpu_loras": None, "max_lora_rank": 16,
                   "lora_modules": None}
    args = parse(["serve", "--lora-modules", "a=/x", '{"name": "b", "path": "/p"}', "--lora-modules", "c=/z",
                  "--max-loras", "2", "--max-cpu-loras", "3", "--max-lora-rank", "64"])
    assert lora_config(args, ALIASES) == {"enable_lora": True, "max_loras": 2, "max_cpu_loras": 3,
                                          "max_lora_rank": 64, "lora_modules": {"a": "/x", "b": "/p", "c": "/z"}}
    assert lora_config(parse(["serve", "--enable-lora"]), ALIASES)["enable_lora"] is True
    assert parse(["serve", "--admin-api-key", "k"]).admin_api_key == "k"


# ----------------------------------------------------------- model selection
def test_model_selects_the_base_or_an_adapter():
    adapters = {"a": DESCRIPTION, "x:y": DESCRIPTION}
    for model in (None, BASE, "HuggingFaceTB/" + BASE, "/models/x:y.gguf"):
        assert lora.select_adapter(model, BASE, ALIASES, adapters) is None
    assert lora.select_adapter("a", BASE, ALIASES, adapters) == "a"
    assert lora.select_adapter(f"{BASE}:a", BASE, ALIASES, adapters) == "a"
    assert lora.select_adapter(f"HuggingFaceTB/{BASE}:a", BASE, ALIASES, adapters) == "a"
    assert lora.select_adapter("/models/x:y.gguf:a", BASE, ALIASES, adapters) == "a"      # ':' in the alias
    assert lora.select_adapter(f"{BASE}:x:y", BASE, ALIASES, adapters) == "x:y"            # ':' in the name
    for model in ("b", f"{BASE}:b", "other:a", f"{BASE}:", ":a"):
        with pytest.raises(ModelNotFoundError) as err:
            lora.select_adapter(model, BASE, ALIASES, adapters)
        assert err.value.param == "model" and err.value.http_status == 404
        assert "'a'" in err.value.message and BASE in err.value.message
    with pytest.raises(ModelNotFoundError) as err:
        lora.select_adapter("b", BASE, ALIASES, {f"n{i}": DESCRIPTION for i in range(20)})
    assert err.value.message.endswith("...")                      # a long list is cut short


def test_adapter_cards_have_vllm_shape():
    cards = lora.adapter_cards({"a": DESCRIPTION}, BASE, 8192)
    assert cards == [{"id": "a", "object": "model", "created": 1700000000, "owned_by": "kvserve", "root": "/ad/a",
                      "parent": BASE, "max_model_len": 8192}]


def test_route_bodies():
    assert lora.parse_load_body({"lora_name": "a", "lora_path": "/p"}, ALIASES) == ("a", "/p")
    assert lora.parse_unload_body({"lora_name": "a"}) == "a"
    for body, param in [({"lora_path": "/p"}, "lora_name"), ({"lora_name": "a"}, "lora_path"),
                        ({"lora_name": "", "lora_path": "/p"}, "lora_name"),
                        ({"lora_name": 3, "lora_path": "/p"}, "lora_name"),
                        ({"lora_name": "a" * 257, "lora_path": "/p"}, "lora_name"),
                        ({"lora_name": BASE, "lora_path": "/p"}, "lora_name"),
                        ({"lora_name": "a", "lora_path": "/p", "load_inplace": True}, "load_inplace")]:
        with pytest.raises(InvalidRequestError) as err:
            lora.parse_load_body(body, ALIASES)
        assert err.value.param == param, body
    with pytest.raises(InvalidRequestError) as err:
        lora.parse_unload_body({"lora_name": "a", "lora_int_id": 1})
    assert err.value.code == "unknown_parameter"


# --------------------------------------------------------------------- codec
def test_codec_round_trips_the_adapter_messages():
    error = AdapterLoadError("bad", param="lora_path").to_dict()
    messages = [codec.EngineReady(100, 49152, 10, 16, 160, [2], "explained", 123, adapters=[DESCRIPTION]),
                codec.EngineReady(100, 49152, 10, 16, 160, [2], "explained", 123),
                codec.EngineFailed(400, error), codec.LoadAdapter("a", "/p"), codec.UnloadAdapter("a"),
                codec.AdapterResult(200, [DESCRIPTION], adapter=DESCRIPTION), codec.AdapterResult(200, []),
                codec.AdapterResult(400, [DESCRIPTION], error=error),
                codec.EngineStatsUpdate(EngineStats(adapters=AdapterCounters(True, 2, 4, running_adapters=["a"])))]
    assert codec.FrameBuffer().feed(b"".join(codec.encode(m) for m in messages)) == messages


# ----------------------------------------------------- engine client answers
class _Writer:
    def __init__(self):
        self.frames = codec.FrameBuffer()
        self.sent = []

    def write(self, data: bytes) -> None:
        self.sent.extend(self.frames.feed(data))

    def is_closing(self) -> bool:
        return False


def _client():
    from kvserve.server.engine_client import EngineClient
    client = EngineClient(None, ServerMetrics(), {})
    client.info = codec.EngineReady(100, 49152, 10, 16, 160, [2], "", 1, adapters=[DESCRIPTION])
    client._set_adapters(client.info.adapters)
    client._writer = _Writer()
    return client


def test_control_answers_go_to_their_queries_in_order():
    async def scenario():
        client = _client()
        reset = asyncio.create_task(client.reset_prefix_cache())
        load = asyncio.create_task(client.load_adapter("b", "/p"))
        bad = asyncio.create_task(client.load_adapter("c", "/q"))
        unload = asyncio.create_task(client.unload_adapter("zz"))
        await asyncio.sleep(0)
        assert client._writer.sent == [codec.ResetPrefixCache(), codec.LoadAdapter("b", "/p"),
                                       codec.LoadAdapter("c", "/q"), codec.UnloadAdapter("zz")]
        b = {**DESCRIPTION, "name": "b"}
        client._handle(codec.PrefixCacheReset(5))
        client._handle(codec.AdapterResult(200, [DESCRIPTION, b], adapter=b))
        client._handle(codec.AdapterResult(400, [DESCRIPTION, b], error=AdapterLoadError(
            "no adapter_config.json", param="lora_path").to_dict()))
        client._handle(codec.AdapterResult(404, [DESCRIPTION, b], error=AdapterNotFoundError("no zz").to_dict()))
        assert await reset == 5 and await load == b
        with pytest.raises(Exception) as err:
            await bad
        assert err.value.http_status == 400 and err.value.code == "invalid_lora_adapter"
        with pytest.raises(Exception) as err:
            await unload
        assert err.value.http_status == 404 and err.value.code == "model_not_found"
        assert set(client.adapters) == {"a", "b"}          # the engine's list after each answer
    asyncio.run(scenario())


def test_a_timed_out_query_keeps_its_place_and_a_stray_answer_is_an_error():
    async def scenario():
        client = _client()
        with pytest.raises(ServiceUnavailableError) as err:
            await client.load_adapter("slow", "/p", timeout_s=0.01)
        assert err.value.code == "engine_timeout" and err.value.http_status == 503
        later = asyncio.create_task(client.reset_prefix_cache())
        await asyncio.sleep(0)
        client._handle(codec.AdapterResult(200, [], adapter=None))     # the late answer: dropped
        assert client.adapters == {} and not later.done()
        client._handle(codec.PrefixCacheReset(1))
        assert await later == 1
        with pytest.raises(codec.CodecError):
            client._handle(codec.PrefixCacheReset(1))                  # nothing waits for it
        pending = asyncio.create_task(client.unload_adapter("a"))
        await asyncio.sleep(0)
        with pytest.raises(codec.CodecError):
            client._handle(codec.PrefixCacheReset(1))                  # the wrong kind of answer
        client._closing = True
        client._engine_gone()
        with pytest.raises(Exception) as err:
            await pending
        assert err.value.code == "engine_unavailable"
    asyncio.run(scenario())


# ------------------------------------------------------ engine loop commands
class _FakeEngine:
    def __init__(self):
        self.adapters: dict[str, dict] = {}

    def load_adapter(self, name, path):
        if path == "/bad":
            raise AdapterLoadError(f"LoRA adapter path {path!r} is not a folder", param="lora_path")
        if path == "/bug":
            raise RuntimeError("unexpected")
        self.adapters[name] = {**DESCRIPTION, "name": name, "path": path}
        return self.adapters[name]

    def unload_adapter(self, name):
        if self.adapters.pop(name, None) is None:
            raise AdapterNotFoundError(f"no adapter named {name!r} is loaded", param="lora_name")

    def list_adapters(self):
        return list(self.adapters.values())


def test_engine_loop_answers_every_adapter_command():
    from kvserve.ipc.engine_proc import EngineLoop
    ours, theirs = socket.socketpair()
    with ours, theirs:
        loop = EngineLoop(_FakeEngine(), ours)
        for message in (codec.LoadAdapter("a", "/ok"), codec.LoadAdapter("b", "/bad"), codec.LoadAdapter("c", "/bug"),
                        codec.UnloadAdapter("zz"), codec.UnloadAdapter("a")):
            loop.handle(message)
        theirs.settimeout(5)
        frames, replies = codec.FrameBuffer(), []
        while len(replies) < 5:
            replies.extend(frames.feed(theirs.recv(1 << 16)))
    ok, bad, bug, missing, unloaded = replies
    assert ok.status == 200 and ok.adapter["path"] == "/ok" and [a["name"] for a in ok.adapters] == ["a"]
    assert bad.status == 400 and "not a folder" in bad.error["error"]["message"] and bad.adapter is None
    assert bug.status == 500 and "unexpected" not in bug.error["error"]["message"]
    assert missing.status == 404 and missing.error["error"]["code"] == "model_not_found"
    assert unloaded.status == 200 and unloaded.adapters == [] and unloaded.error is None


# --------------------------------------------------------------- admin key
def _app_client(api_keys, admin_key):
    from starlette.testclient import TestClient

    from kvserve.server.app import ServingContext, build_app
    from kvserve.server.state import AdmissionLimits, ServerState
    ctx = ServingContext(tokenizer=None, model_name="m", model_aliases=frozenset({"m"}),
                         state=ServerState(AdmissionLimits()), metrics=ServerMetrics(), api_keys=api_keys,
                         admin_keys=(admin_key,) if admin_key else ())
    return TestClient(build_app(ctx), raise_server_exceptions=False)


def test_admin_key_guards_the_admin_routes():
    def status(c, path, key):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        bodies = {"/v1/load_lora_adapter": {"lora_name": "a", "lora_path": "/p"},
                  "/v1/unload_lora_adapter": {"lora_name": "a"}, "/v1/completions": {"prompt": "x"}}
        return c.post(path, json=bodies.get(path, {}), headers=headers).status_code
    admin_routes = ("/admin/reset_prefix_cache", "/v1/load_lora_adapter", "/v1/unload_lora_adapter")
    with _app_client({"user": "alice"}, "root") as c:
        for path in admin_routes:
            assert status(c, path, None) == 401 and status(c, path, "nope") == 401
            assert status(c, path, "user") == 403
            assert status(c, path, "root") == 503                     # past auth; no engine here
        assert status(c, "/v1/completions", "root") == 401            # the admin key opens admin routes only
        assert status(c, "/v1/completions", "user") == 503
    with _app_client({}, "root") as c:                                # no user keys: other routes open
        assert status(c, "/v1/completions", None) == 503
        assert status(c, "/v1/load_lora_adapter", None) == 401 and status(c, "/v1/load_lora_adapter", "root") == 503
    with _app_client({"user": "alice"}, None) as c:                   # no admin key: behind the user keys
        assert status(c, "/admin/reset_prefix_cache", "user") == 503
        assert status(c, "/v1/load_lora_adapter", None) == 401


# ------------------------------------------------------------------ metrics
def test_lora_metrics_appear_once_the_engine_has_lora():
    m = ServerMetrics()
    m.update_engine(EngineStats())
    assert "kvserve_lora" not in m.render()
    counters = AdapterCounters(True, max_resident=2, max_host=4, num_registered=3, num_resident=2, num_host=3,
                               num_disk_loads=5, num_slot_loads=4, num_slot_evictions=2, num_host_evictions=1,
                               disk_load_seconds=0.5, slot_load_seconds=0.25, num_waiting_for_slot=1,
                               running_adapters=["a", "b"], waiting_adapters=["c"])
    m.update_engine(EngineStats(adapters=counters))
    m.lora.requests.inc(adapter="a")
    m.lora.generation_tokens.inc(7, adapter="a")
    m.update_engine(EngineStats(adapters=AdapterCounters(True, 2, 4, running_adapters=["b"])))
    samples = parse_metrics(m.render())
    info = [k for k in samples if k.startswith("kvserve_lora_requests_info")]
    assert info == ['kvserve_lora_requests_info{max_lora="2",running_lora_adapters="b",waiting_lora_adapters=""}']
    assert samples[info[0]] > 1e9                                     # the update's Unix time
    m.update_engine(EngineStats(adapters=counters))
    samples = parse_metrics(m.render())
    assert samples['kvserve_lora_requests_info{max_lora="2",running_lora_adapters="a,b",waiting_lora_adapters="c"}']
    assert samples["kvserve_lora_adapters_resident"] == 2 and samples["kvserve_lora_adapters_host"] == 3
    assert samples["kvserve_lora_max_resident"] == 2 and samples["kvserve_lora_num_waiting_for_slot"] == 1
    assert samples["kvserve_lora_disk_loads_total"] == 5 and samples["kvserve_lora_slot_evictions_total"] == 2
    assert samples['kvserve_lora_load_seconds_total{tier="slot"}'] == 0.25
    assert samples['kvserve_lora_requests_total{adapter="a"}'] == 1
    assert samples['kvserve_lora_generation_tokens_total{adapter="a"}'] == 7
    assert "# TYPE kvserve_lora_requests_info gauge" in m.render()


def test_a_waiting_requests_queued_work_is_its_prompt_past_the_cached_prefix():
    """The replica reports waiting requests' uncached prompt tokens to the router: a turn whose
    history the cache holds (by its events) is little work, a cold prompt is all of it."""
    from kvserve.engine.kv.cache_events import CacheNamespace
    from kvserve.engine.request import EngineRequest
    from kvserve.router.index import request_block_hashes
    from kvserve.sampling.params import SamplingParams
    client = _client()
    history = list(range(100, 164))                                  # 4 blocks of 16
    client.cached_blocks.update(request_block_hashes(history, CacheNamespace(), 16)[:3])
    warm = EngineRequest("w", history + [7] * 10, SamplingParams(max_tokens=1))
    cold = EngineRequest("c", [9] * 74, SamplingParams(max_tokens=1))
    salted = EngineRequest("s", history + [7] * 10, SamplingParams(max_tokens=1), cache_salt="tenant-b")
    assert client._uncached_tokens(warm) == 74 - 48
    assert client._uncached_tokens(cold) == 74 and client._uncached_tokens(salted) == 74
