"""Sampler maths (tier 1, no model): greedy, filters, penalties, seeds, logprobs, masks."""
from __future__ import annotations

import math
import random

import pytest
import torch

from kvserve.sampling import (Sampler, SamplingRow, apply_penalties,
                              process_logits)
from kvserve.sampling.sampler import apply_filters, apply_temperature

from tests.support.sampler_rows import _one_thread, row  # noqa: F401  (autouse fixture)

INF = math.inf


def finite_ids(t: torch.Tensor) -> set[int]:
    return set(torch.nonzero(torch.isfinite(t)).flatten().tolist())


def total_variation(counts: torch.Tensor, probs: torch.Tensor) -> float:
    return 0.5 * (counts / counts.sum() - probs).abs().sum().item()


# ------------------------------------------------------------------------- greedy
def test_greedy_is_exactly_argmax_of_raw_logits():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 1000, generator=gen) * 5
    logits[3, [7, 9, 500]] = 100.0  # a tie: lowest id wins, like torch.argmax
    rows = [row(temperature=0.0) for _ in range(16)]
    rows[5] = row(temperature=0.8)  # a sampling row in the batch changes nothing
    out = Sampler(seed=1)(logits, rows)
    expected = logits.argmax(dim=-1).tolist()
    assert [t for i, t in enumerate(out.token_ids) if i != 5] == [t for i, t in enumerate(expected) if i != 5]
    assert out.token_ids[3] == 7
    assert out.logprobs == [None] * 16 and out.top_logprobs == [[]] * 16


def test_inputs_are_not_modified():
    logits = torch.randn(3, 50)
    before = logits.clone()
    rows = [row(output=[1, 2], prompt=[3], repetition_penalty=1.5, presence_penalty=1.0),
            row(output=[], eos={4}, min_tokens=2, top_k=3, top_p=0.5),
            row(temperature=0.0, logprobs=2)]
    Sampler(seed=0)(logits, rows)
    assert torch.equal(logits, before)


def test_temperature_to_zero_limit():
    logits = torch.tensor([[0.0, 1.0, 0.95, 0.9, -3.0]]).repeat(500, 1)
    # At T=1e-3 the runner-up has relative weight exp(-50): every draw is the argmax.
    out = Sampler(seed=0)(logits, [row(temperature=1e-3) for _ in range(500)])
    assert set(out.token_ids) == {1}
    # Far smaller temperatures stay finite (no NaN, no overflow).
    for t in (1e-20, 1e-38):
        scaled = apply_temperature(logits[:1], torch.tensor([t]))
        assert not torch.isnan(scaled).any() and scaled[0, 1] == 0
        assert Sampler(seed=0)(logits[:4], [row(temperature=t)] * 4).token_ids == [1] * 4
    # At T=1 the same logits spread over several tokens.
    out = Sampler(seed=0)(logits, [row(temperature=1.0) for _ in range(500)])
    assert len(set(out.token_ids)) >= 3


# ------------------------------------------------------------------------ filters
def test_top_k_keeps_exactly_k_candidates():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(1, 40, generator=gen) * 0.3  # nearly flat: every survivor is drawn
    top5 = set(logits[0].topk(5).indices.tolist())
    filtered = apply_filters(logits, torch.tensor([5]), torch.tensor([1.0]), torch.tensor([0.0]))
    assert finite_ids(filtered[0]) == top5
    rows = [row(top_k=5, seed=s) for s in range(2000)]
    out = Sampler()(logits.repeat(2000, 1), rows)
    assert set(out.token_ids) == top5
    # Ties at the boundary: still exactly k, lower ids first.
    flat = torch.zeros(1, 10)
    kept = apply_filters(flat, torch.tensor([3]), torch.tensor([1.0]), torch.tensor([0.0]))
    assert finite_ids(kept[0]) == {0, 1, 2}


@pytest.mark.parametrize("top_p,nucleus", [(0.45, {0}), (0.75, {0, 1}), (0.85, {0, 1, 2}),
                                           (0.99, {0, 1, 2, 3}), (1.0, {0, 1, 2, 3})])
def test_top_p_keeps_the_minimal_nucleus(top_p, nucleus):
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    perm = torch.tensor([2, 0, 3, 1])  # token ids not in probability order
    logits = torch.empty(4)
    logits[perm] = probs.log()
    filtered = apply_filters(logits[None], torch.tensor([0]), torch.tensor([top_p]), torch.tensor([0.0]))
    assert finite_ids(filtered[0]) == {perm[i].item() for i in nucleus}
    out = Sampler()(logits.repeat(400, 1), [row(top_p=top_p, seed=s) for s in range(400)])
    assert set(out.token_ids) == {perm[i].item() for i in nucleus}


def test_top_p_applies_after_top_k_on_renormalised_mass():
    logits = torch.tensor([[0.4, 0.3, 0.2, 0.1]]).log()
    # top-k=2 leaves (4/7, 3/7); top_p=0.6 then keeps both (mass before token 1 is 0.571 < 0.6).
    filtered = apply_filters(logits, torch.tensor([2]), torch.tensor([0.6]), torch.tensor([0.0]))
    assert finite_ids(filtered[0]) == {0, 1}


