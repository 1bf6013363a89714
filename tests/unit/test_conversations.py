"""Tier 1: multi-turn conversations in the fleet simulator (``fleetsim/conversations.py``): how
turns are drawn, their prompt ids, a next turn served from the replica that ran the last one
(both replicas), the coalesced replica against the engine's cache on a day of conversations, and
closed-loop conversations (a turn waits for its previous answer)."""
from __future__ import annotations

import functools
from dataclasses import replace

import numpy as np
import pytest

from kvserve.fleetsim.cached_replica import PrefixCachingReplica
from kvserve.fleetsim.cli import load_scenario
from kvserve.fleetsim.conversations import add_conversations, conversation_of
from kvserve.fleetsim.fleet import FleetSim
from kvserve.fleetsim.log import DONE, RequestLog
from kvserve.fleetsim.prompt_ids import REPLY_ID, prompt_token_ids
from kvserve.fleetsim.replica import BatchReplica
from kvserve.fleetsim.run import prepare, run_policy
from kvserve.fleetsim.sched_replica import BLOCK_SIZE, SchedulerReplica
from kvserve.fleetsim.traffic import draw_requests

CHAT = load_scenario("examples/fleet_chat_scenario.json")
CACHING = {"scheduler": functools.partial(SchedulerReplica, prefix_cache=True), "batch": PrefixCachingReplica}


def test_a_follow_up_sends_the_conversation_so_far_then_its_message():
    log = RequestLog([0.0, 5.0, 40.0, 41.0, 90.0], [0] * 5, [0] * 5, [300, 200, 100, 50, 9000], [20, 30, 40, 10, 10],
                     [0, -1, -1, -1, -1], [200, 0, 0, 0, 0])
    log.prefix_group[1:] = [0, 0, 0, 0]
    log.prefix_len[1:] = [200] * 4
    log.prompt[1:] = [p + 200 for p in log.prompt[1:]]
    add_conversations(log, np.random.default_rng(0), turns=1e9, gap_s=30.0, requests=range(5), max_context=4096)
    # 1 (5 s) is too soon after 0; 2 (40 s) continues 0, 3 (41 s) continues 1, 4 would pass the context
    assert log.parent == [-1, -1, 0, 1, -1]
    assert log.prompt[2] == 300 + 20 + 100 and log.prompt[3] == 400 + 30 + 50 and log.prompt[4] == 9200
    assert conversation_of(log, 2) == 0 and conversation_of(log, 4) == 4
    ids = [prompt_token_ids(log, r) for r in range(4)]
    assert ids[2][:300] == ids[0] and ids[2][300:320] == [REPLY_ID] * 20 and len(ids[2]) == 420
    assert ids[2][:200] == ids[1][:200]                                         # the group's system prompt


def test_drawn_conversations_have_the_scenarios_turns_and_leave_the_arrivals_alone():
    plain = draw_requests(replace(CHAT, models=(replace(CHAT.models[0], turns=1.0),)))
    chat = draw_requests(CHAT)
    assert chat.arrival == plain.arrival and chat.output == plain.output
    follow_ups = np.asarray(chat.parent) >= 0
    settled = np.asarray(chat.arrival) >= 2 * CHAT.models[0].turn_gap_s     # no conversation is old enough before
    assert follow_ups[settled].mean() == pytest.approx(1 - 1 / CHAT.models[0].turns, abs=0.03)
    gaps = [chat.arrival[r] - chat.arrival[chat.parent[r]] for r in np.flatnonzero(follow_ups)]
    assert min(gaps) >= CHAT.models[0].turn_gap_s
    assert all(chat.prefix_group[r] == chat.prefix_group[chat.parent[r]] for r in np.flatnonzero(follow_ups))


