"""The coalesced replica with a prefix cache kept per prefix group.

``PrefixCachingReplica`` is ``BatchReplica`` (decode runs coalesced, a day of a fleet in
seconds) whose KV pool also holds the shared prefixes of prefix groups (``prompt_ids.py``): a
group's prefix, its whole blocks, enters the cache when the first request of the group that
missed it has computed its prompt; a later request of the group that is admitted while it is
there starts its prefill after those blocks (the log records them as its cached tokens) and
reserves only the rest of its prompt and its output. A group in the cache costs its blocks once,
whatever the number of its requests running; a group no running request reads is evictable,
least recently used first, when an admission needs the room.

So it keeps what the engine's ``PrefixCache`` does at the grain of a group rather than a block,
and the differences are stated: a request's own blocks are not kept (two requests' own tokens
never share a block: ``prompt_ids.py``); a group enters the cache when a prompt completes, not
block by block as chunks are computed (a request that arrives during the first one's prefill
misses it entirely, where the engine gives it the blocks computed so far); eviction takes a
group's prefix whole, not its last blocks first. ``SchedulerReplica(prefix_cache=True)`` runs the
engine's real cache step by step: a test holds the two together on cached share and TTFT.

When the deployment's router reads cache events (``kv_aware``), ``cache_listener`` hears a
group's ``BlockStored`` when it enters and its ``BlockRemoved`` when it is evicted, with the
block hashes a real engine would publish for those tokens.
"""
from __future__ import annotations

from collections import OrderedDict

from kvserve.engine.kv.cache_events import BlockRemoved, BlockStored, CacheNamespace
from kvserve.fleetsim.log import RequestLog
from kvserve.fleetsim.prompt_ids import prompt_token_ids
from kvserve.fleetsim.replica import BatchReplica
from kvserve.fleetsim.sizing import ReplicaSizing
from kvserve.router.index import request_block_hashes

BLOCK_SIZE = 16


class GroupCache:
    """What a replica's pool caches: key -> [tokens, requests reading it], least recently used
    first. A key >= 0 is a prefix group; a negative one a finished request's own blocks."""

    def __init__(self):
        self.groups: OrderedDict[int, list[int]] = OrderedDict()
        self.held_tokens = 0                   # tokens of every resident group
        self.pinned_tokens = 0                 # tokens of the groups running requests read

    def __contains__(self, group: int) -> bool:
        return group in self.groups

    def tokens(self, group: int) -> int:
        """The cached prefix of ``group`` (0 if not resident)."""
        entry = self.groups.get(group)
        return entry[0] if entry is not None else 0

    def evictable_tokens(self, keep: int) -> int:
        """Tokens eviction could free, ``keep``'s group left alone."""
        spare = self.held_tokens - self.pinned_tokens
        entry = self.groups.get(keep)
        return spare - entry[0] if entry is not None and entry[1] == 0 else spare

    def insert(self, group: int, tokens: int) -> None:
        """``group``'s prefix is resident, read by the request that computed it."""
        self.groups[group] = [tokens, 1]
        self.held_tokens += tokens
        self.pinned_tokens += tokens

    def acquire(self, group: int) -> None:
        """One more running request reads ``group`` (its recency refreshed)."""
        entry = self.groups[group]
        if entry[1] == 0:
            self.pinned_tokens += entry[0]
        entry[1] += 1
        self.groups.move_to_end(group)

    def release(self, group: int) -> None:
        entry = self.groups[group]
        entry[1] -= 1
        if entry[1] == 0:
            self.pinned_tokens -= entry[0]

    def keep(self, key: int, tokens: int) -> None:
        """Blocks no request reads enter the cache, most recently used (a finished request's own)."""
        self.groups[key] = [tokens, 0]
        self.held_tokens += tokens

    def evict(self, tokens: int) -> list[int]:
        """Evict unread entries, least recently used first, until ``tokens`` are freed; the
        keys evicted."""
        gone = []
        for key, (size, readers) in self.groups.items():
            if tokens <= 0:
                break
            if readers == 0:
                gone.append(key)
                tokens -= size
        for key in gone:
            self.held_tokens -= self.groups.pop(key)[0]
        return gone


