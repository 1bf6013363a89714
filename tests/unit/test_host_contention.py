"""The memory contention of two engines (``fleetsim/host_contention.py``): the factor from the
timed runs; the measurement itself runs the real engine (tests/model/test_host_contention.py)."""
from __future__ import annotations

import pytest

from kvserve.fleetsim.host_contention import Contention


def test_the_factor_is_the_median_beside_over_the_median_alone():
    c = Contention(alone_s=(1.0, 1.2, 0.9, 1.0), beside_s=(1.1, 1.15, 5.0), pinned=True)
    assert c.factor == pytest.approx(1.15 / 1.0)


def test_a_contention_survives_its_json():
    c = Contention(alone_s=(1.0, 1.01), beside_s=(1.05,), pinned=False)
    again = Contention.from_dict(c.as_dict())
    assert again == c and c.as_dict()["factor"] == pytest.approx(1.05 / 1.005, abs=1e-4)
