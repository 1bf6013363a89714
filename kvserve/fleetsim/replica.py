"""A simulated replica: continuous batching with chunked prefill, its decode runs coalesced.

``BatchReplica`` follows the engine scheduler's rules (``engine/scheduler.py``): every running
sequence decodes one token per step; the step's token budget (``max_batched_tokens``) left
after the decodes goes to prompt chunks, first-come first-served, the last chunk cut to fit;
at most ``max_num_seqs`` sequences are admitted (decoding or prefilling); a request whose
prompt completes in a step samples its first token at that step's end. Step times are the
planner's roofline (``planner/roofline.step_time``) of each step's work.

What makes a day of a fleet fast: between two events that change the batch (an admission, a
finish, a full pool) every step is the same decode step, so a *decode run* of ``k`` steps is one
event: ``k`` = steps until the first running sequence finishes or the pool has no token left for
the next step, each step timed at the run's mean context. A request that arrives during a run
and can be admitted cuts the run at the end of the step in flight. Each running sequence stores
the step count at which it finishes (``finish_step``), so a run advances every sequence by
moving one counter.

KV as the engine holds it: a request is admitted when its prompt fits beside the next step's
decodes, each decode step adds a token per running sequence, and when the next step's decodes
do not fit, the newest admitted request is preempted by recompute (its KV freed, back to the
head of the queue, its prompt + the output it had generated computed again on readmission;
no admission in that step), as ``engine/scheduler.py`` does. Differences from the engine,
stated: the pool is counted in tokens (the engine rounds each sequence up to 16-token blocks)
and a prompt is admitted whole (the engine admits on its first chunk's blocks); a prefix cache
is ``cached_replica.PrefixCachingReplica``, which overrides the KV accounting hooks (``_queue``
... ``_evicted``). ``SchedulerReplica`` (``sched_replica.py``) runs the engine's real scheduler
step by step for short traces; tests hold the two within 20% on TTFT p50 / p99 and TPOT, with a
pool the planner sized and with one small enough to preempt.
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
        self.reserved = 0                              # KV tokens the admitted requests hold
        self.order: dict[int, int] = {}                # request -> its place in arrival order, until it ends
        self.recomputed: dict[int, int] = {}           # preempted request -> output tokens it had generated (0: none)
        self.preemptions_total = 0
        self.submitted = 0                             # requests submitted so far
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
        self.order[request] = self.submitted
        self.submitted += 1
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
        return self._fits(self.waiting[0], len(self.finishes))

    def _prompt_len(self, request: int) -> int:
        """Tokens ``request``'s prefill computes: its prompt, and after a preemption the output it
        had generated (recompute)."""
        return self.log.prompt[request] + self.recomputed.get(request, 0)

    # -- KV accounting: what a prefix cache changes (``cached_replica.py``) ------------------------
    def _queue(self, request: int) -> int:
        """Prompt tokens ``request`` adds to ``queued_tokens`` until its first token."""
        return self.log.prompt[request]

    def _answered(self, request: int) -> int:
        """What ``_queue`` added for ``request`` (its first token is out)."""
        return self.log.prompt[request]

    def _room(self) -> int:
        """KV tokens the pool can give out now."""
        return self.kv_tokens - self.reserved

    def _fits(self, request: int, decoding: int) -> bool:
        """Whether ``request``'s prefill fits beside the next step's ``decoding`` tokens."""
        return self._prompt_len(request) + decoding <= self._room()

    def _admit(self, request: int) -> int:
        """Take ``request`` off the queue and hold KV for its prefill; the tokens it starts with."""
        self.reserved += self._prompt_len(request)
        return 0

    def _grow(self, tokens: int) -> None:
        """The running requests' KV grows by ``tokens`` (decode steps, a prefill's sampled token)."""
        self.reserved += tokens

    def _prefilled(self, request: int) -> None:
        """``request``'s prompt is computed (a prefix cache keeps its shared blocks)."""

    def _release(self, request: int) -> None:
        """``request`` finished: its KV goes back to the pool."""
        self.reserved -= self.log.prompt[request] + self.log.output[request]

    def _evicted(self, request: int, context: int, computed: int) -> None:
        """``request`` is preempted with ``context`` tokens (its whole prompt while prefilling,
        prompt + output so far while decoding), the KV of ``computed`` of them computed: the KV
        it holds goes back to the pool."""
        self.reserved -= context

    # -- preemption -------------------------------------------------------------------------------
    def _make_room(self, tokens: int) -> bool:
        """Room for ``tokens`` more KV tokens (the next step's decodes), preempting the newest
        admitted requests while more than one runs; whether any was preempted."""
        preempted = False
        while self._room() < tokens and self.num_running > 1:
            tokens -= self._preempt_newest()
            preempted = True
        return preempted

    def _preempt_newest(self) -> int:
        """Recompute preemption of the newest admitted request: its KV freed, back to the head of
        the queue; the decode tokens the next step no longer needs for it (1 or 0)."""
        prefill = max(self.prefilling, key=lambda entry: self.order[entry[0]], default=None)
        decode = max(self.finishes, key=lambda item: self.order[item[1]], default=None)
        self.preemptions_total += 1
        if decode is None or (prefill is not None and self.order[prefill[0]] > self.order[decode[1]]):
            request, done = prefill
            self.prefilling.remove(prefill)
            self._evicted(request, self._prompt_len(request), done)
            self.recomputed.setdefault(request, 0)
            self.waiting.appendleft(request)
            return 0
        finish_step, request = decode
        self.finishes.remove(decode)
        heapq.heapify(self.finishes)
        generated = self.log.output[request] - (finish_step - self.steps)
        context = self.log.prompt[request] + generated
        self.ctx_sum -= context
        self._evicted(request, context, context - 1)      # the last sampled token's KV is not computed
        self.recomputed[request] = generated
        self.waiting.appendleft(request)
        return 1

    def _plan(self, now: float) -> float | None:
        preempted = self._make_room(len(self.finishes))
        if self.prefilling or (not preempted and self._can_admit()):
            return self._plan_step(now, admit=not preempted)
        if self.finishes:
            return self._plan_run(now)
        return None

    def _plan_step(self, now: float, admit: bool = True) -> float:
        """One step: a decode for each running sequence and prompt chunks in the budget left."""
        decoding = len(self.finishes)
        budget = self.max_batched_tokens - decoding
        while admit and self._can_admit() and budget > len(self.prefilling):
            request = self.waiting.popleft()
            self.prefilling.append([request, self._admit(request)])
        chunks, attn, sampled = [], [], decoding
        for entry in self.prefilling:
            if budget <= 0:
                break
            request, done = entry
            prompt = self._prompt_len(request)
            n = min(prompt - done, budget)
            budget -= n
            chunks.append((entry, n))
            attn.append(chunk_attention(done, n))
            sampled += done + n == prompt
        if decoding:
            attn.append((float(self.ctx_sum), float(self.ctx_sum)))
        tokens = decoding + sum(n for _, n in chunks)
        dt = step_time(self.cost, StepWork(tokens, sampled, tuple(attn))).total_s
        self.segment = ("step", now + dt, chunks)
        return now + dt

    def _plan_run(self, now: float) -> float:
        """A decode run up to the first finish or until the pool is full (at most
        ``MAX_RUN_STEPS``), timed at its mean context."""
        batch = len(self.finishes)
        k = max(1, min(self.finishes[0][0] - self.steps, MAX_RUN_STEPS, self._room() // batch))
        ctx = self.ctx_sum + batch * (k - 1) / 2.0
        dt = step_time(self.cost, StepWork(batch, batch, ((ctx, ctx),))).total_s
        self.segment = ("run", now, dt, k)
        return now + k * dt

    # -- applying ---------------------------------------------------------------------------------
    def _apply_decode(self, k: int, now: float) -> None:
        batch = len(self.finishes)
        self.steps += k
        self.ctx_sum += batch * k
        self._grow(batch * k)
        self.generation_tokens_total += batch * k
        self._finish_due(now)

    def _finish_due(self, now: float) -> None:
        log = self.log
        while self.finishes and self.finishes[0][0] <= self.steps:
            _, request = heapq.heappop(self.finishes)
            self.ctx_sum -= log.prompt[request] + log.output[request]
            self._end(request, now)

    def _end(self, request: int, now: float) -> None:
        self._release(request)
        del self.order[request]
        self.finished_total += 1
        self.log.finish(request, now)

    def _apply_step(self, chunks: list, now: float) -> None:
        if self.finishes:
            self._apply_decode(1, now)
        completed = []
        for entry, n in chunks:
            entry[1] += n
            self.prompt_tokens_total += n
            if entry[1] == self._prompt_len(entry[0]):
                completed.append(entry)
        for entry in completed:
            self.prefilling.remove(entry)
            self._sample_first(entry[0], now)

    def _sample_first(self, request: int, now: float) -> None:
        """``request``'s prefill is computed: it samples a token and decodes from the next step
        (a recompute after a preemption samples its next output token, not its first)."""
        log = self.log
        generated = self.recomputed.pop(request, 0)
        computed = log.prompt[request] + generated + 1
        if generated == 0:
            self._prefilled(request)
            self.unanswered_tokens -= self._answered(request)
            log.first_token(request, now)
        self.generation_tokens_total += 1
        self._grow(1)
        left = log.output[request] - generated - 1
        if left <= 0:
            self._end(request, now)
        else:
            self.ctx_sum += computed
            heapq.heappush(self.finishes, (self.steps + left, request))



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
