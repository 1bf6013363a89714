"""``POST /admin/load_weights``, ``/admin/sleep``, ``/admin/wake`` on a running server (issue 19):
a load while a stream runs lets it finish on the old weights, later requests never see a
cached token from before and equal a fresh engine on the new weights; a sleeping server
refuses generation with 409 and after wake answers exactly as before.

Two tiny random Llama folders of the same shape (seeds 0 and 1) and one of another shape."""
from __future__ import annotations

import concurrent.futures
import json
import threading

import httpx
import pytest

from benchmarks.server_process import ServerProcess
from kvserve.sampling.params import SamplingParams
from tests.support.tiny_models import save_tiny_hf

pytestmark = [pytest.mark.model, pytest.mark.server]

PROMPT = "The paged KV cache keeps every block of a prompt so the next turn " * 4
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def folders(tmp_path_factory, model_path):
    made = {}
    for name, seed, hidden in (("a", 0, 64), ("b", 1, 64), ("wide", 0, 128)):
        folder = tmp_path_factory.mktemp(f"weights-{name}")
        save_tiny_hf("llama", folder, model_path, seed=seed, hidden=hidden, intermediate=2 * hidden)
        made[name] = str(folder)
    return made


@pytest.fixture(scope="module")
def server(folders):
    with_server = ServerProcess("--model", folders["a"], "--served-model-name", "tiny", "--threads", "1",
                                "--dtype", "float32", "--kv-cache-gib", "0.01", "--no-warmup")
    with_server.start()
    yield with_server
    with_server.stop()


def complete(server, prompt: str = PROMPT, max_tokens: int = MAX_TOKENS) -> httpx.Response:
    return httpx.post(server.base_url + "/completions", timeout=120, json={
        "model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})


def stream_text(server, started: threading.Event, max_tokens: int) -> str:
    """A streamed greedy completion's text; ``started`` is set once its first token arrived."""
    text = []
    with httpx.stream("POST", server.base_url + "/completions", timeout=120, json={
            "model": "tiny", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text.append(json.loads(line[6:])["choices"][0]["text"])
                started.set()
    return "".join(text)


def offline_ids(folder: str) -> list[int]:
    from kvserve import LLM
    llm = LLM(folder, dtype="float32", kv_cache_bytes=8 * 2**20, num_threads=1)
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return llm.generate([PROMPT], greedy)[0].outputs[0].token_ids


def text_of(folder: str, ids: list[int]) -> str:
    from kvserve.tokenizer import Tokenizer
    return Tokenizer.load(folder).decode(ids)


def test_load_mid_traffic_then_sleep_and_wake(server, folders):
    before = complete(server).json()
    assert complete(server).json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    started = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(stream_text, server, started, 150)        # in flight when the load arrives
        assert started.wait(60)
        loaded = httpx.post(server.url + "/admin/load_weights", json={"model": folders["b"]}, timeout=300)
        old_stream = running.result()
    assert loaded.status_code == 200 and loaded.json()["weight_epoch"] == 1, loaded.text
    assert len(old_stream) > len(before["choices"][0]["text"])
    assert old_stream.startswith(before["choices"][0]["text"]), old_stream     # it finished on A's weights
    after = complete(server).json()
    assert after["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert after["choices"][0]["text"] == text_of(folders["b"], offline_ids(folders["b"]))

    refused = httpx.post(server.url + "/admin/load_weights", json={"model": folders["wide"]}, timeout=300)
    assert refused.status_code == 400 and "hidden_size" in refused.json()["error"]["message"]

    assert httpx.post(server.url + "/admin/sleep", timeout=60).json()["asleep"] is True
    asleep = complete(server)
    assert asleep.status_code == 409 and asleep.json()["error"]["code"] == "engine_busy"
    assert httpx.post(server.url + "/admin/wake", timeout=60).json()["asleep"] is False
    assert complete(server).json()["choices"][0]["text"] == after["choices"][0]["text"]
