"""Token-budget scheduler: continuous batching with chunked prefill and preemption.

There are no prefill and decode phases. Every sequence has ``num_computed_tokens``
and a number of tokens to compute; each step hands out a token budget across
sequences, running ones first, then waiting ones. A ``SchedulingPolicy``
(``engine/policy.py``) gives the order, the step's budget, the part of it running
sequences leave for waiting ones, and who waits or may preempt (FCFS by default:
priority, arrival, the whole ``max_num_batched_tokens``); it is told each step's
scheduled sequences and token counts at the end of ``schedule`` (``end_step``: the
fair-share policy charges tenants there). The scheduler decides who
runs and how many tokens; the ``KVCacheManager`` decides which blocks: when it
cannot find enough (after evicting unlocked cached blocks), the last running
sequence in the policy's order is preempted by recompute and returns to the
waiting queue at its original place.

A ``ResidencyGate`` (LoRA slots) may hold a waiting sequence back until the weights it
needs are resident; later sequences whose weights are resident go ahead of it.

Lookahead tokens (speculative decoding) are a generic extra: each decoding item
carries ``lookahead_limit``; a speculator asks ``reserve_lookahead`` for slots
after ``schedule`` and ``update`` accepts what the runner verified.

Never imports torch: it sees ints and lists only.
"""
from __future__ import annotations

import heapq
import itertools
import time
from dataclasses import dataclass
from typing import Callable

from kvserve.engine.kv.manager import KVCacheManager
from kvserve.engine.policy import FcfsPolicy, SchedulingPolicy
from kvserve.engine.prompt_logprobs import new_prompt_logprobs, wants_prompt_logprobs
from kvserve.engine.request import EngineRequest, RequestStatus
from kvserve.engine.residency import OpenGate, ResidencyGate
from kvserve.engine.sequence import FinishReason, Sequence, SeqStatus
from kvserve.engine.step import SampledToken, ScheduledSeq, SeqUpdate, StepPlan, StepResult


@dataclass(frozen=True)
class SchedulerConfig:
    """Scheduling limits, resolved before the scheduler is built."""

    max_num_seqs: int = 64              # running sequences at once
    max_num_batched_tokens: int = 1024  # tokens computed per step (all sequences)
    prefix_cache_grace_s: float = 0.0   # a finished request's cached blocks stay unevictable this long


