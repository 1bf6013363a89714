"""Tier 1: the prefix cache's request fields and messages (no model, no server): the cache
salt comes from the tenant, the per-request opt-out, the codec messages. Over HTTP on a
real server: tests/server/test_server_prefix_cache.py."""
from __future__ import annotations

import pytest

from kvserve.ipc import codec
from kvserve.server.auth import NO_AUTH_CACHE_SALT, cache_salt
from kvserve.server.protocol import InvalidRequestError, parse_chat, parse_completion


def test_cache_salt_comes_from_the_tenant_not_the_body():
    assert cache_salt(None) == NO_AUTH_CACHE_SALT
    assert cache_salt("alice") != cache_salt("bob")
    assert cache_salt("alice") != cache_salt(None)
    with pytest.raises(InvalidRequestError) as err:           # no body field can set the salt
        parse_completion({"prompt": "x", "cache_salt": "alice"})
    assert err.value.param == "cache_salt"


def test_use_prefix_cache_field():
    assert parse_completion({"prompt": "x"}).use_prefix_cache is True
    assert parse_completion({"prompt": "x", "use_prefix_cache": False}).use_prefix_cache is False
    assert parse_chat({"messages": [{"role": "user", "content": "x"}],
                       "use_prefix_cache": True}).use_prefix_cache is True
    for bad in ("false", 0, 1, [], {}):
        with pytest.raises(InvalidRequestError) as err:
            parse_completion({"prompt": "x", "use_prefix_cache": bad})
        assert err.value.param == "use_prefix_cache"


def test_codec_round_trips_the_prefix_cache_messages():
    from kvserve.engine.request import EngineRequest
    from kvserve.engine.step import SeqUpdate
    from kvserve.sampling.params import SamplingParams
    messages = [EngineRequest("r", [1, 2], SamplingParams(max_tokens=2), frozenset([0]), 0, "alice",
                              cache_salt="tenant:alice", use_prefix_cache=False),
                codec.ResetPrefixCache(), codec.PrefixCacheReset(7),
                codec.StepOutputs([SeqUpdate(1, "r", 0, [5], [], None, 32)])]
    frames = codec.FrameBuffer()
    decoded = frames.feed(b"".join(codec.encode(m) for m in messages))
    assert decoded[:3] == messages[:3]
    assert decoded[3].updates[0].num_cached_tokens == 32
