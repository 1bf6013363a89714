"""The LoRA transform on a plain model: each adapted ``Projection`` is wrapped in a
``LoRALinear`` that adds the step's low-rank deltas after the base product.

The model file is unchanged: it calls ``proj(x)`` and ``proj.accumulate_(out, x)`` as
before. ``apply_lora`` swaps the four projections of every decoder layer (fused q/k/v,
o, fused gate/up, down) for wrappers over views of the resident slots.
"""
from __future__ import annotations

import torch
from torch import nn

from kvserve.lora.batch import LoRABatch
from kvserve.lora.slots import ROLES, AdapterSlots, LayerSlots
from kvserve.models.projection import Projection


class LoRALinear(nn.Module):
    """``y = base(x) + delta``; the delta of each segment's adapter (see ``LoRABatch``)."""

    def __init__(self, base: Projection, slots: LayerSlots, batch: LoRABatch):
        super().__init__()
        self.base = base
        self.slots, self.batch = slots, batch      # views of the resident slots: not parameters

    @property
    def out_features(self) -> int:
        return self.base.out_features

    @property
    def in_features(self) -> int:
        return self.base.in_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] -> [T, out]: the delta joins the base's ``partial`` product before its
        ``reduce_`` (on a row-parallel shard x holds this rank's input features and the delta
        is a partial sum too: one all-reduce for both)."""
        return self.base.reduce_(self.batch.add_delta_(self.base.partial(x), x, self.slots))

    def accumulate_(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``out += x @ W.T + delta`` in place (the residual stream)."""
        if self.base.partial_sums:           # the sum over ranks first, then into the stream
            return out.add_(self.forward(x))
        self.base.accumulate_(out, x)
        return self.batch.add_delta_(out, x, self.slots)


def apply_lora(model: nn.Module, slots: AdapterSlots, batch: LoRABatch) -> int:
    """Wrap every decoder layer's projections; returns how many were wrapped."""
    wrapped = 0
    for index, layer in enumerate(model.layers):
        for role in ROLES:
            owner = getattr(layer, role.path[0])
            base = getattr(owner, role.path[1])
            if isinstance(base, LoRALinear):
                raise ValueError("the model's projections are already LoRA-wrapped")
            setattr(owner, role.path[1], LoRALinear(base, slots.layer(role.name, index), batch))
            wrapped += 1
    return wrapped
