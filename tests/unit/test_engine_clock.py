"""The engines' step clocks read through the cluster's /metrics, and the simulated host's record."""
import pytest

from kvserve.fleetsim.engine_clock import (ClockReading, ReplicaClock, clock_windows, cpu_per_step_ratios,
                                           measured_by_busy, parse_clocks, plane_reach, quiet_spans,
                                           simulated_by_busy, singles_path, span_clock, streamed_tokens,
                                           trace_clocks)
from kvserve.fleetsim.host_cpu import PlaneFit, SharedHost
from kvserve.fleetsim.log import RequestLog

METRICS = """# HELP kvserve_engine_step_seconds_total Wall seconds the engine's steps took.
# TYPE kvserve_engine_step_seconds_total counter
kvserve_engine_step_seconds_total{replica="a"} 10.0
kvserve_engine_step_seconds_total{replica="b"} 4.0
kvserve_engine_step_cpu_seconds_total{replica="a"} 9.5
kvserve_engine_step_cpu_seconds_total{replica="b"} 3.0
kvserve_engine_steps_total{replica="a"} 100
kvserve_engine_steps_total{replica="b"} 40
kvserve_time_to_first_token_seconds_bucket{replica="a",le="0.5"} 3
kvserve_time_to_first_token_seconds_sum{replica="a"} 1.5
kvserve_time_to_first_token_seconds_count{replica="a"} 6
kvserve_engine_steps_total{replica="f",deployment="fallback"} 9
kvserve_cluster_engine_step_seconds_total 14.0
kvserve_engine_steps_total_other{replica="a"} 7
"""


def test_each_replicas_clock_is_read_from_the_ingress_metrics():
    assert parse_clocks(METRICS) == {"a": ReplicaClock(10.0, 9.5, 100.0, 1.5, 6.0), "b": ReplicaClock(4.0, 3.0, 40.0)}


def reading(t, **replicas):
    return ClockReading(t, {name: ReplicaClock(*map(float, v)) for name, v in replicas.items()})


def test_windows_give_busy_share_cpu_share_cpu_per_step_and_first_tokens():
    readings = [reading(0.0, a=(0, 0, 0)), reading(2.0, a=(2.0, 1.9, 20, 0.6, 3)),       # a alone, busy
                reading(4.0, a=(4.0, 3.5, 40, 0.6, 3), b=(0, 0, 0)),                     # b appears
                reading(6.0, a=(6.0, 5.1, 60, 1.6, 5), b=(1.9, 1.5, 19, 0.5, 1))]        # both busy
    windows = clock_windows(readings)
    assert [(w["start"], w["replica"]) for w in windows] == [(0.0, "a"), (2.0, "a"), (4.0, "a"), (4.0, "b")]
    first = windows[0]
    assert first["busy"] == 1.0 and first["cpu_share"] == 0.95 and first["cpu_ms_per_step"] == 95.0
    assert first["first_tokens"] == 3 and first["replica_ttft_s"] == 0.2 and windows[1]["replica_ttft_s"] is None
    client = [(0.5, 0.3), (1.0, 0.3), (1.5, 0.3), (4.5, 0.9), (5.0, 0.7), (5.5, 0.8), (9.0, 5.0)]
    by_busy = measured_by_busy(windows, client)
    one, two = by_busy["1"], by_busy["2"]
    assert one["windows"] == 2 and one["busy_windows"] == 2 and one["cpu_share"] == pytest.approx(0.875)
    assert one["replica_ttft_s"] == 0.2 and one["client_ttft_s"] == 0.3 and one["path_s"] == pytest.approx(0.1)
    assert two["busy_windows"] == 2 and two["cpu_share"] == pytest.approx((0.8 + 1.5 / 1.9) / 2, abs=1e-3)
    assert two["replica_ttft_s"] == 0.5 and two["first_tokens"] == 3 and two["path_s"] == pytest.approx(0.3)


