"""Tier 2: the GGUF loader on the real default model (tensors and config equal transformers',
the default aliases, a truncated copy of the file). Synthetic files: tests/unit/test_loader.py."""
from __future__ import annotations

import os

import pytest
import torch

from kvserve.errors import ModelLoadError
from kvserve.loader import default_model_path, load_checkpoint, resolve_model_path


@pytest.fixture(scope="module")
def hf_reference():
    """(our Checkpoint, HF model) for the default GGUF, loaded once per module."""
    try:
        path = default_model_path()
    except ModelLoadError as exc:
        pytest.skip(str(exc))
    transformers = pytest.importorskip("transformers")
    os.environ["HF_HUB_OFFLINE"] = "1"
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32)
    return load_checkpoint(None), model


@pytest.mark.model
def test_default_gguf_tensors_equal_transformers(hf_reference):
    ckpt, model = hf_reference
    assert ckpt.kind == "gguf" and ckpt.path == default_model_path()
    reference = model.state_dict()
    assert "lm_head.weight" not in ckpt.tensors  # tied
    assert set(reference) - {"lm_head.weight"} == set(ckpt.tensors)
    for name, tensor in ckpt.tensors.items():
        assert tensor.dtype == torch.float32, name
        assert tensor.shape == reference[name].shape, name
        assert (tensor - reference[name]).abs().max().item() < 1e-6, name
    assert torch.equal(reference["lm_head.weight"], ckpt.tensors["model.embed_tokens.weight"])


@pytest.mark.model
def test_the_session_hf_folder_is_transformers_gguf_load(hf_reference, hf_model_folder):
    """The parity tests' reference (``hf_model_folder``, saved once per session) holds exactly
    the tensors and config transformers loads from the GGUF."""
    import json
    model = hf_reference[1]
    copy = transformers_from_folder(hf_model_folder)
    assert "quantization_config" not in json.load(open(os.path.join(hf_model_folder, "config.json")))
    theirs, ours = model.state_dict(), copy.state_dict()
    assert set(theirs) == set(ours)
    assert all(torch.equal(theirs[k], ours[k]) for k in theirs)
    assert copy.config.tie_word_embeddings and copy.config.num_hidden_layers == model.config.num_hidden_layers


def transformers_from_folder(folder: str):
    import transformers
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)


@pytest.mark.model
def test_default_gguf_config_equals_transformers(hf_reference):
    cfg, ref = hf_reference[0].config, hf_reference[1].config
    assert (cfg.architecture, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == ("llama", 30, 9, 3)
    assert (cfg.hidden_size, cfg.head_dim, cfg.rope_theta, cfg.tie_word_embeddings) == (
        576, 64, 100000.0, True)
    rope_theta = (getattr(ref, "rope_parameters", None) or {}).get("rope_theta") \
        or getattr(ref, "rope_theta", None)
    assert cfg.num_layers == ref.num_hidden_layers
    assert cfg.num_heads == ref.num_attention_heads
    assert cfg.num_kv_heads == ref.num_key_value_heads
    assert cfg.hidden_size == ref.hidden_size
    assert cfg.intermediate_size == ref.intermediate_size
    assert cfg.head_dim == ref.head_dim
    assert cfg.vocab_size == ref.vocab_size
    assert cfg.rope_theta == rope_theta
    assert cfg.rms_norm_eps == ref.rms_norm_eps
    assert cfg.max_position_embeddings == ref.max_position_embeddings
    assert cfg.tie_word_embeddings == ref.tie_word_embeddings
    assert cfg.bos_token_id == ref.bos_token_id
    assert ref.eos_token_id in cfg.eos_token_ids


def test_default_aliases_resolve_to_the_packaged_gguf():
    try:
        path = default_model_path()
    except ModelLoadError as exc:
        pytest.skip(str(exc))
    assert path.endswith(".gguf") and os.path.isfile(path)
    for alias in (None, "default", "smollm2-135m-instruct"):
        assert resolve_model_path(alias) == path


def test_truncated_real_gguf_raises(tmp_path):
    try:
        source = default_model_path()
    except ModelLoadError as exc:
        pytest.skip(str(exc))
    with open(source, "rb") as fh:
        (tmp_path / "cut.gguf").write_bytes(fh.read(1 << 20))
    with pytest.raises(ModelLoadError, match="cut.gguf"):
        load_checkpoint(str(tmp_path / "cut.gguf"))
