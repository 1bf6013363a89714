"""Tier 1: speculative decoding without a model.

- ``propose_ngram`` / ``NgramProposer`` (prompt lookup);
- ``SpecController``: the expected-tokens formula, the step-time fit, on/off and
  per-sequence ``k`` decisions from a synthetic step-time model, probing, caps;
- ``SpeculativeConfig`` parsing and validation;
- the scheduler with draft slots (fake controller, scripted proposals and
  verification outcomes): blocks reserved for drafts and given back, integrity under
  rejections / aborts / preemption / the prefix cache, ``max_tokens`` and stop tokens.
"""
from __future__ import annotations

import itertools
import random

import pytest

from kvserve.engine.block_pool import BlockPool
from kvserve.engine.engine_core import _spec_config
from kvserve.engine.prefix_cache import PrefixCache
from kvserve.engine.prefix_events import CacheNamespace
from kvserve.engine.scheduler import Scheduler, SchedulerConfig
from kvserve.engine.sequence import FinishReason, Sequence, SeqStatus
from kvserve.engine.step import SampledToken, ScheduledSeq, StepPlan, StepResult
from kvserve.errors import InvalidRequestError
from kvserve.sampling.params import SamplingParams
from kvserve.spec.config import SpeculativeConfig
from kvserve.spec.controller import (PRIOR_ALPHA, PROBE_EVERY, LinearTimeModel, SpecController, SpecStats,
                                     expected_tokens)
from kvserve.spec.ngram import NgramProposer, propose_ngram

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
                        SamplingParams(temperature=0), prompt, output, frozenset([EOS]), 0, num_draft_slots=slots)


def test_ngram_proposer_fills_only_speculating_sequences_within_their_slots():
    plan = StepPlan([_scheduled(0, [1, 2, 3, 4, 5, 1, 2], [], 2),
                     _scheduled(1, [1, 2, 3, 4, 5, 1, 2], [], 0),
                     _scheduled(2, [1, 2, 3], [9, 1, 2], 8),
                     _scheduled(3, [1, 2, 3], [4], 3)])
    NgramProposer(ngram_max=3, ngram_min=1).propose(plan)
    assert [s.draft_token_ids for s in plan.scheduled] == [[3, 4], [], [3, 9, 1, 2], []]
    assert NgramProposer().draft_probs(0) is None


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
    assert _spec_config(None) is None and _spec_config("") is None
    assert _spec_config("self:4") == SpeculativeConfig(method="self", draft_layers=4)
    cfg = SpeculativeConfig(num_speculative_tokens=2)
    assert _spec_config(cfg) is cfg
    assert _spec_config({"method": "ngram", "ngram_max": 6}) == SpeculativeConfig(ngram_max=6)
    with pytest.raises(InvalidRequestError):
        _spec_config("draft")


# ============================================================================= scheduler
class GrantK:
    """A controller that always grants ``k`` drafts (within each sequence's limit)."""

    def __init__(self, k: int):
        self.k = k
        self.calls: list[tuple[list[tuple[int, int]], int]] = []

    def plan(self, candidates, base_tokens):
        self.calls.append((list(candidates), base_tokens))
        return {sid: min(limit, self.k) for sid, limit in candidates if self.k > 0}


