"""A simulated replica that runs the engine's real scheduler, one step per event.

``SchedulerReplica`` has ``BatchReplica``'s interface but every step is planned by
:class:`~kvserve.engine.scheduler.Scheduler` over a real :class:`KVCacheManager` and
:class:`BlockPool` (the replica's KV pool in blocks), answered with a synthetic
``StepResult`` (one placeholder token per sampling sequence, ``ignore_eos``), as
``planner/simulate.py`` does offline; the step's time is the roofline of its shape
(``planner/simulate.step_work``). So token budget, ``max_num_seqs``, chunked prefill,
admission order and recompute preemption are the engine's own. One event per step makes it
~100x slower than the coalesced ``BatchReplica``: it is the reference for short traces
(``kvserve simulate --replica scheduler``, the test that holds the two together, and the
simulator-vs-cluster check, whose replicas share one host: ``host``, ``host_cpu.SharedHost``,
multiplies each step's time by the host's contention factor and drift when the step starts).

``prefix_cache=True`` gives the replica the engine's :class:`PrefixCache` on the simulated clock:
requests carry their real prompt ids (``prompt_ids.py``: a shared prefix per group), the
scheduler admits each with its cached prefix, the step's shape holds only the tokens left to
compute (attention still reads the whole context) and the log records each request's cached
tokens. The cache's ``BlockStored`` / ``BlockRemoved`` events go to ``cache_listener`` (set by
the deployment when its router reads them: ``kv_aware``) at the end of every step.
"""
from __future__ import annotations

from kvserve.engine.kv.block_pool import BlockPool
from kvserve.engine.kv.manager import KVCacheManager
from kvserve.engine.kv.prefix_cache import PrefixCache
from kvserve.engine.request import EngineRequest
from kvserve.engine.scheduler import Scheduler, SchedulerConfig
from kvserve.engine.step import SampledToken, StepResult
from kvserve.fleetsim.log import RequestLog
from kvserve.fleetsim.prompt_ids import REPLY_ID, prompt_token_ids
from kvserve.fleetsim.replica import HeldRequests
from kvserve.fleetsim.sizing import ReplicaSizing
from kvserve.planner.roofline import step_time
from kvserve.planner.simulate import StepShape, step_work
from kvserve.sampling.params import SamplingParams

BLOCK_SIZE = 16
_TOKEN = REPLY_ID               # every sampled token: a conversation's next turn starts with them


