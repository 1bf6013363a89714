"""Tier 1: the ghost-text workload's pure parts (kvserve/loadgen/ghost.py, ghost_report.py):
Server-Timing parsing, the keystroke schedule, prompt windows, request bodies, summary maths."""
from __future__ import annotations

import random

import pytest

from kvserve.loadgen.ghost import (GhostConfig, default_ghost_file, keystroke_schedule, read_ghost_file,
                                   request_body, suffix_after, window_start)
from kvserve.loadgen.ghost_report import (GhostRecord, parse_server_timing, record_phases, summarize_ghost)


# ------------------------------------------------------------ Server-Timing
def test_server_timing_parses_the_servers_format():
    value = "queue;dur=12.3, prefill;dur=45.6, ttft;dur=57.9, total;dur=120.4"
    assert parse_server_timing(value) == {"queue": 12.3, "prefill": 45.6, "ttft": 57.9, "total": 120.4}


@pytest.mark.parametrize("value", [None, "", "  ", ","])
def test_server_timing_absent_is_empty(value):
    assert parse_server_timing(value) == {}


def test_server_timing_tolerates_desc_spaces_and_junk():
    value = 'queue ; desc="wait, then run" ; dur = 3, cache;desc=hit, prefill;dur=abc, total;DUR="9.5"'
    assert parse_server_timing(value) == {"queue": 3.0, "total": 9.5}


# ------------------------------------------------------------ typing model
TEXT = "".join(f"def f{i}(x):\n    return x + {i}\n\n" for i in range(200))


def test_schedule_is_deterministic_with_a_seed():
    config = GhostConfig(duration_s=10.0)
    a = keystroke_schedule(TEXT, config, random.Random(3))
    b = keystroke_schedule(TEXT, config, random.Random(3))
    c = keystroke_schedule(TEXT, config, random.Random(4))
    assert a == b and a != c


def test_schedule_speed_jitter_and_pauses():
    config = GhostConfig(duration_s=60.0, keystrokes_per_s=6.0, jitter=0.5, pause_prob=0.3, word_pause_prob=0.0,
                         pause_s=(0.5, 2.0))
    keys = keystroke_schedule(TEXT, config, random.Random(0))
    assert all(0 <= k.at_s < 60.0 for k in keys)
    gaps = [b.at_s - a.at_s for a, b in zip(keys, keys[1:])]
    plain = [g for k, g in zip(keys, gaps) if not k.pause_after]
    assert min(plain) >= 1 / 6 * 0.5 - 1e-9 and max(plain) <= 1 / 6 * 1.5 + 1e-9
    paused = [g for k, g in zip(keys, gaps) if k.pause_after]
    assert paused and min(paused) >= 0.5 and all(TEXT[k.cursor - 1] in "\n " or k.cursor == 0
                                                 for k in keys if k.pause_after)
    # typing pauses bring the rate below the plain speed, but not far
    assert 3.0 < len(keys) / 60.0 < 6.0


def test_word_pauses_follow_word_ends():
    config = GhostConfig(duration_s=60.0, pause_prob=0.0, word_pause_prob=0.5)
    keys = keystroke_schedule(TEXT, config, random.Random(2))
    paused = [k for k in keys if k.pause_after]
    assert paused and all(TEXT[k.cursor - 1] in " ([{.,:=" for k in paused)


def test_schedule_advances_one_char_and_auto_indents():
    config = GhostConfig(duration_s=30.0, pause_prob=0.0, word_pause_prob=0.0)
    keys = keystroke_schedule(TEXT, config, random.Random(1))
    for a, b in zip(keys, keys[1:]):
        if b.cursor < a.cursor:                               # wrapped at the end of the file
            continue
        typed = TEXT[a.cursor:b.cursor]
        assert len(typed) == 1 or (typed[0] == "\n" and not typed[1:].strip())


