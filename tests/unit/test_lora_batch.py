"""Tier 1: one step's LoRA segments (LoRABatch.order / begin) and the LoRALinear
transform against the explicit formula ``y = x W^T + s (x A^T) B^T`` per row, on
random small tensors, for steps that mix adapters and base rows."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from kvserve.engine.step import ScheduledSeq
from kvserve.lora.batch import LoRABatch
from kvserve.lora.layer import LoRALinear, apply_lora
from kvserve.lora.peft_format import load_peft_adapter, module_shape
from kvserve.lora.slots import ROLES, AdapterSlots
from kvserve.models.projection import Projection
from kvserve.sampling.params import SamplingParams
from tests.support.lora_adapters import synthetic_adapter, tiny_model_config

MC = tiny_model_config()
MAX_RANK = 4


def item(seq_id: int, key: str | None, num_tokens: int = 1, lookahead: int = 0) -> ScheduledSeq:
    return ScheduledSeq(seq_id, [5] * num_tokens, 0, [0], True, SamplingParams(), [5], [], frozenset(), 0,
                        adapter_key=key, lookahead_token_ids=[6] * lookahead)


# ------------------------------------------------------------------- segments
def test_order_puts_base_first_then_groups_by_slot_keeping_plan_order():
    batch = LoRABatch({"x": 1, "y": 0}.__getitem__)
    items = [item(0, "x"), item(1, None), item(2, "y"), item(3, "x"), item(4, None), item(5, "y")]
    assert [s.seq_id for s in batch.order(items)] == [1, 4, 2, 5, 0, 3]


def test_begin_makes_one_segment_per_run_of_a_slot():
    batch = LoRABatch({"x": 1, "y": 0}.__getitem__)
    items = [item(1, None, 3), item(2, "y", 2), item(5, "y", 1, lookahead=2), item(0, "x", 4), item(3, "x", 1)]
    batch.begin(items, [s.num_tokens + len(s.lookahead_token_ids) for s in items])
    assert batch.segments == [(3, 8, 0), (8, 13, 1)]          # base rows 0..2 have none
    batch.end()
    assert batch.segments == []


def test_begin_keeps_separate_runs_of_one_slot_apart():
    batch = LoRABatch({"x": 0}.__getitem__)
    items = [item(0, "x", 2), item(1, None, 1), item(2, "x", 2)]   # not ordered: two runs
    batch.begin(items, [2, 1, 2])
    assert batch.segments == [(0, 2, 0), (3, 5, 0)]


# ------------------------------------------------------------------- the math
class TinyLayer(nn.Module):
    def __init__(self):
        super().__init__()
        q, kv, hidden, inter = MC.num_heads * MC.head_dim, MC.num_kv_heads * MC.head_dim, MC.hidden_size, \
            MC.intermediate_size
        self.self_attn, self.mlp = nn.Module(), nn.Module()
        self.self_attn.qkv_proj = Projection(q + 2 * kv, hidden)
        self.self_attn.o_proj = Projection(hidden, q)
        self.mlp.gate_up_proj = Projection(2 * inter, hidden)
        self.mlp.down_proj = Projection(hidden, inter)
        self.dense = {}                                    # role -> W [out, in], before packing
        for role in ROLES:
            proj = getattr(getattr(self, role.path[0]), role.path[1])
            proj.weight.data.normal_()
            self.dense[role.name] = proj.weight.detach().clone()
            proj.pack()                                    # the layout the CPU engine runs


@pytest.fixture(scope="module")
def wrapped(tmp_path_factory):
    """A 2-layer model of Projections, LoRA-wrapped over 3 slots holding: an adapter of
    rank 2 on q/v/down (slot 0), one of rank 4 on all seven with rsLoRA (slot 2)."""
    torch.manual_seed(0)
    model = nn.Module()
    model.layers = nn.ModuleList([TinyLayer() for _ in range(MC.num_layers)])
    weight = {(i, name): w for i, layer in enumerate(model.layers) for name, w in layer.dense.items()}
    folder = tmp_path_factory.mktemp("adapters")
    small = load_peft_adapter(synthetic_adapter(folder / "small", MC, r=2, alpha=3,
                                                targets=("q_proj", "v_proj", "down_proj"), seed=1), MC, MAX_RANK)
    full = load_peft_adapter(synthetic_adapter(folder / "full", MC, r=4, alpha=2, use_rslora=True, seed=2,
                                               targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                        "up_proj", "down_proj")), MC, MAX_RANK)
    slots = AdapterSlots(MC, 3, MAX_RANK, "cpu", torch.float32)
    slots.write(0, small)
    slots.write(2, full)
    batch = LoRABatch({"small": 0, "full": 2}.__getitem__)
    assert apply_lora(model, slots, batch) == 4 * MC.num_layers
    return model, batch, weight, {"small": small, "full": full}


def expected(x: torch.Tensor, layer: int, role, weight, adapter) -> torch.Tensor:
    """``x W^T`` plus, per sub-module of the fused projection, ``s (x A^T) B^T``."""
    x = x.double()
    y = x @ weight[(layer, role.name)].double().t()
    if adapter is None:
        return y
    column = 0
    for module in role.modules:
        out_dim = module_shape(MC, module)[0]
        pair = adapter.tensors.get((layer, module))
        if pair is not None:
            a, b = (t.double() for t in pair)
            y[:, column:column + out_dim] += adapter.scaling * (x @ a.t()) @ b.t()
        column += out_dim
    return y


def test_segments_get_their_adapter_and_base_rows_the_base(wrapped):
    model, batch, weight, adapters = wrapped
    keys = [None, None, "small", "small", "small", "full", "full", None, "small"]   # 9 rows, one item each
    items = batch.order([item(i, key) for i, key in enumerate(keys)])
    rows_key = [s.adapter_key for s in items]
    assert rows_key == [None, None, None, "small", "small", "small", "small", "full", "full"]
    batch.begin(items, [1] * len(items))
    try:
        for layer_index, layer in enumerate(model.layers):
            for role in ROLES:
                proj = getattr(getattr(layer, role.path[0]), role.path[1])
                assert isinstance(proj, LoRALinear)
                x = torch.randn(len(items), proj.in_features)
                out = proj(x)
                acc = torch.randn(len(items), proj.out_features)
                residual = acc.clone()
                proj.accumulate_(acc, x)
                for row, key in enumerate(rows_key):
                    want = expected(x[row:row + 1], layer_index, role, weight, adapters.get(key))
                    assert torch.allclose(out[row:row + 1].double(), want, atol=1e-4), (layer_index, role, row)
                    assert torch.allclose(acc[row:row + 1].double(), residual[row:row + 1].double() + want,
                                          atol=1e-4)
    finally:
        batch.end()


def test_adapters_change_the_output_and_nothing_outside_a_bracket(wrapped):
    model, batch, weight, adapters = wrapped
    qkv = model.layers[1].self_attn.qkv_proj
    x = torch.randn(3, qkv.in_features)
    plain = qkv(x)                                         # no segments: the base projection
    assert torch.allclose(plain.double(), expected(x, 1, ROLES[0], weight, None), atol=1e-4)
    batch.begin([item(0, "small", 3)], [3])
    adapted = qkv(x)
    batch.end()
    q, kv = MC.num_heads * MC.head_dim, MC.num_kv_heads * MC.head_dim
    assert not torch.allclose(adapted[:, :q], plain[:, :q])                    # q adapted
    assert torch.equal(adapted[:, q:q + kv], plain[:, q:q + kv])               # k not
    assert not torch.allclose(adapted[:, q + kv:], plain[:, q + kv:])          # v adapted
    o = model.layers[0].self_attn.o_proj                  # "small" leaves o alone: inactive, skipped
    batch.begin([item(0, "small", 3)], [3])
    try:
        assert torch.equal(o(torch.ones(3, o.in_features)), o.base(torch.ones(3, o.in_features)))
    finally:
        batch.end()


def test_apply_lora_twice_is_refused(wrapped):
    model, batch, _weight, _adapters = wrapped
    slots = AdapterSlots(MC, 1, MAX_RANK, "cpu", torch.float32)
    with pytest.raises(ValueError, match="already LoRA-wrapped"):
        apply_lora(model, slots, batch)


@pytest.mark.parametrize("rows_per_item", [
    [1, 1, 1, 1],          # decodes of two adapters: one batched product over both slots, no padding
    [12, 1, 3, 1],         # a prefill chunk of "small" (its own products) beside short rows of "full"
    [2, 5, 1, 1],          # short segments of unequal length: padded batched product
])
def test_long_and_short_segments_give_the_formula(wrapped, rows_per_item):
    model, batch, weight, adapters = wrapped
    keys = ["small", "small", "full", None]
    items = batch.order([item(i, key, n) for i, (key, n) in enumerate(zip(keys, rows_per_item))])
    counts = [s.num_tokens for s in items]
    row_keys = [s.adapter_key for s, n in zip(items, counts) for _ in range(n)]
    batch.begin(items, counts)
    try:
        assert (len(batch.runs) == 1) == (max(counts) <= 8)   # both adapters short: one run
        for layer_index, layer in enumerate(model.layers):
            for role in ROLES:
                proj = getattr(getattr(layer, role.path[0]), role.path[1])
                x = torch.randn(len(row_keys), proj.in_features)
                out = proj(x)
                for row, key in enumerate(row_keys):
                    want = expected(x[row:row + 1], layer_index, role, weight, adapters.get(key))
                    assert torch.allclose(out[row:row + 1].double(), want, atol=1e-4), (layer_index, role, row)
    finally:
        batch.end()