def test_an_idle_replica_is_not_a_busy_one():
    readings = [reading(0.0, a=(0, 0, 0), b=(0, 0, 0)), reading(2.0, a=(2.0, 1.9, 20), b=(0.2, 0.2, 2))]
    by_busy = measured_by_busy(clock_windows(readings))
    assert list(by_busy) == ["1"] and by_busy["1"]["busy_windows"] == 1 and by_busy["1"]["cpu_share"] == 0.95
    assert by_busy["1"]["replica_ttft_s"] is None and "path_s" not in by_busy["1"]
    idle = [reading(0.0, a=(1, 1, 1)), reading(2.0, a=(1, 1, 1))]
    assert clock_windows(idle)[0]["cpu_share"] is None
    assert measured_by_busy(clock_windows(idle))["0"]["cpu_share"] is None


def test_the_simulated_host_records_each_steps_cores_and_contention():
    record = []
    host = SharedHost(2, 1, PlaneFit(0.2, 0.004), start_cores=0.8, contention=1.05, record=record)
    host.busy("a", 100.0)
    alone = host.step_factor(0.0, 0.06)
    host.busy("b", 100.0)
    both = host.step_factor(1.0, 0.08)
    assert record[0] == (0.0, 1, alone, alone, 0, 0.06) and alone == pytest.approx(1.0)
    _, busy, cores, factor, _, _ = record[1]
    assert busy == 2 and cores > 1.0 and factor == pytest.approx(cores + 0.05)
    summary = simulated_by_busy(record)
    assert summary["1"] == {"cpu_share": 1.0, "cpu_per_step_factor": 1.0, "steps": 1, "cpu_ms_per_step": 60.0}
    assert summary["2"]["cpu_share"] == pytest.approx(1 / cores, abs=1e-3)
    assert summary["2"]["cpu_per_step_factor"] == pytest.approx(1 + 0.05 / cores, abs=1e-3)
    assert summary["2"]["cpu_ms_per_step"] == pytest.approx(80.0 * (1 + 0.05 / cores), abs=0.01)  # not the wall
    host.idle("b")
    host.starting("c")                              # a start takes its cores: the steps meanwhile apart
    starting = host.step_factor(2.0, 0.06)
    assert record[2][4] == 1 and starting > alone
    assert simulated_by_busy(record)["1 + a start"]["cpu_share"] == pytest.approx(1 / starting, abs=1e-3)


def test_a_start_contention_slows_the_steps_only_while_a_replica_starts():
    plain = SharedHost(2, 1, PlaneFit(0.0, 0.0), start_cores=0.8)
    slowed = SharedHost(2, 1, PlaneFit(0.0, 0.0), start_cores=0.8, start_contention=1.3, record=(record := []))
    for host in (plain, slowed):
        host.busy("a", 100.0)
    assert slowed.step_factor(0.0) == plain.step_factor(0.0) == pytest.approx(1.0)   # nothing starts
    for host in (plain, slowed):
        host.starting("b")
    assert slowed.step_factor(1.0) == pytest.approx(1.3 * plain.step_factor(1.0))
    summary = simulated_by_busy(record)                         # CPU per step, not the cores' share
    assert summary["1 + a start"]["cpu_per_step_factor"] == pytest.approx(1.3, abs=1e-3)
    assert summary["1 + a start"]["cpu_share"] == summary["1"]["cpu_share"]
    slowed.start_ended("b")
    assert slowed.step_factor(2.0) == pytest.approx(1.0)
    assert SharedHost(2, 1, PlaneFit(0.0, 0.0), start_contention=0.9).start_contention == 1.0   # never faster


def test_the_cpu_per_step_is_set_measured_over_simulated_where_both_sides_have_the_group():
    measured = {"0": {"cpu_ms_per_step": None}, "1": {"cpu_ms_per_step": 60.0},
                "1 + a start": {"cpu_ms_per_step": 90.0}, "2": {"cpu_ms_per_step": 80.0}}
    simulated = {"1": {"cpu_ms_per_step": 64.0}, "1 + a start": {"cpu_ms_per_step": 85.0}}
    assert cpu_per_step_ratios(measured, simulated) == {"1": 0.938, "1 + a start": 1.059}


