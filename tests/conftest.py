"""Shared settings, tier markers, and the model fixtures (lazy: tier 1 never loads the model).

Tiers by folder: ``unit/`` (tier 1: no model weights, no server), ``model/`` (tier 2: the
real default model), ``server/`` (``kvserve serve`` processes with a real engine), ``gpu/``
(tier 3). Each test gets its folder's marker (``server/`` also ``model``): ``-m unit`` is
``tests/unit``, ``-m "not model"`` leaves out the model and server tests.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TQDM_DISABLE", "1")

import pytest

TESTS = Path(__file__).parent
TIER_MARKERS = {"unit": ("unit",), "model": ("model",), "server": ("server", "model"), "gpu": ("gpu",)}
TEST_THREADS = int(os.environ.get("KVSERVE_TEST_THREADS", "2"))


def _limit_torch_threads() -> None:
    """torch.set_num_threads(KVSERVE_TEST_THREADS, default 2) once torch is imported, without
    importing it here (tier 1 collection needs no torch from conftest)."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.get_num_threads() != TEST_THREADS:
        torch.set_num_threads(TEST_THREADS)


def pytest_collection_modifyitems(config, items):
    for item in items:
        try:
            folder = Path(item.path).resolve().relative_to(TESTS.resolve()).parts[0]
        except ValueError:
            continue
        for marker in TIER_MARKERS.get(folder, ()):
            item.add_marker(marker)


def pytest_collection_finish(session):
    _limit_torch_threads()              # test modules that import torch have done so by now


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    _limit_torch_threads()              # torch first imported inside an earlier test


@pytest.fixture(scope="session")
def model_path() -> str:
    from kvserve.loader import default_model_path
    return default_model_path()


@pytest.fixture(scope="session")
def hf_model_folder(model_path, tmp_path_factory) -> str:
    """The default GGUF as transformers loads it (fp32), saved once per session as a
    safetensors folder: every test that compares with transformers loads its own copy from it
    (~0.1 s) instead of converting the GGUF again (~13 s each). transformers refuses to
    ``save_pretrained`` a GGUF-loaded model, so the tensors and the config (without its
    ``quantization_config``: the tensors are plain fp32) are written directly."""
    import copy

    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM
    folder, name = os.path.split(model_path)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    out = tmp_path_factory.mktemp("hf-default-model")
    tied = model.config.tie_word_embeddings
    save_file({k: v.contiguous() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")},
              str(out / "model.safetensors"), metadata={"format": "pt"})
    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="session")
def tokenizer(model_path):
    from kvserve.tokenizer import Tokenizer
    return Tokenizer.load(model_path)


@pytest.fixture(scope="session")
def llm(model_path):
    """The engine every tier-2 test shares (uncontended: 512 MiB of KV)."""
    from kvserve import LLM
    return LLM(model_path, dtype="float32", kv_cache_bytes=512 * 2**20, max_num_seqs=64, max_num_batched_tokens=1024)


@pytest.fixture(scope="session")
def prompts(tokenizer) -> list[list[int]]:
    from tests.support.prompt_set import build_prompts
    return build_prompts(tokenizer)
