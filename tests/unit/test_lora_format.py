"""Tier 1: the PEFT folder loader (kvserve/lora/peft_format.py) on hand-written adapters
for a small synthetic model: every refusal is an AdapterLoadError that names the
problem; scaling; the content digest."""
from __future__ import annotations

import json
import math
import os

import pytest
import torch

from kvserve.errors import AdapterLoadError
from kvserve.lora.peft_format import load_peft_adapter, module_shape
from tests.support.lora_adapters import synthetic_adapter, synthetic_tensors, tiny_model_config, write_adapter

MC = tiny_model_config()          # hidden 8, q 8, kv 4, MLP 12, 2 layers
MAX_RANK = 4
ATTN = "base_model.model.model.layers.0.self_attn"


def load(folder):
    return load_peft_adapter(str(folder), MC, MAX_RANK)


def refused(folder, *words):
    """The folder is refused with a message that contains every one of ``words``."""
    with pytest.raises(AdapterLoadError) as info:
        load(folder)
    message = info.value.message
    for word in words:
        assert word in message, f"{word!r} not in {message!r}"
    assert info.value.param == "lora_path"
    return message


def test_a_good_adapter_loads_with_its_shapes(tmp_path):
    weights = load(synthetic_adapter(tmp_path, MC, r=2, alpha=4, targets=("q_proj", "down_proj")))
    assert weights.rank == 2 and weights.scaling == 2.0 and weights.path == os.path.abspath(tmp_path)
    assert weights.target_modules == ["q_proj", "down_proj"]
    assert set(weights.tensors) == {(layer, m) for layer in (0, 1) for m in ("q_proj", "down_proj")}
    for (_layer, module), (a, b) in weights.tensors.items():
        out_dim, in_dim = module_shape(MC, module)
        assert a.shape == (2, in_dim) and b.shape == (out_dim, 2) and a.dtype == torch.float32


def test_bin_and_safetensors_hold_the_same_adapter(tmp_path):
    tensors = synthetic_tensors(MC, 2, ("k_proj", "o_proj"), seed=3)
    config = {"target_modules": ["k_proj", "o_proj"]}
    st = load(write_adapter(tmp_path / "st", config, tensors, fmt="safetensors"))
    pt = load(write_adapter(tmp_path / "pt", config, tensors, fmt="bin"))
    assert st.digest == pt.digest
    assert all(torch.equal(st.tensors[k][0], pt.tensors[k][0]) for k in st.tensors)


# ------------------------------------------------------------------ refusals
def test_missing_folder(tmp_path):
    refused(tmp_path / "nowhere", "nowhere", "not a folder")


def test_no_config(tmp_path):
    refused(tmp_path, "no adapter_config.json")


@pytest.mark.parametrize("text, words", [("{not json", ("not a readable JSON",)),
                                         ("[1, 2]", ("not a JSON object",))])
def test_unreadable_config(tmp_path, text, words):
    (tmp_path / "adapter_config.json").write_text(text)
    refused(tmp_path, "adapter_config.json", *words)


@pytest.mark.parametrize("option, value, words", [
    ("peft_type", "PREFIX_TUNING", ("PREFIX_TUNING", "only LORA")),
    ("peft_type", "ia3", ("IA3",)),
    ("use_dora", True, ("DoRA",)),
    ("fan_in_fan_out", True, ("fan_in_fan_out",)),
    ("bias", "lora_only", ("bias", "lora_only")),
    ("bias", "all", ("bias", "'all'")),
    ("modules_to_save", ["lm_head"], ("modules_to_save",)),
    ("rank_pattern", {"q_proj": 4}, ("rank_pattern",)),
    ("alpha_pattern", {"q_proj": 8}, ("alpha_pattern",)),
])
def test_unsupported_options(tmp_path, option, value, words):
    write_adapter(tmp_path, {option: value}, synthetic_tensors(MC))
    refused(tmp_path, *words)


def test_unknown_target_module_in_config(tmp_path):
    write_adapter(tmp_path, {"target_modules": ["q_proj", "lm_head"]}, synthetic_tensors(MC))
    refused(tmp_path, "unknown target module", "lm_head", "q_proj, k_proj")


def test_unknown_module_in_tensor_names(tmp_path):
    tensors = synthetic_tensors(MC)
    tensors[f"{ATTN}.rotary.lora_A.weight"] = torch.zeros(2, 8)
    write_adapter(tmp_path, {}, tensors)
    refused(tmp_path, "unknown target module", "'rotary'")


def test_a_tensor_that_is_no_lora_weight(tmp_path):
    tensors = synthetic_tensors(MC)
    tensors["base_model.model.lm_head.lora_A.weight"] = torch.zeros(2, 8)
    write_adapter(tmp_path, {}, tensors)
    refused(tmp_path, "lm_head.lora_A.weight", "not a LoRA A/B weight")


