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

    def followed_by(self, later: "RequestLog", after_s: float) -> "RequestLog":
        """These requests, then ``later``'s sent ``after_s`` after this log's clock started (its
        arrivals shifted; its parents and prefix groups renumbered past these), none happened yet:
        a lead-in (``cluster_check``: the probe sent before a trace) and what followed it."""
        if self.arrival and max(self.arrival) > after_s + min(later.arrival, default=math.inf):
            raise ValueError("the later requests must be sent after these")
        n, groups = len(self), max(self.prefix_group, default=-1) + 1
        return RequestLog(self.arrival + [t + after_s for t in later.arrival], self.model + later.model,
                          self.klass + later.klass, self.prompt + later.prompt, self.output + later.output,
                          self.prefix_group + [g + groups if g >= 0 else -1 for g in later.prefix_group],
                          self.prefix_len + later.prefix_len,
                          self.parent + [p + n if p >= 0 else -1 for p in later.parent])

    def part_from(self, first: int, shift_s: float) -> "RequestLog":
        """Requests ``first`` onward with what happened to them, every time moved ``shift_s``
        earlier, a parent's index less ``first`` (prefix groups kept): ``followed_by``'s later
        requests back, played."""
        part = RequestLog([t - shift_s for t in self.arrival[first:]], self.model[first:], self.klass[first:],
                          self.prompt[first:], self.output[first:], self.prefix_group[first:],
                          self.prefix_len[first:], [p - first if p >= first else -1 for p in self.parent[first:]])
        part.first_token_s = [t - shift_s for t in self.first_token_s[first:]]
        part.finish_s = [t - shift_s for t in self.finish_s[first:]]
        part.status, part.waited_for_start = self.status[first:], self.waited_for_start[first:]
        part.cached_tokens = self.cached_tokens[first:]
        return part

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
