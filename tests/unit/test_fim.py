"""Fill in the middle without a model: layout detection on small synthetic vocabularies,
the PSM prompt order, the protocol's suffix rules and the completions prompt builder."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from tokenizers import AddedToken
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from tokenizers.processors import TemplateProcessing

from kvserve.errors import InvalidRequestError
from kvserve.server import protocol
from kvserve.server.serving import prepare_prompts
from kvserve.tokenizer import Tokenizer
from kvserve.tokenizer.fim import FimTokens, build_fim_prompt, detect_fim, recognised_layouts

WORDS = ["[UNK]", "<s>", "</s>", "def", "f", "(", ")", ":", "return", "x", "1", "+"]
STARCODER = ["<fim_prefix>", "<fim_suffix>", "<fim_middle>"]
QWEN = ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"]
CODELLAMA = ["▁<PRE>", "▁<SUF>", "▁<MID>"]
CODELLAMA_PLAIN = ["<PRE>", "<SUF>", "<MID>"]


def _tokenizer(folder, special: list[str], add_bos: bool = False, in_vocab: list[str] = ()) -> Tokenizer:
    """A word-level tokenizer.json (+ tokenizer_config.json) in `folder`, loaded the way a
    Hugging Face folder is: `special` are added special tokens, `in_vocab` plain entries."""
    vocab = {w: i for i, w in enumerate([*WORDS, *in_vocab])}
    backend = BackendTokenizer(WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = Whitespace()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ["<s>", "</s>", *special]])
    if add_bos:
        backend.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", vocab["<s>"])])
    folder.mkdir(parents=True, exist_ok=True)
    backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return Tokenizer.from_hf_folder(str(folder))


# ------------------------------------------------------------------ detection
@pytest.mark.parametrize("tokens, layout", [
    (STARCODER, "starcoder"), (QWEN, "qwen"), (CODELLAMA, "codellama"), (CODELLAMA_PLAIN, "codellama"),
    (["<fim_prefix>", "<fim_suffix>"] + QWEN, "qwen"),           # a partial layout does not count
    (["<fim_pad>", *reversed(STARCODER)], "starcoder"),           # order of the ids does not matter
])
def test_each_layout_is_detected_from_the_vocabulary(tmp_path, tokens, layout):
    tok = _tokenizer(tmp_path, tokens)
    fim = tok.fim_tokens
    assert fim is not None and fim.layout == layout
    spelled = tok.convert_ids_to_tokens([fim.prefix_id, fim.suffix_id, fim.middle_id])
    assert [s.replace("▁", "").strip("<|>").split("_")[-1] for s in spelled] in (
        ["prefix", "suffix", "middle"], ["PRE", "SUF", "MID"])


def test_plain_vocabulary_entries_count_too(tmp_path):
    assert _tokenizer(tmp_path, [], in_vocab=STARCODER).fim_tokens.layout == "starcoder"


@pytest.mark.parametrize("tokens", [[], ["<fim_prefix>", "<fim_middle>"], ["<|fim_prefix|>", "<|fim_suffix|>"],
                                    ["▁<PRE>", "▁<SUF>", "<MID>"], ["<EOT>", "<PRE>"]])
def test_no_layout_without_all_three_tokens(tmp_path, tokens):
    assert _tokenizer(tmp_path, tokens).fim_tokens is None


def test_detection_is_cached_per_instance_and_ids_must_fit_the_vocabulary(tmp_path):
    a, b = _tokenizer(tmp_path / "a", STARCODER), _tokenizer(tmp_path / "b", [])
    assert a.fim_tokens is a.fim_tokens and "fim_tokens" in vars(a)
    assert b.fim_tokens is None and a.fim_tokens is not None      # no state shared between instances
    assert detect_fim(a, vocab_size=a.fim_tokens.prefix_id) is None
    assert detect_fim(a, vocab_size=a.vocab_size) == a.fim_tokens


# -------------------------------------------------------------------- prompts
@pytest.mark.parametrize("add_bos", [False, True])
def test_prompt_is_prefix_suffix_middle(tmp_path, add_bos):
    tok = _tokenizer(tmp_path, STARCODER, add_bos=add_bos)
    fim = tok.fim_tokens
    ids = build_fim_prompt(tok, fim, "def f ( x ) :", "return x")
    lead = [tok.bos_token_id] if add_bos else []
    assert ids == [*lead, fim.prefix_id, *tok.encode("def f ( x ) :", add_special_tokens=False), fim.suffix_id,
                   *tok.encode("return x", add_special_tokens=False), fim.middle_id]
    assert tok.encode_fim("def f ( x ) :", "return x") == ids
    expected = "<fim_prefix> def f ( x ) : <fim_suffix> return x <fim_middle>"
    assert tok.decode(ids, skip_special_tokens=False) == ("<s> " + expected if add_bos else expected)
    assert ids.count(tok.eos_token_id) == 0


def test_empty_pieces_leave_just_the_control_tokens():
    class Vocab:
        add_bos, bos_token_id = False, None

        def encode(self, text, add_special_tokens=True):
            assert add_special_tokens is False
            return [ord(c) for c in text]

    fim = FimTokens("codellama", 1, 2, 3)
    assert build_fim_prompt(Vocab(), fim, "", "") == [1, 2, 3]
    assert build_fim_prompt(Vocab(), fim, "a", "b") == [1, 97, 2, 98, 3]


def test_encode_fim_without_tokens_names_suffix(tmp_path):
    with pytest.raises(InvalidRequestError) as info:
        _tokenizer(tmp_path, []).encode_fim("a", "b")
    assert info.value.param == "suffix"


# ------------------------------------------------------------------- protocol
def test_protocol_accepts_suffix_as_text_or_null():
    assert protocol.parse_completion({"prompt": "def f(", "suffix": "    return x"}).suffix == "    return x"
    assert protocol.parse_completion({"prompt": ["a", "b"], "suffix": ""}).suffix == ""
    assert protocol.parse_completion({"prompt": "a", "suffix": None}).suffix is None
    assert protocol.parse_completion({"prompt": "a"}).suffix is None


@pytest.mark.parametrize("body, why", [
    ({"prompt": [1, 2, 3], "suffix": "x"}, "text prompts"),
    ({"prompt": [[1, 2], [3]], "suffix": "x"}, "text prompts"),
    ({"prompt": "a", "suffix": "x", "echo": True}, "echo"),
    ({"prompt": "a", "suffix": ["x"]}, "string"),
    ({"prompt": "a", "suffix": 3}, "string"),
])
def test_protocol_rejects_suffix_it_cannot_honour(body, why):
    with pytest.raises(InvalidRequestError) as info:
        protocol.parse_completion(body)
    assert info.value.param == "suffix" and why in info.value.message


# --------------------------------------------------------- completions prompts
INFO = SimpleNamespace(max_model_len=256, vocab_size=64, block_size=16, num_blocks=64, kv_max_tokens=1024)


def test_prepare_prompts_builds_one_fim_prompt_per_text_prompt(tmp_path):
    tok = _tokenizer(tmp_path, QWEN, add_bos=True)
    spec = protocol.parse_completion({"prompt": ["def f", "x +"], "suffix": "return 1", "max_tokens": 4})
    prepared = prepare_prompts(spec, tok, INFO)
    assert [p.text for p in prepared] == ["def f", "x +"]
    assert [p.token_ids for p in prepared] == [build_fim_prompt(tok, tok.fim_tokens, t, "return 1")
                                               for t in ("def f", "x +")]
    plain = prepare_prompts(protocol.parse_completion({"prompt": "def f", "max_tokens": 4}), tok, INFO)
    assert plain[0].token_ids == tok.encode("def f")


def test_prepare_prompts_refuses_suffix_without_fim_tokens(tmp_path):
    tok = _tokenizer(tmp_path, [])
    spec = protocol.parse_completion({"model": "tiny", "prompt": "def f", "suffix": "return 1", "max_tokens": 4})
    with pytest.raises(InvalidRequestError) as info:
        prepare_prompts(spec, tok, INFO)
    err = info.value
    assert err.http_status == 400 and err.param == "suffix"
    assert "'tiny' has no fill-in-the-middle tokens" in err.message
    assert recognised_layouts() in err.message
    for token in ("<fim_prefix>", "<|fim_prefix|>", "▁<PRE>"):
        assert token in err.message
