"""Tier 1: the one decode-grouping rule (``kvserve.engine.decode_groups``), used by the model
runner to batch single-token sequences into attention kernels and by the planner's step-time
model (``kvserve.planner.simulate.step_work``)."""
from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.engine.decode_groups import decode_groups
from kvserve.planner.roofline import chunk_attention
from kvserve.planner.simulate import StepShape, step_work

RATIO, SLACK = 1.25, 4          # padded blocks <= 1.25 x real blocks + 4 x members


def _blocks(n: int, block_size: int) -> int:
    return -(-n // block_size)


def _padded_and_bound(lens: list[int], block_size: int) -> tuple[int, float]:
    real = sum(_blocks(n, block_size) for n in lens)
    return len(lens) * _blocks(max(lens), block_size), RATIO * real + SLACK * len(lens)


CONTEXTS = st.lists(st.one_of(st.integers(1, 64), st.integers(1, 5000)), max_size=80)
BLOCK_SIZES = st.sampled_from([1, 2, 16, 32])


@settings(max_examples=300, deadline=None)
@given(CONTEXTS, BLOCK_SIZES)
def test_every_index_once_sorted_within_bound_and_maximal(contexts, block_size):
    groups = decode_groups(contexts, block_size)
    assert sorted(i for g in groups for i in g) == list(range(len(contexts)))      # each index exactly once
    assert all(g for g in groups)
    lens = [[contexts[i] for i in g] for g in groups]
    flat = [n for group in lens for n in group]
    assert flat == sorted(contexts)                                                # sorted by length
    for k, group in enumerate(lens):
        padded, bound = _padded_and_bound(group, block_size)
        assert padded <= bound, (group, padded, bound)
        if k + 1 < len(lens):                   # a longer group starts only where merging would break it
            padded, bound = _padded_and_bound(group + [lens[k + 1][0]], block_size)
            assert padded > bound, (group, lens[k + 1][0], padded, bound)


def test_grouping_examples():
    assert decode_groups([], 16) == []
    assert decode_groups([5], 16) == [[0]]
    assert decode_groups([40, 3, 20], 16) == [[1, 2, 0]]              # 3 x 3 blocks <= 1.25 x 6 + 12
    # 20 short (1 block each) and one long (80 blocks): padding the short ones to 80 blocks
    # would read 21 x 80 blocks for 100 real ones, so the long one gets its own kernel.
    assert decode_groups([1280] + [7] * 20, 16) == [list(range(1, 21)), [0]]


def _expected_decode_parts(contexts: list[int], block_size: int) -> list[tuple[float, float]]:
    """(KV tokens read, pairs) per decode kernel, from decode_groups: each group reads its
    members' KV padded to its longest member, in whole blocks."""
    parts = []
    for g in decode_groups(contexts, block_size):
        kv = len(g) * _blocks(max(contexts[i] for i in g), block_size) * block_size
        parts.append((float(kv), float(kv)))
    return parts


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 5000), min_size=1, max_size=80), BLOCK_SIZES)
def test_planner_step_work_decode_parts_come_from_decode_groups(contexts, block_size):
    shape = StepShape(tuple((n - 1, 1) for n in contexts), len(contexts))          # single-token chunks
    work = step_work(shape, "padded", block_size)
    assert list(work.attn) == _expected_decode_parts(contexts, block_size)
    assert work.num_tokens == len(contexts) and work.num_seqs == len(contexts)
    summed = step_work(shape, "sum", block_size)
    assert list(summed.attn) == [(float(sum(contexts)), float(sum(contexts)))]


def test_planner_step_work_with_prefill_chunks_between_the_decodes():
    rng = random.Random(11)
    for _ in range(50):
        chunks = [(rng.randint(0, 3000), 1) if rng.random() < 0.7 else (rng.randint(0, 500), rng.randint(2, 300))
                  for _ in range(rng.randint(1, 40))]
        work = step_work(StepShape(tuple(chunks), 3), "padded", 16)
        decode_ctx = [start + n for start, n in chunks if n == 1]
        expected = _expected_decode_parts(decode_ctx, 16) if decode_ctx else []
        expected += [chunk_attention(start, n, "padded") for start, n in chunks if n > 1]
        assert list(work.attn) == expected
        assert work.num_tokens == sum(n for _, n in chunks)
