"""Helpers shared by the detokenizer tests (tests/model/test_detokenizer.py on the default
model's tokenizer, tests/unit/test_detokenizer_synthetic.py on a synthetic decoder)."""
from __future__ import annotations

from kvserve.tokenizer import IncrementalDetokenizer


def random_splits(ids, rng, max_chunk=4):
    """`ids` cut into consecutive chunks of 1..max_chunk ids."""
    chunks, i = [], 0
    while i < len(ids):
        n = rng.randint(1, max_chunk)
        chunks.append(ids[i:i + n])
        i += n
    return chunks


def run(tok, ids, chunks=None, prompt=(), **kwargs):
    """Feed `chunks` (default: one id at a time); return (deltas, finish text, detokenizer)."""
    detok = IncrementalDetokenizer(tok, list(prompt), **kwargs)
    deltas = []
    for chunk in chunks if chunks is not None else [[i] for i in ids]:
        delta = detok.add(chunk)
        deltas.append(delta)
        assert detok.text == "".join(d.text for d in deltas)
    tail = detok.finish()
    return deltas, tail, detok


def expected_output(full: str, stops, include: bool) -> tuple[str, str | None]:
    """Reference: cut `full` at the earliest stop occurrence (ties: the shortest)."""
    hits = [(full.find(s), len(s), s) for s in stops if s and full.find(s) >= 0]
    if not hits:
        return full, None
    at, size, stop = min(hits)
    return full[:at + (size if include else 0)], stop