def test_layer_out_of_range(tmp_path):
    write_adapter(tmp_path, {}, synthetic_tensors(MC, layers=[0, 2]))
    refused(tmp_path, "layer 2", "has 2")


def test_rank_above_max_in_tensors_and_in_config(tmp_path):
    write_adapter(tmp_path / "t", {"r": 6}, synthetic_tensors(MC, r=6))
    refused(tmp_path / "t", "rank 6", "--max-lora-rank 4")
    write_adapter(tmp_path / "c", {"r": 8}, synthetic_tensors(MC, r=2))
    refused(tmp_path / "c", "r=8", "--max-lora-rank 4")


def test_rank_differs_from_config(tmp_path):
    write_adapter(tmp_path, {"r": 4}, synthetic_tensors(MC, r=2))
    refused(tmp_path, "has rank 2", "r=4")


@pytest.mark.parametrize("drop, missing", [("lora_B", "lora_B"), ("lora_A", "lora_A")])
def test_half_a_pair(tmp_path, drop, missing):
    tensors = {k: v for k, v in synthetic_tensors(MC).items() if not (k.startswith(f"{ATTN}.q_proj") and drop in k)}
    write_adapter(tmp_path, {}, tensors)
    refused(tmp_path, "layer 0 q_proj", f"{missing} is missing")


@pytest.mark.parametrize("which, shape", [("lora_A", (2, 9)), ("lora_B", (5, 2)), ("lora_B", (4, 3))])
def test_shape_that_does_not_fit(tmp_path, which, shape):
    tensors = synthetic_tensors(MC, targets=("v_proj",))
    tensors[f"{ATTN}.v_proj.{which}.weight"] = torch.zeros(shape)
    write_adapter(tmp_path, {"target_modules": ["v_proj"]}, tensors)
    refused(tmp_path, "layer 0 v_proj", "do not fit", "[4, 8]")


def test_no_weights_file(tmp_path):
    write_adapter(tmp_path, {})
    refused(tmp_path, "neither adapter_model.safetensors nor adapter_model.bin")


def test_no_weights_at_all(tmp_path):
    write_adapter(tmp_path, {}, {})
    refused(tmp_path, "no LoRA weights")


@pytest.mark.parametrize("name", ["adapter_model.safetensors", "adapter_model.bin"])
def test_corrupt_weights_file(tmp_path, name):
    write_adapter(tmp_path, {})
    (tmp_path / name).write_bytes(b"\x00garbage, not tensors" * 10)
    refused(tmp_path, "cannot read the adapter weights")


# ------------------------------------------------------------ scaling, digest
@pytest.mark.parametrize("r, alpha, rslora, expected", [(2, 4, False, 2.0), (4, 4, False, 1.0),
                                                        (4, 4, True, 2.0), (2, 3, True, 3 / math.sqrt(2))])
def test_scaling(tmp_path, r, alpha, rslora, expected):
    weights = load(synthetic_adapter(tmp_path, MC, r=r, alpha=alpha, use_rslora=rslora))
    assert weights.scaling == pytest.approx(expected) and weights.use_rslora == rslora


def test_alpha_defaults_to_peft_default(tmp_path):
    """A config without lora_alpha scales as peft does: peft.LoraConfig's default alpha
    is 8 (not imported here: peft pulls in transformers, seconds for tier 1)."""
    write_adapter(tmp_path, {"r": 2}, synthetic_tensors(MC))
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    del config["lora_alpha"]
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    assert load(tmp_path).scaling == 8 / 2


def test_digest_follows_content(tmp_path):
    base = load(synthetic_adapter(tmp_path / "a", MC, seed=1))
    assert load(synthetic_adapter(tmp_path / "same", MC, seed=1)).digest == base.digest
    assert load(synthetic_adapter(tmp_path / "seed", MC, seed=2)).digest != base.digest
    assert load(synthetic_adapter(tmp_path / "alpha", MC, seed=1, alpha=8)).digest != base.digest
    assert load(synthetic_adapter(tmp_path / "rs", MC, seed=1, use_rslora=True)).digest != base.digest
    tensors = synthetic_tensors(MC, seed=1)
    key = f"{ATTN}.q_proj.lora_B.weight"
    tensors[key] = tensors[key].clone()
    tensors[key][0, 0] += 1e-3                       # one element changed
    assert load(write_adapter(tmp_path / "elem", {}, tensors)).digest != base.digest
    # rslora with alpha 4 at r=4 scales like plain alpha 8 at r=4: the same map, the same id
    tensors = synthetic_tensors(MC, r=4, seed=5)
    plain = load(write_adapter(tmp_path / "p", {"r": 4, "lora_alpha": 8}, tensors))
    rs = load(write_adapter(tmp_path / "r", {"r": 4, "lora_alpha": 4, "use_rslora": True}, tensors))
    assert plain.scaling == rs.scaling and plain.digest == rs.digest
