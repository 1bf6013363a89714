"""Shared fixtures: the real default model, a prompt set, and the HF reference."""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TQDM_DISABLE", "1")

import pytest
import torch

torch.set_num_threads(int(os.environ.get("KVSERVE_TEST_THREADS", "2")))


@pytest.fixture(scope="session")
def model_path() -> str:
    from kvserve.loader import default_model_path
    return default_model_path()


@pytest.fixture(scope="session")
def tokenizer(model_path):
    from kvserve.tokenizer import Tokenizer
    return Tokenizer.load(model_path)


@pytest.fixture(scope="session")
def llm(model_path):
    """The engine every tier-2 test shares (uncontended: 512 MiB of KV)."""
    from kvserve import LLM
    return LLM(model_path, kv_cache_bytes=512 * 2**20, max_num_seqs=64, max_num_batched_tokens=1024)


@pytest.fixture(scope="session")
def prompts(tokenizer) -> list[list[int]]:
    from tests.support.prompt_set import build_prompts
    return build_prompts(tokenizer)
