"""Tier 1: grouped expert dispatch / combine (kvserve.models.moe) against a dense reference
that runs every expert on every token and masks by the routing; and the Qwen2-MoE router's
top-k normalisation."""
from __future__ import annotations

import pytest
import torch

from kvserve.config import MoEConfig
from kvserve.models.moe import GroupedExperts, LocalDispatcher
from kvserve.models.projection import Projection
from kvserve.models.qwen2_moe import Qwen2MoeSparseBlock

HIDDEN, INTER, EXPERTS, TOP_K = 16, 8, 6, 2


def _experts(packed: bool) -> GroupedExperts:
    generator = torch.Generator().manual_seed(0)
    experts = GroupedExperts(EXPERTS, HIDDEN, INTER)
    tensors = {}
    for e in range(EXPERTS):
        for name, shape in (("gate_proj", (INTER, HIDDEN)), ("up_proj", (INTER, HIDDEN)),
                            ("down_proj", (HIDDEN, INTER))):
            tensors[f"experts.{e}.{name}.weight"] = torch.randn(shape, generator=generator)
    experts.load_weights(tensors, "experts.")
    if packed:                                  # the CPU fp32 layouts the engine uses
        for module in experts.modules():
            if isinstance(module, Projection):
                module.pack()
    return experts


def _routing(tokens: int, unused_expert: int | None = None):
    """(hidden [T, H], topk_ids [T, k] distinct per token, topk_weights [T, k])."""
    generator = torch.Generator().manual_seed(tokens)
    hidden = torch.randn(tokens, HIDDEN, generator=generator)
    scores = torch.rand(tokens, EXPERTS, generator=generator)
    if unused_expert is not None:
        scores[:, unused_expert] = -1.0
    weights, ids = scores.topk(TOP_K, dim=-1)
    return hidden, ids, weights.softmax(-1)


def _dense_reference(hidden, topk_ids, topk_weights, experts: GroupedExperts) -> torch.Tensor:
    """Every expert on every token, weighted by the token's routing weight (0 if unrouted)."""
    out = torch.zeros_like(hidden)
    for index, expert in enumerate(experts.experts):
        weight = (topk_weights * (topk_ids == index)).sum(dim=1, keepdim=True)
        out += expert(hidden) * weight
    return out


@pytest.mark.parametrize("tokens", [1, 3, 40])
@pytest.mark.parametrize("packed", [False, True])
def test_grouped_equals_dense_reference(tokens, packed):
    experts = _experts(packed)
    hidden, ids, weights = _routing(tokens)
    dispatcher = LocalDispatcher(EXPERTS)
    grouped = dispatcher.dispatch(hidden, ids, weights)
    out = dispatcher.combine(experts(grouped.hidden, grouped.counts.tolist()), grouped)
    torch.testing.assert_close(out, _dense_reference(hidden, ids, weights, experts), rtol=1e-5, atol=1e-5)


def test_dispatch_groups_rows_by_expert_in_token_order():
    hidden, ids, weights = _routing(25, unused_expert=4)
    grouped = LocalDispatcher(EXPERTS).dispatch(hidden, ids, weights)
    assert grouped.counts.tolist() == torch.bincount(ids.reshape(-1), minlength=EXPERTS).tolist()
    assert grouped.counts[4] == 0 and int(grouped.counts.sum()) == 25 * TOP_K
    start = 0
    for expert, rows in enumerate(grouped.counts.tolist()):
        tokens = grouped.token_index[start:start + rows]
        assert bool((ids[tokens] == expert).any(dim=1).all())          # each row routed to its expert
        assert tokens.tolist() == sorted(tokens.tolist())                # stable: token order kept
        torch.testing.assert_close(grouped.hidden[start:start + rows], hidden[tokens], rtol=0, atol=0)
        start += rows
    pairs = sorted(zip(grouped.token_index.tolist(), grouped.weights.tolist()))
    assert pairs == sorted((t, w) for t in range(25) for w in weights[t].tolist())


def test_an_expert_with_no_rows_is_skipped():
    experts = _experts(packed=True)
    hidden, ids, weights = _routing(9, unused_expert=2)
    dispatcher = LocalDispatcher(EXPERTS)
    grouped = dispatcher.dispatch(hidden, ids, weights)
    out = dispatcher.combine(experts(grouped.hidden, grouped.counts.tolist()), grouped)
    torch.testing.assert_close(out, _dense_reference(hidden, ids, weights, experts), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError):
        experts(grouped.hidden, grouped.counts.tolist()[:-1])


@pytest.mark.parametrize("norm", [False, True])
def test_router_softmax_topk_and_normalisation(norm):
    moe = MoEConfig(num_experts=EXPERTS, top_k=TOP_K, expert_intermediate_size=INTER,
                    shared_expert_intermediate_size=INTER, norm_topk_prob=norm)
    block = Qwen2MoeSparseBlock(HIDDEN, moe)
    block.router.data = torch.randn(EXPERTS, HIDDEN, generator=torch.Generator().manual_seed(3))
    x = torch.randn(11, HIDDEN, generator=torch.Generator().manual_seed(4))
    ids, weights = block.route(x)
    probs = (x @ block.router.T).softmax(-1)
    expected, expected_ids = probs.topk(TOP_K, dim=-1)
    if norm:
        expected = expected / expected.sum(-1, keepdim=True)
    assert torch.equal(ids, expected_ids)
    torch.testing.assert_close(weights, expected)
    assert bool((weights.sum(-1) - 1).abs().lt(1e-6).all()) == norm
