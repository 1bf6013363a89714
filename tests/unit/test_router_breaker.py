"""Tier 1: circuit breakers in routing. The pure policies never choose a replica whose
breaker is open (``ReplicaState.breaker_open``); the ingress's board of breakers
(``ReplicaBreakers``) takes a failing replica out of routing, hands out one probe once
``open_s`` passed, and lets it back in only when the probe succeeds. Hand-moved clock."""
import pytest

from kvserve.cluster.breaker import BreakerState, ReplicaBreakers
from kvserve.engine.kv.cache_events import CacheNamespace
from kvserve.router import POLICIES, ReplicaState, RouteRequest, make_policy, request_block_hashes
from kvserve.router.policies import NoReplicaError

BS = 4
NS = CacheNamespace(cache_salt="tenant:alice")
PROMPT = tuple(range(100, 132))                   # 8 full blocks


def _states(blocked=(), names=("a", "b", "c")):
    return [ReplicaState(n, max_num_seqs=4, breaker_open=n in blocked) for n in names]


@pytest.mark.parametrize("name", POLICIES)
def test_no_policy_chooses_a_replica_whose_breaker_is_open(name):
    policy = make_policy(name, BS)
    cold = [RouteRequest(tuple(range(1000 * i, 1000 * i + 32)), NS) for i in range(12)]   # spread over the rest
    assert {policy.choose(_states(blocked={"b"}), request).replica for request in cold} == {"a", "c"}
    with pytest.raises(NoReplicaError):
        policy.choose(_states(blocked={"a", "b", "c"}), RouteRequest(PROMPT, NS))
    unhealthy_and_open = _states(blocked={"a"})
    unhealthy_and_open[1].healthy = False
    assert policy.choose(unhealthy_and_open, RouteRequest(PROMPT, NS)).replica == "c"


def test_kv_aware_leaves_the_prefix_holder_while_its_breaker_is_open_and_returns_after():
    policy = make_policy("kv_aware", BS)
    policy.index.record("a", request_block_hashes(PROMPT, NS, BS))     # "a" holds the whole prompt
    assert policy.choose(_states(), RouteRequest(PROMPT, NS)).reason == "prefix"
    moved = policy.choose(_states(blocked={"a"}), RouteRequest(PROMPT, NS))
    assert moved.replica != "a" and moved.cached_tokens == 0
    back = policy.choose(_states(), RouteRequest(PROMPT, NS))
    assert back.replica == "a" and back.cached_tokens == len(PROMPT)


def test_a_failing_replica_is_out_until_its_probe_succeeds():
    clock = [0.0]
    board = ReplicaBreakers(failure_threshold=3, open_s=5.0, clock=lambda: clock[0])
    policy = make_policy("round_robin")

    def routed(n=6):
        return {policy.choose(_states(board.blocked()), RouteRequest(PROMPT, NS)).replica for _ in range(n)}
    board.retain(["a", "b", "c"])
    assert routed() == {"a", "b", "c"} and board.due_probes() == []
    for _ in range(2):
        board.on_failure("b")
    board.on_success("b")                          # an answer in between: the count starts again
    for _ in range(2):
        board.on_failure("b")
    assert routed() == {"a", "b", "c"}
    board.on_failure("b")                          # three in a row: open
    assert board.states()["b"] is BreakerState.OPEN and routed() == {"a", "c"}
    clock[0] = 4.9
    assert board.due_probes() == [] and routed() == {"a", "c"}
    clock[0] = 5.0                                 # half open: one probe, normal traffic still kept away
    assert board.due_probes() == ["b"] and board.due_probes() == []
    assert board.states()["b"] is BreakerState.HALF_OPEN and routed() == {"a", "c"}
    board.on_failure("b")                          # the probe failed: open for another open_s
    clock[0] = 9.9
    assert board.states()["b"] is BreakerState.OPEN and board.due_probes() == []
    clock[0] = 10.0
    assert board.due_probes() == ["b"]
    board.on_success("b")                          # the probe passed: back in routing
    assert board.states()["b"] is BreakerState.CLOSED and routed() == {"a", "b", "c"}
    assert board.breakers["b"].times_opened == 2


def test_an_unhealthy_report_trips_at_once_and_replaced_replicas_are_forgotten():
    clock = [0.0]
    board = ReplicaBreakers(failure_threshold=3, open_s=5.0, clock=lambda: clock[0])
    board.retain(["a", "b"])
    board.trip("a")
    assert board.blocked() == ["a"]
    board.trip("a")                                # already open: the open period does not restart
    clock[0] = 5.0
    assert board.due_probes() == ["a"]
    board.retain(["b", "c"])                       # Ray Serve replaced "a" with "c"
    assert board.blocked() == [] and set(board.states()) == {"b", "c"}
    board.on_failure("c")
    board.forget("c")
    assert set(board.states()) == {"b"}