def test_prompt_windows_extend_each_other():
    text = read_ghost_file(default_ghost_file())
    config = GhostConfig(duration_s=40.0, context_chars=1500, window_slack=0.25)
    keys = keystroke_schedule(text, config, random.Random(5))
    start, prompts, moves = None, [], 0
    for key in keys:
        new = window_start(text, key.cursor, start, config.context_chars, config.window_slack)
        moves += start is not None and new != start
        start = new
        prompts.append(text[start:key.cursor])
        assert len(prompts[-1]) <= 1500 * 1.25 + 1
        assert start == 0 or text[start - 1] == "\n"              # windows begin at a line start
    extended = sum(b.startswith(a) for a, b in zip(prompts, prompts[1:]))
    assert extended >= len(prompts) - 1 - moves - 2 and moves < len(prompts) / 20
    assert min(len(p) for p in prompts[len(prompts) // 2:]) > 600


def test_window_near_the_file_start_is_the_whole_prefix():
    assert window_start(TEXT, 100, None, 1500, 0.25) == 0
    assert window_start(TEXT, 5000, None, 1500, 0.25) >= 3500


def test_suffix_and_body():
    cursor = TEXT.index("return x + 1")
    assert suffix_after(TEXT, cursor, 0) == ""
    assert suffix_after(TEXT, cursor, 10) == "\ndef f2(x)"
    config = GhostConfig(service_tier=None, max_tokens=4)
    body = request_body(config, None, "abc", "")
    assert body == {"prompt": "abc", "max_tokens": 4, "temperature": 0.0, "stream": False}
    body = request_body(GhostConfig(), "m", "abc", "xyz")
    assert body["service_tier"] == "priority" and body["suffix"] == "xyz" and body["model"] == "m"


def test_config_limits_max_tokens():
    with pytest.raises(ValueError):
        GhostConfig(max_tokens=17)


# ------------------------------------------------------------ summary maths
def _done(seq, start, e2e_ms, timing=None, prompt=100, cached=50, tokens=8, gap=None):
    return GhostRecord(0, seq, start, start + e2e_ms / 1000, prompt_tokens=prompt, cached_tokens=cached,
                       completion_tokens=tokens, server_timing=timing or {}, gap_s=gap)


def test_phases_of_one_request():
    r = _done(0, 1.0, 150, {"queue": 10, "prefill": 40, "ttft": 60, "total": 130})
    assert record_phases(r) == pytest.approx({"queue": 10, "prefill": 40, "decode": 70, "client_overhead": 20})
    assert record_phases(_done(1, 1.0, 150)) == {}


def test_summary_on_hand_made_records():
    timing = {"queue": 10.0, "prefill": 40.0, "ttft": 60.0, "total": 130.0}
    records = [
        _done(0, 0.0, 150, timing, prompt=100, cached=0, gap=0.5),
        _done(1, 0.5, 250, dict(timing, total=230.0), prompt=100, cached=80, tokens=16, gap=0.5),
        _done(2, 1.0, 100, None, prompt=200, cached=120, gap=0.5),     # no Server-Timing
        GhostRecord(0, 3, 1.5, 1.6, cancelled=True, gap_s=0.1),      # cut short by the typist
        GhostRecord(0, 4, 1.6, 1.7, cancelled=True, gap_s=0.3),      # waited for, too slow
        GhostRecord(0, 5, 1.7, 2.0, error="http_400"),
    ]
    s = summarize_ghost(records, budget_ms=200.0)
    assert (s["num_requests"], s["num_completed"], s["num_cancelled"], s["num_errors"]) == (6, 3, 2, 1)
    assert s["duration_s"] == pytest.approx(2.0)
    assert s["cancellations_per_s"] == pytest.approx(1.0)
    assert s["e2e_ms"]["p50"] == pytest.approx(150) and s["e2e_ms"]["count"] == 3
    assert s["e2e_ms_outputs_le_8"]["count"] == 2 and s["e2e_ms_outputs_le_16"]["count"] == 3
    assert s["ttft_ms"] == {"count": 0} and s["server_ttft_ms"]["mean"] == pytest.approx(60)
    assert s["goodput"]["fraction"] == pytest.approx(2 / 3)
    assert s["goodput"]["num_waited"] == 5 and s["goodput"]["fraction_of_waited"] == pytest.approx(2 / 5)
    assert s["cached_token_fraction"] == pytest.approx(200 / 400)
    budget = s["budget"]
    assert budget["server_timing_present"] == 2
    assert budget["queue"]["mean"] == pytest.approx(10) and budget["queue"]["mean_share_of_budget"] == 0.05
    assert budget["decode"]["mean"] == pytest.approx((70 + 170) / 2)
    assert budget["client_overhead"]["mean"] == pytest.approx(20) and budget["client_overhead"]["count"] == 2


def test_summary_of_nothing():
    s = summarize_ghost([])
    assert s["num_requests"] == 0 and s["goodput"]["fraction"] == 0.0 and s["cached_token_fraction"] is None
