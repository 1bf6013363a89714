"""Tier 1: speculative decoding without a model.

- ``propose_ngram`` / ``NgramProposer`` (prompt lookup);
- ``SpecController``: the expected-tokens formula, the step-time fit, on/off and
  per-sequence ``k`` decisions from a synthetic step-time model, probing, caps;
- ``SpeculativeConfig`` parsing and validation.

The scheduler with draft slots is tested in ``tests/unit/test_spec_scheduler.py``.
"""
from __future__ import annotations

import random

import pytest

from kvserve.engine.step import ScheduledSeq, StepPlan
from kvserve.errors import InvalidRequestError
from kvserve.sampling.params import SamplingParams
from kvserve.speculative.config import SpeculativeConfig, speculative_config
from kvserve.speculative.controller import (PRIOR_ALPHA, PROBE_EVERY, LinearTimeModel, SpecController, SpecStats,
                                     expected_tokens)
from kvserve.speculative.ngram import NgramProposer, propose_ngram

EOS = 0


# =============================================================================== n-gram
def test_ngram_longest_suffix_wins():
    tokens = [5, 2, 7, 8, 2, 9, 5, 2]
    # the 2-gram [5, 2] occurred at 0 (followed by 7, 8, 2); the 1-gram [2] last at 4 (followed by 9)
    assert propose_ngram(tokens, 3, ngram_max=2, ngram_min=1) == [7, 8, 2]
    assert propose_ngram(tokens, 3, ngram_max=1, ngram_min=1) == [9, 5, 2]
    # a 3-gram [9, 5, 2] never occurred before: falls back to the 2-gram
    assert propose_ngram(tokens, 3, ngram_max=3, ngram_min=1) == [7, 8, 2]


def test_ngram_most_recent_occurrence_wins():
    tokens = [1, 2, 3, 1, 2, 4, 1, 2]
    assert propose_ngram(tokens, 2, ngram_max=2, ngram_min=2) == [4, 1]
    tokens = [9, 1, 5, 9, 1, 6, 0, 9, 1]
    assert propose_ngram(tokens, 1, ngram_max=4, ngram_min=1) == [6]


def test_ngram_no_match_is_empty():
    assert propose_ngram([1, 2, 3, 4, 5], 4, ngram_max=3, ngram_min=1) == []
    assert propose_ngram([], 4, ngram_max=3, ngram_min=1) == []
    assert propose_ngram([7], 4, ngram_max=3, ngram_min=1) == []
    # only a 1-gram matches, but 2 tokens are the shortest suffix allowed
    assert propose_ngram([3, 8, 1, 3], 2, ngram_max=3, ngram_min=2) == []
    assert propose_ngram([3, 8, 1, 3], 2, ngram_max=3, ngram_min=1) == [8, 1]


def test_ngram_respects_num_tokens():
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2]
    assert propose_ngram(tokens, 3, 2, 1) == [3, 4, 5]
    assert propose_ngram(tokens, 1, 2, 1) == [3]
    assert propose_ngram(tokens, 0, 2, 1) == []
    assert propose_ngram(tokens, -1, 2, 1) == []
    # near the end the continuation is shorter than asked (it runs into the suffix itself)
    assert propose_ngram([4, 5, 4], 8, 1, 1) == [5, 4]


def test_ngram_never_matches_the_suffix_itself():
    # the suffix's own (last) occurrence has nothing after it: it must not count as a match
    assert propose_ngram([1, 2, 3], 2, ngram_max=3, ngram_min=1) == []
    assert propose_ngram([6, 7, 8, 9], 3, ngram_max=4, ngram_min=1) == []
    # a run: the latest *earlier* occurrence of [7, 7] starts at 1 and is followed by one 7
    assert propose_ngram([7, 7, 7, 7], 4, ngram_max=2, ngram_min=1) == [7]
    assert propose_ngram([7, 7], 4, ngram_max=4, ngram_min=1) == [7]
    # the latest earlier [1, 1] starts at 1 and overlaps the suffix: followed by the suffix's last 1 only
    assert propose_ngram([2, 1, 1, 1], 3, ngram_max=2, ngram_min=2) == [1]