class Scheduler:
    """Owns sequences; produces StepPlans, consumes StepResults; asks ``kv`` for blocks."""

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, max_model_len: int | None = None,
                 eos_token_ids: frozenset[int] = frozenset(), gate: ResidencyGate | None = None,
                 policy: SchedulingPolicy | None = None, clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.kv = kv
        self.gate = gate or OpenGate()
        self.policy = policy or FcfsPolicy()
        self.clock = clock                     # arrival times and the policy's "now" (seconds)
        self.max_model_len = max_model_len     # lookahead never runs past it; default max_tokens
        self.eos_token_ids = eos_token_ids     # for requests that name none
        self._waiting: list[tuple[tuple, Sequence]] = []   # heap by the policy's sort key
        self._running: list[Sequence] = []
        self._seqs: dict[int, Sequence] = {}
        self._by_request: dict[str, list[Sequence]] = {}
        self._seq_ids = itertools.count()
        self._arrivals = itertools.count()
        self.num_preemptions = 0

    # ----------------------------------------------------------------- queries
    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def has_unfinished(self) -> bool:
        return bool(self._running or self._waiting)

    def request_status(self, request_id: str) -> RequestStatus | None:
        """WAITING while no sequence of the request has computed anything, RUNNING after;
        None once every sequence ended (or for an unknown id)."""
        seqs = self._by_request.get(request_id)
        if not seqs:
            return None
        if all(s.status is SeqStatus.WAITING and s.num_computed_tokens == 0 for s in seqs):
            return RequestStatus.WAITING
        return RequestStatus.RUNNING

    def check_integrity(self) -> None:
        """Blocks and cache locks are held exactly by the running sequences."""
        self.kv.check_integrity(self._running, [seq for _key, seq in self._waiting])

    # ---------------------------------------------------------------- requests
    def add_request(self, request: EngineRequest, adapter_key: str | None = None) -> Sequence:
        """Queue a request as one leader sequence; its ``n - 1`` siblings travel in
        ``pending_fork`` until the leader's prompt is computed. Returns the leader.
        ``adapter_key``: the identity of the loaded adapter the request runs with (the
        engine resolves the request's adapter name to it); it names the cache namespace
        and what the gate must make resident."""
        prompt, params = list(request.prompt_token_ids), request.params
        if params.max_tokens is None and self.max_model_len is None:
            raise ValueError("max_tokens is needed when the scheduler has no max_model_len")
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - len(prompt)
        eos = frozenset(request.eos_token_ids) if request.eos_token_ids is not None else self.eos_token_ids
        # prompt logprobs need every prompt position computed: no cache reads
        namespace = self.kv.namespace_for(adapter_key, request.cache_salt,
                                          request.use_prefix_cache and params.prompt_logprobs is None)
        arrival, now = next(self._arrivals), self.clock()

        def make(sibling: int) -> Sequence:
            return Sequence(seq_id=next(self._seq_ids), request_id=request.request_id, sibling_index=sibling,
                            prompt_token_ids=prompt, params=params, max_tokens=max_tokens, eos_token_ids=eos,
                            priority=request.priority, arrival_index=arrival, cache_namespace=namespace,
                            cache_grace_s=request.prefix_cache_grace_s,
                            max_lookahead_tokens=request.num_speculative_tokens, adapter_key=adapter_key,
                            service_class=request.service_class, tenant=request.tenant, arrival_time=now,
                            structured=request.structured)

        leader = make(0)
        leader.pending_fork = [make(i) for i in range(1, params.n)]
        for seq in (leader, *leader.pending_fork):
            self.gate.register(seq.seq_id, adapter_key)
        self._seqs[leader.seq_id] = leader
        self._by_request.setdefault(request.request_id, []).extend([leader, *leader.pending_fork])
        heapq.heappush(self._waiting, (self.policy.sort_key(leader), leader))
        return leader

    def abort_request(self, request_id: str) -> list[SeqUpdate]:
        """End every sequence of ``request_id`` now, freeing all their blocks."""
        targets = [s for s in self._by_request.pop(request_id, []) if not s.is_finished]
        updates = []
        for seq in targets:
            if not seq.is_finished:
                self._finish(seq, FinishReason.ABORT)
            updates.append(SeqUpdate(seq.seq_id, seq.request_id, seq.sibling_index, [], [],
                                     FinishReason.ABORT.value, seq.num_cached_tokens))
        self._drop_finished_waiting()
        return updates

    def finish_sequence(self, seq_id: int, reason: FinishReason) -> None:
        """End one sequence (e.g. a stop string matched in the front end); frees its blocks."""
        seq = self._seqs.get(seq_id)
        if seq is not None and not seq.is_finished:
            waiting = seq.status is SeqStatus.WAITING
            self._finish(seq, reason)
            if waiting:
                self._drop_finished_waiting()

    def _drop_finished_waiting(self) -> None:
        self._waiting = [(k, s) for k, s in self._waiting if not s.is_finished]
        heapq.heapify(self._waiting)

    # ---------------------------------------------------------------- schedule
    def schedule(self) -> StepPlan:
        """Choose this step's work within the policy's token budget and the free blocks."""
        plan = StepPlan()
        policy = self.policy
        self._running.sort(key=policy.sort_key)
        self._waiting = [(policy.sort_key(seq), seq) for _key, seq in self._waiting]
        heapq.heapify(self._waiting)
        budget = policy.begin_step(self._running, [seq for _key, seq in self._waiting],
                                   self.config.max_num_batched_tokens,
                                   self.config.max_num_seqs - len(self._running), self.clock())
        scheduled_ids: set[int] = set()
        tried_heads: set[int] = set()
        index = 0
        while index < len(self._running) and budget > 0:
            seq = self._running[index]
            if seq.seq_id in scheduled_ids:       # admitted earlier in this step
                index += 1
                continue
            head = self._waiting[0][1] if self._waiting and not plan.preempted_seq_ids else None
            if head is not None and head.seq_id not in tried_heads and policy.admit_before(head, seq):
                tried_heads.add(head.seq_id)      # one try per head: a refused one is not retried
                budget = self._admit_waiting(plan, budget, scheduled_ids, before=seq)
                continue
            if seq.pending_fork and seq.num_tokens_to_compute == 0:
                if not self._fork(seq, plan, scheduled_ids):
                    break
                continue          # the leader and its new siblings are scheduled below
            num_new = min(seq.num_tokens_to_compute, budget)
            if num_new == 0:
                index += 1
                continue
            if not self._make_room(seq, self.kv.blocks_needed(seq, num_new), plan, scheduled_ids):
                break             # seq itself was preempted: nothing newer can run
            self.kv.allocate(seq, num_new)
            plan.scheduled.append(self._scheduled(seq, num_new))
            scheduled_ids.add(seq.seq_id)
            budget -= num_new
            index += 1
        if not plan.preempted_seq_ids:
            budget = self._admit_waiting(plan, budget, scheduled_ids)
        plan.token_budget_left = budget
        policy.end_step([(self._seqs[item.seq_id], item.num_tokens) for item in plan.scheduled])
        return plan

    def wake_in_s(self) -> float | None:
        """Seconds until a sequence the policy holds back may be admitted (None: none is)."""
        return self.policy.wake_in_s(self.clock())

    def _admit_waiting(self, plan: StepPlan, budget: int, scheduled_ids: set[int],
                       before: Sequence | None = None) -> int:
        """Admit waiting sequences in order while budget, sequence slots and blocks allow
        (with ``before``: only those the policy admits ahead of that running sequence)."""
        held_back = []            # gate or policy said not yet: they keep their place in the queue
        while self._waiting and budget > 0 and len(self._running) < self.config.max_num_seqs:
            seq = self._waiting[0][1]
            if before is not None and not self.policy.admit_before(seq, before):
                break
            if (self.policy.holds_back(seq) or seq.seq_id in plan.preempted_seq_ids
                    or not self.gate.acquire(seq.seq_id)):
                held_back.append(heapq.heappop(self._waiting))
                continue
            hit = self.kv.match(seq)
            num_new = min(seq.num_tokens_to_compute_after(hit.num_tokens), budget)
            # Nothing running: grace-protected blocks would never free themselves in time.
            if not self.kv.admit(seq, hit, num_new, include_protected=not self._running):
                self.gate.release(seq.seq_id)
                victim = self._victim_for(seq)
                if victim is None:
                    break         # FCFS for KV: nobody overtakes the head of the queue
                budget += self._unschedule(victim, plan)
                self._preempt(victim, plan)
                continue          # match again: the victim's blocks are free or cached now
            heapq.heappop(self._waiting)
            seq.status = SeqStatus.RUNNING
            self._running.append(seq)
            scheduled_ids.add(seq.seq_id)
            if num_new > 0:
                plan.scheduled.append(self._scheduled(seq, num_new))
                budget -= num_new
        for item in held_back:
            heapq.heappush(self._waiting, item)
        return budget

    def _victim_for(self, seq: Sequence) -> Sequence | None:
        """The last running sequence the policy lets ``seq``'s admission preempt."""
        return next((victim for victim in self._preemption_order()
                     if not victim.pending_fork and self.policy.may_preempt_for(seq, victim)), None)

    @staticmethod
    def _unschedule(seq: Sequence, plan: StepPlan) -> int:
        """Take ``seq`` out of this step's plan; the tokens it had."""
        items = [item for item in plan.scheduled if item.seq_id == seq.seq_id]
        plan.scheduled = [item for item in plan.scheduled if item.seq_id != seq.seq_id]
        return sum(item.num_tokens for item in items)

    def _make_room(self, seq: Sequence, num_blocks: int, plan: StepPlan, scheduled_ids: set[int]) -> bool:
        """Free ``num_blocks`` blocks for ``seq``: eviction first, then preemption of the
        newest unscheduled sequence; if none is left, ``seq`` preempts itself (False)."""
        while not self.kv.make_free(num_blocks):
            victim = self._pick_victim(scheduled_ids | {seq.seq_id})
            if victim is None:
                self._preempt(seq, plan)
                return False
            self._preempt(victim, plan)
        return True

    def _pick_victim(self, protected: set[int]) -> Sequence | None:
        return next((seq for seq in self._preemption_order() if seq.seq_id not in protected), None)

    def _preemption_order(self) -> list[Sequence]:
        """Running sequences, the last in the policy's order first."""
        return sorted(self._running, key=self.policy.sort_key, reverse=True)

    def _preempt(self, seq: Sequence, plan: StepPlan) -> None:
        """Recompute preemption: blocks freed (its full ones stay cached), back to waiting."""
        self.kv.free(seq, grace_s=0.0)
        self.gate.release(seq.seq_id)
        seq.num_computed_tokens = 0
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self._running.remove(seq)
        heapq.heappush(self._waiting, (self.policy.sort_key(seq), seq))
        plan.preempted_seq_ids.append(seq.seq_id)

    def _fork(self, leader: Sequence, plan: StepPlan, scheduled_ids: set[int]) -> bool:
        """Start the leader's pending siblings on its computed prompt prefix (the KV
        manager shares full blocks and copies a partial one)."""
        children = leader.pending_fork
        if not self._make_room(leader, self.kv.fork_blocks_needed(leader, len(children)), plan, scheduled_ids):
            return False
        plan.block_copies.extend(self.kv.fork(leader, children))
        for child in children:
            self.gate.share(child.seq_id, leader.seq_id)
            child.status = SeqStatus.RUNNING
            self._seqs[child.seq_id] = child
        leader.pending_fork = []
        position = self._running.index(leader) + 1
        self._running[position:position] = children
        return True

    def _scheduled(self, seq: Sequence, num_new: int) -> ScheduledSeq:
        start = seq.num_computed_tokens
        sample = start + num_new == seq.num_tokens and not seq.pending_fork
        return ScheduledSeq(
            seq_id=seq.seq_id, token_ids=seq.token_slice(start, start + num_new),
            start_position=start, block_table=list(seq.block_table), sample=sample,
            params=seq.params, prompt_token_ids=seq.prompt_token_ids,
            output_token_ids=seq.output_token_ids, eos_token_ids=seq.eos_token_ids,
            sibling_index=seq.sibling_index, adapter_key=seq.adapter_key,
            want_prompt_logprobs=wants_prompt_logprobs(seq, start, num_new), structured=seq.structured,
            lookahead_limit=self._lookahead_limit(seq, num_new, sample))

    def _lookahead_limit(self, seq: Sequence, num_new: int, sample: bool) -> int:
        """Most lookahead tokens a decoding sequence may verify this step: the step then
        emits up to limit + 1 tokens, within max_tokens, the context and its own cap."""
        if not sample or num_new != 1 or seq.max_lookahead_tokens == 0:
            return 0
        limit = seq.max_tokens - len(seq.output_token_ids) - 1
        if self.max_model_len is not None:
            limit = min(limit, self.max_model_len - seq.num_tokens - 1)
        if seq.max_lookahead_tokens is not None:
            limit = min(limit, seq.max_lookahead_tokens)
        return max(limit, 0)

    # --------------------------------------------------------------- lookahead
    def reserve_lookahead(self, plan: StepPlan, item: ScheduledSeq, num_slots: int) -> int:
        """Reserve up to ``num_slots`` lookahead slots (budget and blocks, never by
        preempting anyone) after ``item``'s tokens; the number granted."""
        seq = self._seqs.get(item.seq_id)
        num_slots = min(num_slots, item.lookahead_limit, plan.token_budget_left)
        if seq is None or num_slots <= 0:
            return 0
        granted = self.kv.allocate_lookahead(seq, item.num_tokens, num_slots)
        if granted:
            item.block_table = list(seq.block_table)
            item.num_lookahead_slots = granted
            plan.token_budget_left -= granted
        return granted

    # ------------------------------------------------------------------ update
    def update(self, plan: StepPlan, result: StepResult) -> list[SeqUpdate]:
        """Advance computed counts, append sampled tokens (accepted lookahead first),
        finish sequences that stop, and give back unused lookahead slots."""
        updates = []
        for item in plan.scheduled:
            seq = self._seqs.get(item.seq_id)
            if seq is None or seq.is_finished or seq.status is not SeqStatus.RUNNING:
                continue          # aborted or preempted after this plan was made
            seq.num_computed_tokens += item.num_tokens
            prompt_lps = new_prompt_logprobs(seq, item, result)
            if not item.sample:
                self.kv.commit(seq)
                if prompt_lps:
                    updates.append(SeqUpdate(seq.seq_id, seq.request_id, seq.sibling_index, [], [], None,
                                             seq.num_cached_tokens, prompt_logprobs=prompt_lps))
                continue
            accepted = result.accepted_lookahead.get(item.seq_id, [])
            emitted, reason = self._append_tokens(seq, accepted + [result.sampled[item.seq_id]])
            # every emitted token but the last had its KV computed in the verification pass
            seq.num_computed_tokens += len(emitted) - 1
            self.kv.commit(seq)
            if reason is not None:
                self._finish(seq, reason)
            elif item.num_lookahead_slots:
                self.kv.trim(seq)
            updates.append(SeqUpdate(seq.seq_id, seq.request_id, seq.sibling_index,
                                     [t.token_id for t in emitted], emitted,
                                     reason.value if reason else None, seq.num_cached_tokens,
                                     len(item.lookahead_token_ids), len(accepted), prompt_lps))
        return updates

    def _append_tokens(self, seq: Sequence, tokens: list[SampledToken]
                       ) -> tuple[list[SampledToken], FinishReason | None]:
        """Append tokens up to the first that stops the sequence; (appended, reason)."""
        emitted = []
        for sampled in tokens:
            seq.output_token_ids.append(sampled.token_id)
            emitted.append(sampled)
            reason = self._stop_reason(seq, sampled.token_id)
            if reason is not None:
                return emitted, reason
        return emitted, None

    @staticmethod
    def _stop_reason(seq: Sequence, token_id: int) -> FinishReason | None:
        params = seq.params
        if len(seq.output_token_ids) >= params.min_tokens:
            if not params.ignore_eos and token_id in seq.eos_token_ids:
                return FinishReason.STOP
            if params.stop_token_ids and token_id in params.stop_token_ids:
                return FinishReason.STOP
        if len(seq.output_token_ids) >= seq.max_tokens:
            return FinishReason.LENGTH
        return None

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        if seq.status is SeqStatus.RUNNING:
            self._running.remove(seq)
        grace_s = seq.cache_grace_s if seq.cache_grace_s is not None else self.config.prefix_cache_grace_s
        if reason is FinishReason.ABORT:
            grace_s = self.policy.abort_grace_s(seq, grace_s)
        self.kv.free(seq, grace_s)
        self.gate.forget(seq.seq_id)
        for child in seq.pending_fork:       # never forked: finish with the leader
            self.gate.forget(child.seq_id)
            child.status = SeqStatus.FINISHED
            child.finish_reason = reason
        seq.pending_fork = []
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        self._seqs.pop(seq.seq_id, None)
        siblings = self._by_request.get(seq.request_id)
        if siblings is not None and all(s.is_finished for s in siblings):
            del self._by_request[seq.request_id]
