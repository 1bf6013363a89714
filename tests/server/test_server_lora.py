"""Multi-LoRA over HTTP: start-up and runtime adapters selected by ``model``, greedy parity
with the offline engine, /v1/models, the admin load / unload routes and their errors, a
reload under one name never serving the old adapter's KV, unload during a stream, the
adapter metrics, and a bad start-up adapter exiting 2 (the pure helpers without a server:
tests/unit/test_server_lora_units.py).

One server for the module (user key + admin key, two resident slots, rank <= 16) plus two
short-lived ones that fail at start. Adapters are written by peft (tests/support/
lora_adapters.py) on a shape-only copy of the default model (random weights: an adapter
depends on the projection shapes, not on the base weights), or by hand with safetensors.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time

import httpx
import pytest

from benchmarks.server_process import ServerProcess, free_port
from kvserve.server.metrics import parse_metrics

pytestmark = pytest.mark.model

MODEL = "SmolLM2-135M-Instruct"
USER_KEY, ADMIN_KEY = "lora-user-key", "lora-admin-key"
PROMPT = "Write one sentence about the sea:"
CACHE_PROMPT = "Reload check. The quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat today."
ATTENTION_MLP = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj")     # no down_proj
ROUNDS = 100


# ------------------------------------------------------------------ adapters
def _shape_only_base(mc):
    """A transformers Llama with the default model's projection shapes and random weights
    (tiny vocabulary): make_adapter needs the module tree, not the weights."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig
    config = LlamaConfig(vocab_size=64, hidden_size=mc.hidden_size, intermediate_size=mc.intermediate_size,
                         num_hidden_layers=mc.num_layers, num_attention_heads=mc.num_heads,
                         num_key_value_heads=mc.num_kv_heads, head_dim=mc.head_dim, tie_word_embeddings=True)
    try:
        from transformers.initialization import no_init_weights
    except ImportError:                    # older transformers
        from transformers.modeling_utils import no_init_weights
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.eval()


def _write_adapter(folder, config: dict, tensors: dict | None) -> str:
    """A PEFT folder written by hand (config + safetensors); ``tensors`` None: no weights file."""
    from safetensors.torch import save_file
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "bias": "none", "lora_alpha": 16, **config}, f)
    if tensors is not None:
        save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(folder, "adapter_model.safetensors"))
    return str(folder)


def _key(layer: int, module: str, which: str) -> str:
    part = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
    return f"base_model.model.model.layers.{layer}.{part}.{module}.lora_{which}.weight"


def _variant(pool_folder: str, folder, seed: int, mc) -> str:
    """``pool_folder``'s adapter plus a down_proj pair with a random A (``seed``) and a zero
    B: new content (a new identity, so nothing may be served from the cache), exactly the
    same outputs (the extra term adds 0)."""
    import torch
    from safetensors.torch import load_file
    tensors = load_file(os.path.join(pool_folder, "adapter_model.safetensors"))
    with open(os.path.join(pool_folder, "adapter_config.json")) as f:
        config = json.load(f)
    r, layer = config["r"], seed % mc.num_layers
    generator = torch.Generator().manual_seed(seed)
    tensors[_key(layer, "down_proj", "A")] = torch.randn(r, mc.intermediate_size, generator=generator) * 0.02
    tensors[_key(layer, "down_proj", "B")] = torch.zeros(mc.hidden_size, r)
    config["target_modules"] = sorted(set(config["target_modules"]) | {"down_proj"})
    return _write_adapter(folder, config, tensors)


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """The offline reference runs beside the server on a shared machine: one thread each
    (two OpenMP threads on busy cores run far slower than one)."""
    import torch
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def offline():
    """The offline engine with LoRA: the reference for every output."""
    from kvserve import LLM
    return LLM(None, dtype="float32", enable_lora=True, max_loras=2, kv_cache_bytes=256 * 2**20,
               max_num_seqs=8, num_threads=1)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, offline) -> dict[str, str]:
    """name -> folder: alpha, beta (start-up), gamma (loaded at run time), pool0..3 (reloads)."""
    import gc

    from tests.support.lora_adapters import make_adapter
    root = tmp_path_factory.mktemp("adapters")
    base = _shape_only_base(offline.engine.model_config)
    folders = {"alpha": make_adapter(base, str(root / "alpha"), r=8, targets=ATTENTION_MLP, seed=1, scale_b=3.0),
               "beta": make_adapter(base, str(root / "beta"), r=4, alpha=8, targets=("q_proj", "v_proj"), seed=2,
                                    scale_b=4.0),
               "gamma": make_adapter(base, str(root / "gamma"), r=16, targets=ATTENTION_MLP, seed=3, scale_b=2.0)}
    for i in range(4):                      # small (a round reads one from disk): attention only, rank 4
        folders[f"pool{i}"] = make_adapter(base, str(root / f"pool{i}"), r=4, targets=("q_proj", "v_proj", "o_proj"),
                                           seed=10 + i, scale_b=4.0)
    del base
    gc.collect()
    return folders