def test_windows_that_overlap_a_start_are_grouped_apart():
    readings = [reading(0.0, a=(0, 0, 0)), reading(2.0, a=(2.0, 1.9, 20)), reading(4.0, a=(4.0, 3.2, 40)),
                reading(6.0, a=(6.0, 5.0, 60))]
    by_busy = measured_by_busy(clock_windows(readings), starts=[(2.5, 3.5)])
    assert by_busy["1"]["busy_windows"] == 2 and by_busy["1"]["cpu_share"] == pytest.approx(0.925)
    assert by_busy["1 + a start"]["busy_windows"] == 1 and by_busy["1 + a start"]["cpu_share"] == 0.65


def test_quiet_spans_hold_at_most_one_engines_busy_share_and_no_start():
    readings = [reading(0.0, a=(0, 0, 0), b=(0, 0, 0)), reading(2.0, a=(1.0, 1, 10), b=(0.6, 1, 6)),   # 0.8
                reading(4.0, a=(3.0, 2, 30), b=(1.0, 1, 10)),          # 1.2: two engines' worth
                reading(6.0, a=(3.5, 2, 35), b=(1.0, 1, 10)),          # 0.25, but a replica started
                reading(8.0, a=(5.5, 3, 55), b=(1.0, 1, 10))]          # 1.0
    assert quiet_spans(readings, starts=[(5.0, 5.5)]) == [(0.0, 2.0), (6.0, 8.0)]
    assert quiet_spans(readings, busy_at_most=1.5) == [(0.0, 2.0), (2.0, 4.0), (4.0, 6.0), (6.0, 8.0)]


def test_the_simulated_side_leaves_out_the_lead_in_before_the_trace():
    record = [(1.0, 1, 1.0, 1.0, 0, 0.010), (6.0, 1, 1.0, 1.0, 0, 0.060), (7.0, 2, 1.0, 1.2, 0, 0.060)]
    log = RequestLog([0.0], [0], [0], [8], [4])                 # no first token yet: the measured side is empty
    clocks = trace_clocks([], record, log, trace_from_s=5.0)
    assert clocks["simulated"]["1"] == {"cpu_share": 1.0, "cpu_per_step_factor": 1.0, "steps": 1, "cpu_ms_per_step": 60.0}
    assert trace_clocks([], record, log)["simulated"]["1"]["steps"] == 2


def test_streamed_tokens_spread_each_output_from_its_first_token_to_its_last():
    from kvserve.fleetsim.log import RequestLog
    log = RequestLog([0.0, 0.0, 0.0], [0] * 3, [0] * 3, [8] * 3, [10, 4, 1])
    log.first_token_s, log.finish_s = [1.0, 2.0, 3.0], [3.0, float("nan"), 3.0]     # the second never finished
    assert streamed_tokens(log, 0.0, 2.0) == pytest.approx(5.0)
    assert streamed_tokens(log, 2.0, 4.0) == pytest.approx(6.0)                     # + the one-token answer
    assert streamed_tokens(log, 5.0, 6.0) == 0.0


