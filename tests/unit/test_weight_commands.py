"""Tier 1: the engine process's weights gate: a command waits for in-flight requests, holds
newer ones, runs between steps, admits what it held; one pending at a time; errors typed.
The engine here is a recorder of the calls the gate makes (the real one is exercised in
tests/server/test_server_weights.py)."""
from __future__ import annotations

from kvserve.engine.request import EngineRequest
from kvserve.errors import EngineBusyError
from kvserve.ipc import codec
from kvserve.ipc.weight_commands import WeightsGate
from kvserve.sampling.params import SamplingParams


class RecordingEngine:
    def __init__(self):
        self.in_flight, self.calls = 1, []

    def has_unfinished(self) -> bool:
        return self.in_flight > 0

    def load_weights(self, path):
        self.calls.append(("load", path))
        return {"weight_epoch": 1}

    def sleep(self):
        self.calls.append(("sleep", None))
        raise EngineBusyError("cannot sleep: test")


def request(rid: str) -> EngineRequest:
    return EngineRequest(rid, [1, 2, 3], SamplingParams(max_tokens=2))


def test_a_command_waits_for_in_flight_requests_and_holds_new_ones():
    engine, gate = RecordingEngine(), WeightsGate()
    assert gate.offer(codec.WeightsCommand("load", "/models/v2")) is None
    assert gate.hold(request("r1")) and gate.hold(request("r2"))
    assert gate.run_if_idle(engine) == (None, [])              # r0 still decoding on the old weights
    assert engine.calls == []
    engine.in_flight = 0
    result, held = gate.run_if_idle(engine)
    assert result.status == 200 and result.result == {"weight_epoch": 1}
    assert [r.request_id for r in held] == ["r1", "r2"] and engine.calls == [("load", "/models/v2")]
    assert not gate.hold(request("r3"))                         # nothing pending: straight through


def test_one_command_at_a_time_and_aborted_held_requests_leave():
    gate = WeightsGate()
    assert gate.offer(codec.WeightsCommand("sleep")) is None
    refused = gate.offer(codec.WeightsCommand("wake"))
    assert refused.status == 409 and refused.error["error"]["code"] == "engine_busy"
    gate.hold(request("r1"))
    assert gate.release("r1") and not gate.release("r1")


def test_typed_errors_and_bad_commands_are_answered_not_raised():
    engine = RecordingEngine()
    engine.in_flight = 0
    for command, status, code in ((codec.WeightsCommand("sleep"), 409, "engine_busy"),
                                  (codec.WeightsCommand("load"), 400, "invalid_parameter"),
                                  (codec.WeightsCommand("dance"), 400, "invalid_parameter")):
        gate = WeightsGate()
        gate.offer(command)
        result, _ = gate.run_if_idle(engine)
        assert result.status == status and result.error["error"]["code"] == code


def test_the_messages_cross_the_codec():
    for message in (codec.WeightsCommand("load", "/m"), codec.WeightsResult(200, {"weight_epoch": 2})):
        decoded = codec.FrameBuffer().feed(codec.encode(message))
        assert decoded == [message]
