"""32 varied prompts for the tier-2 tests: chat and raw, short and ~1,000 tokens.

Long prompts are slices of real source files from Python's standard library, so
they are realistic text and the same on every machine with the same Python.
"""
from __future__ import annotations

import inspect
import json.decoder
import textwrap

CHAT_QUESTIONS = [
    "What is the capital of France?",
    "Explain paged attention in two sentences.",
    "Write a haiku about a cache miss.",
    "List three prime numbers greater than 100.",
    "Translate 'good morning' into Spanish and German.",
    "What does a KV cache store in a transformer?",
    "Give me a Python one-liner that reverses a string.",
    "Summarise the plot of Romeo and Juliet in one sentence.",
    "Why is the sky blue? 🌤️",
    "请用一句话介绍你自己。",
]

RAW_TEXTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a land far away,",
    "1, 1, 2, 3, 5, 8, 13,",
    "The quick brown fox",
    "import numpy as np\n\n# compute the mean of",
    "Q: What is 17 times 3?\nA:",
    "In 1969, the Apollo 11 mission",
    "SELECT name, COUNT(*) FROM users",
    "Mitochondria are",
    "<html>\n<head>\n<title>",
    "Dear Sir or Madam,\n\nI am writing to",
]


def _source_slices(tokenizer, target_tokens: int, count: int) -> list[list[int]]:
    sources = [inspect.getsource(m) for m in (json.decoder, textwrap, inspect)]
    ids = tokenizer.encode("\n".join(sources), add_special_tokens=False)
    stride = (len(ids) - target_tokens) // count
    return [ids[i * stride:i * stride + target_tokens - 37 * i] for i in range(count)]


def build_prompts(tokenizer) -> list[list[int]]:
    """Token ids of 32 prompts: 10 chat, 12 raw, 4 medium (~300) and 6 long (~800-1,000)."""
    prompts = []
    for question in CHAT_QUESTIONS:
        text = tokenizer.apply_chat_template([{"role": "user", "content": question}])
        prompts.append(tokenizer.encode(text, add_special_tokens=False))
    prompts += [tokenizer.encode(t) for t in RAW_TEXTS]
    prompts += _source_slices(tokenizer, 330, 4)
    prompts += _source_slices(tokenizer, 1040, 6)
    assert len(prompts) == 32
    return prompts
