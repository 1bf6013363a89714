"""Tier 2: fill in the middle through the real HTTP server, on two tiny random Llama folders
that share the SmolLM2 tokenizer (rebuilt from the default GGUF): one with StarCoder-style
FIM tokens added to the vocabulary, one without (SmolLM2's own vocabulary has none).

The suffix request's prompt must be exactly fim.build_fim_prompt's ids: the same request
sent as those token ids gets the same usage, tokens and logprobs, and so does the offline API.
"""
from __future__ import annotations

import json
import shutil

import httpx
import pytest
import torch

from benchmarks.server_process import ServerProcess

pytestmark = pytest.mark.model

FIM_TOKENS = ["<fim_prefix>", "<fim_suffix>", "<fim_middle>"]
PREFIX = "def add(a, b):\n    "
SUFFIX = "\n    return c\n"
GREEDY = {"max_tokens": 4, "temperature": 0, "ignore_eos": True, "logprobs": 1, "use_prefix_cache": False}
SERVER_ARGS = ("--threads", "1", "--dtype", "float32", "--kv-cache-gib", "0.02", "--max-num-seqs", "4",
               "--max-model-len", "256")


def _save_tokenizer(folder, model_path, extra: list[str]) -> None:
    from tokenizers import AddedToken

    from kvserve.tokenizer.gguf_vocab import build_byte_level_bpe, read_gguf_tokenizer_metadata
    meta = read_gguf_tokenizer_metadata(model_path)
    backend = build_byte_level_bpe(meta)
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in extra])
    backend.save(str(folder / "tokenizer.json"))
    config = {"bos_token": meta.tokens[meta.bos_token_id], "eos_token": meta.tokens[meta.eos_token_id],
              "add_bos_token": meta.add_bos}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def folders(tmp_path_factory, model_path) -> dict[str, str]:
    """{"fim": folder whose vocabulary has the FIM tokens, "plain": the same model without them}."""
    from transformers import LlamaConfig, LlamaForCausalLM
    root = tmp_path_factory.mktemp("fim")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49160, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         rope_theta=10000.0, initializer_range=0.3, bos_token_id=1, eos_token_id=2,
                         tie_word_embeddings=False)
    LlamaForCausalLM(config).eval().save_pretrained(root / "fim", safe_serialization=True)
    shutil.copytree(root / "fim", root / "plain")
    _save_tokenizer(root / "fim", model_path, FIM_TOKENS)
    _save_tokenizer(root / "plain", model_path, [])
    return {name: str(root / name) for name in ("fim", "plain")}


@pytest.fixture(scope="module")
def fim_tokenizer(folders):
    from kvserve.tokenizer import Tokenizer
    return Tokenizer.load(folders["fim"])


def _complete(server, **body) -> httpx.Response:
    return httpx.post(server.url + "/v1/completions", json=body, timeout=120)


def test_smollm2_vocabulary_has_no_fim_tokens(tokenizer, fim_tokenizer):
    assert tokenizer.fim_tokens is None                 # the default GGUF: no FIM layout
    assert fim_tokenizer.fim_tokens is not None and fim_tokenizer.fim_tokens.layout == "starcoder"
    assert fim_tokenizer.fim_tokens.prefix_id == 49152


def test_suffix_gets_the_fim_prompt_and_a_completion(folders, fim_tokenizer):
    from kvserve import LLM, SamplingParams
    from kvserve.tokenizer.fim import build_fim_prompt
    expected = build_fim_prompt(fim_tokenizer, fim_tokenizer.fim_tokens, PREFIX, SUFFIX)
    assert expected[0] == fim_tokenizer.fim_tokens.prefix_id and expected[-1] == fim_tokenizer.fim_tokens.middle_id
    with ServerProcess("--model", folders["fim"], *SERVER_ARGS) as server:
        fim = _complete(server, prompt=PREFIX, suffix=SUFFIX, **GREEDY)
        as_ids = _complete(server, prompt=expected, **GREEDY)
        two = _complete(server, prompt=[PREFIX, "x = 1\n"], suffix=SUFFIX, **GREEDY)
        streamed = _complete(server, prompt=PREFIX, suffix=SUFFIX, stream=True,
                             stream_options={"include_usage": True}, **GREEDY)
        echo = _complete(server, prompt=PREFIX, suffix=SUFFIX, echo=True, max_tokens=2)
    assert fim.status_code == as_ids.status_code == two.status_code == streamed.status_code == 200, fim.text
    body, reference = fim.json(), as_ids.json()
    assert body["usage"]["prompt_tokens"] == len(expected) == reference["usage"]["prompt_tokens"]
    assert body["usage"]["completion_tokens"] == 4
    choice, ref = body["choices"][0], reference["choices"][0]
    assert choice["text"] == ref["text"] and choice["logprobs"]["tokens"] == ref["logprobs"]["tokens"]
    assert choice["logprobs"]["token_logprobs"] == pytest.approx(ref["logprobs"]["token_logprobs"], abs=1e-4)
    second = build_fim_prompt(fim_tokenizer, fim_tokenizer.fim_tokens, "x = 1\n", SUFFIX)
    assert two.json()["usage"]["prompt_tokens"] == len(expected) + len(second)
    events = [json.loads(line[6:]) for line in streamed.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    assert "".join(c["text"] for e in events for c in e["choices"]) == choice["text"]
    assert events[-1]["usage"]["prompt_tokens"] == len(expected)
    assert echo.status_code == 400 and echo.json()["error"]["param"] == "suffix"
    offline = LLM(folders["fim"], dtype="float32", kv_cache_bytes=8 * 2**20, max_num_seqs=4)
    out = offline.generate({"prompt": PREFIX, "suffix": SUFFIX}, SamplingParams(max_tokens=4, temperature=0,
                                                                                 ignore_eos=True))[0]
    assert out.prompt_token_ids == expected and out.outputs[0].text == choice["text"]


def test_suffix_without_fim_tokens_is_a_400_naming_suffix(folders):
    with ServerProcess("--model", folders["plain"], *SERVER_ARGS) as server:
        refused = _complete(server, prompt=PREFIX, suffix=SUFFIX, **GREEDY)
        plain = _complete(server, prompt=PREFIX, **GREEDY)
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["param"] == "suffix" and error["type"] == "invalid_request_error"
    assert "no fill-in-the-middle tokens" in error["message"] and "<fim_prefix>" in error["message"]
    assert plain.status_code == 200 and plain.json()["usage"]["completion_tokens"] == 4