def test_ngram_matches_a_brute_force_reference():
    rng = random.Random(0)

    def reference(tokens, num, nmax, nmin):
        if num <= 0:
            return []
        for n in range(min(nmax, len(tokens) - 1), nmin - 1, -1):
            suffix = tokens[len(tokens) - n:]
            starts = [i for i in range(len(tokens) - n) if tokens[i:i + n] == suffix]
            if starts:
                i = starts[-1] + n
                return tokens[i:i + num]
        return []

    for _ in range(2000):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(0, 20))]
        num, nmin = rng.randrange(0, 6), rng.randrange(1, 4)
        nmax = rng.randrange(nmin, 6)
        assert propose_ngram(tokens, num, nmax, nmin) == reference(tokens, num, nmax, nmin), (tokens, num, nmax, nmin)


def _scheduled(seq_id, prompt, output, slots):
    return ScheduledSeq(seq_id, [(prompt + output)[-1]], len(prompt) + len(output) - 1, [0, 1, 2, 3], True,
                        SamplingParams(temperature=0), prompt, output, frozenset([EOS]), 0,
                        num_lookahead_slots=slots)


def test_ngram_proposer_fills_only_speculating_sequences_within_their_slots():
    plan = StepPlan([_scheduled(0, [1, 2, 3, 4, 5, 1, 2], [], 2),
                     _scheduled(1, [1, 2, 3, 4, 5, 1, 2], [], 0),
                     _scheduled(2, [1, 2, 3], [9, 1, 2], 8),
                     _scheduled(3, [1, 2, 3], [4], 3)])
    drafts = NgramProposer(ngram_max=3, ngram_min=1).propose(plan)
    assert [drafts[s.seq_id].token_ids if s.seq_id in drafts else [] for s in plan.scheduled] == \
        [[3, 4], [], [3, 9, 1, 2], []]
    assert all(d.probs is None for d in drafts.values())          # point masses: no draft distribution


# =========================================================================== controller
def test_expected_tokens_formula():
    for alpha in (0.0, 0.3, 0.6, 0.9, 0.99):
        for k in range(0, 9):
            assert expected_tokens(alpha, k) == pytest.approx(sum(alpha ** i for i in range(k + 1)))
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(0.5, 0) == 1.0


def test_linear_time_model_recovers_a_and_b():
    rng = random.Random(1)
    model = LinearTimeModel()
    assert model.coefficients() is None
    model.observe(8, 0.05)
    assert model.coefficients() is None                      # one point
    model.observe(8, 0.06)
    assert model.coefficients() is None                      # no spread in x
    model = LinearTimeModel()
    for _ in range(400):
        x = rng.randrange(1, 512)
        model.observe(x, 0.030 + 0.002 * x + rng.gauss(0, 0.002))
    a, b = model.coefficients()
    assert a == pytest.approx(0.030, abs=0.002)
    assert b == pytest.approx(0.002, rel=0.02)


def test_linear_time_model_clamps_and_forgets():
    model = LinearTimeModel(window=50)
    for x in range(1, 51):                                   # decreasing: slope clamped to 0
        model.observe(x, 1.0 - 0.01 * x)
    a, b = model.coefficients()
    assert b == 0.0 and a >= 0.0
    for x in range(1, 51):                                   # a new regime replaces the window
        model.observe(x, 0.010 + 0.001 * x)
    a, b = model.coefficients()
    assert (a, b) == (pytest.approx(0.010), pytest.approx(0.001))
    assert model.num_points == 50


A, B = 0.030, 0.002                                          # 30 ms per step + 2 ms per token


def _controller(k_max=8, **kw) -> SpecController:
    c = SpecController(k_max, **kw)
    for t in range(1, 300):
        c.observe_step(t, A + B * t)
    assert c.forward_time.coefficients() == (pytest.approx(A), pytest.approx(B))
    return c


def _train(c: SpecController, seq_id: int, proposed: int, accepted: int, times: int) -> None:
    for _ in range(times):
        c.observe_verification(seq_id, proposed, accepted)


def test_explores_at_full_k_before_any_measurement():
    c = SpecController(4)
    assert c.plan([(0, 10), (1, 2), (2, 0)], base_tokens=3) == {0: 4, 1: 2}
    assert c.stats.num_steps_on == 1
    assert c.plan([], base_tokens=0) == {}