class SchedulerReplica:
    """One simulated replica driven by the engine's scheduler (the module docstring)."""

    def __init__(self, name: str, sizing: ReplicaSizing, log: RequestLog, host=None,
                 prefix_cache: bool = False):
        self.name = name
        self.host = host                               # a SharedHost, or None: the replica has its own
        self.log = log
        self.cost = sizing.cost
        self.kv_tokens = sizing.kv_tokens
        self.now = 0.0                                 # the simulated clock, as of the last event
        pool = BlockPool(max(1, sizing.kv_tokens // BLOCK_SIZE), BLOCK_SIZE)
        cache = PrefixCache(pool, clock=self._clock) if prefix_cache else None
        self.sched = Scheduler(SchedulerConfig(sizing.max_num_seqs, sizing.max_batched_tokens),
                               KVCacheManager(pool, prefix_cache=cache), max_model_len=None, clock=self._clock)
        self.cache_listener = None                     # called with (name, events) after each step
        self.queued: dict[int, int] = {}               # request -> uncached prompt tokens, until its first token
        self.plan = None                               # the step in flight
        self.first_seen: set[int] = set()
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.finished_total = 0                        # requests finished (the deployment frees their slots)
        self.version = 0
        self.owner = -1
        self.held = HeldRequests()

    def _clock(self) -> float:
        return self.now

    @property
    def queued_tokens(self) -> int:
        """Prompt tokens of the requests without a first token, past the prefix the cache held
        when each arrived (what the router's ``queued_tokens`` counts)."""
        return sum(self.queued.values())

    @property
    def num_running(self) -> int:
        return self.sched.num_running

    @property
    def num_waiting(self) -> int:
        return self.sched.num_waiting

    @property
    def preemptions_total(self) -> int:
        """Recompute preemptions the scheduler made (``BatchReplica``'s counter of the same)."""
        return self.sched.num_preemptions

    @property
    def kv_usage(self) -> float:
        """Blocks the sequences hold over the pool (cached-only blocks excluded), as the engine
        reports it (``EngineStats.kv_blocks_used``)."""
        kv = self.sched.kv
        return kv.block_pool.num_used_blocks / kv.num_blocks if kv.num_blocks else 0.0

    @property
    def idle(self) -> bool:
        return self.plan is None and not self.sched.has_unfinished()

    def submit(self, request: int, now: float, prompt_ids: list[int] | None = None) -> float | None:
        """Queue ``request`` with the scheduler; the next event's time if the replica was idle.
        ``prompt_ids``: its ids if the router already made them (``prompt_ids.py``)."""
        self.now = now
        params = SamplingParams(max_tokens=self.log.output[request], temperature=0, ignore_eos=True)
        kv = self.sched.kv
        if kv.prefix_cache is None:
            ids = [_TOKEN] * self.log.prompt[request]
            self.queued[request] = len(ids)
        else:
            ids = prompt_ids if prompt_ids is not None else prompt_token_ids(self.log, request)
            cached = kv.num_cached_prompt_blocks(kv.namespace_for(None, None, True), ids) * BLOCK_SIZE
            self.queued[request] = len(ids) - cached
        self.sched.add_request(EngineRequest(str(request), ids, params))
        self.held.update(now, self.num_running + self.num_waiting)
        return self._step(now) if self.plan is None else None

    def complete(self, now: float) -> float | None:
        """The step in flight ends at ``now``: apply it and plan the next."""
        self.now = now
        plan, self.plan = self.plan, None
        sampled = {s.seq_id: SampledToken(_TOKEN) for s in plan.scheduled if s.sample}
        for update in self.sched.update(plan, StepResult(sampled=sampled)):
            request = int(update.request_id)
            self.generation_tokens_total += len(update.new_token_ids)
            if update.new_token_ids and request not in self.first_seen:
                self.first_seen.add(request)
                self.queued.pop(request, None)
                self.log.first_token(request, now)
                self.log.cached_tokens[request] = update.num_cached_tokens
            if update.finish_reason is not None:
                self.first_seen.discard(request)
                self.finished_total += 1
                self.log.finish(request, now)
        self.held.update(now, self.num_running + self.num_waiting)
        return self._step(now)

    def _step(self, now: float) -> float | None:
        next_event = self._plan_step(now)
        if self.cache_listener is not None:
            events = self.sched.kv.drain_events()
            if events:
                self.cache_listener(self.name, events)
        return next_event

    def _plan_step(self, now: float) -> float | None:
        if not self.sched.has_unfinished():
            if self.host is not None:
                self.host.idle(self.name)
            return None
        plan = self.sched.schedule()
        if plan.is_empty:
            raise RuntimeError(f"{self.name}: the scheduler cannot make progress with {self.sched.kv.num_blocks} blocks")
        self.plan = plan
        shape = StepShape(tuple((s.start_position, s.num_tokens) for s in plan.scheduled),
                          sum(s.sample for s in plan.scheduled))
        self.prompt_tokens_total += sum(max(0, min(s.start_position + s.num_tokens, len(s.prompt_token_ids))
                                            - s.start_position) for s in plan.scheduled)
        seconds = step_time(self.cost, step_work(shape, self.cost.hw.kv_read_mode, BLOCK_SIZE)).total_s
        if self.host is not None:
            self.host.busy(self.name, shape.num_sampled / seconds)
            seconds *= self.host.step_factor(now, seconds)
        return now + seconds
