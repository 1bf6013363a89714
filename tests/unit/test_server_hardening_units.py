"""Issue 15's defects, tier 1: lone surrogates, empty keys, stop signals, size refusal, generation length."""
from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest

from kvserve.errors import ContextLengthExceededError, InvalidRequestError
from kvserve.sampling.params import SamplingParams
from kvserve.server import json_body, protocol
from kvserve.server.auth import load_keys
from kvserve.server.serving import PreparedPrompt, apply_generation_length, check_prompt_size

INFO = SimpleNamespace(max_model_len=100)


@pytest.mark.parametrize("body", [b'{"prompt": "\\ud800"}', b'{"\\udfff": 1}', b'{"stop": ["a", "\\udc00b"]}',
                                  b'{"messages": [{"role": "\\ud800", "content": "hi"}]}'])
def test_lone_surrogates_are_invalid_encoding(body):
    with pytest.raises(InvalidRequestError) as info:
        json_body.parse_json_body(body)
    assert info.value.code == "invalid_encoding"


def test_surrogate_pairs_are_characters():
    assert json_body.parse_json_body(b'{"a": "\\ud83d\\ude00"}') == {"a": "\U0001F600"}


def test_empty_api_key_is_a_startup_error():
    with pytest.raises(ValueError, match="empty"):
        load_keys("")
    assert load_keys(None) == {}


def test_engine_process_ignores_process_group_stop_signals():
    code = ("import os, signal; from kvserve.ipc.engine_proc import ignore_stop_signals; ignore_stop_signals(); "
            "os.kill(os.getpid(), signal.SIGINT); os.kill(os.getpid(), signal.SIGTERM); print('alive')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "alive"


def _chat(messages, max_tokens=None):
    return protocol.GenerateSpec(kind="chat", model=None, params=SamplingParams(max_tokens=max_tokens),
                                 messages=messages)


def test_prompt_refused_by_size_before_tokenising():
    check_prompt_size(_chat([{"role": "user", "content": "x" * 6396}]), INFO)       # 64 chars per token fit (role included)
    with pytest.raises(ContextLengthExceededError):
        check_prompt_size(_chat([{"role": "user", "content": "x" * 6397}]), INFO)
    with pytest.raises(ContextLengthExceededError) as info:
        check_prompt_size(_chat([{"role": "user", "content": ""}] * 100), INFO)
    assert info.value.param == "messages"


def test_generation_length_default_and_limit():
    prompts = [PreparedPrompt("p", list(range(90)))]
    spec = _chat([{"role": "user", "content": "hi"}])
    apply_generation_length(spec, prompts, INFO, default_max_tokens=64, max_tokens_limit=None)
    assert spec.params.max_tokens == 10                   # cut to what the context leaves
    spec = _chat([{"role": "user", "content": "hi"}])
    apply_generation_length(spec, [PreparedPrompt("p", [1])], INFO, default_max_tokens=64, max_tokens_limit=32)
    assert spec.params.max_tokens == 32
    with pytest.raises(InvalidRequestError) as info:
        apply_generation_length(_chat([], max_tokens=33), prompts, INFO, 64, 32)
    assert info.value.param == "max_tokens"
    spec = _chat([{"role": "user", "content": "hi"}])
    apply_generation_length(spec, prompts, INFO, None, None)
    assert spec.params.max_tokens is None                 # both off: to the end of the context


def test_completions_without_max_tokens_get_openais_16_within_the_servers_caps():
    def length(default, limit, prompt_len=1, body=None):
        spec = protocol.parse_completion(body or {"prompt": "hi"})
        apply_generation_length(spec, [PreparedPrompt("hi", list(range(prompt_len)))], INFO, default, limit)
        return spec.params.max_tokens
    assert length(None, None) == 16                       # OpenAI's default for completions
    assert length(2048, None) == 16
    assert length(2048, 8) == 8                           # a lower server limit wins: never a 400 for it
    assert length(None, None, prompt_len=95) == 5         # cut to what the context leaves
    assert length(2048, 64, body={"prompt": "hi", "max_tokens": 40}) == 40