def test_the_plane_reach_is_the_steps_time_off_cpu_over_what_the_plane_and_background_wanted():
    from kvserve.fleetsim.log import RequestLog
    plane = PlaneFit(background_cores=0.2, cpu_s_per_token=0.01)
    log = RequestLog([0.0], [0], [0], [8], [40])
    log.first_token_s, log.finish_s = [0.0], [4.0]                   # 10 tokens/s over [0, 4): 0.1 cores of plane
    readings = [reading(0.0, a=(0, 0, 0)), reading(2.0, a=(2.0, 1.7, 20)),         # busy, 0.85 of a core
                reading(4.0, a=(4.0, 3.4, 40), b=(0, 0, 0)),
                reading(6.0, a=(6.0, 4.9, 60), b=(2.0, 1.5, 20))]                  # two busy: not read
    # 0.3 s lost in each of two windows of 2 s of steps that met 0.3 cores of plane and background: 0.5
    assert plane_reach(readings, log, plane) == pytest.approx(0.5)
    assert plane_reach(readings[2:], log, plane) is None
    assert plane_reach(readings, log, plane, since=2.0) == pytest.approx(0.5)      # the second window alone
    assert plane_reach(readings, log, plane, since=4.0) is None
    host = SharedHost(2, 1, plane, reach=0.5)
    host.busy("a", 10.0)
    assert host.cores_factor() == pytest.approx((1 + 0.5 * 0.1) / (1 - 0.5 * 0.2))    # 0.857 of a core
    balanced = SharedHost(2, 1, plane)                # no reach: the cores add up, the engine runs alone
    balanced.busy("a", 10.0)
    assert balanced.cores_factor() == 1.0
    for name in ("a", "b"):                           # two busy on two cores: the larger of the two sharings
        host.busy(name, 10.0)
        balanced.busy(name, 10.0)
    assert balanced.cores_factor() == pytest.approx((1.1 + (1.1 ** 2 + 0.4) ** 0.5) / 2)      # 2 s = 2.2 + 0.2 / s
    assert host.cores_factor() == pytest.approx(max(balanced.cores_factor(), (1 + 0.5 * 0.2) / (1 - 0.5 * 0.2)))


def test_the_singles_path_is_their_client_ttft_less_the_replicas_once_all_of_them_and_no_more_counted():
    from kvserve.fleetsim.log import RequestLog
    log = RequestLog([0.0, 3.0, 6.0], [0] * 3, [0] * 3, [8] * 3, [4] * 3)
    log.first_token_s = [0.3, 3.4, 6.2]                   # client TTFTs 0.3, 0.4 (then a third request)
    readings = [reading(0.0, a=(0, 0, 0, 1.0, 2)), reading(2.0, a=(1, 1, 10, 1.25, 3)),
                reading(4.0, a=(2, 2, 20, 1.6, 4)), reading(7.0, a=(3, 3, 30, 1.75, 5))]
    assert singles_path(readings, log, 2) == pytest.approx(0.35 - 0.3)
    assert singles_path(readings[:2], log, 2) is None and singles_path([], log, 2) is None


def test_a_span_sums_every_replicas_steps_between_its_readings():
    readings = [reading(0.0, a=(1, 1, 10)), reading(1.0, a=(1.5, 1.4, 15)),
                reading(3.0, a=(3.0, 2.6, 30), b=(0.4, 0.3, 4)), reading(5.0, a=(3.0, 2.6, 30), b=(1.4, 1.1, 14))]
    span = span_clock(readings, 0.5)        # from the reading at 1.0 to the last; b counted from zero
    assert span["seconds"] == 4.0 and span["steps"] == 15 + 14 and span["busy"] == pytest.approx((1.5 + 1.4) / 4, abs=1e-3)
    assert span["cpu_share"] == pytest.approx((1.2 + 1.1) / 2.9, abs=1e-3)
    assert span["wall_ms_per_step"] == pytest.approx(1e3 * 2.9 / 29, abs=0.01)
    assert span["cpu_ms_per_step"] == pytest.approx(1e3 * 2.3 / 29, abs=0.01)
    singles = span_clock(readings, 0.0, 1.0)
    assert singles["steps"] == 5 and singles["cpu_share"] == pytest.approx(0.8)
    quiet = span_clock(readings, 3.0, 3.5)      # one reading: no span
    assert quiet is None
    idle = span_clock([reading(0.0, a=(1, 1, 1)), reading(2.0, a=(1, 1, 1))], 0.0)
    assert idle["steps"] == 0 and idle["busy"] == 0.0 and idle["wall_ms_per_step"] is None and idle["cpu_share"] is None