def test_min_p_threshold():
    logits = torch.tensor([[0.05, 0.4, 0.1, 0.3, 0.15]]).log()
    filtered = apply_filters(logits, torch.tensor([0]), torch.tensor([1.0]), torch.tensor([0.3]))
    assert finite_ids(filtered[0]) == {1, 3, 4}  # p >= 0.3 * 0.4 = 0.12
    assert torch.equal(filtered[0, [1, 3, 4]], logits[0, [1, 3, 4]])
    out = Sampler()(logits.repeat(400, 1), [row(min_p=0.3, seed=s) for s in range(400)])
    assert set(out.token_ids) == {1, 3, 4}


def test_rows_without_a_filter_are_untouched():
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(4, 30, generator=gen)
    filtered = apply_filters(logits, torch.tensor([0, 3, 0, 0]), torch.tensor([1.0, 1.0, 0.5, 1.0]),
                             torch.tensor([0.0, 0.0, 0.0, 0.2]))
    assert torch.equal(filtered[0], logits[0])
    assert len(finite_ids(filtered[1])) == 3
    assert len(finite_ids(filtered[2])) < 30 and len(finite_ids(filtered[3])) < 30


# ---------------------------------------------------------------------- penalties
def test_penalties_exact_values():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]] * 4)
    rows = [
        row(prompt=[0, 1], output=[2, 2, 4], repetition_penalty=2.0,
            frequency_penalty=0.5, presence_penalty=0.25),
        row(prompt=[0, 1], output=[2, 2, 4]),  # no penalties
        row(prompt=[0, 1], output=[2, 2, 4], presence_penalty=-1.0),
        row(prompt=[5], output=[3], repetition_penalty=0.5),
    ]
    out = apply_penalties(logits, rows)
    # repetition (prompt+output: 0,1,2,4): 2/2, -1*2, 0.5/2, -, -2*2; then
    # token 2 (count 2): 0.25 - 2*0.5 - 0.25; token 4 (count 1): -4 - 0.5 - 0.25.
    assert out[0].tolist() == [1.0, -2.0, -1.0, 3.0, -4.75, 1.0]
    assert torch.equal(out[1], logits[1])
    assert out[2].tolist() == [2.0, -1.0, 1.5, 3.0, -1.0, 1.0]  # output tokens only
    assert out[3].tolist() == [2.0, -1.0, 0.5, 6.0, -2.0, 2.0]  # r < 1 boosts seen tokens
    assert torch.equal(logits, torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]] * 4))
    assert apply_penalties(logits, [rows[1]] * 4) is logits
    # Greedy rows follow the processed logits: here the penalty flips the winner.
    flip = torch.tensor([[0.0, 5.0, 4.0]])
    assert Sampler()(flip, [row(output=[1], temperature=0.0, frequency_penalty=2.0)]).token_ids == [2]


def test_process_logits_combines_penalties_and_min_tokens_mask():
    logits = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    r = row(output=[3], eos={3}, min_tokens=2, stop_token_ids=[1], presence_penalty=1.0)
    assert process_logits(logits, [r]).tolist() == [[1.0, -INF, 3.0, -INF]]
    assert process_logits(logits, [row()]) is logits


# -------------------------------------------------------------------------- seeds
def _seeded_rows(n: int) -> list[SamplingRow]:
    return [row(seed=1000 + i, output=list(range(i % 7)), temperature=0.9, top_k=50 if i % 3 else 0)
            for i in range(n)]


def test_seeded_rows_are_independent_of_batch_composition_and_sampler_state():
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(24, 300, generator=gen)
    rows = _seeded_rows(24)
    alone = [Sampler()(logits[i:i + 1], [rows[i]]).token_ids[0] for i in range(24)]
    batched = Sampler()(logits, rows).token_ids
    assert batched == alone
    # Shuffled, padded with unseeded, greedy and penalised rows, after many steps of use.
    sampler = Sampler()
    for _ in range(3):
        sampler(logits, [row() for _ in range(24)])
    order = list(range(24))
    random.Random(0).shuffle(order)
    mixed_logits, mixed_rows, where = [], [], {}
    for i in order:
        mixed_logits += [torch.randn(1, 300, generator=gen)[0], logits[i]]
        mixed_rows += [row(temperature=random.Random(i).choice([0.0, 1.0]), presence_penalty=0.5,
                           output=[1, 2]), rows[i]]
        where[i] = len(mixed_rows) - 1
    out = sampler(torch.stack(mixed_logits), mixed_rows).token_ids
    assert [out[where[i]] for i in range(24)] == alone


