"""The coalesced replica with a prefix cache kept per prefix group and per conversation.

``PrefixCachingReplica`` is ``BatchReplica`` (decode runs coalesced, a day of a fleet in
seconds) whose KV pool also caches what the engine's ``PrefixCache`` would, at the grain of an
entry rather than a block. A group's shared prefix (``prompt_ids.py``), its whole blocks, enters
when the first request of the group that missed it has computed its prompt. A finished request's
full blocks after that prefix (prompt and output, as the engine commits them: the last output
token's KV is never computed) are its conversation's history: one entry per conversation, grown
by each turn (``conversations.py``). A request admitted while its group's prefix and its
conversation's history are there starts its prefill after them (the log records them as its
cached tokens) and reserves only the rest of its prompt and its output; the history counts only
behind its group's prefix, as in the engine's radix tree. An entry costs its blocks once,
whatever the number of requests reading it; an admission that needs the room evicts entries no
running request reads, least recently used first.

The differences from the engine, stated: a group enters whole when a prompt completes (the engine
gives a request that arrives during the first one's prefill the blocks computed so far); an entry
leaves whole (the engine evicts a leaf block at a time). ``SchedulerReplica(prefix_cache=True)``
runs the engine's real cache step by step: tests hold the two together on cached share and TTFT
with shared prefixes and with conversations.

When the deployment's router reads cache events (``kv_aware``), ``cache_listener`` hears each
entry's ``BlockStored`` when it enters or grows and its ``BlockRemoved`` when it is evicted, with
the block hashes a real engine would publish for those tokens.
"""
from __future__ import annotations

from collections import OrderedDict

from kvserve.engine.kv.cache_events import BlockRemoved, BlockStored, CacheNamespace, block_hash, namespace_seed
from kvserve.fleetsim.conversations import conversation_of
from kvserve.fleetsim.log import RequestLog
from kvserve.fleetsim.prompt_ids import REPLY_ID, prompt_token_ids
from kvserve.fleetsim.replica import BatchReplica
from kvserve.fleetsim.sizing import ReplicaSizing
from kvserve.router.index import request_block_hashes

BLOCK_SIZE = 16


class EntryCache:
    """What a replica's pool caches: key -> [tokens, requests reading it], least recently used
    first. A key >= 0 is a prefix group's shared prefix; a negative one a conversation's history
    (``_history_key``: a request's own blocks, grown by its later turns)."""

    def __init__(self):
        self.entries: OrderedDict[int, list[int]] = OrderedDict()
        self.held_tokens = 0                   # tokens of every entry
        self.pinned_tokens = 0                 # tokens of the entries running requests read

    def __contains__(self, key: int) -> bool:
        return key in self.entries

    def tokens(self, key: int) -> int:
        """The tokens cached under ``key`` (0 if none)."""
        entry = self.entries.get(key)
        return entry[0] if entry is not None else 0

    def evictable_tokens(self, keep=()) -> int:
        """Tokens eviction could free, the entries ``keep`` left alone."""
        spare = self.held_tokens - self.pinned_tokens
        for key in keep:
            entry = self.entries.get(key)
            if entry is not None and entry[1] == 0:
                spare -= entry[0]
        return spare

    def insert(self, group: int, tokens: int) -> None:
        """``group``'s prefix is resident, read by the request that computed it."""
        self.entries[group] = [tokens, 1]
        self.held_tokens += tokens
        self.pinned_tokens += tokens

    def acquire(self, key: int) -> None:
        """One more running request reads ``key`` (its recency refreshed)."""
        entry = self.entries[key]
        if entry[1] == 0:
            self.pinned_tokens += entry[0]
        entry[1] += 1
        self.entries.move_to_end(key)

    def release(self, key: int) -> None:
        """A running request that read ``key`` finished."""
        entry = self.entries[key]
        entry[1] -= 1
        if entry[1] == 0:
            self.pinned_tokens -= entry[0]

    def put(self, key: int, tokens: int) -> None:
        """``key`` holds ``tokens`` now, most recently used (a conversation's history, grown or
        new; requests still reading it keep reading it)."""
        entry = self.entries.get(key)
        if entry is None:
            self.entries[key] = entry = [0, 0]
        self.held_tokens += tokens - entry[0]
        if entry[1]:
            self.pinned_tokens += tokens - entry[0]
        entry[0] = tokens
        self.entries.move_to_end(key)

    def evict(self, tokens: int) -> list[int]:
        """Evict unread entries, least recently used first, until ``tokens`` are freed; the
        keys evicted."""
        gone = []
        for key, (size, readers) in self.entries.items():
            if tokens <= 0:
                break
            if readers == 0:
                gone.append(key)
                tokens -= size
        for key in gone:
            self.held_tokens -= self.entries.pop(key)[0]
        return gone