@pytest.fixture(scope="module")
def server(adapters):
    modules = [f"alpha={adapters['alpha']}", json.dumps({"name": "beta", "path": adapters["beta"]})]
    with ServerProcess("--api-key", USER_KEY, "--admin-api-key", ADMIN_KEY, "--threads", "1", "--dtype", "float32",
                       "--kv-cache-gib", "0.2", "--max-num-seqs", "8", "--max-loras", "2",
                       "--max-lora-rank", "16", "--lora-modules", *modules) as proc:
        yield proc


# ------------------------------------------------------------------- helpers
def _post(server, path: str, body: dict, key: str | None = USER_KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(server.url + path, json=body, headers=headers, timeout=120)


def _complete(server, model: str, prompt: str = PROMPT, max_tokens: int = 8, **extra) -> dict:
    r = _post(server, "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                          "temperature": 0, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def _chat(server, model: str, content: str, max_tokens: int = 8) -> dict:
    r = _post(server, "/v1/chat/completions", {"model": model, "max_tokens": max_tokens, "temperature": 0,
                                               "messages": [{"role": "user", "content": content}]})
    assert r.status_code == 200, r.text
    return r.json()


def _offline(offline, name: str | None, folder: str | None, prompt=PROMPT, max_tokens: int = 8, **params):
    from kvserve import SamplingParams
    from kvserve.frontend.lora_request import LoRARequest
    lora = LoRARequest(name, folder) if name else None
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, **params)
    if isinstance(prompt, list):
        return offline.chat(prompt, sp, lora_request=lora)[0].outputs[0].text
    return offline.generate([prompt], sp, lora_request=lora)[0].outputs[0].text


def _load(server, name: str, path: str, key: str | None = ADMIN_KEY) -> httpx.Response:
    return _post(server, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path}, key)


def _unload(server, name: str, key: str | None = ADMIN_KEY) -> httpx.Response:
    return _post(server, "/v1/unload_lora_adapter", {"lora_name": name}, key)


def _metrics(server) -> dict[str, float]:
    r = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=30)
    assert r.status_code == 200                  # with an admin key, /metrics is an admin route
    return parse_metrics(r.text)


# --------------------------------------------------------------------- tests
def test_models_list_the_adapters_with_their_parent(server, adapters):
    r = httpx.get(server.base_url + "/models", headers={"Authorization": f"Bearer {USER_KEY}"}, timeout=30)
    cards = {c["id"]: c for c in r.json()["data"]}
    assert r.json()["data"][0]["id"] == MODEL and {"alpha", "beta"} <= set(cards)
    for name in ("alpha", "beta"):
        card = cards[name]
        assert card["object"] == "model" and card["owned_by"] == "kvserve" and card["parent"] == MODEL
        assert card["root"] == os.path.abspath(adapters[name])
        assert card["max_model_len"] == cards[MODEL]["max_model_len"] > 0 and card["created"] > 0


