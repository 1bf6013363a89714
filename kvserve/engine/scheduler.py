"""Token-budget scheduler: continuous batching with chunked prefill and preemption.

There are no prefill and decode phases. Every sequence has ``num_computed_tokens``
and a number of tokens to compute; each step hands out ``max_num_batched_tokens``
across sequences, running ones first (oldest, highest priority first), then
waiting ones in (priority, arrival) order. When blocks run out, the prefix cache
gives back unlocked blocks first (LRU); only if that cannot cover the need is the
newest lowest-priority running sequence preempted by recompute: its blocks are
freed (the full ones stay cached) and it returns to the waiting queue at its
original place.

With a prefix cache, a sequence is matched against the cache when it is admitted
(its computed count starts at the hit, in whole blocks, never covering its last
token), and its newly full blocks are inserted as they are computed, so concurrent
requests with the same prefix, later turns and recomputes after preemption reuse
them. A running sequence keeps its cache handle locked; a finished one unlocks it
with ``prefix_cache_grace_s`` of protection (a live turn awaiting its next message).

Never imports torch: it sees ints and lists only.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

from kvserve.engine.kv.block_pool import BlockPool
from kvserve.engine.kv.prefix_cache import PrefixCache
from kvserve.engine.sequence import FinishReason, Sequence, SeqStatus
from kvserve.engine.step import ScheduledSeq, SeqUpdate, StepPlan, StepResult


@dataclass(frozen=True)
class SchedulerConfig:
    """Scheduling limits, resolved before the scheduler is built."""

    max_num_seqs: int = 64              # running sequences at once
    max_num_batched_tokens: int = 1024  # tokens computed per step (all sequences)
    prefix_cache_grace_s: float = 0.0   # a finished request's cached blocks stay unevictable this long


class Scheduler:
    """Owns sequences and their block tables; produces StepPlans, consumes StepResults."""

    def __init__(self, config: SchedulerConfig, block_pool: BlockPool, prefix_cache: PrefixCache | None = None,
                 spec_controller=None, max_model_len: int | None = None):
        self.config = config
        self.block_pool = block_pool
        self.prefix_cache = prefix_cache       # None: no caching at all
        self.spec = spec_controller            # kvserve.speculative.controller.SpecController, or None
        self.max_model_len = max_model_len     # drafts never run past it
        self._waiting: list[tuple[tuple[int, int, int], Sequence]] = []   # heap by sort_key
        self._running: list[Sequence] = []
        self._seqs: dict[int, Sequence] = {}
        self._by_request: dict[str, list[Sequence]] = {}
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

    def live_block_tables(self) -> list[list[int]]:
        """Block tables of every sequence holding blocks (for integrity checks)."""
        return [seq.block_table for seq in self._running]

    def check_integrity(self) -> None:
        """Assert free + cached-only + in use == total, every reference accounted for
        (sequences' block tables plus the cache's one), the cache tree sound and its
        locks held exactly by the running sequences' handles."""
        self.block_pool.check_integrity(self.live_block_tables())
        if self.prefix_cache is not None:
            self.prefix_cache.check_integrity(s.cache_handle for s in self._running if s.cache_handle)
        for _key, seq in self._waiting:
            if seq.block_table or seq.cache_handle is not None:
                raise AssertionError(f"waiting sequence {seq.seq_id} holds blocks or a cache lock")

    # ------------------------------------------------------------- admission
    def add_sequence(self, seq: Sequence) -> None:
        """Queue a new sequence (its siblings, if any, travel in ``seq.pending_fork``)."""
        seq.status = SeqStatus.WAITING
        self._seqs[seq.seq_id] = seq
        self._by_request.setdefault(seq.request_id, []).append(seq)
        for child in seq.pending_fork:
            self._by_request[seq.request_id].append(child)
        heapq.heappush(self._waiting, (seq.sort_key, seq))

    def abort_request(self, request_id: str) -> list[SeqUpdate]:
        """End every sequence of ``request_id`` now, freeing all their blocks."""
        targets = [s for s in self._by_request.pop(request_id, []) if not s.is_finished]
        updates = []
        for seq in targets:
            if not seq.is_finished:
                self._finish(seq, FinishReason.ABORT)
            updates.append(SeqUpdate(seq.seq_id, seq.request_id, seq.sibling_index, [], [],
                                     FinishReason.ABORT.value, seq.num_cached_tokens))
        self._waiting = [(k, s) for k, s in self._waiting if not s.is_finished]
        heapq.heapify(self._waiting)
        return updates

    # -------------------------------------------------------------- schedule
    def schedule(self) -> StepPlan:
        """Choose this step's work within the token budget and the free blocks."""
        plan = StepPlan()
        budget = self.config.max_num_batched_tokens
        self._running.sort(key=lambda s: s.sort_key)
        scheduled_ids: set[int] = set()
        index = 0
        while index < len(self._running) and budget > 0:
            seq = self._running[index]
            if seq.pending_fork and seq.num_tokens_to_compute == 0:
                if not self._fork(seq, plan, scheduled_ids):
                    break
                continue          # the leader and its new siblings are scheduled below
            num_new = min(seq.num_tokens_to_compute, budget)
            if num_new == 0:
                index += 1
                continue
            if not self._reserve_blocks(seq, num_new, plan, scheduled_ids):
                break             # seq itself was preempted: nothing newer can run
            plan.scheduled.append(self._scheduled(seq, num_new))
            scheduled_ids.add(seq.seq_id)
            budget -= num_new
            index += 1
        if not plan.preempted_seq_ids:
            budget = self._admit_waiting(plan, budget)
        if self.spec is not None:
            self._add_draft_slots(plan, budget)
        return plan

    def _add_draft_slots(self, plan: StepPlan, budget: int) -> None:
        """Speculative decoding: give decoding sequences room for draft tokens, as many
        as the controller picks within the leftover budget, the sequence's own limits
        (max_tokens, context) and the blocks free without preempting anyone."""
        candidates, items = [], {}
        for item in plan.scheduled:
            seq = self._seqs.get(item.seq_id)
            if seq is None or not item.sample or item.num_tokens != 1 or seq.num_speculative_tokens == 0:
                continue
            limit = seq.max_tokens - len(seq.output_token_ids) - 1        # the verified step emits limit + 1
            if self.max_model_len is not None:
                limit = min(limit, self.max_model_len - seq.num_tokens - 1)
            if seq.num_speculative_tokens is not None:
                limit = min(limit, seq.num_speculative_tokens)
            if limit > 0:
                candidates.append((seq.seq_id, limit))
                items[seq.seq_id] = (item, seq)
        if not candidates:
            return
        for seq_id, k in self.spec.plan(candidates, plan.num_tokens).items():
            item, seq = items[seq_id]
            k = min(k, budget)
            pool = self.block_pool
            needed = pool.blocks_for_tokens(seq.num_computed_tokens + 1 + k) - len(seq.block_table)
            if needed > 0 and not self._evict_for(needed):
                # drafts never preempt anyone: use what is free
                k = (len(seq.block_table) + pool.num_free_blocks) * pool.block_size - seq.num_computed_tokens - 1
                k = min(k, budget)
                needed = pool.blocks_for_tokens(seq.num_computed_tokens + 1 + k) - len(seq.block_table)
            if k <= 0:
                continue
            if needed > 0:
                seq.block_table.extend(self.block_pool.allocate(needed))
                item.block_table = list(seq.block_table)
            item.num_draft_slots = k
            budget -= k

    def _admit_waiting(self, plan: StepPlan, budget: int) -> int:
        pool = self.block_pool
        while self._waiting and budget > 0 and len(self._running) < self.config.max_num_seqs:
            seq = self._waiting[0][1]
            handle = self._match_prefix(seq)            # locked, or None
            hit_blocks = list(handle.block_ids) if handle is not None else []
            seq.num_computed_tokens = len(hit_blocks) * pool.block_size
            num_new = min(seq.num_tokens_to_compute, budget)
            needed = pool.blocks_for_tokens(seq.num_computed_tokens + num_new) - len(hit_blocks)
            # Nothing running: grace-protected blocks would never free themselves in time.
            if not self._evict_for(needed, include_protected=not self._running):
                seq.num_computed_tokens = 0
                if handle is not None:
                    self.prefix_cache.unlock(handle)
                break             # FCFS: nobody overtakes the head of the queue
            heapq.heappop(self._waiting)
            pool.share(hit_blocks)
            seq.block_table = hit_blocks + (pool.allocate(needed) or [])
            seq.cache_handle = handle
            if handle is not None:
                self.prefix_cache.record_query(seq.num_tokens, seq.num_computed_tokens)
                if seq.num_preemptions == 0:
                    seq.num_cached_tokens = seq.num_computed_tokens
            seq.status = SeqStatus.RUNNING
            self._running.append(seq)
            if num_new > 0:
                plan.scheduled.append(self._scheduled(seq, num_new))
                budget -= num_new
        return budget

    def _match_prefix(self, seq: Sequence):
        """The locked cache handle of ``seq``'s longest cached prefix (never its last
        token), or None when ``seq`` does not use the cache."""
        if self.prefix_cache is None or seq.cache_namespace is None:
            return None
        tokens = seq.token_slice(0, seq.num_tokens)
        handle = self.prefix_cache.match(seq.cache_namespace, tokens, max_tokens=seq.num_tokens - 1)
        self.prefix_cache.lock(handle)
        return handle

    def _evict_for(self, num_blocks: int, include_protected: bool = False) -> bool:
        """Make ``num_blocks`` blocks free, evicting unlocked cached blocks if needed
        (those within their grace time only if ``include_protected``). False if even
        that cannot (the caller preempts or waits)."""
        pool = self.block_pool
        while num_blocks > pool.num_free_blocks and self.prefix_cache is not None:
            if not self.prefix_cache.evict(num_blocks - pool.num_free_blocks, include_protected):
                break
        return num_blocks <= pool.num_free_blocks

    def _reserve_blocks(self, seq: Sequence, num_new: int, plan: StepPlan,
                        scheduled_ids: set[int]) -> bool:
        """Grow ``seq``'s block table for ``num_new`` tokens, evicting cached blocks,
        then preempting newer sequences, while blocks are short. False if ``seq`` had
        to preempt itself."""
        pool = self.block_pool
        needed = pool.blocks_for_tokens(seq.num_computed_tokens + num_new) - len(seq.block_table)
        if not self._make_room(needed, seq, plan, scheduled_ids):
            return False
        if needed > 0:
            seq.block_table.extend(pool.allocate(needed))
        return True

    def _make_room(self, num_blocks: int, seq: Sequence, plan: StepPlan, scheduled_ids: set[int]) -> bool:
        """Free ``num_blocks`` blocks for ``seq``: eviction first, then preemption of the
        newest unscheduled sequence; if none is left, ``seq`` preempts itself (False)."""
        while not self._evict_for(num_blocks):
            victim = self._pick_victim(scheduled_ids | {seq.seq_id})
            if victim is None:
                self._preempt(seq, plan)
                return False
            self._preempt(victim, plan)
        return True

    def _pick_victim(self, protected: set[int]) -> Sequence | None:
        for seq in reversed(self._running):          # newest, lowest priority last
            if seq.seq_id not in protected:
                return seq
        return None

    def _preempt(self, seq: Sequence, plan: StepPlan) -> None:
        """Recompute preemption: blocks freed (its full ones stay cached), back to waiting."""
        self._release_cache_handle(seq, grace_s=0.0)
        self.block_pool.free(seq.block_table)
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self._running.remove(seq)
        heapq.heappush(self._waiting, (seq.sort_key, seq))
        plan.preempted_seq_ids.append(seq.seq_id)

    def _fork(self, leader: Sequence, plan: StepPlan, scheduled_ids: set[int]) -> bool:
        """Give each pending sibling the leader's computed prompt prefix: full blocks
        are shared (and the leader's cache handle locked once more per sibling), a
        partially filled last block is copied (copy-on-write)."""
        pool = self.block_pool
        children = leader.pending_fork
        num_full = leader.num_computed_tokens // pool.block_size
        has_partial = leader.num_computed_tokens % pool.block_size != 0
        if not self._make_room(len(children) if has_partial else 0, leader, plan, scheduled_ids):
            return False
        shared = leader.block_table[:num_full]
        for child in children:
            pool.share(shared)
            child.block_table = list(shared)
            if has_partial:
                copy = pool.allocate(1)[0]
                plan.block_copies.append((leader.block_table[num_full], copy))
                child.block_table.append(copy)
            child.num_computed_tokens = leader.num_computed_tokens
            child.num_cached_tokens = leader.num_cached_tokens
            if leader.cache_handle is not None:
                self.prefix_cache.lock(leader.cache_handle)
                child.cache_handle = leader.cache_handle
            child.status = SeqStatus.RUNNING
            self._seqs[child.seq_id] = child
        leader.pending_fork = []
        position = self._running.index(leader) + 1
        self._running[position:position] = children
        return True

    # ------------------------------------------------------------ prefix cache
    def _cache_full_blocks(self, seq: Sequence) -> None:
        """Insert ``seq``'s newly computed full blocks into the cache and move its lock
        to the longer prefix."""
        old = seq.cache_handle
        if old is None:
            return
        bs = self.block_pool.block_size
        num_full = seq.num_computed_tokens // bs
        if num_full <= old.num_blocks:
            return
        start = old.num_blocks
        new = self.prefix_cache.insert(old, seq.token_slice(start * bs, num_full * bs),
                                       seq.block_table[start:num_full])
        self.prefix_cache.lock(new)
        self.prefix_cache.unlock(old)
        seq.cache_handle = new

    def _release_cache_handle(self, seq: Sequence, grace_s: float) -> None:
        if seq.cache_handle is not None:
            self.prefix_cache.unlock(seq.cache_handle, grace_s)
            seq.cache_handle = None

    def reset_prefix_cache(self) -> int:
        """Drop every cached block no running sequence uses; returns how many."""
        return self.prefix_cache.reset() if self.prefix_cache is not None else 0

    @staticmethod
    def _scheduled(seq: Sequence, num_new: int) -> ScheduledSeq:
        start = seq.num_computed_tokens
        return ScheduledSeq(
            seq_id=seq.seq_id, token_ids=seq.token_slice(start, start + num_new),
            start_position=start, block_table=list(seq.block_table),
            sample=start + num_new == seq.num_tokens and not seq.pending_fork,
            params=seq.params, prompt_token_ids=seq.prompt_token_ids,
            output_token_ids=seq.output_token_ids, eos_token_ids=seq.eos_token_ids,
            sibling_index=seq.sibling_index,
            want_prompt_logprobs=(seq.params.prompt_logprobs is not None and seq.sibling_index == 0
                                  and start + num_new > seq.num_prompt_logprobs_done - 1
                                  and start < len(seq.prompt_token_ids) - 1))

    # ---------------------------------------------------------------- update
    def update(self, plan: StepPlan, result: StepResult) -> list[SeqUpdate]:
        """Advance computed counts, append sampled tokens (accepted drafts first), finish
        sequences that stop, and give back the blocks reserved for rejected drafts."""
        updates = []
        for item in plan.scheduled:
            seq = self._seqs.get(item.seq_id)
            if seq is None or seq.is_finished or seq.status is not SeqStatus.RUNNING:
                continue          # aborted or preempted after this plan was made
            seq.num_computed_tokens += item.num_tokens
            prompt_lps = self._new_prompt_logprobs(seq, item, result)
            if not item.sample:
                self._cache_full_blocks(seq)
                if prompt_lps:
                    updates.append(SeqUpdate(seq.seq_id, seq.request_id, seq.sibling_index, [], [], None,
                                             seq.num_cached_tokens, prompt_logprobs=prompt_lps))
                continue
            accepted = result.accepted_drafts.get(item.seq_id, [])
            emitted, reason = [], None
            for sampled in accepted + [result.sampled[item.seq_id]]:
                seq.output_token_ids.append(sampled.token_id)
                emitted.append(sampled)
                reason = self._stop_reason(seq, sampled.token_id)
                if reason is not None:
                    break
            # every emitted token but the last had its KV computed in the verification pass
            seq.num_computed_tokens += len(emitted) - 1
            self._cache_full_blocks(seq)
            if reason is not None:
                self._finish(seq, reason)
            elif item.num_draft_slots:
                self._release_draft_blocks(seq)
            updates.append(SeqUpdate(seq.seq_id, seq.request_id, seq.sibling_index,
                                     [t.token_id for t in emitted], emitted,
                                     reason.value if reason else None, seq.num_cached_tokens,
                                     len(item.draft_token_ids), len(accepted), prompt_lps))
        return updates

    @staticmethod
    def _new_prompt_logprobs(seq: Sequence, item: ScheduledSeq, result: StepResult) -> list:
        """The prompt logprobs this chunk produced that were not reported before."""
        produced = result.prompt_logprobs.get(item.seq_id)
        if not produced:
            return []
        first_position = item.start_position + 1              # position of produced[0]
        skip = max(0, seq.num_prompt_logprobs_done - first_position)
        fresh = produced[skip:]
        seq.num_prompt_logprobs_done = max(seq.num_prompt_logprobs_done, first_position + len(produced))
        return fresh

    def _release_draft_blocks(self, seq: Sequence) -> None:
        """Free blocks reserved for drafts that were rejected (or never proposed): a
        sequence holds exactly the blocks of its computed tokens."""
        keep = self.block_pool.blocks_for_tokens(seq.num_computed_tokens)
        if len(seq.block_table) > keep:
            self.block_pool.free(seq.block_table[keep:])
            del seq.block_table[keep:]

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
        self._release_cache_handle(seq, 0.0 if reason is FinishReason.ABORT else grace_s)
        if seq.block_table:
            self.block_pool.free(seq.block_table)
            seq.block_table = []
        for child in seq.pending_fork:       # never forked: finish with the leader
            child.status = SeqStatus.FINISHED
            child.finish_reason = reason
        seq.pending_fork = []
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        self._seqs.pop(seq.seq_id, None)
        siblings = self._by_request.get(seq.request_id)
        if siblings is not None and all(s.is_finished for s in siblings):
            del self._by_request[seq.request_id]

    def finish_sequence(self, seq_id: int, reason: FinishReason) -> None:
        """End one sequence (e.g. a stop string matched in the front end); frees its blocks."""
        seq = self._seqs.get(seq_id)
        if seq is not None and not seq.is_finished:
            if seq.status is SeqStatus.WAITING:
                self._waiting = [(k, s) for k, s in self._waiting if s is not seq]
                heapq.heapify(self._waiting)
            self._finish(seq, reason)