class SpecHarness:
    """A scheduler with a fake controller, a scripted proposer and a scripted verifier.

    ``propose(item) -> drafts`` (default: one 7 per slot) and ``accept(item) -> count``
    (default: all) decide each speculating sequence's step; the final token is 7.
    After every step: block integrity, and every running sequence holds exactly the
    blocks of its computed tokens (no draft block outlives its step).
    """

    def __init__(self, num_blocks=64, block_size=4, max_num_seqs=8, budget=64, k=4, max_model_len=None,
                 prefix_cache=False):
        self.pool = BlockPool(num_blocks, block_size)
        self.cache = PrefixCache(self.pool) if prefix_cache else None
        self.controller = GrantK(k)
        self.sched = Scheduler(SchedulerConfig(max_num_seqs, budget), self.pool, self.cache, self.controller,
                               max_model_len)
        self.ids = itertools.count()
        self.arrivals = itertools.count()
        self.seqs: list[Sequence] = []
        self.plans: list[StepPlan] = []
        self.updates = []
        self.finished: dict[tuple[str, int], str] = {}

    def add(self, request_id, prompt_len=8, max_tokens=8, n=1, num_speculative_tokens=None, prompt=None, **kw):
        kw.setdefault("ignore_eos", False)
        params = SamplingParams(n=n, max_tokens=max_tokens, temperature=0, **kw)
        arrival = next(self.arrivals)
        tokens = list(prompt) if prompt is not None else list(range(1, prompt_len + 1))

        def make(i):
            return Sequence(next(self.ids), request_id, i, list(tokens), params, max_tokens, frozenset([EOS]),
                            0, arrival, cache_namespace=CacheNamespace() if self.cache else None,
                            num_speculative_tokens=num_speculative_tokens)
        leader = make(0)
        leader.pending_fork = [make(i) for i in range(1, n)]
        self.seqs += [leader] + leader.pending_fork
        self.sched.add_sequence(leader)
        return leader

    def schedule(self, propose=None) -> StepPlan:
        plan = self.sched.schedule()
        bs = self.pool.block_size
        for s in plan.scheduled:
            if s.num_draft_slots:
                assert s.sample and s.num_tokens == 1, "drafts only for decoding sequences"
            # the real token and every draft slot land in blocks the sequence holds
            assert len(s.block_table) * bs >= s.context_len + s.num_draft_slots
            seq = self.sched._seqs[s.seq_id]
            assert s.block_table == seq.block_table
            drafts = propose(s) if propose else [7] * s.num_draft_slots
            assert len(drafts) <= s.num_draft_slots
            s.draft_token_ids = list(drafts)
        assert plan.num_tokens <= self.sched.config.max_num_batched_tokens
        self.plans.append(plan)
        return plan

    def finish_step(self, plan, accept=None, final=7):
        sampled, accepted = {}, {}
        for s in plan.scheduled:
            if not s.sample:
                continue
            count = accept(s) if accept else len(s.draft_token_ids)
            assert 0 <= count <= len(s.draft_token_ids)
            if s.draft_token_ids:
                accepted[s.seq_id] = [SampledToken(t) for t in s.draft_token_ids[:count]]
            sampled[s.seq_id] = SampledToken(final(s) if callable(final) else final)
        updates = self.sched.update(plan, StepResult(sampled, accepted))
        self.updates += updates
        for u in updates:
            assert u.num_draft_accepted <= u.num_draft_proposed
            assert len(u.new_token_ids) <= u.num_draft_accepted + 1
            if u.finish_reason:
                self.finished[(u.request_id, u.sibling_index)] = u.finish_reason
        self.check()
        return updates

    def step(self, propose=None, accept=None, final=7):
        return self.finish_step(self.schedule(propose), accept, final)

    def check(self, mid_step=False):
        """``mid_step``: between schedule and update, when draft slots are still reserved."""
        self.sched.check_integrity()
        for seq in self.seqs:
            if seq.status is SeqStatus.RUNNING:
                assert mid_step or len(seq.block_table) == self.pool.blocks_for_tokens(seq.num_computed_tokens), \
                    f"seq {seq.seq_id} holds {len(seq.block_table)} blocks for {seq.num_computed_tokens} tokens"
                assert seq.num_computed_tokens <= seq.num_tokens
                assert len(seq.output_token_ids) <= seq.max_tokens
            else:
                assert not seq.block_table

    def run(self, max_steps=1000, **kw):
        for _ in range(max_steps):
            if not self.sched.has_unfinished():
                assert self.pool.num_used_blocks == 0
                return
            self.step(**kw)
        raise AssertionError("did not finish")


