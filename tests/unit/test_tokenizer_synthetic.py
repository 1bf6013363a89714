"""Tier 1: the tokenizer on synthetic data (no model): every known pre-tokenizer builds,
a tiny GGUF vocabulary with special and user tokens, missing or bad paths. On the default
model's tokenizer against transformers: tests/model/test_tokenizer.py."""
from __future__ import annotations

import pytest

from kvserve.tokenizer import Tokenizer
from kvserve.tokenizer.gguf_vocab import PRE_TOKENIZER_SPLITS, _pre_tokenizer, bytes_to_unicode


@pytest.mark.parametrize("pre", sorted(PRE_TOKENIZER_SPLITS))
def test_every_known_pre_tokenizer_builds(pre):
    pieces = [p for p, _ in _pre_tokenizer(pre).pre_tokenize_str("Hello  world 12345 it's\n\tok")]
    alphabet = set(bytes_to_unicode().values())
    assert pieces and all(set(p) <= alphabet for p in pieces)
    if pre in ("llama-bpe", "qwen2", "smollm"):
        digits = [p for p in pieces if p.isdigit()]
        assert digits == {"llama-bpe": ["123", "45"], "qwen2": list("12345"), "smollm": list("12345")}[pre]


def test_tiny_gguf_special_and_user_tokens(tmp_path):
    """Control tokens keep their GGUF ids even when spelled outside the byte alphabet."""
    gguf = pytest.importorskip("gguf")
    b2u = bytes_to_unicode()
    tokens = [b2u[i] for i in range(256)] + ["he", "hel", "hell", "hello", "Ġw", "Ġwo",
                                             "<｜end▁of▁sentence｜>", "<think>", "<|im_end|>"]
    types = [1] * 262 + [3, 4, 3]
    path = str(tmp_path / "tiny.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("llama-bpe")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(["h e", "he l", "hel l", "hell o", "Ġ w", "Ġw o"])
    writer.add_bos_token_id(262)
    writer.add_eos_token_id(264)
    writer.add_add_bos_token(True)
    writer.add_chat_template("{% for m in messages %}{{ m['content'] }}<|im_end|>{% endfor %}")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tiny = Tokenizer.load(path)
    assert tiny.vocab_size == 265 and tiny.add_bos
    assert tiny.all_special_ids == {262, 264} and tiny.eos_token_ids == {264}
    ids = tiny.encode("hello wo<think> x<｜end▁of▁sentence｜>ü")
    assert ids == [262, 259, 261, 263, 32, 120, 262, 195, 188]
    assert tiny.decode(ids) == "hello wo<think> xü"
    assert tiny.decode(ids, skip_special_tokens=False) == "<｜end▁of▁sentence｜>hello wo<think> x<｜end▁of▁sentence｜>ü"


def test_load_rejects_missing_paths(tmp_path):
    from kvserve.errors import ModelLoadError

    with pytest.raises(ModelLoadError):
        Tokenizer.load(str(tmp_path / "nope.gguf"))
    with pytest.raises(ModelLoadError):
        Tokenizer.load(str(tmp_path))  # a folder without tokenizer.json
    (tmp_path / "bad.gguf").write_bytes(b"NOPE" + b"\0" * 32)
    with pytest.raises(ModelLoadError):
        Tokenizer.load(str(tmp_path / "bad.gguf"))