def test_speculates_at_batch_1_off_at_batch_64_and_back_on():
    """Acceptance ~0.74 with t(T) = 30 ms + 2 ms T: a lone sequence gains a lot from
    drafts; at 64 sequences a draft token costs about what a whole sequence's share of
    the step does, so the step goes plain."""
    c = _controller()
    for sid in range(64):
        _train(c, sid, proposed=4, accepted=3, times=10)          # 30 accepted, 10 rejections
    assert c._seqs[0].alpha == pytest.approx((30 + 2 * PRIOR_ALPHA) / 42)

    chosen = c.plan([(0, 16)], base_tokens=1)
    assert chosen and chosen[0] >= 4
    assert c.stats.num_steps_on == 1

    big = [(sid, 16) for sid in range(64)]
    for _ in range(2 * PROBE_EVERY + 1):                     # probes included: still off
        assert c.plan(big, base_tokens=64) == {}
    assert c.stats.num_steps_off == 2 * PROBE_EVERY + 1
    assert c.stats.num_steps_on == 1

    chosen = c.plan([(0, 16), (1, 16)], base_tokens=2)       # the batch shrinks: back on
    assert set(chosen) == {0, 1} and min(chosen.values()) >= 1
    assert c.stats.num_steps_on == 2


def test_speculation_pays_only_with_acceptance():
    c = _controller()
    _train(c, 0, proposed=4, accepted=0, times=30)           # alpha ~ 0.04
    assert c.plan([(0, 8)], base_tokens=1) == {}
    _train(c, 1, proposed=4, accepted=4, times=30)           # alpha ~ 1
    assert c.plan([(1, 8)], base_tokens=1) == {1: 8}


def test_per_sequence_k_grows_with_acceptance():
    c = _controller(k_max=8)
    others = [(sid, 16) for sid in range(1, 8)]                # 8 sequences decode together
    ks = []
    for _ in range(8):
        chosen = c.plan([(0, 16)] + others, base_tokens=8)
        ks.append(chosen.get(0, 0))
        _train(c, 0, proposed=4, accepted=4, times=5)
    print(f"k of a sequence accepting everything, step by step: {ks}")
    assert ks == sorted(ks) and ks[-1] > ks[0] >= 1
    # in the same step, the sequence with the better record gets more drafts
    chosen = c.plan([(0, 16)] + others, base_tokens=8)
    assert chosen[0] > max(chosen.get(sid, 0) for sid, _ in others)


def test_k_never_exceeds_the_sequence_limit_or_k_max():
    c = _controller(k_max=5)
    for sid in range(3):
        _train(c, sid, 4, 4, 50)
    assert c.plan([(0, 2), (1, 9), (2, 1)], base_tokens=3) == {0: 2, 1: 5, 2: 1}


def test_a_written_off_sequence_is_probed_alongside_good_ones():
    c = _controller()
    _train(c, 0, proposed=4, accepted=0, times=30)           # written off
    _train(c, 1, proposed=4, accepted=4, times=30)           # excellent: keeps the step on
    probed_at = [step for step in range(1, 2 * PROBE_EVERY + 1)
                 if 0 in c.plan([(0, 8), (1, 8)], base_tokens=2)]
    assert probed_at == [PROBE_EVERY, 2 * PROBE_EVERY]
    assert all(c.plan([(0, 8), (1, 8)], base_tokens=2).get(0, 0) == 0 for _ in range(PROBE_EVERY - 1))


def test_a_lone_written_off_sequence_is_probed():
    c = _controller()
    _train(c, 0, proposed=4, accepted=0, times=30)
    assert any(c.plan([(0, 8)], base_tokens=1) for _ in range(2 * PROBE_EVERY))


def test_max_batch_size_caps_speculation():
    c = _controller(max_batch_size=4)
    for sid in range(5):
        _train(c, sid, 4, 4, 30)
    assert c.plan([(sid, 8) for sid in range(5)], base_tokens=5) == {}
    assert c.stats.num_steps_off == 1
    assert set(c.plan([(sid, 8) for sid in range(4)], base_tokens=4)) == {0, 1, 2, 3}
    assert c.stats.num_steps_on == 1