def test_adapters_give_the_offline_engine_text(server, offline, adapters):
    base = _complete(server, MODEL)["choices"][0]["text"]
    assert base == _offline(offline, None, None)
    messages = [{"role": "user", "content": "Name a colour."}]
    base_chat = _chat(server, MODEL, "Name a colour.")["choices"][0]["message"]["content"]
    for name in ("alpha", "beta"):
        expected = _offline(offline, name, adapters[name])
        assert expected != base, f"adapter {name} does not change the output: the test would be vacuous"
        for model in (name, f"{MODEL}:{name}", f"HuggingFaceTB/{MODEL}:{name}"):
            body = _complete(server, model)
            assert body["choices"][0]["text"] == expected, model
            assert body["model"] == name
        chat = _chat(server, f"{MODEL}:{name}", "Name a colour.")["choices"][0]["message"]["content"]
        assert chat == _offline(offline, name, adapters[name], messages) != base_chat
    for path, body in (("/tokenize", {"model": "alpha", "prompt": "hi"}), ("/detokenize", {"model": "beta",
                                                                                           "tokens": [1]})):
        assert _post(server, path, body).status_code == 200
    for model in ("nope", f"{MODEL}:nope", "alpha:beta"):
        r = _post(server, "/v1/completions", {"model": model, "prompt": "x", "max_tokens": 1})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", model
    assert _post(server, "/tokenize", {"model": "nope", "prompt": "hi"}).status_code == 404


def test_adapter_routes_need_the_admin_key(server, adapters):
    for key, status in ((None, 401), ("wrong", 401), (USER_KEY, 403)):
        assert _load(server, "delta", adapters["gamma"], key).status_code == status
        assert _unload(server, "alpha", key).status_code == status
        assert _post(server, "/admin/reset_prefix_cache", {}, key).status_code == status
    assert _post(server, "/v1/completions", {"prompt": "x", "max_tokens": 1}, ADMIN_KEY).status_code == 401
    loaded = _load(server, "delta", adapters["gamma"])
    assert loaded.status_code == 200 and loaded.json()["lora_name"] == "delta" and loaded.json()["rank"] == 16
    assert _unload(server, "delta").status_code == 200
    assert _post(server, "/admin/reset_prefix_cache", {}, ADMIN_KEY).json() == {"reset": True}


def _bad_adapters(root, mc) -> list[tuple[str, str]]:
    """(folder, words the 400 message must contain) for each kind of unservable adapter."""
    import torch
    h, r = mc.hidden_size, 8
    q = {_key(0, "q_proj", "A"): torch.randn(r, h), _key(0, "q_proj", "B"): torch.randn(h, r)}
    big = {_key(0, "q_proj", "A"): torch.randn(32, h), _key(0, "q_proj", "B"): torch.randn(h, 32)}
    wide = {_key(0, "q_proj", "A"): torch.randn(r, 1024), _key(0, "q_proj", "B"): torch.randn(1024, r)}
    ok = {"r": r, "target_modules": ["q_proj"]}
    no_config = root / "no_config"
    no_config.mkdir()
    (no_config / "adapter_model.safetensors").write_bytes(b"")
    return [(str(root / "missing"), "is not a folder"),
            (str(no_config), "no adapter_config.json"),
            (_write_adapter(root / "lm_head", {"r": r, "target_modules": ["q_proj", "lm_head"]}, q),
             "unknown target module 'lm_head'"),
            (_write_adapter(root / "embed", {"r": r, "target_modules": ["embed_tokens"]}, q),
             "unknown target module 'embed_tokens'"),
            (_write_adapter(root / "rank", {"r": 32, "target_modules": ["q_proj"]}, big), "exceeds --max-lora-rank 16"),
            (_write_adapter(root / "shape", ok, wide), "do not fit the base model"),
            (_write_adapter(root / "dora", {**ok, "use_dora": True}, q), "DoRA"),
            (_write_adapter(root / "ia3", {**ok, "peft_type": "IA3"}, q), "peft_type 'IA3' is not supported")]


