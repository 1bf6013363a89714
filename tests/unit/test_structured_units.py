"""Tier 1: the constraint seam with the real xgrammar backend on a tiny vocabulary (no model):
matcher lifecycle, masks for lookahead rows and their rollback, rebuild after a mismatch,
the sampler's grammar mask, the verifier rejecting drafts the grammar forbids, the
compile cache and its errors, and vocabulary-type detection."""
from __future__ import annotations

import json

import pytest
import torch

from kvserve.engine.constraint import ConstraintTracker, NullConstraints
from kvserve.engine.lookahead import LookaheadGroup
from kvserve.engine.step import ScheduledSeq
from kvserve.engine.structured_spec import StructuredKind, StructuredSpec
from kvserve.errors import InvalidRequestError
from kvserve.sampling import Sampler, SamplingParams
from kvserve.sampling.sampler import process_logits
from kvserve.speculative.verify import Verifier
from kvserve.structured.backend import XGrammarBackend, unpack_bitmask
from kvserve.structured.vocab import tokenizer_info, vocab_type

from tests.support.sampler_rows import _one_thread, row  # noqa: F401  (autouse fixture)

# A byte-level vocabulary: printable ASCII spells itself; "Ġ" is a space; 11 is EOS, 12 a chat marker.
TOKENS = ["{", "}", '"', "a", "b", ":", "1", "2", ",", "Ġ", "ab", "<eos>", "<|im_start|>", "[", "]", "c"]
A, B, AB, EOS, MARKER = 3, 4, 10, 11, 12
VOCAB = 20                      # the model's logits are wider than the tokenizer: ids 16..19 are padding


@pytest.fixture(scope="module")
def backend() -> XGrammarBackend:
    return XGrammarBackend(tokenizer_info(TOKENS, {EOS, MARKER}, {EOS}, VOCAB), VOCAB)


def choice(*values: str) -> StructuredSpec:
    return StructuredSpec(StructuredKind.CHOICE, json.dumps(list(values)))


def sched(seq_id: int, output: list[int], spec: StructuredSpec | None, drafts=()) -> ScheduledSeq:
    return ScheduledSeq(seq_id=seq_id, token_ids=[0], start_position=5, block_table=[0], sample=True,
                        params=SamplingParams(temperature=0), prompt_token_ids=[0, 1], output_token_ids=output,
                        eos_token_ids=frozenset({EOS}), sibling_index=0, structured=spec,
                        lookahead_token_ids=list(drafts))


def allowed_ids(mask_row: torch.Tensor) -> set[int]:
    return set(torch.nonzero(mask_row).flatten().tolist())


def test_masks_follow_the_output_and_allow_eos_only_where_the_grammar_ends(backend):
    tracker = ConstraintTracker(backend)
    spec = choice("ab", "ba")
    masks = tracker.masks([sched(1, [], spec)], "cpu")
    assert masks.rows == [0] and allowed_ids(masks.allowed[0]) == {A, B, AB}
    assert allowed_ids(tracker.masks([sched(1, [A], spec)], "cpu").allowed[0]) == {B}
    assert allowed_ids(tracker.masks([sched(1, [A, B], spec)], "cpu").allowed[0]) == {EOS}
    assert not tracker.is_terminated(1)
    assert tracker.masks([sched(1, [A, B, EOS], spec)], "cpu") is None    # EOS accepted: nothing to mask
    assert tracker.is_terminated(1)
    tracker.masks([], "cpu")
    assert tracker.num_matchers == 0                          # terminated matchers are released


def test_only_constrained_rows_get_masks_and_siblings_have_their_own_matchers(backend):
    tracker = ConstraintTracker(backend)
    spec = choice("ab", "ba")
    masks = tracker.masks([sched(1, [], None), sched(2, [A], spec), sched(3, [B], spec)], "cpu")
    assert masks.rows == [1, 2]
    assert allowed_ids(masks.allowed[0]) == {B} and allowed_ids(masks.allowed[1]) == {A}
    assert tracker.masks([sched(1, [], None)], "cpu") is None


def test_lookahead_rows_are_filled_after_each_draft_and_rolled_back(backend):
    tracker = ConstraintTracker(backend)
    spec = choice("ab", "ba")
    masks = tracker.masks([sched(1, [], spec, drafts=[A, B])], "cpu")
    assert masks.rows == [0, 1, 2]
    assert [allowed_ids(m) for m in masks.allowed] == [{A, B, AB}, {B}, {EOS}]
    # a draft the grammar rejects: its row forbids it, the rows after it are left free
    masks = tracker.masks([sched(1, [], spec, drafts=[A, A, B])], "cpu")
    assert masks.rows == [0, 1] and A not in allowed_ids(masks.allowed[1])
    # the drafts were rolled back: the matcher is still at the start
    assert allowed_ids(tracker.masks([sched(1, [], spec)], "cpu").allowed[0]) == {A, B, AB}


