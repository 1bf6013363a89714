"""Tier 1: speculative rejection sampling on controlled distributions (no model).

The target here emits tokens independently per position (``p_i`` does not depend on
the drafts before it), which is a valid special case of the sampler's contract:
every emitted token must be distributed as the target would have sampled it, for
any draft distribution ``q``. So:

- the first emitted token is ``~ p_0`` (draft accepted, or the residual on rejection);
- given drafts ``0 .. i-1`` accepted, the next emitted token is ``~ p_i``;
- given all ``n`` drafts accepted, the bonus token is ``~ p_n`` (``n`` = the row's own
  count, not the batch's ``K``).

Drafts are drawn from ``q`` position by position (``d_i ~ q_i``), 100,000 rows per
batch, with seeded generators so each test is deterministic; thresholds are a few
standard errors wide so they also hold for other seeds.
"""
from __future__ import annotations

import math

import pytest
import torch

from kvserve.speculative.rejection import rejection_sample

V = 12               # vocabulary
K = 3                # drafts per row
N = 100_000          # rows


def _normalise(x: torch.Tensor) -> torch.Tensor:
    return x / x.sum(dim=-1, keepdim=True)


def _target() -> torch.Tensor:
    """``p_0 .. p_K`` ``[K + 1, V]``: distinct, full support, most mass on the first half."""
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(K + 1, V, generator=gen) * 1.2
    logits[:, : V // 2] += 1.5
    return logits.softmax(dim=-1)


P = _target()


def _close(p: torch.Tensor) -> torch.Tensor:
    """A small perturbation of ``p`` (total variation a few percent)."""
    gen = torch.Generator().manual_seed(12)
    return _normalise(p * torch.exp(0.15 * torch.randn(p.shape, generator=gen)))


def _far(p: torch.Tensor) -> torch.Tensor:
    """Prefers exactly what ``p`` dislikes (reversed preference order, most mass on the second half)."""
    return (-2.0 * p.log()).softmax(dim=-1)


def _nearly_disjoint(p: torch.Tensor) -> torch.Tensor:
    """99.9% of the mass on the half of the vocabulary ``p`` gives the least."""
    q = torch.full_like(p, 1e-3 / (V // 2))
    q[:, V // 2:] = _normalise(torch.rand(p.shape[0], V - V // 2, generator=torch.Generator().manual_seed(13))
                               + 0.1) * (1 - 1e-3)
    return q


DRAFTS = {"close": _close(P[:K]), "far": _far(P[:K]), "nearly_disjoint": _nearly_disjoint(P[:K])}


def tv(counts: torch.Tensor, p: torch.Tensor) -> float:
    """Total-variation distance between empirical ``counts`` ``[V]`` and ``p`` ``[V]``."""
    return 0.5 * float((counts.double() / counts.sum() - p.double()).abs().sum())


def tv_bound(p: torch.Tensor, n: int, sigmas: float = 4.0) -> float:
    """A generous bound for the empirical TV of ``n`` draws from ``p``: ``sigmas`` standard
    errors per category (the expected TV is about a fifth of this at 4 sigmas)."""
    return 0.5 * sigmas * float(torch.sqrt(p.double() * (1 - p.double()) / n).sum())


def histogram(tokens: torch.Tensor) -> torch.Tensor:
    return torch.bincount(tokens, minlength=V)


def draw_drafts(q: torch.Tensor, n: int, seed: int) -> torch.Tensor:
    """``[n, K]`` drafts, ``d_i ~ q_i`` independently per row (sequential draws)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.stack([torch.multinomial(q[i], n, replacement=True, generator=gen) for i in range(q.shape[0])],
                       dim=1)


def run(q: torch.Tensor, tokens: torch.Tensor, num_drafts: torch.Tensor | None = None, seed: int = 0,
        p: torch.Tensor = P):
    n = tokens.shape[0]
    k = q.shape[0]
    if num_drafts is None:
        num_drafts = torch.full((n,), k, dtype=torch.long)
    gen = torch.Generator().manual_seed(seed)
    return rejection_sample(p[: k + 1].expand(n, k + 1, V), q.expand(n, k, V), tokens, num_drafts, gen)


# ------------------------------------------------------------------ sanity of the setup
def test_setup_drafts_are_close_and_far_as_claimed():
    for i in range(K):
        p = P[i]
        assert 0.01 < 0.5 * float((DRAFTS["close"][i] - p).abs().sum()) < 0.1
        assert 0.5 * float((DRAFTS["far"][i] - p).abs().sum()) > 0.5
        assert 0.5 * float((DRAFTS["nearly_disjoint"][i] - p).abs().sum()) > 0.7
    # the targets differ from each other, so using the wrong position is detectable
    for i in range(K + 1):
        for j in range(i + 1, K + 1):
            assert 0.5 * float((P[i] - P[j]).abs().sum()) > 0.05


# ------------------------------------------------------------------ the first emitted token
@pytest.mark.parametrize("kind", sorted(DRAFTS))
def test_first_token_converges_to_target(kind):
    q = DRAFTS[kind]
    tokens = draw_drafts(q, N, seed=1)
    num_accepted, final = run(q, tokens, seed=2)
    first = torch.where(num_accepted > 0, tokens[:, 0], final)
    tvs = {n: tv(histogram(first[:n]), P[0]) for n in (1_000, 10_000, N)}
    print(f"{kind}: TV vs p_0 by draws {tvs}; acceptance of draft 0 {float((num_accepted > 0).double().mean()):.3f}")
    assert tvs[N] < tvs[1_000]
    assert tvs[N] < 0.01
    assert tvs[10_000] < tv_bound(P[0], 10_000)
    # the drafts alone are far from p_0 at this sample size: the test can tell them apart
    assert tv(histogram(tokens[:, 0]), P[0]) > 3 * tvs[N]


@pytest.mark.parametrize("kind", sorted(DRAFTS))
def test_later_tokens_given_earlier_accepted(kind):
    """Given drafts 0..i-1 accepted, the (i+1)-th emitted token is ~ p_i (the bonus ~ p_K)."""
    q = DRAFTS[kind]
    tokens = draw_drafts(q, N, seed=3)
    num_accepted, final = run(q, tokens, seed=4)
    for i in range(1, K + 1):
        rows = num_accepted >= i
        n = int(rows.sum())
        if n < 2_000:              # far drafts rarely get this deep: nothing to measure
            continue
        nxt = final[rows] if i == K else torch.where(num_accepted[rows] > i, tokens[rows, i], final[rows])
        distance = tv(histogram(nxt), P[i])
        print(f"{kind}: emitted token {i} given {i} accepted: {n} rows, TV {distance:.4f}")
        assert distance < tv_bound(P[i], n)


def test_exactly_disjoint_support_always_rejects_and_emits_the_target():
    """q puts no mass where p does: every draft is rejected and the residual is p itself."""
    p = P.clone()
    p[:, V // 2:] = 0.0
    p = _normalise(p)
    q = torch.zeros(K, V)
    q[:, V // 2:] = 1.0 / (V - V // 2)
    tokens = draw_drafts(q, N, seed=5)
    num_accepted, final = run(q, tokens, seed=6, p=p)
    assert int(num_accepted.sum()) == 0
    assert not bool((final >= V // 2).any())
    assert tv(histogram(final), p[0]) < tv_bound(p[0], N)


# ------------------------------------------------------------------ acceptance rates
def test_q_equal_p_accepts_everything():
    q = P[:K].clone()
    tokens = draw_drafts(q, N, seed=7)
    num_accepted, final = run(q, tokens, seed=8)
    assert bool((num_accepted == K).all())
    assert tv(histogram(final), P[K]) < tv_bound(P[K], N)       # the bonus token ~ p_K


def test_num_drafts_per_row_is_respected():
    """Rows verify only their own first ``n`` drafts; the bonus comes from ``p_n``."""
    q = P[:K].clone()                                   # q == p: every counted draft is accepted
    tokens = draw_drafts(q, N, seed=9)
    num_drafts = torch.arange(N) % (K + 1)              # 0, 1, 2, 3, 0, ...
    # positions past a row's count hold tokens the target would accept for sure if it looked at them
    best = P[:K].argmax(dim=-1)
    past = torch.arange(K)[None, :] >= num_drafts[:, None]
    tokens = torch.where(past, best.expand(N, K), tokens)
    num_accepted, final = run(q, tokens, num_drafts, seed=10)
    assert torch.equal(num_accepted, num_drafts)
    for n in range(K + 1):
        rows = num_drafts == n
        assert tv(histogram(final[rows]), P[n]) < tv_bound(P[n], int(rows.sum())), f"bonus after {n} drafts"


def test_num_drafts_respected_under_rejection():
    q = DRAFTS["far"]
    tokens = draw_drafts(q, N, seed=14)
    num_drafts = torch.arange(N) % (K + 1)
    num_accepted, final = run(q, tokens, num_drafts, seed=15)
    assert bool((num_accepted <= num_drafts).all())
    # rows with no drafts emit just a sample of p_0
    rows = num_drafts == 0
    assert tv(histogram(final[rows]), P[0]) < tv_bound(P[0], int(rows.sum()))
    # first emitted token ~ p_0 over every row that had a draft
    rows = num_drafts > 0
    first = torch.where(num_accepted[rows] > 0, tokens[rows, 0], final[rows])
    assert tv(histogram(first), P[0]) < tv_bound(P[0], int(rows.sum()))


def test_point_mass_draft_accepts_with_probability_p_of_the_draft():
    """A one-hot q at ``d`` (n-gram style): accept ``d`` with probability ``p(d)``;
    on rejection emit ``p`` renormalised without ``d``, so the first token is still ~ p_0."""
    d = torch.tensor([int(P[0].argsort()[V // 2]), int(P[1].argmax()), int(P[2].argmin())])   # mid, top, bottom
    q = torch.nn.functional.one_hot(d, V).float()
    tokens = d.expand(N, K).clone()
    num_accepted, final = run(q, tokens, seed=16)
    rate0 = float((num_accepted >= 1).double().mean())
    se = math.sqrt(float(P[0, d[0]]) * (1 - float(P[0, d[0]])) / N)
    assert abs(rate0 - float(P[0, d[0]])) < 4 * se
    # deeper acceptance multiplies: P(>= 2 accepted) = p_0(d_0) p_1(d_1)
    both = float(P[0, d[0]] * P[1, d[1]])
    assert abs(float((num_accepted >= 2).double().mean()) - both) < 4 * math.sqrt(both * (1 - both) / N)
    # the token emitted at a rejection is never the rejected draft
    rejected_at_0 = num_accepted == 0
    assert not bool((final[rejected_at_0] == d[0]).any())
    first = torch.where(num_accepted > 0, tokens[:, 0], final)
    assert tv(histogram(first), P[0]) < tv_bound(P[0], N)


def test_acceptance_rate_matches_min_one_p_over_q():
    """Per draft position 0: P(accept) = sum_x q(x) min(1, p(x)/q(x)) = 1 - TV(p, q)."""
    for kind, q in DRAFTS.items():
        tokens = draw_drafts(q, N, seed=17)
        num_accepted, _ = run(q, tokens, seed=18)
        expected = 1.0 - 0.5 * float((P[0] - q[0]).abs().sum())
        got = float((num_accepted >= 1).double().mean())
        assert abs(got - expected) < 4 * math.sqrt(expected * (1 - expected) / N) + 1e-9, kind


# ------------------------------------------------------------------ edge cases
def test_zero_draft_columns_samples_the_target():
    n = 20_000
    gen = torch.Generator().manual_seed(19)
    num_accepted, final = rejection_sample(P[:1].expand(n, 1, V), torch.zeros(n, 0, V),
                                           torch.zeros(n, 0, dtype=torch.long), torch.zeros(n, dtype=torch.long),
                                           gen)
    assert int(num_accepted.abs().sum()) == 0
    assert tv(histogram(final), P[0]) < tv_bound(P[0], n)


def test_seeded_generator_is_reproducible():
    q = DRAFTS["close"]
    tokens = draw_drafts(q, 5_000, seed=20)
    a = run(q, tokens, seed=21)
    b = run(q, tokens, seed=21)
    c = run(q, tokens, seed=22)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not (torch.equal(a[0], c[0]) and torch.equal(a[1], c[1]))


def test_never_emits_a_token_the_target_excludes():
    """Top-k/top-p leave zeros in p; neither an accepted draft nor a residual/bonus sample lands there."""
    p = P.clone()
    p[:, ::3] = 0.0
    p = _normalise(p)
    q = _normalise(torch.ones(K, V))                   # uniform drafts, some on excluded tokens
    tokens = draw_drafts(q, N, seed=23)
    num_accepted, final = run(q, tokens, seed=24, p=p)
    excluded = set(range(0, V, 3))
    for i in range(K):
        accepted = tokens[num_accepted > i, i]
        assert not set(accepted.unique().tolist()) & excluded
    assert not set(final.unique().tolist()) & excluded
