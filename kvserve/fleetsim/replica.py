"""A simulated replica: continuous batching with chunked prefill, its decode runs coalesced.

``BatchReplica`` follows the engine scheduler's rules (``engine/scheduler.py``): every running
sequence decodes one token per step; the step's token budget (``max_batched_tokens``) left
after the decodes goes to prompt chunks, first-come first-served, the last chunk cut to fit;
at most ``max_num_seqs`` sequences are admitted (decoding or prefilling); a request whose
prompt completes in a step samples its first token at that step's end. Step times are the
planner's roofline (``planner/roofline.step_time``) of each step's work.

What makes a day of a fleet fast: between two events that change the batch (an admission, a
finish) every step is the same decode step, so a *decode run* of ``k`` steps is one event:
``k`` = steps until the first running sequence finishes, each step timed at the run's mean
context. A request that arrives during a run and can be admitted cuts the run at the end of
the step in flight. Each running sequence stores the step count at which it finishes
(``finish_step``), so a run advances every sequence by moving one counter.

Differences from the engine, stated: admission reserves a request's whole prompt + output in
the KV pool (the engine allocates per block and preempts when the pool runs out; the
simulator never preempts); a prefix cache is ``cached_replica.PrefixCachingReplica``, which
overrides the KV accounting hooks (``_queue`` ... ``_release``). ``SchedulerReplica``
(``sched_replica.py``) runs the engine's real scheduler step by step for short traces; a test
holds the two within 20% on TTFT p50 / p99.
"""
from __future__ import annotations

import heapq
from collections import deque

from kvserve.fleetsim.log import RequestLog
from kvserve.fleetsim.sizing import ReplicaSizing
from kvserve.planner.roofline import StepWork, chunk_attention, step_time

MAX_RUN_STEPS = 4096       # longest decode run timed at one mean context


