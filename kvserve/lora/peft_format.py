"""Read and check a LoRA adapter in PEFT's folder format.

A folder holds ``adapter_config.json`` and ``adapter_model.safetensors`` (or
``adapter_model.bin``). Each adapted projection ``W [out, in]`` has ``lora_A [r, in]``
and ``lora_B [out, r]``; the adapted map is ``y = x W^T + s * (x A^T) B^T`` with
``s = lora_alpha / r`` (``lora_alpha / sqrt(r)`` with ``use_rslora``).

Everything that cannot be served is refused here with an ``AdapterLoadError`` naming
what is wrong: a missing or unreadable file, a non-LoRA PEFT type, DoRA, trained
biases, ``modules_to_save``, per-module rank or alpha patterns, an unknown target
module, a rank above ``max_rank``, a tensor whose shape does not fit the base model.

The adapter's identity is a digest of its scaling and tensors, so two loads of the same
files share prefix-cache blocks and anything else under the same name never does.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass, field

import torch

from kvserve.config import ModelConfig
from kvserve.errors import AdapterLoadError

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight$")
PEFT_DEFAULT_ALPHA = 8          # peft.LoraConfig.lora_alpha when a config leaves it out
UNSUPPORTED_FLAGS = {"use_dora": "DoRA (use_dora)", "fan_in_fan_out": "fan_in_fan_out weights",
                     "use_qalora": "QA-LoRA"}


@dataclass
class AdapterWeights:
    """One adapter in host memory: ``tensors[(layer, module)] = (A [r, in], B [out, r])``
    in fp32, and the scale its product is multiplied by."""

    path: str
    rank: int
    lora_alpha: float
    use_rslora: bool
    scaling: float
    tensors: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(repr=False)
    digest: str = ""

    @property
    def target_modules(self) -> list[str]:
        return sorted({module for _layer, module in self.tensors}, key=MODULES.index)

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.tensors.values())


def module_shape(config: ModelConfig, module: str) -> tuple[int, int]:
    """``(out, in)`` of one projection of the base model."""
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    hidden, inter = config.hidden_size, config.intermediate_size
    return {"q_proj": (q, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden), "o_proj": (hidden, q),
            "gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}[module]


def read_config(path: str) -> dict:
    """``adapter_config.json`` of ``path``, checked for options that cannot be served."""
    if not os.path.isdir(path):
        raise AdapterLoadError(f"LoRA adapter path {path!r} is not a folder", param="lora_path")
    config_file = os.path.join(path, "adapter_config.json")
    try:
        with open(config_file, encoding="utf-8") as f:
            config = json.load(f)
    except FileNotFoundError:
        raise AdapterLoadError(f"{path!r} has no adapter_config.json", param="lora_path") from None
    except (OSError, ValueError) as exc:
        raise AdapterLoadError(f"{config_file}: not a readable JSON file ({exc})", param="lora_path") from None
    if not isinstance(config, dict):
        raise AdapterLoadError(f"{config_file}: not a JSON object", param="lora_path")
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise AdapterLoadError(f"{config_file}: peft_type {peft_type!r} is not supported (only LORA)",
                               param="lora_path")
    for flag, what in UNSUPPORTED_FLAGS.items():
        if config.get(flag):
            raise AdapterLoadError(f"{config_file}: {what} is not supported", param="lora_path")
    if config.get("bias", "none") != "none":
        raise AdapterLoadError(f"{config_file}: bias={config['bias']!r} is not supported (only 'none')",
                               param="lora_path")
    for option in ("modules_to_save", "rank_pattern", "alpha_pattern", "layer_replication"):
        if config.get(option):
            raise AdapterLoadError(f"{config_file}: {option} is not supported", param="lora_path")
    targets = config.get("target_modules")
    if isinstance(targets, list):
        unknown = [t for t in targets if t.rsplit(".", 1)[-1] not in MODULES]
        if unknown:
            raise AdapterLoadError(f"{config_file}: unknown target module {unknown[0]!r}; supported: "
                                   f"{', '.join(MODULES)}", param="lora_path")
    return config


def read_tensors(path: str) -> dict[str, torch.Tensor]:
    """The adapter's tensors, from safetensors (preferred) or a PyTorch ``.bin``."""
    st_file, bin_file = (os.path.join(path, f) for f in ("adapter_model.safetensors", "adapter_model.bin"))
    try:
        if os.path.exists(st_file):
            from safetensors.torch import load_file
            return load_file(st_file)
        if os.path.exists(bin_file):
            return torch.load(bin_file, map_location="cpu", weights_only=True)
    except Exception as exc:      # safetensors / torch raise many types for a corrupt file
        raise AdapterLoadError(f"{path!r}: cannot read the adapter weights ({exc})", param="lora_path") from None
    raise AdapterLoadError(f"{path!r} has neither adapter_model.safetensors nor adapter_model.bin",
                           param="lora_path")