class PrefixCachingReplica(BatchReplica):
    """``BatchReplica`` with a prefix cache per prefix group (the module docstring)."""

    def __init__(self, name: str, sizing: ReplicaSizing, log: RequestLog, block_size: int = BLOCK_SIZE):
        super().__init__(name, sizing, log)
        self.block_size = block_size
        self.cache = GroupCache()
        self.reads: dict[int, tuple[int, int]] = {}     # running request -> (group, cached tokens it reads)
        self.queued: dict[int, int] = {}                # request -> uncached prompt tokens, until its first token
        self.hashes: dict[int, list[int]] = {}          # group -> its prefix's block hashes (for events)
        self.cache_listener = None                      # called with (name, events); set by the deployment

    @property
    def kv_usage(self) -> float:
        used = self.reserved + self.cache.pinned_tokens
        return used / self.kv_tokens if self.kv_tokens else 0.0

    def _shareable(self, request: int) -> int:
        """Whole blocks of ``request``'s group prefix, at least one prompt token left to compute."""
        log = self.log
        if log.prefix_group[request] < 0:
            return 0
        bs = self.block_size
        return min(log.prefix_len[request] // bs, (log.prompt[request] - 1) // bs) * bs

    def _hit(self, request: int) -> int:
        group = self.log.prefix_group[request]
        return min(self.cache.tokens(group), self._shareable(request)) if group >= 0 else 0

    def _queue(self, request: int) -> int:
        self.queued[request] = uncached = self.log.prompt[request] - self._hit(request)
        return uncached

    def _answered(self, request: int) -> int:
        return self.queued.pop(request)

    def _fits(self, request: int) -> bool:
        need = self.log.prompt[request] + self.log.output[request] - self._hit(request)
        spare = self.kv_tokens - self.reserved - self.cache.held_tokens
        return need <= spare + self.cache.evictable_tokens(self.log.prefix_group[request])

    def _admit(self, request: int) -> int:
        log, group = self.log, self.log.prefix_group[request]
        hit = self._hit(request)
        if hit:
            self.cache.acquire(group)
            self.reads[request] = (group, hit)
        need = log.prompt[request] + log.output[request] - hit
        over = self.reserved + self.cache.held_tokens + need - self.kv_tokens
        if over > 0:
            self._announce([BlockRemoved(self.hashes.pop(g, [])) for g in self.cache.evict(over)])
        self.reserved += need
        log.cached_tokens[request] = hit
        return hit

    def _prefilled(self, request: int) -> None:
        group, tokens = self.log.prefix_group[request], self._shareable(request)
        if request in self.reads or tokens == 0 or group in self.cache:
            return
        self.cache.insert(group, tokens)                # its blocks move from the request to the cache
        self.reads[request] = (group, tokens)
        self.reserved -= tokens
        if self.cache_listener is not None:
            ids = prompt_token_ids(self.log, request)[:tokens]
            self.hashes[group] = hashes = request_block_hashes(ids, CacheNamespace(), self.block_size)
            self._announce([BlockStored(hashes, None, ids, self.block_size, None)])

    def _release(self, request: int) -> None:
        """Its group read no more; the full blocks of its own tokens (prompt and output, as the
        engine commits them) stay cached, unread, until evicted."""
        log, shared = self.log, self.reads.pop(request, None)
        size = log.prompt[request] + log.output[request]
        if shared is None:
            self.reserved -= size
        else:
            self.cache.release(shared[0])
            self.reserved -= size - shared[1]
        own = (size - 1) // self.block_size * self.block_size - self._shareable(request)
        if own > 0:
            self.cache.keep(-2 - request, own)

    def _announce(self, events: list) -> None:
        if events and self.cache_listener is not None:
            self.cache_listener(self.name, [e for e in events if e.block_hashes])
