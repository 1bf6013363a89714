"""logit_bias (tier 1, no model): sampler maths, validation, protocol, codec, engine rule."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from kvserve.engine.admission import EngineLimits
from kvserve.engine.engine_core import EngineCore
from kvserve.engine.request import EngineRequest
from kvserve.errors import InvalidRequestError
from kvserve.sampling import (MAX_LOGIT_BIAS, Sampler, SamplingParams, apply_logit_bias,
                              process_logits)
from kvserve.ipc import codec
from kvserve.server import protocol
from kvserve.server.serving import check_logit_bias

from tests.support.sampler_rows import _one_thread, row  # noqa: F401  (autouse fixture)

INF = math.inf


def _logits(b: int, v: int, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(b, v, generator=torch.Generator().manual_seed(seed)) * scale


# ----------------------------------------------------------------- the sampler
def test_bias_is_added_exactly_and_only_where_asked():
    logits = _logits(4, 50)
    before = logits.clone()
    rows = [row(logit_bias={3: 2.5, 7: -1.0}), row(), row(logit_bias={}), row(logit_bias={0: 100, 49: -100})]
    out = apply_logit_bias(logits, rows)
    assert torch.equal(logits, before)                               # input untouched
    expected = logits.clone()
    expected[0, 3] += 2.5
    expected[0, 7] -= 1.0
    expected[3, 0] += 100
    expected[3, 49] -= 100
    assert torch.equal(out, expected)
    assert torch.equal(out[1], logits[1]) and torch.equal(out[2], logits[2])
    # No bias anywhere (None, {} or only zeros / out-of-vocabulary ids): the tensor itself.
    assert apply_logit_bias(logits, [row(), row(logit_bias={}), row(logit_bias={5: 0.0}),
                                     row(logit_bias={50: 10.0})]) is logits
    assert process_logits(logits, [row(logit_bias={})] * 4) is logits


def test_rows_without_bias_are_bit_for_bit_unchanged():
    logits = _logits(6, 300, seed=1)
    plain = [row(), row(output=[1, 2, 2], presence_penalty=0.5, repetition_penalty=1.3, prompt=[4]),
             row(output=[], eos={5}, min_tokens=2), row(temperature=0.0)]
    biased = [row(logit_bias={i: 50.0 for i in range(0, 300, 3)}),
              row(logit_bias={5: 100.0}, output=[1], frequency_penalty=1.0)]
    alone = process_logits(logits[:4], plain)
    mixed = process_logits(torch.cat([logits[:2], logits[4:5], logits[2:4], logits[5:6]]),
                           [plain[0], plain[1], biased[0], plain[2], plain[3], biased[1]])
    for a, m in ((0, 0), (1, 1), (2, 3), (3, 4)):
        assert torch.equal(mixed[m], alone[a])
    assert torch.equal(mixed[0], logits[0])
    # Sampling rows too: a biased neighbour does not change a seeded row's token.
    seeded = [row(seed=s, temperature=0.9, top_k=40) for s in range(8)]
    ref = Sampler()(logits[:1].repeat(8, 1), seeded).token_ids
    got = Sampler()(logits[:1].repeat(16, 1), [r for s in seeded for r in (s, row(logit_bias={0: 100}))]).token_ids
    assert got[0::2] == ref and set(got[1::2]) == {0}


def test_plus_100_forces_a_token_greedy_and_sampled():
    logits = _logits(1, 1000, seed=2)
    target = int(logits[0].argmin())                                  # the least likely token
    n = 400
    rows = ([row(temperature=0.0, logit_bias={target: 100.0})]
            + [row(temperature=1.5, seed=s, logit_bias={target: 100}) for s in range(n // 2)]
            + [row(temperature=1.0, top_p=0.9, top_k=50, min_p=0.1, logit_bias={target: 100.0})
               for _ in range(n // 2)])
    out = Sampler(seed=3)(logits.repeat(len(rows), 1), rows)
    assert set(out.token_ids) == {target}


def test_minus_100_bans_a_token_greedy_and_sampled():
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0, 0.0]])
    greedy = Sampler()(logits, [row(temperature=0.0, logit_bias={0: -100.0})]).token_ids
    assert greedy == [1]
    n = 3000
    out = Sampler(seed=4)(logits.repeat(n, 1), [row(temperature=2.0, logit_bias={0: -100, 2: -100.0})
                                                for _ in range(n)])
    assert not {0, 2} & set(out.token_ids)
    assert {1, 3, 4, 5} <= set(out.token_ids)
    # Without the bias token 0 is the most frequent draw.
    free = Sampler(seed=4)(logits.repeat(n, 1), [row(temperature=2.0) for _ in range(n)]).token_ids
    assert max(set(free), key=free.count) == 0


def test_bias_comes_before_the_penalties():
    logits = torch.tensor([[2.0, 1.0, -1.0, 0.5]])
    r = row(prompt=[0, 2], output=[3, 3], logit_bias={0: 2.0, 2: 1.5, 3: 1.0},
            repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    # token 0: (2 + 2) / 2; token 2: (-1 + 1.5) / 2 (now positive: divided);
    # token 3: (0.5 + 1) / 2 - 2 * 0.5 - 0.25.
    assert process_logits(logits, [r]).tolist() == [[2.0, 1.0, 0.25, -0.5]]
    # Greedy follows the processed logits: the penalty can undo a small bias.
    flip = torch.tensor([[0.0, 5.0, 4.0]])
    pick = Sampler()(flip, [row(output=[1, 1], temperature=0.0, logit_bias={1: 1.5}, frequency_penalty=2.0)])
    assert pick.token_ids == [2]


def test_min_tokens_mask_wins_over_a_positive_bias():
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.0]])                     # 3 = eos
    sampler = Sampler(seed=0)

    def greedy(n_out: int) -> int:
        r = row(output=[0] * n_out, eos={3}, min_tokens=2, temperature=0.0, logit_bias={3: 100.0})
        return sampler(logits, [r]).token_ids[0]
    assert [greedy(k) for k in range(4)] == [2, 2, 3, 3]
    sampled = sampler(logits.repeat(300, 1), [row(output=[0], eos={3}, min_tokens=2, logit_bias={3: 100.0})
                                              for _ in range(300)]).token_ids
    assert 3 not in sampled
    done = sampler(logits.repeat(50, 1), [row(output=[0, 0], eos={3}, min_tokens=2, logit_bias={3: 100.0})
                                          for _ in range(50)]).token_ids
    assert set(done) == {3}


def test_fully_masked_row_falls_back_to_its_biased_logits():
    logits = torch.tensor([[1.0, -INF, 3.0], [1.0, -INF, 3.0]])
    rows = [row(eos={0, 2}, min_tokens=1, temperature=0.0, logit_bias={0: 5.0, 1: 100.0}),
            row(eos={0, 2}, min_tokens=1, temperature=0.0)]
    processed = process_logits(logits, rows)
    assert processed.tolist() == [[6.0, -INF, 3.0], [1.0, -INF, 3.0]]
    assert Sampler()(logits, rows).token_ids == [0, 2]


def test_logprobs_stay_those_of_the_raw_distribution():
    logits = _logits(2, 100, seed=5)
    rows = [row(temperature=0.0, logprobs=3, logit_bias={10: 100.0}),
            row(seed=1, logprobs=2, logit_bias={11: 100.0, 12: -100.0})]
    out = Sampler()(logits, rows)
    assert out.token_ids == [10, 11]
    raw = torch.log_softmax(logits, dim=-1)
    for i, k in ((0, 3), (1, 2)):
        assert out.logprobs[i] == pytest.approx(raw[i, out.token_ids[i]].item(), abs=1e-6)
        assert [t for t, _ in out.top_logprobs[i]] == raw[i].topk(k).indices.tolist()


def test_bias_on_the_logits_device_dtype():
    logits = _logits(2, 20).to(torch.float64)
    out = apply_logit_bias(logits, [row(logit_bias={1: 1.25}), row()])
    assert out.dtype == torch.float64 and out[0, 1].item() == logits[0, 1].item() + 1.25


# ------------------------------------------------------------------ validation
@pytest.mark.parametrize("bias", [
    [1, 2], "x", {"5": 1.0}, {-1: 1.0}, {True: 1.0}, {1.0: 1.0}, {5: "1"}, {5: True}, {5: None},
    {5: 100.5}, {5: -100.01}, {5: math.nan}, {5: math.inf}, {5: -math.inf},
    {i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)},
])
def test_invalid_logit_bias_is_rejected_by_name(bias):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(logit_bias=bias).validate()
    assert info.value.param == "logit_bias"


def test_valid_logit_bias_and_clone():
    for bias in (None, {}, {0: 100, 5: -100.0, 2**40: 0.0}, {i: 1.0 for i in range(MAX_LOGIT_BIAS)}):
        SamplingParams(logit_bias=bias).validate()
    p = SamplingParams(logit_bias={1: 2.0})
    q = p.clone()
    q.logit_bias[1] = 3.0
    assert p.logit_bias == {1: 2.0} and p.has_logit_bias and not SamplingParams(logit_bias={}).has_logit_bias


def _fake_engine(vocab: int) -> SimpleNamespace:
    return SimpleNamespace(asleep=None, limits=EngineLimits(max_model_len=1000, vocab_size=vocab, block_size=16,
                                                            num_blocks=100, kv_max_tokens=1600))


def test_engine_checks_the_vocabulary_bound():
    engine = _fake_engine(100)

    def validate(params):
        EngineCore.validate_request(engine, EngineRequest("r", [1, 2], params))
    validate(SamplingParams(logit_bias={99: 1.0}))
    with pytest.raises(InvalidRequestError) as info:
        validate(SamplingParams(logit_bias={3: 1.0, 100: 1.0}))
    assert info.value.param == "logit_bias"
    with pytest.raises(InvalidRequestError) as info:                  # validate() runs first
        validate(SamplingParams(logit_bias={3: 101.0}))
    assert info.value.param == "logit_bias"


# --------------------------------------------------------------- HTTP protocol
def test_protocol_maps_openai_logit_bias():
    spec = protocol.parse_completion({"prompt": "x", "logit_bias": {"50256": 100, "0": -100.0, "7": 0.5}})
    assert spec.params.logit_bias == {50256: 100.0, 0: -100.0, 7: 0.5}
    assert all(type(v) is float for v in spec.params.logit_bias.values())
    chat = protocol.parse_chat({"messages": [{"role": "user", "content": "x"}], "logit_bias": {"3": 1}})
    assert chat.params.logit_bias == {3: 1.0}
    for empty in ({}, None):
        assert protocol.parse_completion({"prompt": "x", "logit_bias": empty}).params.logit_bias is None
    many = {str(i): 1 for i in range(MAX_LOGIT_BIAS)}
    assert len(protocol.parse_completion({"prompt": "x", "logit_bias": many}).params.logit_bias) == MAX_LOGIT_BIAS


@pytest.mark.parametrize("bias", [
    [1], "5", 5, {"abc": 1}, {"-1": 1}, {"1.5": 1}, {"01": 1}, {" 1": 1}, {"1e3": 1}, {"": 1}, {"+1": 1},
    {"١": 1}, {"99999999999999999999": 1}, {"5": "1"}, {"5": True}, {"5": None}, {"5": 101},
    {"5": -100.5}, {"5": 1e400}, {"5": [1]}, {str(i): 1 for i in range(MAX_LOGIT_BIAS + 1)},
])
def test_protocol_rejects_bad_logit_bias_by_name(bias):
    for parse, body in ((protocol.parse_completion, {"prompt": "x"}),
                        (protocol.parse_chat, {"messages": [{"role": "user", "content": "x"}]})):
        with pytest.raises(InvalidRequestError) as info:
            parse({**body, "logit_bias": bias})
        assert info.value.param == "logit_bias" and info.value.code == "invalid_parameter"


def test_http_process_checks_the_vocabulary_before_submitting():
    info = SimpleNamespace(vocab_size=100)
    check_logit_bias(protocol.parse_completion({"prompt": "x", "logit_bias": {"99": 5}}), info)
    check_logit_bias(protocol.parse_completion({"prompt": "x"}), info)
    with pytest.raises(InvalidRequestError) as err:
        check_logit_bias(protocol.parse_completion({"prompt": "x", "logit_bias": {"100": 5}}), info)
    assert err.value.param == "logit_bias"


def test_codec_round_trips_int_keys():
    params = SamplingParams(max_tokens=3, logit_bias={50256: 100.0, 0: -100.0, 7: 0.5})
    message = EngineRequest("r", [1, 2], params, frozenset([2]))
    (decoded,) = codec.FrameBuffer().feed(codec.encode(message))
    assert decoded == message and decoded.params.logit_bias == {50256: 100.0, 0: -100.0, 7: 0.5}
    assert all(type(k) is int for k in decoded.params.logit_bias)
    decoded.params.validate()