def test_draft_model_time_counts_against_speculation():
    cheap, costly = _controller(uses_draft_model=True), _controller(uses_draft_model=True)
    for s in range(1, 65):
        cheap.observe_draft_pass(s, 0.001 + 0.0001 * s)
        costly.observe_draft_pass(s, 0.030 + 0.002 * s)       # as slow as the target itself
    for c in (cheap, costly):
        _train(c, 0, 4, 3, 10)                               # alpha ~ 0.74
    assert cheap.plan([(0, 8)], base_tokens=1)
    assert costly.plan([(0, 8)], base_tokens=1) == {}


def test_observe_verification_and_forget():
    c = SpecController(4)
    c.observe_verification(3, 0, 0)                          # nothing proposed: nothing learnt
    assert 3 not in c._seqs and c.stats.num_verifications == 0
    c.observe_verification(3, 4, 2)
    c.observe_verification(3, 2, 2)
    assert c._seqs[3].accepted == 4 and c._seqs[3].rejections == 1
    c.forget(3)
    c.forget(3)
    assert 3 not in c._seqs
    s = c.stats
    assert (s.num_proposed, s.num_accepted, s.num_verifications) == (6, 4, 2)
    assert s.accepted_per_position == [2, 2, 0, 0]
    assert s.acceptance_rate == pytest.approx(4 / 6)
    assert s.mean_accepted_length == pytest.approx(2.0)


def test_spec_stats_record():
    s = SpecStats()
    s.record(0, 0)
    assert s.num_verifications == 0 and s.acceptance_rate == 0.0 and s.mean_accepted_length == 0.0
    s.record(3, 3)
    s.record(1, 0)
    d = s.as_dict()
    assert d["num_proposed"] == 4 and d["num_accepted"] == 3 and d["accepted_per_position"] == [1, 1, 1]
    assert d["acceptance_rate"] == pytest.approx(0.75)
    assert d["num_rejections"] == 1 and d["alpha"] == pytest.approx(3 / (3 + 1))
    assert d["mean_accepted_length"] == pytest.approx(1.5)


# ================================================================================ config
def test_speculative_config_parse():
    assert SpeculativeConfig.parse("ngram") == SpeculativeConfig(method="ngram")
    cfg = SpeculativeConfig.parse("draft:/models/tiny.gguf", num_speculative_tokens=6)
    assert (cfg.method, cfg.draft_model, cfg.num_speculative_tokens) == ("draft", "/models/tiny.gguf", 6)
    assert SpeculativeConfig.parse("draft:C:/models/x.gguf").draft_model == "C:/models/x.gguf"
    cfg = SpeculativeConfig.parse("self:8")
    assert (cfg.method, cfg.draft_layers) == ("self", 8)


@pytest.mark.parametrize("spec", ["", "bogus", "ngram:3", "draft", "draft:", "self", "self:", "self:abc",
                                  "self:-1", "self:0", "self:2.5", "NGRAM"])
def test_speculative_config_parse_errors(spec):
    with pytest.raises(InvalidRequestError) as err:
        SpeculativeConfig.parse(spec)
    assert err.value.param == "speculative"


@pytest.mark.parametrize("kwargs, param", [
    ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"num_speculative_tokens": 17}, "num_speculative_tokens"),
    ({"ngram_min": 3, "ngram_max": 2}, "ngram_min"),
    ({"ngram_min": 0}, "ngram_min"),
    ({"min_gain": -0.1}, "min_gain"),
    ({"min_gain": float("nan")}, "min_gain"),
])
def test_speculative_config_validation(kwargs, param):
    with pytest.raises(InvalidRequestError) as err:
        SpeculativeConfig(**kwargs)
    assert err.value.param == param
    with pytest.raises(InvalidRequestError):
        SpeculativeConfig.parse("ngram", **kwargs)


def test_engine_config_spellings():
    assert speculative_config(None) is None and speculative_config("") is None
    assert speculative_config("self:4") == SpeculativeConfig(method="self", draft_layers=4)
    cfg = SpeculativeConfig(num_speculative_tokens=2)
    assert speculative_config(cfg) is cfg
    assert speculative_config({"method": "ngram", "ngram_max": 6}) == SpeculativeConfig(ngram_max=6)
    with pytest.raises(InvalidRequestError):
        speculative_config("draft")