class BatchReplica:
    """One simulated engine replica (the module docstring's rules)."""

    def __init__(self, name: str, sizing: ReplicaSizing, log: RequestLog):
        self.name = name
        self.log = log
        self.cost = sizing.cost
        self.max_num_seqs = sizing.max_num_seqs
        self.max_batched_tokens = sizing.max_batched_tokens
        self.kv_tokens = sizing.kv_tokens
        self.waiting: deque[int] = deque()            # request ids not yet admitted
        self.prefilling: list[list[int]] = []          # [request, prompt tokens done] admitted, FCFS
        self.finishes: list[tuple[int, int]] = []      # heap of (finish_step, request)
        self.steps = 0                                 # decode steps taken (every running seq gains one)
        self.ctx_sum = 0                               # tokens in the running sequences' KV
        self.reserved = 0                              # KV tokens reserved by admitted requests
        self.unanswered_tokens = 0                     # uncached prompt tokens of requests with no first token
        self.segment: tuple | None = None              # ("run", t0, dt, k) or ("step", t_end, chunks)
        self.prompt_tokens_total = 0                   # prompt tokens computed
        self.generation_tokens_total = 0
        self.finished_total = 0                        # requests finished (the deployment frees their slots)
        self.version = 0                               # bumped by the fleet loop when the next event moves
        self.owner = -1                                # the deployment's index (set by the fleet)
        self.held = HeldRequests()

    # -- what the router and the autoscaler read --------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.finishes) + len(self.prefilling)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def queued_tokens(self) -> int:
        """Uncached prompt tokens of the requests waiting or prefilling (until their first token),
        counted when each arrived: what the engine reports to the router."""
        return self.unanswered_tokens

    @property
    def kv_usage(self) -> float:
        return self.reserved / self.kv_tokens if self.kv_tokens else 0.0

    @property
    def idle(self) -> bool:
        return self.segment is None and not self.waiting

    # -- events -----------------------------------------------------------------------------------
    def submit(self, request: int, now: float, prompt_ids: list[int] | None = None) -> float | None:
        """Queue ``request``; return the time of this replica's next event if it changed (it was
        idle, or a decode run is cut for the admission), else None. ``prompt_ids`` are not read (the
        coalesced replicas simulate without ids)."""
        self.waiting.append(request)
        self.unanswered_tokens += self._queue(request)
        self.held.update(now, self.num_running + self.num_waiting)
        if self.segment is None:
            return self._plan(now)
        if self.segment[0] == "run" and self._can_admit():
            _, t0, dt, k = self.segment
            done = min(k, int((now - t0) / dt) + 1)
            if done < k:
                self.segment = ("run", t0, dt, done)
                return t0 + done * dt
        return None

    def complete(self, now: float) -> float | None:
        """Apply the segment that ends at ``now``; plan the next; its end time, or None when idle."""
        kind = self.segment[0]
        if kind == "run":
            self._apply_decode(self.segment[3], now)
        else:
            self._apply_step(self.segment[2], now)
        self.segment = None
        self.held.update(now, self.num_running + self.num_waiting)
        return self._plan(now)

    # -- planning ---------------------------------------------------------------------------------
    def _can_admit(self) -> bool:
        if not self.waiting or self.num_running >= self.max_num_seqs:
            return False
        return self._fits(self.waiting[0])

    # -- KV accounting: what a prefix cache changes (``cached_replica.py``) ------------------------
    def _queue(self, request: int) -> int:
        """Prompt tokens ``request`` adds to ``queued_tokens`` until its first token."""
        return self.log.prompt[request]

    def _answered(self, request: int) -> int:
        """What ``_queue`` added for ``request`` (its first token is out)."""
        return self.log.prompt[request]

    def _fits(self, request: int) -> bool:
        """Whether the pool has room for ``request``'s whole prompt + output."""
        return self.reserved + self.log.prompt[request] + self.log.output[request] <= self.kv_tokens

    def _admit(self, request: int) -> int:
        """Take ``request`` off the queue and reserve its KV; the prompt tokens it starts with."""
        self.reserved += self.log.prompt[request] + self.log.output[request]
        return 0

    def _prefilled(self, request: int) -> None:
        """``request``'s prompt is computed (a prefix cache keeps its shared blocks)."""

    def _release(self, request: int) -> None:
        """``request`` finished: its KV goes back to the pool."""
        self.reserved -= self.log.prompt[request] + self.log.output[request]

    def _plan(self, now: float) -> float | None:
        if self.prefilling or self._can_admit():
            return self._plan_step(now)
        if self.finishes:
            return self._plan_run(now)
        return None

    def _plan_step(self, now: float) -> float:
        """One step: a decode for each running sequence and prompt chunks in the budget left."""
        decoding = len(self.finishes)
        budget = self.max_batched_tokens - decoding
        while self._can_admit() and budget > len(self.prefilling):
            request = self.waiting.popleft()
            self.prefilling.append([request, self._admit(request)])
        chunks, attn, sampled = [], [], decoding
        for entry in self.prefilling:
            if budget <= 0:
                break
            request, done = entry
            n = min(self.log.prompt[request] - done, budget)
            budget -= n
            chunks.append((entry, n))
            attn.append(chunk_attention(done, n))
            sampled += done + n == self.log.prompt[request]
        if decoding:
            attn.append((float(self.ctx_sum), float(self.ctx_sum)))
        tokens = decoding + sum(n for _, n in chunks)
        dt = step_time(self.cost, StepWork(tokens, sampled, tuple(attn))).total_s
        self.segment = ("step", now + dt, chunks)
        return now + dt

    def _plan_run(self, now: float) -> float:
        """A decode run up to the first finish (at most ``MAX_RUN_STEPS``), timed at its mean context."""
        batch = len(self.finishes)
        k = max(1, min(self.finishes[0][0] - self.steps, MAX_RUN_STEPS))
        ctx = self.ctx_sum + batch * (k - 1) / 2.0
        dt = step_time(self.cost, StepWork(batch, batch, ((ctx, ctx),))).total_s
        self.segment = ("run", now, dt, k)
        return now + k * dt

    # -- applying ---------------------------------------------------------------------------------
    def _apply_decode(self, k: int, now: float) -> None:
        batch = len(self.finishes)
        self.steps += k
        self.ctx_sum += batch * k
        self.generation_tokens_total += batch * k
        self._finish_due(now)

    def _finish_due(self, now: float) -> None:
        log = self.log
        while self.finishes and self.finishes[0][0] <= self.steps:
            _, request = heapq.heappop(self.finishes)
            self.ctx_sum -= log.prompt[request] + log.output[request]
            self._release(request)
            self.finished_total += 1
            log.finish(request, now)

    def _apply_step(self, chunks: list, now: float) -> None:
        if self.finishes:
            self._apply_decode(1, now)
        log, completed = self.log, []
        for entry, n in chunks:
            entry[1] += n
            self.prompt_tokens_total += n
            if entry[1] == log.prompt[entry[0]]:
                completed.append(entry)
        for entry in completed:
            self.prefilling.remove(entry)
            request = entry[0]
            self._prefilled(request)
            self.unanswered_tokens -= self._answered(request)
            log.first_token(request, now)
            self.generation_tokens_total += 1
            output = log.output[request]
            self.ctx_sum += log.prompt[request] + 1
            if output <= 1:
                self.ctx_sum -= log.prompt[request] + 1
                self._release(request)
                self.finished_total += 1
                log.finish(request, now)
            else:
                heapq.heappush(self.finishes, (self.steps + output - 1, request))



class HeldRequests:
    """The integral over time of the requests a replica holds (running + waiting), for Ray
    Serve's request-count signal, which averages ongoing requests over a look-back window
    rather than reading one instant. ``update`` right after each change of the count."""

    def __init__(self):
        self.seconds = 0.0                 # request-seconds held so far
        self.since: float | None = None
        self.count = 0

    def update(self, now: float, count: int) -> None:
        """The count held from ``now`` on (the previous one was held since the last update)."""
        if self.since is not None:
            self.seconds += self.count * (now - self.since)
        self.since, self.count = now, count

    def total(self, now: float) -> float:
        """Request-seconds held up to ``now``."""
        return self.seconds + (self.count * (now - self.since) if self.since is not None else 0.0)