def load_peft_adapter(path: str, model: ModelConfig, max_rank: int) -> AdapterWeights:
    """Read, check and digest the adapter at ``path`` for a base model of ``model``'s shape."""
    config = read_config(path)
    raw = read_tensors(path)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in raw.items():
        match = _KEY.search(key)
        if match is None:
            raise AdapterLoadError(f"{path!r}: tensor {key!r} is not a LoRA A/B weight of a supported module "
                                   f"({', '.join(MODULES)})", param="lora_path")
        layer, module, which = int(match.group(1)), match.group(2), match.group(3)
        if module not in MODULES:
            raise AdapterLoadError(f"{path!r}: unknown target module {module!r} in tensor {key!r}; supported: "
                                   f"{', '.join(MODULES)}", param="lora_path")
        if layer >= model.num_layers:
            raise AdapterLoadError(f"{path!r}: tensor {key!r} is for layer {layer}, the base model has "
                                   f"{model.num_layers}", param="lora_path")
        pairs.setdefault((layer, module), {})[which] = tensor
    if not pairs:
        raise AdapterLoadError(f"{path!r}: the adapter holds no LoRA weights", param="lora_path")
    tensors, rank = {}, 0
    for (layer, module), ab in sorted(pairs.items()):
        tensors[(layer, module)] = _check_pair(path, layer, module, ab, model, max_rank)
        rank = max(rank, tensors[(layer, module)][0].shape[0])
    declared = int(config.get("r", rank))
    if declared > max_rank:
        raise AdapterLoadError(f"{path!r}: rank r={declared} exceeds --max-lora-rank {max_rank}", param="lora_path")
    odd = next((key for key, (a, _b) in tensors.items() if a.shape[0] != declared), None)
    if odd is not None:
        raise AdapterLoadError(f"{path!r}: layer {odd[0]} {odd[1]} has rank {tensors[odd][0].shape[0]}, the "
                               f"config says r={declared}", param="lora_path")
    alpha = float(config.get("lora_alpha", PEFT_DEFAULT_ALPHA))     # as peft.LoraConfig when absent
    use_rslora = bool(config.get("use_rslora", False))
    scaling = alpha / math.sqrt(declared) if use_rslora else alpha / declared
    weights = AdapterWeights(os.path.abspath(path), declared, alpha, use_rslora, scaling, tensors)
    weights.digest = adapter_digest(weights)
    return weights


def _check_pair(path: str, layer: int, module: str, ab: dict, model: ModelConfig, max_rank: int):
    where = f"{path!r}: layer {layer} {module}"
    if set(ab) != {"A", "B"}:
        missing = "lora_B" if "A" in ab else "lora_A"
        raise AdapterLoadError(f"{where}: {missing} is missing", param="lora_path")
    a, b = ab["A"].float().contiguous(), ab["B"].float().contiguous()
    out_dim, in_dim = module_shape(model, module)
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != in_dim or b.shape[0] != out_dim or a.shape[0] != b.shape[1]:
        raise AdapterLoadError(f"{where}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit the base "
                               f"model's [{out_dim}, {in_dim}] projection", param="lora_path")
    if a.shape[0] > max_rank:
        raise AdapterLoadError(f"{where}: rank {a.shape[0]} exceeds --max-lora-rank {max_rank}", param="lora_path")
    return a, b


def adapter_digest(weights: AdapterWeights) -> str:
    """A content digest: the scaling and every tensor, in a fixed order."""
    h = hashlib.sha256(repr((weights.scaling, sorted(weights.tensors))).encode())
    for key in sorted(weights.tensors):
        for tensor in weights.tensors[key]:
            h.update(tensor.numpy().tobytes())
    return h.hexdigest()[:32]