def test_bad_adapters_are_refused_with_a_clear_400(server, offline, adapters, tmp_path):
    before = [c["id"] for c in httpx.get(server.base_url + "/models", timeout=30,
                                         headers={"Authorization": f"Bearer {USER_KEY}"}).json()["data"]]
    for folder, words in _bad_adapters(tmp_path, offline.engine.model_config):
        r = _load(server, "bad", folder)
        assert r.status_code == 400, (folder, r.text)
        error = r.json()["error"]
        assert words in error["message"] and error["code"] == "invalid_lora_adapter", (folder, error)
    duplicate = _load(server, "alpha", adapters["beta"])
    assert duplicate.status_code == 400 and "already loaded" in duplicate.json()["error"]["message"]
    for body, param in (({"lora_name": MODEL, "lora_path": adapters["beta"]}, "lora_name"),
                        ({"lora_name": "x"}, "lora_path"),
                        ({"lora_name": "x", "lora_path": "/p", "extra": 1}, "extra")):
        r = _post(server, "/v1/load_lora_adapter", body, ADMIN_KEY)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    missing = _unload(server, "never-loaded")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    after = [c["id"] for c in httpx.get(server.base_url + "/models", timeout=30,
                                        headers={"Authorization": f"Bearer {USER_KEY}"}).json()["data"]]
    assert after == before
    assert _complete(server, MODEL, max_tokens=4)["usage"]["completion_tokens"] == 4
    assert _complete(server, "alpha", max_tokens=4)["choices"][0]["text"] == _offline(
        offline, "alpha", adapters["alpha"], max_tokens=4)


class _Stream(threading.Thread):
    """One streamed completion read in the background: its text, finish reason, end time."""

    def __init__(self, server, body: dict):
        super().__init__(daemon=True)
        self.server, self.body = server, {**body, "stream": True}
        self.text, self.finish, self.done_at, self.status = "", None, None, None
        self.first = threading.Event()

    def run(self):
        headers = {"Authorization": f"Bearer {USER_KEY}"}
        with httpx.stream("POST", self.server.url + "/v1/completions", json=self.body, timeout=300,
                          headers=headers) as r:
            self.status = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    for choice in json.loads(line[6:])["choices"]:
                        self.text += choice["text"]
                        self.finish = choice["finish_reason"] or self.finish
                    self.first.set()
        self.done_at = time.monotonic()
        self.first.set()


def test_unload_during_a_stream_lets_it_finish(server, offline, adapters):
    assert _load(server, "gamma", adapters["gamma"]).json()["loaded"] is True
    expected = _offline(offline, "gamma", adapters["gamma"], max_tokens=48, ignore_eos=True)
    stream = _Stream(server, {"model": "gamma", "prompt": PROMPT, "max_tokens": 48, "temperature": 0,
                              "ignore_eos": True})
    stream.start()
    assert stream.first.wait(120)
    samples = _metrics(server)
    info = [k for k in samples if k.startswith("kvserve_lora_requests_info{")]
    assert len(info) == 1 and 'max_lora="2"' in info[0] and 'running_lora_adapters="gamma"' in info[0], info
    r = _unload(server, "gamma")
    unloaded_at = time.monotonic()
    assert r.status_code == 200 and r.json() == {"lora_name": "gamma", "unloaded": True}
    stream.join(300)
    assert stream.done_at is not None and stream.done_at > unloaded_at, "the stream ended before the unload"
    assert stream.status == 200 and stream.finish == "length" and stream.text == expected
    gone = _post(server, "/v1/completions", {"model": "gamma", "prompt": "x", "max_tokens": 1})
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"
    assert "gamma" not in [c["id"] for c in httpx.get(server.base_url + "/models", timeout=30, headers={
        "Authorization": f"Bearer {USER_KEY}"}).json()["data"]]


