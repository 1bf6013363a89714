"""Tier 1: loading a model that is not there (or is no model) raises ModelLoadError
(no default model needed; the rest of the typed errors: tests/model/test_errors.py)."""
from __future__ import annotations

import pytest

from kvserve import LLM
from kvserve.errors import ModelLoadError


def test_unknown_model_path(tmp_path):
    with pytest.raises(ModelLoadError) as info:
        LLM(str(tmp_path / "no-such-model.gguf"))
    assert "no-such-model" in info.value.message


def test_folder_without_config(tmp_path):
    with pytest.raises(ModelLoadError):
        LLM(str(tmp_path))
