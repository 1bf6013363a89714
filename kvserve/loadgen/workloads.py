"""Workloads for ``kvserve bench``: lists of requests (or conversations) to send.

- ``random``: prompts of random token lengths (uniform in ``len * [1 - r, 1 + r]``),
  made of random whole-word vocabulary tokens so their length is known.
- ``shared-prefix``: one shared system prompt of ``--prefix-len`` tokens, then a
  random question (the prefix cache's favourite case).
- ``multi-turn``: conversations of ``--turns`` turns; each turn resends the whole
  history, including the model's earlier replies (the runner fills those in).
- ``code``: code completion: a prefix of ``--input-len`` tokens cut from real source
  files (``--code-dir``, default: the Python standard library), on /v1/completions.

Lengths are measured with a tokenizer (default: the default model's); the server
reports the real counts in ``usage``, which is what the report uses.
"""
from __future__ import annotations

import os
import random
from dataclasses import dataclass, field


@dataclass
class BenchRequest:
    """One request: ``prompt`` (completions) or ``messages`` (chat); ``turns`` > 1 for
    a conversation whose later user turns are ``followups``."""

    id: int
    max_tokens: int
    prompt: str | None = None
    messages: list[dict] | None = None
    followups: list[str] = field(default_factory=list)
    input_tokens: int = 0                 # tokenizer estimate of the first turn's prompt

    @property
    def turns(self) -> int:
        return 1 + len(self.followups)


class TextMaker:
    """Random text of a given token length, from whole-word vocabulary tokens."""

    def __init__(self, tokenizer, seed: int = 0):
        self.tokenizer = tokenizer
        self.rng = random.Random(seed)
        words = []
        for token_id in range(min(tokenizer.vocab_size, 50_000)):
            text = tokenizer.decode([token_id])
            if len(text) >= 3 and text[0] == " " and text[1:].isalpha() and text[1:].isascii():
                words.append(text)
        if not words:
            raise ValueError("the tokenizer has no whole-word tokens to build prompts from")
        self.words = words

    def text(self, num_tokens: int) -> str:
        return "".join(self.rng.choice(self.words) for _ in range(max(1, num_tokens))).strip()

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))


def _length(rng: random.Random, mean: int, spread: float) -> int:
    lo, hi = max(1, int(mean * (1 - spread))), max(1, int(mean * (1 + spread)))
    return rng.randint(lo, hi)


def random_workload(maker: TextMaker, num: int, input_len: int, output_len: int, spread: float,
                    chat: bool) -> list[BenchRequest]:
    requests = []
    for i in range(num):
        text = maker.text(_length(maker.rng, input_len, spread))
        max_tokens = _length(maker.rng, output_len, spread)
        if chat:
            requests.append(BenchRequest(i, max_tokens, messages=[{"role": "user", "content": text}]))
        else:
            requests.append(BenchRequest(i, max_tokens, prompt=text))
        requests[-1].input_tokens = maker.count(text)
    return requests


def shared_prefix_workload(maker: TextMaker, num: int, prefix_len: int, input_len: int, output_len: int,
                           spread: float) -> list[BenchRequest]:
    system = "You are a helpful assistant. " + maker.text(prefix_len)
    requests = []
    for i in range(num):
        question = maker.text(_length(maker.rng, input_len, spread))
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        requests.append(BenchRequest(i, _length(maker.rng, output_len, spread), messages=messages,
                                     input_tokens=maker.count(system + question)))
    return requests


def multi_turn_workload(maker: TextMaker, num_conversations: int, turns: int, input_len: int,
                        output_len: int, spread: float) -> list[BenchRequest]:
    requests = []
    for i in range(num_conversations):
        first = maker.text(_length(maker.rng, input_len, spread))
        followups = [maker.text(_length(maker.rng, input_len, spread)) for _ in range(turns - 1)]
        requests.append(BenchRequest(i, _length(maker.rng, output_len, spread),
                                     messages=[{"role": "user", "content": first}], followups=followups,
                                     input_tokens=maker.count(first)))
    return requests


def _source_files(code_dir: str, limit: int = 2000) -> list[str]:
    found = []
    for root, dirs, files in os.walk(code_dir):
        dirs[:] = sorted(d for d in dirs if not d.startswith((".", "__")) and d not in ("site-packages", "test"))
        for name in sorted(files):
            if name.endswith((".py", ".c", ".h", ".rs", ".go", ".js", ".ts")):
                found.append(os.path.join(root, name))
                if len(found) >= limit:
                    return found
    return found


def code_workload(maker: TextMaker, num: int, input_len: int, output_len: int, spread: float,
                  code_dir: str | None = None) -> list[BenchRequest]:
    """Completion prompts: the first ~input_len tokens up to a random line of real source files."""
    code_dir = code_dir or os.path.dirname(os.__file__)
    files = _source_files(code_dir)
    if not files:
        raise ValueError(f"no source files under {code_dir}")
    requests, rng = [], maker.rng
    while len(requests) < num:
        with open(rng.choice(files), encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines(keepends=True)
        if len(lines) < 8:
            continue
        target = _length(rng, input_len, spread)
        start = rng.randrange(0, max(1, len(lines) - 8))
        chunk, count = "", 0
        for line in lines[start:]:
            if count >= target:
                break
            chunk += line
            count += max(1, len(line) // 4)          # rough; trimmed exactly below
        ids = maker.tokenizer.encode(chunk, add_special_tokens=False)[:target]
        prompt = maker.tokenizer.decode(ids)
        requests.append(BenchRequest(len(requests), _length(rng, output_len, spread), prompt=prompt,
                                     input_tokens=len(ids)))
    return requests


def build_workload(name: str, tokenizer, num: int, input_len: int, output_len: int, spread: float = 0.0,
                   chat: bool = True, prefix_len: int = 512, turns: int = 3, code_dir: str | None = None,
                   seed: int = 0) -> list[BenchRequest]:
    """The requests of workload ``name`` (same seed -> same requests)."""
    maker = TextMaker(tokenizer, seed)
    if name == "random":
        return random_workload(maker, num, input_len, output_len, spread, chat)
    if name == "shared-prefix":
        return shared_prefix_workload(maker, num, prefix_len, input_len, output_len, spread)
    if name == "multi-turn":
        return multi_turn_workload(maker, num, turns, input_len, output_len, spread)
    if name == "code":
        return code_workload(maker, num, input_len, output_len, spread, code_dir)
    raise ValueError(f"unknown workload {name!r}: random, shared-prefix, multi-turn, code")
