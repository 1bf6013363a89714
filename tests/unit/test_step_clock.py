"""The engine's step clock: wall and CPU seconds of its steps, whose ratio is the host's share."""
import time

from kvserve.engine.step_time import StepClock


def test_a_busy_step_counts_its_cpu_and_a_waiting_one_only_its_wall():
    clock = StepClock()
    with clock:                                   # a step that computes: CPU close to its wall
        deadline = time.perf_counter() + 0.05
        while time.perf_counter() < deadline:
            pass
    assert clock.wall_s >= 0.05 and clock.cpu_s > 0.25 * clock.wall_s
    busy_cpu = clock.cpu_s
    with clock:                                   # a step that waits (a starved process): wall only
        time.sleep(0.1)
    assert clock.wall_s >= 0.15
    assert clock.cpu_s - busy_cpu < 0.02
    assert clock.cpu_s / clock.wall_s < 0.6


def test_a_step_that_raises_is_still_counted():
    clock = StepClock()
    try:
        with clock:
            time.sleep(0.01)
            raise RuntimeError("the step failed")
    except RuntimeError:
        pass
    assert clock.wall_s >= 0.01