def test_a_matcher_out_of_step_is_rebuilt_by_replay(backend):
    tracker = ConstraintTracker(backend, idle_steps=2)
    spec = choice("ab", "ba")
    tracker.masks([sched(1, [A], spec)], "cpu")
    # the same seq id now shows another history (a restarted sequence): replayed from scratch
    assert allowed_ids(tracker.masks([sched(1, [B], spec)], "cpu").allowed[0]) == {A}
    for _ in range(4):                                         # idle: dropped, then rebuilt on need
        tracker.masks([], "cpu")
    assert tracker.num_matchers == 0
    assert allowed_ids(tracker.masks([sched(1, [B, A], spec)], "cpu").allowed[0]) == {EOS}


def test_grammar_mask_in_the_sampler_leaves_other_rows_untouched():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, VOCAB, generator=gen)
    logits[0, 7] = logits[2, 7] = 50.0                          # the unconstrained favourite
    allowed = torch.zeros(VOCAB, dtype=torch.bool)
    allowed[[A, B]] = True
    rows = [row(temperature=0), row(temperature=0), row(temperature=0)]
    rows[0].allowed = allowed
    out = process_logits(logits, rows)
    assert torch.equal(out[1:], logits[1:])
    assert set(torch.nonzero(torch.isfinite(out[0])).flatten().tolist()) == {A, B}
    tokens = Sampler(seed=0)(logits, rows).token_ids
    assert tokens[0] == max((A, B), key=lambda t: logits[0, t].item()) and tokens[2] == 7


def test_grammar_wins_over_min_tokens_when_only_eos_is_allowed():
    logits = torch.zeros(1, VOCAB)
    only_eos = torch.zeros(VOCAB, dtype=torch.bool)
    only_eos[EOS] = True
    r = row(eos={EOS}, temperature=0, min_tokens=5)
    r.allowed = only_eos
    assert Sampler(seed=0)(logits, [r]).token_ids == [EOS]


def test_verifier_rejects_a_draft_the_grammar_forbids(backend):
    tracker = ConstraintTracker(backend)
    spec = choice("ab", "ba")
    seq = sched(1, [], spec, drafts=[A, A])
    masks = tracker.masks([seq], "cpu")
    logits = torch.zeros(3, VOCAB)
    logits[:, A] = 10.0                                       # the model loves "a" everywhere
    logits[:, B] = 5.0
    rows = [row(temperature=0) for _ in range(3)]
    for i, r in zip(masks.rows, masks.allowed):
        rows[i].allowed = r
    samples, accepted, final = Verifier(Sampler(seed=0))(logits, rows, [LookaheadGroup(1, 0, [A, A])])
    assert [t.token_id for t in accepted[1]] == [A] and final[1].token_id == B


def test_compile_errors_name_the_field_and_compiles_are_cached(backend):
    with pytest.raises(InvalidRequestError) as err:
        backend.validate(StructuredSpec(StructuredKind.REGEX, "a(b"))
    assert err.value.param == "guided_regex"
    with pytest.raises(InvalidRequestError) as err:
        backend.validate(StructuredSpec(StructuredKind.GRAMMAR, "root ::= undefined_rule"))
    assert err.value.param == "guided_grammar"
    spec = StructuredSpec(StructuredKind.JSON_SCHEMA, json.dumps({"type": "object", "properties": {
        "a": {"type": "integer"}}, "required": ["a"]}))
    before = len(backend.grammars.compile_times_s)
    backend.validate(spec)
    backend.validate(spec)
    assert len(backend.grammars.compile_times_s) == before + 1
    with pytest.raises(InvalidRequestError):
        NullConstraints().validate(spec)


def test_special_tokens_are_never_allowed_as_text(backend):
    tracker = ConstraintTracker(backend)
    masks = tracker.masks([sched(1, [], StructuredSpec(StructuredKind.REGEX, ".+"))], "cpu")
    ids = allowed_ids(masks.allowed[0])
    assert MARKER not in ids and EOS not in ids and A in ids
    assert not ids & set(range(len(TOKENS), VOCAB))           # padding ids beyond the vocabulary


def test_unpack_bitmask_matches_the_bits():
    packed = torch.tensor([[0b101, -2**31]], dtype=torch.int32)
    assert torch.nonzero(unpack_bitmask(packed, 64)[0]).flatten().tolist() == [0, 2, 63]


def test_vocab_type_detection():
    import xgrammar as xgr
    assert vocab_type(["Ġthe", "a", "<0x0A>"]) == xgr.VocabType.BYTE_LEVEL
    assert vocab_type(["\u2581the", "a", "<0x0A>"]) == xgr.VocabType.BYTE_FALLBACK