class PrefixCachingReplica(BatchReplica):
    """``BatchReplica`` with a prefix cache per prefix group and conversation (the module
    docstring)."""

    def __init__(self, name: str, sizing: ReplicaSizing, log: RequestLog, block_size: int = BLOCK_SIZE):
        super().__init__(name, sizing, log)
        self.block_size = block_size
        self.cache = EntryCache()
        self.reads: dict[int, list[tuple[int, int]]] = {}   # running request -> [(key, cached tokens it reads)]
        self.queued: dict[int, int] = {}                # request -> uncached prompt tokens, until its first token
        self.hashes: dict[int, list[int]] = {}          # key -> its blocks' hashes (for events)
        self.ids: dict[int, list[int]] = {}             # request -> the prompt ids its router made, until it ends
        self.cache_listener = None                      # called with (name, events); set by the deployment

    def submit(self, request: int, now: float, prompt_ids: list[int] | None = None) -> float | None:
        """``BatchReplica.submit``; the router's ``prompt_ids`` are kept for the cache's events
        (not made again)."""
        if prompt_ids is not None and self.cache_listener is not None:
            self.ids[request] = prompt_ids
        return super().submit(request, now, prompt_ids)

    def _prompt_ids(self, request: int) -> list[int]:
        ids = self.ids.get(request)
        return ids if ids is not None else prompt_token_ids(self.log, request)

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

    def _hits(self, request: int) -> list[tuple[int, int]]:
        """The cached entries ``request``'s prompt starts with, (key, tokens): its group's prefix,
        then its conversation's history, which is reached only through the group's blocks (the
        engine's radix tree never holds a block without its parent)."""
        log, hits = self.log, []
        group_part = self._shareable(request)
        if group_part:
            group = log.prefix_group[request]
            tokens = min(self.cache.tokens(group), group_part)
            if tokens < group_part:
                return [(group, tokens)] if tokens else []
            hits.append((group, tokens))
        if log.parent[request] >= 0 or request in self.recomputed:
            key = _history_key(log, request)
            limit = (self._prompt_len(request) - 1) // self.block_size * self.block_size - group_part
            tokens = min(self.cache.tokens(key), limit)
            if tokens > 0:
                hits.append((key, tokens))
        return hits

    def _hit(self, request: int) -> int:
        return sum(tokens for _, tokens in self._hits(request))

    def _queue(self, request: int) -> int:
        self.queued[request] = uncached = self.log.prompt[request] - self._hit(request)
        return uncached

    def _answered(self, request: int) -> int:
        return self.queued.pop(request)

    def _room(self) -> int:
        return self.kv_tokens - self.reserved - self.cache.held_tokens + self.cache.evictable_tokens()

    def _fits(self, request: int, decoding: int) -> bool:
        hits = self._hits(request)
        need = self._prompt_len(request) - sum(tokens for _, tokens in hits)
        spare = self.kv_tokens - self.reserved - self.cache.held_tokens
        return need + decoding <= spare + self.cache.evictable_tokens([key for key, _ in hits])

    def _admit(self, request: int) -> int:
        log, hits = self.log, self._hits(request)
        for key, _ in hits:
            self.cache.acquire(key)
        hit = sum(tokens for _, tokens in hits)
        self.reads[request] = hits
        self._take(self._prompt_len(request) - hit)
        if request not in self.recomputed:            # the engine counts a request's first admission only
            log.cached_tokens[request] = hit
        return hit

    def _grow(self, tokens: int) -> None:
        self._take(tokens)

    def _take(self, tokens: int) -> None:
        """Hold ``tokens`` more KV tokens, evicting unread entries if the pool is short."""
        over = self.reserved + self.cache.held_tokens + tokens - self.kv_tokens
        if over > 0:
            self._announce([BlockRemoved(self.hashes.pop(key, [])) for key in self.cache.evict(over)])
        self.reserved += tokens

    def _prefilled(self, request: int) -> None:
        """A missed group's prefix enters the cache, its blocks moved from the request."""
        group, tokens = self.log.prefix_group[request], self._shareable(request)
        if tokens == 0 or group in self.cache:
            return
        self.cache.insert(group, tokens)
        self.reads[request].append((group, tokens))
        self.reserved -= tokens
        if self.cache_listener is not None:
            ids = self._prompt_ids(request)[:tokens]
            self.hashes[group] = hashes = request_block_hashes(ids, CacheNamespace(), self.block_size)
            self._announce([BlockStored(hashes, None, ids, self.block_size, None)])

    def _release(self, request: int) -> None:
        """What it read is read no more; the full blocks of its tokens after the group's prefix
        (prompt and output, as the engine commits them) stay cached as its conversation's
        history, unread until a next turn, evictable."""
        size = self.log.prompt[request] + self.log.output[request]
        self._drop(request, size, size - 1)
        self.ids.pop(request, None)

    def _evicted(self, request: int, context: int, computed: int) -> None:
        """Preempted: as ``_release``, the full blocks it had computed cached as its
        conversation's history, where its recompute finds them (the engine keeps a preempted
        sequence's full blocks in its cache)."""
        self._drop(request, context, computed)

    def _drop(self, request: int, context: int, computed: int) -> None:
        """``request`` holds ``context`` tokens no more; the whole blocks of its first
        ``computed`` tokens after its group's prefix become its conversation's history."""
        hits = self.reads.pop(request)
        self.reserved -= context - sum(tokens for _, tokens in hits)
        for key, _ in hits:
            self.cache.release(key)
        group_part = self._shareable(request)
        history = computed // self.block_size * self.block_size - group_part
        if history > 0:
            key = _history_key(self.log, request)
            self.cache.put(key, history)
            if self.cache_listener is not None:
                self._announce_history(request, key, group_part, history)

    def _announce_history(self, request: int, key: int, group_part: int, history: int) -> None:
        bs = self.block_size
        ids = self._prompt_ids(request) + [REPLY_ID] * (self.log.output[request] - 1)
        group = self.hashes.get(self.log.prefix_group[request], []) if group_part else []
        if len(group) == group_part // bs:             # chained on from the group's blocks, not hashed again
            parent = group[-1] if group else namespace_seed(CacheNamespace())
            hashes = []
            for start in range(group_part, group_part + history, bs):
                parent = block_hash(parent, ids[start:start + bs])
                hashes.append(parent)
        else:
            hashes = request_block_hashes(ids[:group_part + history], CacheNamespace(), bs)[group_part // bs:]
        old = set(self.hashes.get(key, ()))
        self.hashes[key] = hashes
        stored = [h for h in hashes if h not in old]
        gone = old.difference(hashes)
        self._announce(([BlockRemoved(list(gone))] if gone else []) +
                       [BlockStored(stored, None, [], self.block_size, None)])

    def _announce(self, events: list) -> None:
        if events and self.cache_listener is not None:
            self.cache_listener(self.name, [e for e in events if e.block_hashes])


def _history_key(log: RequestLog, request: int) -> int:
    """The cache key of ``request``'s conversation's history (negative: groups are >= 0)."""
    return -2 - conversation_of(log, request)
