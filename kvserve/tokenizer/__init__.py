"""Tokenizer, chat templates and incremental detokenization (HTTP-process side)."""
from kvserve.tokenizer.detokenizer import DetokenizerDelta, IncrementalDetokenizer
from kvserve.tokenizer.tokenizer import Tokenizer

__all__ = ["Tokenizer", "IncrementalDetokenizer", "DetokenizerDelta"]