def test_different_seeds_offsets_and_positions_differ():
    logits = torch.zeros(1, 1000)  # uniform: collisions are rare
    sampler = Sampler()

    def draw(**kw):
        return sampler(logits, [row(**kw)]).token_ids[0]

    by_seed = {draw(seed=s) for s in range(20)}
    assert len(by_seed) >= 15
    assert len({draw(seed=7, seed_offset=k) for k in range(20)}) >= 15
    assert len({draw(seed=7, output=[0] * k) for k in range(20)}) >= 15
    assert draw(seed=7, seed_offset=2, output=[5, 6]) == draw(seed=7, seed_offset=2, output=[1, 9])


# ------------------------------------------------------------------ distribution
def test_unseeded_empirical_distribution_matches_softmax():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2, -2.0, 0.7])
    n = 20_000
    out = Sampler(seed=123)(logits.repeat(n, 1), [row(temperature=1.0) for _ in range(n)])
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=10).float()
    assert total_variation(counts, logits.softmax(-1)) < 0.02


def test_seeded_and_filtered_distributions_match():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2, -2.0, 0.7])
    n = 5_000
    out = Sampler()(logits.repeat(n, 1), [row(seed=s, temperature=0.7) for s in range(n)])
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=10).float()
    assert total_variation(counts, (logits / 0.7).softmax(-1)) < 0.04
    out = Sampler(seed=5)(logits.repeat(n, 1), [row(top_k=3) for _ in range(n)])
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=10).float()
    expected = torch.zeros(10)
    top = logits.topk(3).indices
    expected[top] = logits[top].softmax(-1)
    assert total_variation(counts, expected) < 0.03


# ----------------------------------------------------------------------- logprobs
def test_logprobs_are_of_the_raw_distribution():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(4, 100, generator=gen)
    rows = [row(logprobs=5, temperature=0.5, top_k=10, repetition_penalty=1.3, output=[1, 2]),
            row(logprobs=0, temperature=0.0),
            row(),
            row(logprobs=20, seed=3, presence_penalty=2.0, output=[4])]
    out = Sampler(seed=0)(logits, rows)
    raw = torch.log_softmax(logits, dim=-1)
    for i in (0, 1, 3):
        assert out.logprobs[i] == pytest.approx(raw[i, out.token_ids[i]].item(), abs=1e-6)
    assert out.logprobs[2] is None and out.top_logprobs[2] == []
    assert out.top_logprobs[1] == []
    for i, k in ((0, 5), (3, 20)):
        top = out.top_logprobs[i]
        values, ids = raw[i].topk(k)
        assert [t for t, _ in top] == ids.tolist()
        assert [v for _, v in top] == pytest.approx(values.tolist(), abs=1e-6)
        assert all(a[1] >= b[1] for a, b in zip(top, top[1:]))


# ---------------------------------------------------------------- min_tokens, -inf
def test_min_tokens_masks_eos_until_reached():
    logits = torch.tensor([[0.0, 1.0, 2.0, 10.0, 9.0]])  # 3 = eos, 4 = a stop token id
    sampler = Sampler(seed=0)

    def greedy(n_out, **kw):
        r = row(output=[0] * n_out, eos={3}, min_tokens=3, stop_token_ids=[4], temperature=0.0, **kw)
        return sampler(logits, [r]).token_ids[0]

    assert [greedy(k) for k in range(5)] == [2, 2, 2, 3, 3]
    assert greedy(1, ignore_eos=True) == 2  # ignore_eos is about stopping, not masking
    sampled = sampler(logits.repeat(300, 1),
                      [row(output=[0], eos={3}, min_tokens=2, stop_token_ids=[4]) for _ in range(300)])
    assert not {3, 4} & set(sampled.token_ids)


def test_negative_infinity_and_fully_masked_rows_give_no_nan():
    logits = torch.full((4, 6), -INF)
    logits[0, 2] = 1.0                       # one finite token
    logits[1, [1, 4]] = torch.tensor([0.0, 0.5])
    logits[2, 5] = 3.0                       # only eos is finite and min_tokens masks it
    rows = [row(logprobs=2, top_p=0.5), row(seed=1, top_k=1, min_p=0.5, logprobs=1),
            row(eos={5}, min_tokens=4, logprobs=0), row(logprobs=3)]
    out = Sampler(seed=0)(logits, rows)
    assert out.token_ids[:3] == [2, 4, 5]
    assert 0 <= out.token_ids[3] < 6
    assert out.logprobs[0] == 0.0 and out.logprobs[3] == -INF
    assert not any(isinstance(v, float) and math.isnan(v) for v in out.logprobs)
    assert out.top_logprobs[0][0] == (2, 0.0) and out.top_logprobs[0][1][1] == -INF
    many = Sampler(seed=1)(logits[1:2].repeat(500, 1), [row(temperature=2.0)] * 500)
    assert set(many.token_ids) == {1, 4}


def test_empty_batch_and_shape_check():
    assert Sampler()(torch.zeros(0, 10), []).token_ids == []
    with pytest.raises(ValueError):
        Sampler()(torch.zeros(2, 10), [row()])
