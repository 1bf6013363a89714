"""The one scheduler harness for tier-1 tests: a real Scheduler over a real KVCacheManager
(block pool, optional prefix cache with a fake clock), driven by hand-built step results.

Requests enter as ``EngineRequest`` exactly as the engine receives them; a fake runner
samples a scripted token for every sampling sequence. After every step the pool, the
cache tree and the locks are checked.
"""
from __future__ import annotations

from kvserve.engine.kv.block_pool import BlockPool
from kvserve.engine.kv.manager import KVCacheManager
from kvserve.engine.kv.prefix_cache import PrefixCache
from kvserve.engine.request import EngineRequest
from kvserve.engine.scheduler import Scheduler, SchedulerConfig
from kvserve.engine.sequence import Sequence
from kvserve.engine.step import SampledToken, StepPlan, StepResult
from kvserve.sampling.params import SamplingParams

EOS = 0


class Clock:
    """A clock the test moves by hand (prefix-cache grace times, batching windows)."""

    now = 0.0

    def __call__(self) -> float:
        return self.now


class SchedulerHarness:
    """A scheduler, its KV manager and the record of what each step produced."""

    def __init__(self, num_blocks: int = 64, block_size: int = 4, max_num_seqs: int = 8, budget: int = 32,
                 grace_s: float = 0.0, prefix_cache: bool = False, max_model_len: int | None = None,
                 gate=None, policy=None):
        self.pool = BlockPool(num_blocks, block_size)
        self.clock = Clock()
        self.cache = PrefixCache(self.pool, clock=self.clock) if prefix_cache else None
        self.kv = KVCacheManager(self.pool, self.cache)
        self.sched = Scheduler(SchedulerConfig(max_num_seqs, budget, grace_s), self.kv, max_model_len,
                               frozenset([EOS]), gate, policy,    # gate: a ResidencyGate (None: open)
                               clock=self.clock)                  # policy: None = FCFS
        self.seqs: list[Sequence] = []
        self.plans: list[StepPlan] = []
        self.updates = []
        self.finished: dict[tuple[str, int], str] = {}

    def add(self, request_id: str, prompt, max_tokens: int = 8, n: int = 1, priority: int = 0,
            request_kw: dict | None = None, adapter_key: str | None = None, **params_kw) -> Sequence:
        """Queue a request; ``prompt`` is a token list or a length (tokens 1..length).
        ``request_kw`` are further EngineRequest fields; ``adapter_key`` the resolved
        adapter identity; ``params_kw`` SamplingParams fields."""
        params = SamplingParams(n=n, max_tokens=max_tokens, **{"temperature": 0, **params_kw})
        tokens = list(range(1, prompt + 1)) if isinstance(prompt, int) else list(prompt)
        leader = self.sched.add_request(EngineRequest(request_id, tokens, params, priority=priority,
                                                      **(request_kw or {})), adapter_key)
        self.seqs += [leader, *leader.pending_fork]
        return leader

    def seq(self, seq_id: int) -> Sequence:
        return next(s for s in self.seqs if s.seq_id == seq_id)

    @staticmethod
    def result(plan: StepPlan, token: int = 7) -> StepResult:
        """Every sampling sequence samples ``token``."""
        return StepResult({s.seq_id: SampledToken(token) for s in plan.scheduled if s.sample})

    def record(self, updates) -> None:
        self.updates += updates
        for u in updates:
            if u.finish_reason:
                self.finished[(u.request_id, u.sibling_index)] = u.finish_reason

    def step(self, token: int = 7):
        """Schedule, sample ``token`` everywhere, update, check; ``(plan, updates)``."""
        plan = self.sched.schedule()
        self.plans.append(plan)
        assert plan.num_tokens <= self.sched.config.max_num_batched_tokens
        for s in plan.scheduled:      # every write lands in a block the sequence holds
            assert len(s.block_table) * self.pool.block_size >= s.context_len
        updates = self.sched.update(plan, self.result(plan, token))
        self.record(updates)
        self.check()
        return plan, updates

    def check(self) -> None:
        self.sched.check_integrity()

    def run(self, max_steps: int = 500) -> list[StepPlan]:
        plans = []
        for _ in range(max_steps):
            if not self.sched.has_unfinished():
                return plans
            plans.append(self.step()[0])
        raise AssertionError("did not finish")

    def cached_tokens(self, request_id: str) -> set[int]:
        return {u.num_cached_tokens for u in self.updates if u.request_id == request_id}
