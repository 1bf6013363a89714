"""Every simulated request: what it is (arrival, model, class, lengths) and what happened to it."""
from __future__ import annotations

import math

import numpy as np

PENDING, DONE, REJECTED = 0, 1, 2


class RequestLog:
    """Requests as parallel Python lists, indexed by request id (fast scalar access in the loop);
    ``first_token_s`` / ``finish_s`` are NaN until they happen; ``status`` PENDING, DONE or
    REJECTED (a bounded wait for a replica ran out: a 503 with Retry-After). ``prefix_group``
    (-1: none) and ``prefix_len``: the leading prompt tokens a request shares with its group
    (``prompt_ids.py``); ``parent``: the conversation's previous turn, whose prompt and output
    this prompt starts with (-1: none; ``conversations.py``); ``cached_tokens``: prompt tokens a
    replica's prefix cache served. ``ended``: None, or (set by whoever reads it, e.g. the closed
    loop of ``conversations.TurnGate``) a list each finished or refused request is appended to."""

    def __init__(self, arrival_s, model, klass, prompt, output, prefix_group=None, prefix_len=None, parent=None):
        self.arrival = [float(x) for x in arrival_s]
        self.model = [int(x) for x in model]
        self.klass = [int(x) for x in klass]
        self.prompt = [int(x) for x in prompt]
        self.output = [int(x) for x in output]
        n = len(self.arrival)
        self.first_token_s = [math.nan] * n
        self.finish_s = [math.nan] * n
        self.status = [PENDING] * n
        self.waited_for_start = [False] * n
        self.prefix_group = [int(x) for x in prefix_group] if prefix_group is not None else [-1] * n
        self.prefix_len = [int(x) for x in prefix_len] if prefix_len is not None else [0] * n
        self.parent = [int(x) for x in parent] if parent is not None else [-1] * n
        self.cached_tokens = [0] * n
        self.ended: list[int] | None = None

    def fresh(self) -> "RequestLog":
        """The same requests with nothing happened yet (one per simulated policy or engine run)."""
        return RequestLog(self.arrival, self.model, self.klass, self.prompt, self.output, self.prefix_group,
                          self.prefix_len, self.parent)

    def __len__(self) -> int:
        return len(self.arrival)

    def first_token(self, request: int, now: float) -> None:
        self.first_token_s[request] = now

    def finish(self, request: int, now: float) -> None:
        self.finish_s[request] = now
        self.status[request] = DONE
        if self.ended is not None:
            self.ended.append(request)

    def reject(self, request: int, now: float) -> None:
        self.finish_s[request] = now
        self.status[request] = REJECTED
        if self.ended is not None:
            self.ended.append(request)

    def arrays(self) -> dict[str, np.ndarray]:
        """The log as numpy arrays: ttft_s and tpot_s (NaN where not served) and the inputs."""
        arrival = np.asarray(self.arrival)
        first = np.asarray(self.first_token_s)
        finish = np.asarray(self.finish_s)
        output = np.asarray(self.output)
        status = np.asarray(self.status)
        served = status == DONE
        ttft = np.where(served, first - arrival, np.nan)
        with np.errstate(invalid="ignore", divide="ignore"):
            tpot = np.where(served & (output > 1), (finish - first) / np.maximum(output - 1, 1), np.nan)
        return {"arrival_s": arrival, "model": np.asarray(self.model), "klass": np.asarray(self.klass),
                "prompt": np.asarray(self.prompt), "output": output, "status": status, "ttft_s": ttft,
                "tpot_s": tpot, "waited_for_start": np.asarray(self.waited_for_start),
                "cached_tokens": np.asarray(self.cached_tokens)}
