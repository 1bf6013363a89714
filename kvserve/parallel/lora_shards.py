"""LoRA adapters under tensor parallelism: every rank holds its shard of each resident adapter.

An adapter's shard follows its base projection's (``tensor_parallel.py``):

- column-parallel q/k/v and gate/up: the rows of B for the rank's output features (its q
  heads, its KV heads, its MLP rows); A whole;
- row-parallel o and down: the columns of A for the rank's input features; B whole. The
  rank's delta ``x_r @ A_r @ B`` is then a partial sum like its base product, and
  ``LoRALinear`` adds it before the projection's all-reduce (``RowParallel.partial`` /
  ``reduce_``): one all-reduce for both.

Rank 0's ``ShardedAdapterSlots`` (the ``LoRAManager``'s slots) announces each slot write to
the other ranks (``lora_write``: the slot and the whole adapter, each rank cuts its own
shard) before writing its own. A worker's ``RankAdapters`` keeps the same slots and maps an
adapter key (the digest the forwards carry) to its slot from the writes it has seen, so its
``LoRABatch`` lays the rows out as rank 0's does.
"""
from __future__ import annotations

import dataclasses

from kvserve.config import ModelConfig
from kvserve.lora.batch import LoRABatch
from kvserve.lora.layer import apply_lora
from kvserve.lora.peft_format import AdapterWeights
from kvserve.lora.slots import AdapterSlots
from kvserve.parallel.tensor_parallel import head_ranges


def shard_adapter(weights: AdapterWeights, config: ModelConfig, rank: int, tp: int) -> AdapterWeights:
    """Rank ``rank``'s shard of ``weights`` (an adapter of the unsharded ``config``)."""
    q0, heads, kv0, kv_heads = head_ranges(config.num_heads, config.num_kv_heads, rank, tp)
    d, width = config.head_dim, config.intermediate_size // tp
    mlp = (rank * width, (rank + 1) * width)
    out_rows = {"q_proj": (q0 * d, (q0 + heads) * d), "k_proj": (kv0 * d, (kv0 + kv_heads) * d),
                "v_proj": (kv0 * d, (kv0 + kv_heads) * d), "gate_proj": mlp, "up_proj": mlp}
    in_cols = {"o_proj": (q0 * d, (q0 + heads) * d), "down_proj": mlp}
    tensors = {}
    for (layer, module), (a, b) in weights.tensors.items():       # A [r, in], B [out, r]
        if module in out_rows:
            lo, hi = out_rows[module]
            b = b[lo:hi]
        else:
            lo, hi = in_cols[module]
            a = a[:, lo:hi]
        tensors[(layer, module)] = (a.contiguous(), b.contiguous())
    return dataclasses.replace(weights, tensors=tensors)


class ShardedAdapterSlots(AdapterSlots):
    """Rank 0's resident slots, sized for its shard; each write also goes to the other ranks."""

    def __init__(self, config: ModelConfig, rank_config: ModelConfig, num_slots: int, max_rank: int,
                 device, dtype, group):
        super().__init__(rank_config, num_slots, max_rank, device, dtype)
        self.full_config, self.group = config, group

    def write(self, slot: int, weights: AdapterWeights) -> None:
        self.group.broadcast_object(("lora_write", (slot, weights)))
        super().write(slot, shard_adapter(weights, self.full_config, self.group.rank, self.group.world_size))


class RankAdapters:
    """A worker rank's LoRA: its shard's projections wrapped over slots like rank 0's, the
    batch context its runner brackets forwards with, and the key held in each slot."""

    def __init__(self, model, num_slots: int, max_rank: int, device, dtype, rank: int, tp: int):
        self.config, self.rank, self.tp = model.config, rank, tp
        self.slots = AdapterSlots(model.rank_config, num_slots, max_rank, device, dtype)
        self.slot_of_key: dict[str, int] = {}
        self.batch = LoRABatch(self.slot_of_key.__getitem__, device)
        apply_lora(model, self.slots, self.batch)

    def write(self, arg: tuple[int, AdapterWeights]) -> None:
        """``lora_write``: cut this rank's shard of the adapter into the slot."""
        slot, weights = arg
        for key in [k for k, s in self.slot_of_key.items() if s == slot]:
            del self.slot_of_key[key]
        self.slots.write(slot, shard_adapter(weights, self.config, self.rank, self.tp))
        self.slot_of_key[weights.digest] = slot