def test_reloading_a_name_never_serves_the_old_adapters_cache(server, offline, adapters, tmp_path):
    """Issue test 3: every round unloads the name and loads content never seen before
    under it; its first request must hit no cached block and give that adapter's output,
    a repeat must hit the cache (so the check is not vacuous)."""
    mc = offline.engine.model_config
    expected = [_offline(offline, f"pool{i}", adapters[f"pool{i}"], CACHE_PROMPT, max_tokens=2) for i in range(4)]
    assert len(set(expected)) == 4, expected               # consecutive rounds tell adapters apart
    def folder(i: int) -> str:
        return _variant(adapters[f"pool{i % 4}"], tmp_path / f"round{i}", i, mc)
    for i in range(4):                                      # the zero-B pair changes no output
        assert _offline(offline, f"round{i}", folder(i), CACHE_PROMPT, max_tokens=2) == expected[i]
    started = time.monotonic()
    for i in range(ROUNDS):
        if i:
            assert _unload(server, "cycle").status_code == 200
            shutil.rmtree(tmp_path / f"round{i - 1}")
        loaded = _load(server, "cycle", folder(i))
        assert loaded.status_code == 200, loaded.text
        first = _complete(server, "cycle", CACHE_PROMPT, max_tokens=2)
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, f"round {i}"
        assert first["choices"][0]["text"] == expected[i % 4], f"round {i}"
        again = _complete(server, "cycle", CACHE_PROMPT, max_tokens=1)     # one token: the round stays short
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16, f"round {i}"
        assert expected[i % 4].startswith(again["choices"][0]["text"]), f"round {i}"
    print(f"{ROUNDS} reload rounds in {time.monotonic() - started:.1f} s")


def test_metrics_show_the_adapters(server, offline, adapters):
    before = _metrics(server)
    body = _complete(server, "alpha", max_tokens=5, ignore_eos=True)
    m = _metrics(server)
    assert m["kvserve_lora_max_resident"] == 2 and m["kvserve_lora_max_host"] == 4
    assert m["kvserve_lora_adapters_loaded"] >= 2 and 1 <= m["kvserve_lora_adapters_resident"] <= 2
    assert m["kvserve_lora_adapters_host"] >= 1 and m["kvserve_lora_num_waiting_for_slot"] == 0
    assert m["kvserve_lora_disk_loads_total"] >= 2 and m["kvserve_lora_slot_loads_total"] >= 1
    assert 'kvserve_lora_load_seconds_total{tier="disk"}' in m and "kvserve_lora_slot_evictions_total" in m
    assert "kvserve_lora_host_evictions_total" in m
    key = 'kvserve_lora_requests_total{adapter="alpha"}'
    assert m[key] == before.get(key, 0) + 1
    tokens = 'kvserve_lora_generation_tokens_total{adapter="alpha"}'
    assert m[tokens] == before.get(tokens, 0) + body["usage"]["completion_tokens"] == before.get(tokens, 0) + 5
    info = [k for k in m if k.startswith("kvserve_lora_requests_info{")]
    assert info == ['kvserve_lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""}']


def _serve_until_exit(*args: str, timeout_s: float = 300) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "kvserve.cli", "serve", "--port", str(free_port()), "--threads", "1",
               "--dtype", "float32", "--kv-cache-gib", "0.05", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout_s,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})


def test_a_bad_startup_adapter_is_a_clear_exit_2(tmp_path, adapters):
    refused = _serve_until_exit("--lora-modules", f"{MODEL}={adapters['alpha']}")     # checked before the engine
    assert refused.returncode == 2 and "is a name of the base model" in refused.stderr, refused.stderr[-2000:]
    missing = tmp_path / "missing"
    out = _serve_until_exit("--lora-modules", f"good={adapters['alpha']}", f"bad={missing}")
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"kvserve serve: LoRA adapter path '{missing}' is not a folder" in out.stderr, out.stderr[-2000:]
