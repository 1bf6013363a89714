"""Checkpoint loaders: GGUF files and Hugging Face folders -> one :class:`Checkpoint`.

Tensors always come out under Hugging Face Llama names, float32, HF layout.
"""
from kvserve.loader.api import default_model_path, load_checkpoint, resolve_model_path
from kvserve.loader.checkpoint import Checkpoint

__all__ = ["Checkpoint", "default_model_path", "load_checkpoint", "resolve_model_path"]
