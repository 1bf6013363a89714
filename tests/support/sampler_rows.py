"""Helpers shared by the sampler's tier-1 tests: SamplingRow construction and a
one-thread torch fixture (exact, quick maths on a shared machine)."""
from __future__ import annotations

import pytest
import torch

from kvserve.sampling import SamplingParams, SamplingRow


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Import into a test module to run its tests with one torch thread."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def row(prompt=(), output=(), eos=frozenset(), seed_offset=0, **params) -> SamplingRow:
    """A SamplingRow from plain values and SamplingParams keyword arguments."""
    return SamplingRow(SamplingParams(**params), list(prompt), list(output), frozenset(eos), seed_offset)
