"""An engine beside a replica start (``fleetsim/start_contention.py``): the factors from the
timed runs and what the simulated host predicts for the same host; the measurement itself runs
the real engine (tests/model/test_start_contention.py)."""
from __future__ import annotations

import pytest

from kvserve.fleetsim.start_contention import StartContention


def _measured(beside_cpu=(1.1, 1.2, 1.15), beside_wall=(1.3, 1.25, 1.4), start_cpu=(6.0, 6.4)) -> StartContention:
    return StartContention(alone_wall_s=(1.0, 1.02, 0.98), alone_cpu_s=(1.0, 0.99, 1.01), beside_wall_s=beside_wall,
                           beside_cpu_s=beside_cpu, starts_wall_s=(8.0, 8.0), starts_cpu_s=start_cpu)


def test_the_factors_are_medians_and_the_start_cores_its_cpu_over_its_seconds():
    measured = _measured()
    assert measured.cpu_factor == pytest.approx(1.15 / 1.0)
    assert measured.wall_factor == pytest.approx(1.3 / 1.0)
    assert measured.start_cores == pytest.approx(12.4 / 16.0)


def test_the_model_gives_one_engine_beside_one_start_on_two_cores_only_the_cpu_factor():
    measured = _measured()
    assert measured.predicted_wall_factor(2, 1, with_cpu_factor=False) == pytest.approx(1.0)   # a core each
    assert measured.predicted_wall_factor(2, 1) == pytest.approx(1.15)
    # on one core the start takes its fair half (less than its 0.78 cores), the engine the rest
    assert measured.predicted_wall_factor(1, 1, with_cpu_factor=False) == pytest.approx(2.0)


def test_a_start_contention_survives_its_json():
    measured = _measured()
    figures = measured.as_dict(cores=2)
    assert StartContention.from_dict(figures) == measured
    assert figures["predicted_wall_factor"] == pytest.approx(1.15) and figures["predicted_wall_factor_cores_only"] == 1.0
    assert "predicted_wall_factor" not in measured.as_dict()