def _decode_ready(h: SpecHarness, **add_kw) -> Sequence:
    seq = h.add("a", **add_kw)
    plan = h.schedule()
    assert plan.scheduled[0].num_draft_slots == 0            # a prefill chunk never speculates
    h.finish_step(plan)
    return seq


def test_draft_slots_reserved_with_blocks_then_released_on_rejection():
    h = SpecHarness(block_size=4, k=4)
    seq = _decode_ready(h, prompt_len=4, max_tokens=20)       # 4 prompt tokens computed, 1 output
    assert seq.num_computed_tokens == 4 and len(seq.block_table) == 1
    plan = h.schedule()
    item = plan.scheduled[0]
    # the real token at position 4 and drafts at 5..8: 9 positions, 3 blocks
    assert item.num_draft_slots == 4 and item.start_position == 4
    assert len(seq.block_table) == 3 and h.pool.num_used_blocks == 3
    h.finish_step(plan, accept=lambda s: 0)                  # every draft rejected
    assert seq.output_token_ids == [7, 7]
    assert seq.num_computed_tokens == 5
    assert len(seq.block_table) == 2 and h.pool.num_used_blocks == 2
    assert h.pool.num_free_blocks == h.pool.num_blocks - 2


def test_accepted_drafts_advance_computed_tokens():
    h = SpecHarness(block_size=4, k=3)
    seq = _decode_ready(h, prompt_len=4, max_tokens=20)
    updates = h.step(propose=lambda s: [11, 12, 13], accept=lambda s: 2, final=14)
    assert seq.output_token_ids == [7, 11, 12, 14]
    assert [u.new_token_ids for u in updates] == [[11, 12, 14]]
    assert (updates[0].num_draft_proposed, updates[0].num_draft_accepted) == (3, 2)
    assert seq.num_computed_tokens == seq.num_tokens - 1 == 7
    h.step(accept=lambda s: 3)                               # all accepted: 4 more tokens
    assert seq.num_computed_tokens == seq.num_tokens - 1 == 11 and len(seq.output_token_ids) == 8


def test_fewer_drafts_than_slots_and_none_at_all():
    h = SpecHarness(block_size=4, k=6)
    seq = _decode_ready(h, prompt_len=4, max_tokens=30)
    h.step(propose=lambda s: [])                             # the proposer found nothing
    assert len(seq.output_token_ids) == 2 and len(seq.block_table) == 2
    h.step(propose=lambda s: [5, 5])
    assert len(seq.output_token_ids) == 5
    assert h.updates[-1].num_draft_proposed == 2


def test_per_sequence_num_speculative_tokens():
    h = SpecHarness(k=4)
    off = h.add("off", max_tokens=10, num_speculative_tokens=0)
    two = h.add("two", max_tokens=10, num_speculative_tokens=2)
    default = h.add("default", max_tokens=10)
    h.step()
    plan = h.schedule()
    slots = {s.seq_id: s.num_draft_slots for s in plan.scheduled}
    assert slots == {off.seq_id: 0, two.seq_id: 2, default.seq_id: 4}
    candidates = dict(h.controller.calls[-1][0])
    assert off.seq_id not in candidates and candidates[two.seq_id] == 2
    h.finish_step(plan)
    h.run()
    assert all(len(s.output_token_ids) == 10 for s in (off, two, default))


def test_max_tokens_never_exceeded_by_accepted_drafts():
    h = SpecHarness(k=8)
    seqs = [h.add(f"r{i}", prompt_len=5, max_tokens=m) for i, m in enumerate((1, 2, 3, 6, 13))]
    while h.sched.has_unfinished():
        plan = h.schedule()
        for s in plan.scheduled:
            seq = h.sched._seqs[s.seq_id]
            assert len(seq.output_token_ids) + s.num_draft_slots + 1 <= seq.max_tokens or not s.sample
        h.finish_step(plan)                                  # everything accepted
    assert [len(s.output_token_ids) for s in seqs] == [1, 2, 3, 6, 13]
    assert all(s.finish_reason is FinishReason.LENGTH for s in seqs)
    assert h.pool.num_free_blocks == h.pool.num_blocks


