"""KVCacheManager: every decision about KV blocks, so the scheduler only decides who runs.

It owns the block pool and the prefix cache and is the only writer of a sequence's
``block_table``, ``cache_handle`` and (at admission) ``num_computed_tokens``:

    admit      match the prompt against the cache (whole blocks, never the last
               token), share and lock the hit, allocate the rest for the first chunk
    allocate   grow a running sequence's table for its next tokens
    fork       give n > 1 siblings the leader's prompt blocks (full blocks shared,
               a partial last block copied: copy-on-write)
    commit     insert newly computed full blocks into the cache, move the lock
    trim       free blocks past the computed tokens (unused lookahead slots)
    free       release a finished or preempted sequence's lock (with grace) and blocks

A block table covers positions ``[0, len(table) * block_size)``::

    |<- hit (shared, locked) ->|<- computed ->|<- this step ->|<- lookahead ->|
    0                     num_cached     num_computed     + n tokens      + k slots

"Cannot allocate" is a ``False`` return that the scheduler answers by preempting
someone (``make_free`` evicts unlocked cached blocks first, LRU). Pure Python.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from kvserve.engine.kv.block_pool import BlockPool
from kvserve.engine.kv.cache_events import CacheEvent, CacheNamespace
from kvserve.engine.kv.prefix_cache import PrefixCache, PrefixCacheStats, PrefixHandle


@dataclass(frozen=True)
class PrefixHit:
    """A locked prefix-cache match for a waiting sequence (``handle`` None: no cache)."""

    handle: PrefixHandle | None
    num_tokens: int                 # tokens covered by the hit, whole blocks

    @property
    def block_ids(self) -> list[int]:
        return list(self.handle.block_ids) if self.handle is not None else []


NO_HIT = PrefixHit(None, 0)


@dataclass
class PendingImport:
    """Blocks taken to receive KV from another engine (prefill/decode disaggregation).

    ``handle`` locks the prefix the importer already caches (``num_present`` blocks);
    ``block_ids`` (one reference each, held by the import) receive blocks
    ``[num_present, num_present + len(block_ids))`` of the prompt. The caller writes
    their KV, then ``finish_import`` puts them in the cache or ``cancel_import`` frees
    them; either releases every reference and lock the import took."""

    namespace: CacheNamespace
    token_ids: list[int]
    handle: PrefixHandle
    num_present: int
    block_ids: list[int]


@dataclass(frozen=True)
class KVImportResult:
    """What an import of ``num_offered`` blocks did: ``num_imported`` written and cached,
    ``num_present`` already cached here (skipped), ``num_dropped`` refused (no room, a gap
    before them, or hashes that disagree with this engine's namespace)."""

    num_offered: int
    num_imported: int
    num_present: int
    num_dropped: int


class KVCacheManager:
    """Blocks for sequences: allocation, prefix reuse, forks, eviction, integrity."""

    def __init__(self, block_pool: BlockPool, prefix_cache: PrefixCache | None = None):
        self.block_pool = block_pool
        self.prefix_cache = prefix_cache       # None: no caching at all
        self.weight_epoch = 0

    # ----------------------------------------------------------------- numbers
    @property
    def block_size(self) -> int:
        return self.block_pool.block_size

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    def blocks_needed(self, seq, num_tokens: int) -> int:
        """Blocks ``seq`` lacks to hold positions up to ``num_computed + num_tokens``."""
        return self.block_pool.blocks_for_tokens(seq.num_computed_tokens + num_tokens) - len(seq.block_table)

    def namespace_for(self, adapter_id: str | None, cache_salt: str | None,
                      uses_cache: bool) -> CacheNamespace | None:
        """The cache namespace a new request reads and writes (None: it opts out or the
        cache is off). It carries the current weight epoch."""
        if self.prefix_cache is None or not uses_cache:
            return None
        return CacheNamespace(adapter_id, self.weight_epoch, cache_salt)

    # --------------------------------------------------------------- eviction
    def make_free(self, num_blocks: int, include_protected: bool = False) -> bool:
        """Ensure ``num_blocks`` free blocks, evicting unlocked cached blocks (LRU; those
        within their grace time only if ``include_protected``). False if even that cannot."""
        pool = self.block_pool
        while num_blocks > pool.num_free_blocks and self.prefix_cache is not None:
            if not self.prefix_cache.evict(num_blocks - pool.num_free_blocks, include_protected):
                break
        return num_blocks <= pool.num_free_blocks

    # -------------------------------------------------------------- admission
    def match(self, seq) -> PrefixHit:
        """Lock ``seq``'s longest cached prefix (never its last token): the caller either
        ``admit``s with it or ``release``s it."""
        if self.prefix_cache is None or seq.cache_namespace is None:
            return NO_HIT
        handle = self.prefix_cache.match(seq.cache_namespace, seq.token_slice(0, seq.num_tokens),
                                         max_tokens=seq.num_tokens - 1)
        self.prefix_cache.lock(handle)
        return PrefixHit(handle, handle.num_tokens)

    def release(self, hit: PrefixHit) -> None:
        """Unlock a match that was not admitted."""
        if hit.handle is not None:
            self.prefix_cache.unlock(hit.handle)

    def admit(self, seq, hit: PrefixHit, num_new_tokens: int, include_protected: bool) -> bool:
        """Start ``seq`` at its hit and give it blocks for ``num_new_tokens`` more; False
        (hit released, nothing changed) if the blocks cannot be made free."""
        hit_blocks = hit.block_ids
        needed = self.block_pool.blocks_for_tokens(hit.num_tokens + num_new_tokens) - len(hit_blocks)
        if not self.make_free(needed, include_protected):
            self.release(hit)
            return False
        self.block_pool.share(hit_blocks)
        seq.block_table = hit_blocks + (self.block_pool.allocate(needed) or [])
        seq.cache_handle = hit.handle
        seq.num_computed_tokens = hit.num_tokens
        if hit.handle is not None:
            self.prefix_cache.record_query(seq.num_tokens, hit.num_tokens)
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = hit.num_tokens
        return True

    # ------------------------------------------------------------- allocation
    def allocate(self, seq, num_new_tokens: int) -> bool:
        """Grow ``seq``'s table to hold ``num_new_tokens`` more tokens, evicting cached
        blocks if needed; False (nothing changed) if too few blocks can be freed."""
        needed = self.blocks_needed(seq, num_new_tokens)
        if needed <= 0:
            return True
        if not self.make_free(needed):
            return False
        seq.block_table.extend(self.block_pool.allocate(needed))
        return True

    def allocate_lookahead(self, seq, num_tokens: int, num_slots: int) -> int:
        """Reserve up to ``num_slots`` positions after ``seq``'s next ``num_tokens`` tokens
        without preempting anyone (eviction only); the number reserved."""
        pool = self.block_pool
        needed = self.blocks_needed(seq, num_tokens + num_slots)
        if needed > 0 and not self.make_free(needed):
            room = (len(seq.block_table) + pool.num_free_blocks) * pool.block_size
            num_slots = min(num_slots, room - seq.num_computed_tokens - num_tokens)
            needed = self.blocks_needed(seq, num_tokens + num_slots)
        if num_slots <= 0:
            return 0
        if needed > 0:
            seq.block_table.extend(pool.allocate(needed))
        return num_slots

    def fork_blocks_needed(self, leader, num_children: int) -> int:
        """Blocks a fork of ``num_children`` siblings takes (one copy each of a partial block)."""
        return num_children if leader.num_computed_tokens % self.block_size else 0

    def fork(self, leader, children: list) -> list[tuple[int, int]]:
        """Give each child the leader's computed prefix: full blocks shared (and the
        leader's cache handle locked once more), a partial last block copied. The caller
        made ``fork_blocks_needed`` blocks free. Returns the (src, dst) block copies."""
        pool, copies = self.block_pool, []
        num_full = leader.num_computed_tokens // self.block_size
        shared = leader.block_table[:num_full]
        for child in children:
            pool.share(shared)
            child.block_table = list(shared)
            if leader.num_computed_tokens % self.block_size:
                copy = pool.allocate(1)[0]
                copies.append((leader.block_table[num_full], copy))
                child.block_table.append(copy)
            child.num_computed_tokens = leader.num_computed_tokens
            child.num_cached_tokens = leader.num_cached_tokens
            if leader.cache_handle is not None:
                self.prefix_cache.lock(leader.cache_handle)
                child.cache_handle = leader.cache_handle
        return copies

    # ------------------------------------------------------------ after a step
    def commit(self, seq) -> None:
        """Insert ``seq``'s newly computed full blocks into the cache and move its lock
        to the longer prefix."""
        old = seq.cache_handle
        if old is None:
            return
        bs = self.block_size
        num_full = seq.num_computed_tokens // bs
        if num_full <= old.num_blocks:
            return
        start = old.num_blocks
        new = self.prefix_cache.insert(old, seq.token_slice(start * bs, num_full * bs),
                                       seq.block_table[start:num_full])
        self.prefix_cache.lock(new)
        self.prefix_cache.unlock(old)
        seq.cache_handle = new

    def trim(self, seq) -> None:
        """Free blocks past ``seq``'s computed tokens (lookahead slots left unused): a
        sequence holds exactly the blocks of its computed tokens."""
        keep = self.block_pool.blocks_for_tokens(seq.num_computed_tokens)
        if len(seq.block_table) > keep:
            self.block_pool.free(seq.block_table[keep:])
            del seq.block_table[keep:]

    def free(self, seq, grace_s: float = 0.0) -> None:
        """Unlock ``seq``'s cached prefix (protected from eviction for ``grace_s``) and
        drop its references to its blocks; full cached ones stay in the cache."""
        if seq.cache_handle is not None:
            self.prefix_cache.unlock(seq.cache_handle, grace_s)
            seq.cache_handle = None
        if seq.block_table:
            self.block_pool.free(seq.block_table)
            seq.block_table = []

    # ------------------------------------------------ import / export (disagg)
    def lock_prompt_prefix(self, namespace: CacheNamespace, token_ids: list[int]) -> PrefixHandle:
        """Lock the cached full blocks of a prompt (never its last token, as ``match``),
        e.g. to read their KV out; the caller must ``unlock_prefix`` it."""
        handle = self.prefix_cache.match(namespace, list(token_ids), max_tokens=len(token_ids) - 1)
        self.prefix_cache.lock(handle)
        return handle

    def unlock_prefix(self, handle: PrefixHandle, grace_s: float = 0.0) -> None:
        """Release a lock from ``lock_prompt_prefix`` (protected ``grace_s`` seconds more)."""
        self.prefix_cache.unlock(handle, grace_s)

    def num_cached_prompt_blocks(self, namespace: CacheNamespace, token_ids: list[int]) -> int:
        """Leading full blocks of a prompt this cache holds (no lock is left behind)."""
        handle = self.lock_prompt_prefix(namespace, token_ids)
        self.unlock_prefix(handle)
        return handle.num_blocks

    def begin_import(self, namespace: CacheNamespace, token_ids: list[int], first_block: int,
                     num_blocks: int) -> PendingImport | None:
        """Take blocks to receive blocks ``[first_block, first_block + num_blocks)`` of the
        prompt ``token_ids`` (whole blocks, the last token never included). Blocks this
        cache already holds are not taken (``num_present`` may exceed ``first_block``);
        if the cache lacks blocks before ``first_block`` (a gap) or nothing is left to
        import, returns None and holds nothing. Evicts unlocked cached blocks (LRU) to
        make room and takes as many as it can (a prefix of the range)."""
        if self.prefix_cache is None:
            return None
        bs = self.block_size
        num_full = min((len(token_ids) - 1) // bs, first_block + num_blocks)
        handle = self.lock_prompt_prefix(namespace, token_ids)
        present = handle.num_blocks
        wanted = num_full - present
        if present < first_block or wanted <= 0:
            self.unlock_prefix(handle)
            return None
        self.make_free(wanted)
        block_ids = self.block_pool.allocate(min(wanted, self.block_pool.num_free_blocks)) or []
        if not block_ids:
            self.unlock_prefix(handle)
            return None
        return PendingImport(namespace, list(token_ids[:(present + len(block_ids)) * bs]), handle, present,
                             block_ids)

    def finish_import(self, pending: PendingImport, grace_s: float = 0.0) -> PrefixHandle:
        """Insert the written blocks into the cache (they become cached-only, protected
        ``grace_s`` seconds so the request they were moved for finds them); returns the
        handle of the longer prefix, unlocked."""
        bs, cache = self.block_size, self.prefix_cache
        start = pending.num_present * bs
        new = cache.insert(pending.handle, pending.token_ids[start:], pending.block_ids)
        cache.lock(new)
        cache.unlock(pending.handle)
        self.block_pool.free(pending.block_ids)
        cache.unlock(new, grace_s)
        return new

    def cancel_import(self, pending: PendingImport) -> None:
        """Give back an import's blocks and lock without caching anything."""
        self.block_pool.free(pending.block_ids)
        self.prefix_cache.unlock(pending.handle)

    # ------------------------------------------------------------ cache admin
    def reset_prefix_cache(self) -> int:
        """Drop every cached block no running sequence uses; returns how many."""
        return self.prefix_cache.reset() if self.prefix_cache is not None else 0

    def bump_weight_epoch(self) -> int:
        """New requests get a new namespace epoch; older epochs' unlocked blocks go now."""
        self.weight_epoch += 1
        if self.prefix_cache is not None:
            epoch = self.weight_epoch
            self.prefix_cache.evict_namespaces(lambda ns: ns.weight_epoch < epoch)
        return self.weight_epoch

    def drain_events(self) -> list[CacheEvent]:
        """Block stored / removed events since the last drain."""
        return self.prefix_cache.drain_events() if self.prefix_cache is not None else []

    def cache_stats(self) -> PrefixCacheStats | None:
        return self.prefix_cache.stats() if self.prefix_cache is not None else None

    def check_integrity(self, running: Iterable, waiting: Iterable = ()) -> None:
        """Assert free + cached-only + in use == total, every reference held by a running
        sequence's table or the cache, the tree sound and its locks held exactly by the
        running sequences' handles; waiting sequences hold nothing."""
        running = list(running)
        self.block_pool.check_integrity([seq.block_table for seq in running])
        if self.prefix_cache is not None:
            self.prefix_cache.check_integrity(s.cache_handle for s in running if s.cache_handle)
        for seq in waiting:
            if seq.block_table or seq.cache_handle is not None:
                raise AssertionError(f"waiting sequence {seq.seq_id} holds blocks or a cache lock")
