"""The resident pool: ``num_slots`` adapters in preallocated stacked tensors.

The model fuses q/k/v into one projection and gate/up into another, so each of the four
projection roles of a layer gets, per slot, ``A [in, n_sub * R]`` and a block-diagonal
``B [n_sub * R, out]`` (``R`` = the maximum rank). An adapter of rank ``r`` that adapts
``k`` of a role's sub-modules fills only the first ``width = k * r`` columns of ``A`` and
rows of ``B`` (its sub-modules side by side), and products read only those: padding to
the maximum rank costs memory, never bandwidth. The scale is folded into ``B`` and both
are stored the way ``x @ A @ B`` reads them, so one step's delta for a run of rows of one
adapter is two small matrix products per projection, whatever its rank and targets.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.config import ModelConfig
from kvserve.lora.peft_format import AdapterWeights, module_shape


@dataclass(frozen=True)
class LayerSlots:
    """One layer's projection across the slots: the stacks (for batched products over a
    range of slots), each slot's width, and per slot its ``(A, B)`` views or None. The
    lists are the pool's own, updated in place when a slot is written or cleared."""

    a: torch.Tensor                 # [slots, in, W]
    b: torch.Tensor                 # [slots, W, out]
    width: list[int]
    views: list


@dataclass(frozen=True)
class Role:
    """One fused projection of a layer and the PEFT modules it is made of, in output order."""

    name: str
    path: tuple[str, str]          # attribute path in a decoder layer
    modules: tuple[str, ...]


ROLES = (Role("qkv", ("self_attn", "qkv_proj"), ("q_proj", "k_proj", "v_proj")),
         Role("o", ("self_attn", "o_proj"), ("o_proj",)),
         Role("gate_up", ("mlp", "gate_up_proj"), ("gate_proj", "up_proj")),
         Role("down", ("mlp", "down_proj"), ("down_proj",)))


class AdapterSlots:
    """Stacked LoRA weights of ``num_slots`` adapters for every layer and role."""

    def __init__(self, config: ModelConfig, num_slots: int, max_rank: int, device, dtype: torch.dtype):
        self.config, self.num_slots, self.max_rank = config, num_slots, max_rank
        self.a: dict[str, torch.Tensor] = {}       # role -> [layers, slots, in, n_sub * R]
        self.b: dict[str, torch.Tensor] = {}       # role -> [layers, slots, n_sub * R, out]
        self.offsets: dict[str, list[int]] = {}    # role -> output offset of each sub-module
        for role in ROLES:
            shapes = [module_shape(config, m) for m in role.modules]
            in_dim, width = shapes[0][1], len(role.modules) * max_rank
            self.offsets[role.name] = [sum(s[0] for s in shapes[:i]) for i in range(len(shapes))]
            out_dim = sum(s[0] for s in shapes)
            self.a[role.name] = torch.zeros(config.num_layers, num_slots, in_dim, width, device=device, dtype=dtype)
            self.b[role.name] = torch.zeros(config.num_layers, num_slots, width, out_dim, device=device, dtype=dtype)
        # width[role][slot]: columns of A (rows of B) the slot's adapter uses; 0: role not adapted
        self.width: dict[str, list[int]] = {role.name: [0] * num_slots for role in ROLES}
        # views[role][layer][slot]: (A[:, :width], B[:width]) of the slot, None if not adapted;
        # made once per write so that a step's products take them ready-made
        self.views: dict[str, list[list]] = {role.name: [[None] * num_slots for _ in range(config.num_layers)]
                                             for role in ROLES}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.a.values(), *self.b.values()))

    @property
    def slot_nbytes(self) -> int:
        return self.nbytes // self.num_slots

    def layer(self, role: str, layer: int) -> LayerSlots:
        """Everything one layer's ``LoRALinear`` reads (see ``LayerSlots``)."""
        return LayerSlots(self.a[role][layer], self.b[role][layer], self.width[role], self.views[role][layer])

    def write(self, slot: int, weights: AdapterWeights) -> None:
        """Copy an adapter into ``slot``: transposed, scale folded into B, the role's
        adapted sub-modules (in any layer) side by side in the first columns."""
        self.clear(slot)
        r = weights.rank
        for role in ROLES:
            adapted = [m for m in role.modules if any(mod == m for _layer, mod in weights.tensors)]
            self.width[role.name][slot] = len(adapted) * r
            for (layer, module), (a, b) in weights.tensors.items():
                if module not in adapted:
                    continue
                lo, offset = adapted.index(module) * r, self.offsets[role.name][role.modules.index(module)]
                self.a[role.name][layer, slot, :, lo:lo + r].copy_(a.t())
                self.b[role.name][layer, slot, lo:lo + r, offset:offset + b.shape[0]].copy_(b.t() * weights.scaling)
            width = self.width[role.name][slot]
            for layer, views in enumerate(self.views[role.name]):
                views[slot] = (self.a[role.name][layer, slot, :, :width],
                               self.b[role.name][layer, slot, :width]) if width else None

    def clear(self, slot: int) -> None:
        for role in ROLES:
            self.a[role.name][:, slot].zero_()
            self.b[role.name][:, slot].zero_()
            self.width[role.name][slot] = 0
            for views in self.views[role.name]:
                views[slot] = None
