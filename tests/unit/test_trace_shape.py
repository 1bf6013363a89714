"""The cluster check's requests sized to the host (``fleetsim/trace_shape.py``): a fast host keeps
the reference lengths, a slow one shortens them until a request costs a replica what it cost on
the host the check was set on, and the trace then holds as many requests."""
from __future__ import annotations

import pytest

from benchmarks.fleet_sim_cluster import load_rates, trace_requests
from kvserve.fleetsim.host_fit import probe_trace
from kvserve.fleetsim.trace_shape import (MIN_SCALE, REFERENCE_LENGTHS, REFERENCE_REQUESTS_PER_S, SINGLES_GAP_S,
                                          TraceShape, shape_for_host)

PHASES = [(20.0, 0.25), (40.0, 0.8), (40.0, 0.2)]
TARGET_S = 1.0 / REFERENCE_REQUESTS_PER_S


def linear_cost(prefill_tokens_per_s: float, decode_tokens_per_s: float):
    """A replica's cost of a request at a capacity that does not depend on the lengths."""
    return lambda prompt, output: prompt / prefill_tokens_per_s + output / decode_tokens_per_s


def test_a_host_as_fast_as_the_reference_or_faster_keeps_the_reference_lengths():
    for speedup in (1.0, 1.3, 4.0):
        shape = shape_for_host(linear_cost(400.0 * speedup, 80.0 * speedup))
        assert (shape.prompt_tokens, shape.output_tokens) == REFERENCE_LENGTHS and shape.scale == 1.0
        assert shape.seconds_per_request <= TARGET_S * 1.02


def test_the_avx2_host_gets_requests_a_third_as_long_and_the_trace_as_many():
    # its replica was planned at 144.8 prefill / 27.6 decode tokens/s for 128 / 24 tokens: 1.75 s a
    # request, 0.57 a second, and the check's trace held 22-33 requests (the skip)
    cost = linear_cost(144.8, 27.6)
    reference = TraceShape(*REFERENCE_LENGTHS, 1.0, cost(*REFERENCE_LENGTHS))
    assert trace_requests(PHASES, reference) < 50
    shape = shape_for_host(cost)
    assert 0.3 <= shape.scale <= 0.4 and shape.seconds_per_request == pytest.approx(TARGET_S, rel=0.05)
    assert (shape.prompt_tokens, shape.output_tokens) == (round(128 * shape.scale), round(24 * shape.scale))
    assert trace_requests(PHASES, shape) == pytest.approx(45.0 * REFERENCE_REQUESTS_PER_S, rel=0.05)
    assert [rate for _, rate in load_rates(PHASES, shape)] == pytest.approx(
        [load / shape.seconds_per_request for _, load in PHASES])


def test_a_cost_not_proportional_to_the_lengths_settles_on_the_target():
    # a step's fixed cost makes a short request cost more per token: one proportional step undershoots
    def cost(prompt: int, output: int) -> float:
        return 0.15 + prompt / 150.0 + output / 30.0
    shape = shape_for_host(cost)
    assert shape.scale < 0.4 and shape.seconds_per_request == pytest.approx(TARGET_S, rel=0.05)


def test_a_host_too_slow_stops_at_the_smallest_scale_and_says_what_a_request_costs():
    cost = linear_cost(20.0, 4.0)
    shape = shape_for_host(cost)
    assert shape.scale == MIN_SCALE and shape.seconds_per_request == pytest.approx(cost(32, 6))
    assert shape.seconds_per_request > 2 * TARGET_S and trace_requests(PHASES, shape) < 50


def test_the_probe_is_sized_with_the_trace():
    shape = shape_for_host(linear_cost(144.8, 27.6))
    assert shape.singles_gap_s == pytest.approx(SINGLES_GAP_S / shape.scale)
    probe = probe_trace(batch=10, batch_gap_s=0.25, prompt_tokens=shape.prompt_tokens,
                        output_tokens=shape.output_tokens, gap_s=shape.singles_gap_s)
    assert list(probe.output) == [shape.output_tokens] * 14 and list(probe.prompt[4:]) == [shape.prompt_tokens] * 10
    assert probe.arrival[1] - probe.arrival[0] == pytest.approx(shape.singles_gap_s)
    assert shape.as_dict() == {"prompt_tokens": shape.prompt_tokens, "output_tokens": shape.output_tokens,
                               "scale": round(shape.scale, 3),
                               "seconds_per_request": round(shape.seconds_per_request, 4)}