def test_drafts_never_run_past_the_context():
    h = SpecHarness(k=8, max_model_len=12)
    seq = h.add("a", prompt_len=6, max_tokens=6)             # exactly fills the context
    while h.sched.has_unfinished():
        plan = h.schedule()
        for s in plan.scheduled:
            assert s.context_len + s.num_draft_slots <= 12
        h.finish_step(plan)
    assert seq.num_tokens == 12


def test_stop_token_inside_accepted_drafts_ends_the_sequence_there():
    h = SpecHarness(block_size=4, k=4)
    seq = _decode_ready(h, prompt_len=4, max_tokens=20)
    updates = h.step(propose=lambda s: [7, EOS, 8, 9], accept=lambda s: 4, final=10)
    assert seq.output_token_ids == [7, 7, EOS]
    assert updates[0].new_token_ids == [7, EOS] and updates[0].finish_reason == "stop"
    assert (updates[0].num_draft_proposed, updates[0].num_draft_accepted) == (4, 4)
    assert seq.is_finished and not seq.block_table
    assert h.pool.num_free_blocks == h.pool.num_blocks


def test_stop_token_ids_and_ignore_eos_and_min_tokens_with_drafts():
    h = SpecHarness(block_size=4, k=4)
    stop = h.add("stop", max_tokens=20, stop_token_ids=[42])
    ignore = h.add("ignore", max_tokens=20, ignore_eos=True)
    early = h.add("min", max_tokens=20, min_tokens=3)
    h.step()                                                 # prefill: one token each
    h.step(propose=lambda s: [5, 42, EOS, 6], accept=lambda s: 4)
    assert stop.output_token_ids == [7, 5, 42] and stop.finish_reason is FinishReason.STOP
    assert ignore.output_token_ids == [7, 5, 42, EOS, 6, 7] and not ignore.is_finished
    # min_tokens: EOS as the 3rd output token is allowed (len >= min_tokens when checked)
    assert early.output_token_ids == [7, 5, 42, EOS] and early.finish_reason is FinishReason.STOP
    h.run()


def test_abort_mid_speculation_frees_draft_blocks():
    h = SpecHarness(block_size=4, k=4)
    _decode_ready(h, prompt_len=4, max_tokens=20)
    b = h.add("b", prompt_len=4, max_tokens=20)
    h.step()
    plan = h.schedule()
    assert all(s.num_draft_slots == 4 for s in plan.scheduled)
    h.sched.abort_request("a")                               # between schedule and update
    h.check(mid_step=True)
    h.finish_step(plan, accept=lambda s: 1)
    assert len(b.output_token_ids) == 3
    h.sched.abort_request("b")
    h.check()
    assert h.pool.num_free_blocks == h.pool.num_blocks
    assert not h.sched.has_unfinished()


def test_stop_string_finish_between_schedule_and_update():
    h = SpecHarness(block_size=4, k=4)
    seq = _decode_ready(h, prompt_len=4, max_tokens=20)
    plan = h.schedule()
    h.sched.finish_sequence(seq.seq_id, FinishReason.STOP)
    h.check(mid_step=True)
    h.finish_step(plan)
    assert seq.output_token_ids == [7]
    assert h.pool.num_free_blocks == h.pool.num_blocks


def test_drafts_never_preempt_anyone():
    # 5 blocks of 4: a holds 2 (prompt 6 + 1 output), b holds 2, one block free
    h = SpecHarness(num_blocks=5, block_size=4, k=8)
    a = h.add("a", prompt_len=6, max_tokens=30)
    b = h.add("b", prompt_len=6, max_tokens=30)
    h.step()
    plan = h.schedule()
    assert not plan.preempted_seq_ids
    slots = {s.seq_id: s.num_draft_slots for s in plan.scheduled}
    # a: the real token at 6, drafts up to the end of its blocks plus the free one (positions 7..11)
    assert slots[a.seq_id] == 5
    assert slots[b.seq_id] == 1                              # b: only its own block's slack is left
    assert h.pool.num_free_blocks == 0
    h.finish_step(plan, accept=lambda s: 0)
    assert a.status is SeqStatus.RUNNING and b.status is SeqStatus.RUNNING
    assert h.pool.num_free_blocks == 1


