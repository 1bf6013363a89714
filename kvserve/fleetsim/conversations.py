"""Multi-turn conversations: requests that continue an earlier request's conversation.

A chat user's next turn sends the whole conversation again: the previous turn's prompt, the
answer it got, then the new message. So a conversation's prompts grow turn by turn, and each one
starts with a prefix that only one replica's cache can hold: where the last turn ran. That is
the reuse a KV-aware router exists for (a shared system prompt is the easy case).

``add_conversations`` turns some of a model's drawn requests into later turns of earlier ones,
keeping the arrivals (the traffic's rate stays the scenario's): each request, in arrival order,
is a follow-up with probability ``1 - 1 / turns`` (so a conversation has ``turns`` turns on
average), taking the conversation that has waited longest since its last turn, at least
``gap_s`` ago; the follow-up keeps its drawn length as its new message and its own output, and
its prompt is its parent's prompt + output + that message. A conversation that would pass
``max_context`` tokens (prompt + output) ends there: the request starts a new one. The
conversation's first turn keeps its prefix group (a system prompt), so its later turns have it
too.

Open loop by default: a turn's arrival does not wait for the previous answer (``gap_s`` should
exceed the latency, as a user's reading and typing time does). A model with ``closed_loop``
sends a turn no sooner than ``gap_s`` after its previous turn's answer ended (``TurnGate``): its
drawn arrival is the earliest it is sent. While answers come back within the drawn spacing the
traffic is the open loop's; when the fleet is slow, later turns come later and the load it sees
falls, as real users' does. A refused turn ends too: its user sends the next one after the gap.
"""
from __future__ import annotations

from collections import deque

import numpy as np

from kvserve.fleetsim.log import PENDING, RequestLog

MAX_CONTEXT = 16_384


def add_conversations(log: RequestLog, rng: np.random.Generator, turns: float, gap_s: float, requests,
                      max_context: int = MAX_CONTEXT) -> RequestLog:
    """Make ``requests`` of ``log`` (in arrival order) conversations of ``turns`` turns on average
    (the module docstring); in place, returns ``log``."""
    chosen = sorted(requests, key=lambda r: log.arrival[r])
    follow = rng.random(len(chosen)) < 1.0 - 1.0 / turns
    open_: deque[int] = deque()              # each open conversation's last turn, longest waiting first
    for request, is_follow_up in zip(chosen, follow.tolist()):
        if is_follow_up and open_ and log.arrival[open_[0]] <= log.arrival[request] - gap_s:
            parent = open_.popleft()
            message = log.prompt[request] - (log.prefix_len[request] if log.prefix_group[request] >= 0 else 0)
            prompt = log.prompt[parent] + log.output[parent] + message
            if prompt + log.output[request] <= max_context:
                log.parent[request] = parent
                log.prompt[request] = prompt
                log.prefix_group[request] = log.prefix_group[parent]
                log.prefix_len[request] = log.prefix_len[parent]
        open_.append(request)
    return log


def conversation_of(log: RequestLog, request: int) -> int:
    """The first turn of ``request``'s conversation (itself if it has no parent)."""
    while log.parent[request] >= 0:
        request = log.parent[request]
    return request


def turn_due(log: RequestLog, request: int, gap_s: float | None) -> float:
    """When ``request`` may be sent: its drawn arrival; in a closed loop (``gap_s`` not None) a
    later turn no sooner than ``gap_s`` after its previous turn ended, infinity until it has."""
    parent = log.parent[request]
    if gap_s is None or parent < 0:
        return log.arrival[request]
    if log.status[parent] == PENDING:
        return float("inf")
    return max(log.arrival[request], log.finish_s[parent] + gap_s)


class TurnGate:
    """The closed loop (module docstring) over ``log``: ``gaps[m]`` is model ``m``'s turn gap if
    its conversations are closed-loop, else None. It sets ``log.ended`` and reads it."""

    def __init__(self, log: RequestLog, gaps: list[float | None]):
        self.log, self.gaps = log, gaps
        self.waiting: dict[int, int] = {}      # a turn not yet ended -> its follow-up held for it
        log.ended = []

    def send_time(self, request: int) -> float | None:
        """When ``request`` is sent, asked at its drawn arrival: that arrival, a later time, or
        None while its previous turn has not ended (``released`` gives the time then)."""
        due = turn_due(self.log, request, self.gaps[self.log.model[request]])
        if due == float("inf"):
            self.waiting[self.log.parent[request]] = request
            return None
        return due

    def released(self) -> list[tuple[float, int]]:
        """(send time, request) of each held follow-up whose previous turn ended since the last call."""
        log, sends = self.log, []
        for parent in log.ended:
            request = self.waiting.pop(parent, None)
            if request is not None:
                sends.append((turn_due(log, request, self.gaps[log.model[request]]), request))
        log.ended.clear()
        return sends