@pytest.mark.parametrize("kind", ["scheduler", "batch"])
def test_a_next_turn_on_the_replica_of_the_last_one_starts_from_its_blocks(kind):
    """Turn 2 computes only what turn 1 did not leave in the cache: turn 1's prompt and output
    up to its last full block (the last output token's KV is never computed)."""
    log = RequestLog([1.0, 30.0], [0, 0], [0, 0], [1000, 1000 + 100 + 60], [100, 16], parent=[-1, 0])
    one = replace(CHAT, models=(replace(CHAT.models[0], prefix_groups=0, turns=1.0),), duration_s=60)
    run_policy(one, prepare(one), "always_on", CACHING[kind], log)
    assert log.cached_tokens == [0, (1000 + 100 - 1) // BLOCK_SIZE * BLOCK_SIZE]


@functools.lru_cache(maxsize=None)
def _chat(router: str, kind: str) -> dict:
    """A minute of the chat scenario (a pure function of its arguments: each run once)."""
    scenario = replace(CHAT, duration_s=60)
    report, arrays, _ = run_policy(scenario, prepare(scenario), "always_on", CACHING[kind], router=router)
    assert (arrays["status"] == DONE).all()
    return {"p50": report["p50_ttft_s"], "p99": report["p99_ttft_s"], "tpot": report["p50_tpot_s"],
            "share": arrays["cached_tokens"].sum() / arrays["prompt"].sum()}


@pytest.mark.parametrize("router", ["least_loaded", "kv_aware"])
def test_the_coalesced_replica_follows_the_engines_cache_on_conversations(router):
    fast, real = _chat(router, "batch"), _chat(router, "scheduler")
    assert fast["share"] == pytest.approx(real["share"], abs=0.05), (fast, real)
    for key in ("p50", "p99", "tpot"):
        assert fast[key] == pytest.approx(real[key], rel=0.2), (key, fast, real)


def test_the_kv_aware_router_keeps_a_conversation_where_its_history_is():
    spread, aware = _chat("least_loaded", "batch"), _chat("kv_aware", "batch")
    assert aware["share"] > spread["share"] + 0.1 and aware["p50"] < spread["p50"]


def _closed(scenario, closed_loop: bool = True, turns: float | None = None):
    model = scenario.models[0]
    return replace(scenario, models=(replace(model, closed_loop=closed_loop, turns=turns or model.turns),))


def test_a_closed_loop_turn_is_sent_the_gap_after_its_answer():
    log = RequestLog([1.0, 30.0], [0, 0], [0, 0], [1000, 1000 + 100 + 60], [100, 16], parent=[-1, 0])
    one = _closed(replace(CHAT, models=(replace(CHAT.models[0], prefix_groups=0),), duration_s=60))
    run_policy(one, prepare(one), "always_on", CACHING["batch"], log, router="kv_aware")
    gap = one.models[0].turn_gap_s
    assert log.arrival[0] == 1.0 and log.arrival[1] == log.finish_s[0] + gap > 30.0   # not at its drawn 30 s
    assert log.status == [DONE, DONE] and log.cached_tokens[1] == (1000 + 100 - 1) // BLOCK_SIZE * BLOCK_SIZE


def _one_replica(closed_loop: bool):
    """Two minutes of the chat scenario on one replica without a prefix cache (the always-on fleet
    has four): overloaded."""
    scenario = _closed(replace(CHAT, duration_s=120), closed_loop)
    prepared, log = prepare(scenario), draw_requests(scenario)
    drawn = list(log.arrival)
    FleetSim(scenario, "always_on", prepared.sizings, log, prepared.planned, prepared.peak_rps,
             prepared.initial_rps, initial_replicas=[1]).run()
    return log, drawn


def test_a_closed_loop_sends_later_turns_later_when_the_fleet_is_slow():
    (open_, drawn), (closed, same_drawn) = _one_replica(False), _one_replica(True)
    gap = CHAT.models[0].turn_gap_s
    assert drawn == same_drawn and open_.arrival == drawn and set(open_.status) == set(closed.status) == {DONE}
    follow_ups = [r for r in range(len(drawn)) if closed.parent[r] >= 0]
    assert all(closed.arrival[r] >= max(drawn[r], closed.finish_s[closed.parent[r]] + gap) for r in follow_ups)
    assert all(closed.arrival[r] == drawn[r] for r in range(len(drawn)) if closed.parent[r] < 0)
    too_soon = sum(open_.arrival[r] < open_.finish_s[open_.parent[r]] + gap for r in follow_ups)
    assert too_soon > len(follow_ups) / 2                # the open loop sends turns before the answer is read
    assert sum(closed.arrival[r] > drawn[r] for r in follow_ups) > len(follow_ups) / 2
    ttft = {name: np.median(np.subtract(log.first_token_s, log.arrival)) for name, log in
            (("open", open_), ("closed", closed))}
    assert ttft["closed"] < 0.9 * ttft["open"], ttft                 # the slower fleet sees less load
    again, _ = _one_replica(True)
    assert again.arrival == closed.arrival and again.finish_s == closed.finish_s     # deterministic


class _Recording(BatchReplica):
    """A replica without a prefix cache (so no cache events) that notes the requests it is given."""

    def __init__(self, name, sizing, log, served: dict):
        super().__init__(name, sizing, log)
        self.served = served

    def submit(self, request, now, prompt_ids=None):
        self.served[request] = self.name
        return super().submit(request, now, prompt_ids)


def _follow_ups_on_the_last_turns_replica(session_keys: bool) -> float:
    scenario = replace(CHAT, duration_s=90, models=(replace(CHAT.models[0], session_keys=session_keys),))
    log, served = draw_requests(scenario), {}
    run_policy(scenario, prepare(scenario), "always_on", functools.partial(_Recording, served=served), log,
               router="kv_aware")
    follow_ups = [r for r in range(len(log)) if log.parent[r] >= 0]
    return float(np.mean([served[r] == served[log.parent[r]] for r in follow_ups]))


def test_session_keys_keep_a_conversation_on_its_replica_when_no_cache_tells_the_router():
    """With ``session_keys`` each turn carries its conversation's ``prompt_cache_key``: the
    KV-aware router, hearing no cache events here, sends more next turns where the last one ran
    (the session term, worth 64 prompt tokens against the replicas' queued tokens: measured 55%
    against 29% without the key, about one in four replicas)."""
    without, keyed = _follow_ups_on_the_last_turns_replica(False), _follow_ups_on_the_last_turns_replica(True)
    assert without < 0.4 and keyed > without + 0.15, (without, keyed)