def test_draft_slots_capped_by_the_leftover_token_budget():
    h = SpecHarness(k=8, budget=10)
    h.add("a", prompt_len=4, max_tokens=30)
    h.add("b", prompt_len=4, max_tokens=30)
    h.step()                                                 # prefills: 8 of 10 tokens
    plan = h.schedule()
    assert sum(s.num_tokens + s.num_draft_slots for s in plan.scheduled) == 10
    h.finish_step(plan)


@pytest.mark.parametrize("prefix_cache", [False, True])
@pytest.mark.parametrize("seed", range(8))
def test_bursts_of_rejections_aborts_and_preemptions_keep_integrity(prefix_cache, seed):
    """Random proposals, acceptance counts and stop tokens on a tight pool; some
    requests are aborted mid-speculation. Every step: free + used == total, ref
    counts match the block tables, no draft block outlives its step."""
    rng = random.Random(seed)
    h = SpecHarness(num_blocks=20, block_size=4, max_num_seqs=6, budget=48, k=6, prefix_cache=prefix_cache)
    requests = {}
    for i in range(14):
        prompt = [rng.randrange(1, 6) for _ in range(rng.randrange(2, 14))]   # small vocab: cache hits
        n = 2 if i % 5 == 4 else 1
        requests[f"r{i}"] = h.add(f"r{i}", prompt=prompt, max_tokens=rng.randrange(4, 40), n=n,
                                  ignore_eos=i % 3 == 0, num_speculative_tokens=rng.choice([None, None, 0, 2]))
    aborted = set()
    for step in range(2000):
        if not h.sched.has_unfinished():
            break
        plan = h.schedule(propose=lambda s: [rng.choice([1, 2, 3, EOS if rng.random() < 0.05 else 4])
                                             for _ in range(rng.randrange(0, s.num_draft_slots + 1))])
        if step % 7 == 3:                                    # an abort between schedule and update
            live = [rid for rid, seq in requests.items() if not seq.is_finished and rid not in aborted]
            if live:
                victim = rng.choice(live)
                aborted.add(victim)
                h.sched.abort_request(victim)
                h.check(mid_step=True)
        h.finish_step(plan, accept=lambda s: rng.choice([0, 0, len(s.draft_token_ids),
                                                         rng.randrange(len(s.draft_token_ids) + 1)]),
                      final=lambda s: EOS if rng.random() < 0.03 else rng.randrange(1, 6))
    else:
        raise AssertionError("did not finish")
    assert h.sched.num_preemptions > 0, "the pool was meant to force preemption"
    assert sum(len(p.scheduled) for p in h.plans) > 0
    assert any(u.num_draft_accepted for u in h.updates) and any(
        u.num_draft_accepted < u.num_draft_proposed for u in h.updates)
    assert h.pool.num_used_blocks == 0
    for seq in h.seqs:
        assert seq.is_finished
        assert len(seq.output_token_ids) <= seq.max_tokens
        if seq.finish_reason is FinishReason.STOP:
            assert seq.output_token_ids[-1] == EOS and EOS not in seq.output_token_ids[:-1]
        if seq.finish_reason is FinishReason.LENGTH:
            assert len(seq.output_token_ids) == seq.max_tokens
    print(f"seed {seed} cache {prefix_cache}: {len(h.plans)} steps, {h.sched.num_preemptions} preemptions, "
          f"{sum(u.num_draft_proposed for u in h.updates)} drafts, "
          f"{sum(u.num_draft_accepted for u in h.updates)} accepted")
