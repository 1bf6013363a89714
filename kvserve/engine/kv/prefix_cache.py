"""Radix prefix cache over full KV blocks (docs/prefix_cache.md). Pure Python, no torch.

One tree per ``CacheNamespace`` (adapter id, weight epoch, cache salt). A node holds a
run of one or more full blocks: their token ids (``num_blocks * block_size`` of them),
block ids and chained hashes. Children are keyed by the token ids of their first block.
A match that ends inside a node splits it, so a handle always ends at a node's end::

    block_size 2          root ── [a b | c d] ─┬─ [e f]
                                               └─ [g h | i j]
    match(a b c d g h x)  -> blocks of [a b | c d] and [g h]: [g h | i j] splits into
                             [g h] ── [i j]; the handle ends at [g h]

References: the cache holds one reference on every block in the tree
(``BlockPool.cache_blocks``). A caller that uses matched blocks takes its own references
with ``BlockPool.share`` and keeps the handle locked while it does; ``evict`` only
removes least-recently-used *unlocked* leaves (tail block first) whose grace time has
passed, so blocks of running requests and of live turns stay. Grace protection may hold
at most ``max_protected_share`` of the pool: when more is protected and a caller needs
blocks, the least recently used protected blocks beyond that share become evictable (a
small pool under load would otherwise fill with finished requests' graces and starve).

Eviction does not scan the tree: the leaves wait in heaps by last use (``leaf_queue.py``),
pushed whenever a leaf is made or touched, those found within their grace time kept apart.
"""
from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterable

from kvserve.engine.kv.block_pool import BlockPool
from kvserve.engine.kv.cache_events import (BlockRemoved, BlockStored, CacheEvent, CacheNamespace, block_hash,
                                          namespace_seed)
from kvserve.engine.kv.leaf_queue import LeafQueue
from kvserve.engine.stats import PrefixSubtree


class _Node:
    """A run of full blocks; the root of a namespace holds none."""

    __slots__ = ("namespace", "parent", "key", "token_ids", "block_ids", "block_hashes", "children",
                 "lock_count", "last_access", "protected_until", "serial")

    def __init__(self, namespace, parent, token_ids, block_ids, block_hashes, serial):
        self.namespace: CacheNamespace = namespace
        self.parent: _Node | None = parent
        self.token_ids: list[int] = token_ids
        self.block_ids: list[int] = block_ids
        self.block_hashes: list[int] = block_hashes
        self.children: dict[tuple[int, ...], _Node] = {}
        self.lock_count = 0
        self.last_access = 0              # logical clock: larger = more recently used
        self.protected_until = 0.0        # clock time before which it is never evicted
        self.serial = serial              # creation order: a deterministic LRU tie-break
        self.key: tuple[int, ...] = ()

    @property
    def is_root(self) -> bool:
        return self.parent is None


@dataclass(frozen=True, eq=False)
class PrefixHandle:
    """The result of ``match`` / ``insert``: the cached blocks covering the first
    ``num_tokens`` tokens of a sequence, ending at the end of ``node``. Valid while
    locked (or until the next cache call, if never locked)."""

    namespace: CacheNamespace
    node: _Node
    block_ids: tuple[int, ...]
    num_tokens: int

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)


@dataclass
class PrefixCacheStats:
    """Counters since start (or since the last reset of the counters, never automatic)."""

    num_queries: int = 0              # lookups made when admitting a sequence
    num_query_tokens: int = 0         # tokens those lookups asked for
    num_hit_tokens: int = 0           # tokens served from the cache
    num_evicted_blocks: int = 0       # blocks the cache dropped (eviction and reset)
    num_cached_blocks: int = 0        # blocks in the tree now
    num_nodes: int = 0                # tree nodes now (roots excluded)
    num_dropped_events: int = 0       # events lost because nobody drained them

    @property
    def hit_rate(self) -> float:
        """Hit tokens / query tokens (0 before any query)."""
        return self.num_hit_tokens / self.num_query_tokens if self.num_query_tokens else 0.0


class PrefixCache:
    """Radix tree of full KV blocks, namespaced, with locked handles and LRU eviction."""

    def __init__(self, block_pool: BlockPool, clock: Callable[[], float] = time.monotonic,
                 max_pending_events: int = 4096, max_protected_share: float = 0.5):
        self.block_pool = block_pool
        self.max_protected_blocks = int(block_pool.num_blocks * max_protected_share)
        self.block_size = block_pool.block_size
        self._clock = clock
        self._roots: dict[CacheNamespace, _Node] = {}
        self._leaves: set[_Node] = set()      # non-root nodes without children
        self._queue = LeafQueue()             # the leaves in eviction order
        # num_protected_blocks while nothing changed: (counted at, valid until, count); None after a change
        self._protected_memo: tuple[float, float, int] | None = None
        self._tick = itertools.count(1)
        self._serials = itertools.count()
        self._events: deque[CacheEvent] = deque(maxlen=max_pending_events)
        self._stats = PrefixCacheStats()

    # ------------------------------------------------------------------ lookup
    def match(self, namespace: CacheNamespace, token_ids: list[int], max_tokens: int | None = None) -> PrefixHandle:
        """Longest cached prefix of ``token_ids`` in whole blocks, at most ``max_tokens``
        tokens (callers pass ``len - 1`` so the last token is always computed). Splits
        the node the match ends inside; marks the path as recently used. The handle is
        not locked: lock it before anything else can evict."""
        bs = self.block_size
        limit = len(token_ids) if max_tokens is None else min(max_tokens, len(token_ids))
        max_blocks = max(limit, 0) // bs
        node = self._roots.get(namespace)
        block_ids: list[int] = []
        tick = next(self._tick)
        while node is not None and len(block_ids) < max_blocks:
            start = len(block_ids) * bs
            child = node.children.get(tuple(token_ids[start:start + bs]))
            if child is None:
                break
            num_same = self._num_equal_blocks(child, token_ids, start, max_blocks - len(block_ids))
            if num_same < len(child.block_ids):
                child = self._split(child, num_same)
            child.last_access = tick
            block_ids.extend(child.block_ids)
            node = child
        if node is None:
            node = self._root(namespace, create=False)
        self._queue_if_leaf(node)
        return PrefixHandle(namespace, node, tuple(block_ids), len(block_ids) * bs)

    def _num_equal_blocks(self, node: _Node, token_ids: list[int], start: int, max_blocks: int) -> int:
        """Leading blocks of ``node`` equal to ``token_ids[start:]`` (the first is known equal)."""
        bs = self.block_size
        count = 1
        while count < min(len(node.block_ids), max_blocks):
            lo = count * bs
            if node.token_ids[lo:lo + bs] != token_ids[start + lo:start + lo + bs]:
                break
            count += 1
        return count

    def _root(self, namespace: CacheNamespace, create: bool = True) -> _Node:
        root = self._roots.get(namespace)
        if root is None:
            root = _Node(namespace, None, [], [], [], next(self._serials))
            if create:
                self._roots[namespace] = root
        return root

    def _split(self, node: _Node, num_blocks: int) -> _Node:
        """Cut ``node`` after ``num_blocks`` blocks; returns the new upper part. The
        lower part keeps the node's identity, so handles ending at it stay valid."""
        bs = self.block_size
        cut = num_blocks * bs
        self._protected_memo = None
        upper = _Node(node.namespace, node.parent, node.token_ids[:cut], node.block_ids[:num_blocks],
                      node.block_hashes[:num_blocks], next(self._serials))
        upper.key, upper.last_access, upper.protected_until = node.key, node.last_access, node.protected_until
        node.parent.children[upper.key] = upper
        node.token_ids, node.block_ids = node.token_ids[cut:], node.block_ids[num_blocks:]
        node.block_hashes = node.block_hashes[num_blocks:]
        node.key = tuple(node.token_ids[:bs])
        node.parent = upper
        upper.children[node.key] = node
        self._stats.num_nodes += 1
        return upper

    # ------------------------------------------------------------------ insert
    def insert(self, handle: PrefixHandle, token_ids: list[int], block_ids: list[int]) -> PrefixHandle:
        """Add full blocks that continue ``handle``'s prefix: ``token_ids`` (a multiple
        of block_size) whose KV is in ``block_ids``. Blocks whose tokens are already
        cached are skipped (the caller keeps its own copies); new ones get the cache's
        reference. Returns the handle of the longer prefix (unlocked: lock it, then
        unlock the old one)."""
        bs = self.block_size
        if len(token_ids) != len(block_ids) * bs:
            raise ValueError(f"{len(token_ids)} tokens do not fill {len(block_ids)} blocks of {bs}")
        if not block_ids:
            return handle
        node = handle.node if handle.num_blocks else self._root(handle.namespace)
        path_ids = list(handle.block_ids)
        tick = next(self._tick)
        done = 0
        while done < len(block_ids):
            start = done * bs
            key = tuple(token_ids[start:start + bs])
            child = node.children.get(key)
            if child is None:
                child = self._add_node(node, key, token_ids[start:], block_ids[done:])
            else:
                num_same = self._num_equal_blocks(child, token_ids, start, len(block_ids) - done)
                if num_same < len(child.block_ids):
                    child = self._split(child, num_same)
            child.last_access = tick
            path_ids.extend(child.block_ids)
            done += len(child.block_ids)
            node = child
        self._queue_if_leaf(node)
        return PrefixHandle(handle.namespace, node, tuple(path_ids), len(path_ids) * bs)

    def _add_node(self, parent: _Node, key: tuple[int, ...], token_ids: list[int], block_ids: list[int]) -> _Node:
        bs = self.block_size
        parent_hash = parent.block_hashes[-1] if not parent.is_root else namespace_seed(parent.namespace)
        hashes, previous = [], parent_hash
        for i in range(len(block_ids)):
            previous = block_hash(previous, token_ids[i * bs:(i + 1) * bs])
            hashes.append(previous)
        self.block_pool.cache_blocks(block_ids)
        self._protected_memo = None
        node = _Node(parent.namespace, parent, list(token_ids), list(block_ids), hashes, next(self._serials))
        node.key = key
        parent.children[key] = node
        self._leaves.discard(parent)
        self._leaves.add(node)
        self._stats.num_nodes += 1
        self._stats.num_cached_blocks += len(block_ids)
        self._publish(BlockStored(list(hashes), None if parent.is_root else parent_hash, list(token_ids), bs,
                                  parent.namespace.adapter_id))
        return node

    # ------------------------------------------------------------------ locks
    def lock(self, handle: PrefixHandle) -> None:
        """Protect the handle's blocks from eviction until ``unlock`` (locks nest)."""
        if not handle.node.is_root:
            handle.node.lock_count += 1
            self._protected_memo = None

    def unlock(self, handle: PrefixHandle, grace_s: float = 0.0) -> None:
        """Release one lock; the blocks stay protected ``grace_s`` seconds more (a live
        turn waiting for its next message). Marks the path as recently used."""
        node = handle.node
        if node.is_root:
            return
        if node.lock_count <= 0:
            raise RuntimeError("unlock of a prefix handle that is not locked")
        node.lock_count -= 1
        self._protected_memo = None
        if grace_s > 0:
            node.protected_until = max(node.protected_until, self._clock() + grace_s)
        tick = next(self._tick)
        self._set_access(node, tick)

    # --------------------------------------------------------------- eviction
    def evict(self, num_blocks: int, include_protected: bool = False) -> list[int]:
        """Drop the cache's reference on up to ``num_blocks`` blocks, least recently used
        unlocked leaves first, each leaf from its last block backwards. Returns the block
        ids dropped, in order (a block a sequence still shares does not become free).
        Blocks within their grace time are kept unless ``include_protected`` (then they go
        after every unprotected one), except the protected blocks beyond
        ``max_protected_blocks``."""
        now = self._clock()
        dropped = self._evict(num_blocks, now, lambda node: True)
        if include_protected:
            if len(dropped) < num_blocks:
                dropped += self._evict(num_blocks - len(dropped), float("inf"), lambda node: True)
            return dropped
        # the tree walk only when grace time held some back and could hold more than its share
        if len(dropped) < num_blocks and self._stats.num_cached_blocks > self.max_protected_blocks:
            excess = self.num_protected_blocks(now) - self.max_protected_blocks
            if excess > 0:
                dropped += self._evict(min(num_blocks - len(dropped), excess), float("inf"), lambda node: True)
        return dropped

    def num_protected_blocks(self, now: float | None = None) -> int:
        """Blocks that only grace time keeps: those of an unlocked node protected until after
        ``now``, and of its ancestors, which it pins (only leaves are evicted), unless a
        running request's lock below them holds them anyway. A finished request's prompt
        and its output are inserted as a chain of nodes and grace marks the last one: counting
        that node alone let a small pool fill with pinned chains past the share. One walk of
        the tree, remembered until the tree or a lock changes or the next grace ends."""
        now = self._clock() if now is None else now
        memo = self._protected_memo
        if memo is not None and memo[0] <= now < memo[1]:
            return memo[2]
        count, next_end = self._count_protected(now)
        self._protected_memo = (now, next_end, count)
        return count

    def _count_protected(self, now: float) -> tuple[int, float]:
        """``num_protected_blocks`` at ``now`` by a walk of the tree, and the next time a grace
        counted in it ends (infinity if none)."""
        count, next_end, order, stack = 0, float("inf"), [], list(self._roots.values())
        while stack:                                   # parents before children
            node = stack.pop()
            order.append(node)
            stack.extend(node.children.values())
        state: dict[int, tuple[bool, bool]] = {}       # id(node) -> (grace below or here, lock below or here)
        for node in reversed(order):                   # children before parents
            graced = node.lock_count == 0 and node.protected_until > now
            if graced:
                next_end = min(next_end, node.protected_until)
            locked = node.lock_count > 0
            for child in node.children.values():
                child_graced, child_locked = state.pop(id(child))
                graced, locked = graced or child_graced, locked or child_locked
            state[id(node)] = (graced, locked)
            if not node.is_root and graced and not locked:
                count += len(node.block_ids)
        return count, next_end

    def evict_namespaces(self, predicate: Callable[[CacheNamespace], bool]) -> list[int]:
        """Drop every unlocked block of the namespaces ``predicate`` selects (e.g. older
        weight epochs), grace time included."""
        return self._evict(self._stats.num_cached_blocks, float("inf"), lambda node: predicate(node.namespace))

    def reset(self) -> int:
        """Drop every unlocked block, grace time included (an admin reset). Blocks of
        running requests stay until they finish. Returns the number dropped."""
        return len(self._evict(self._stats.num_cached_blocks, float("inf"), lambda node: True))

    def _evict(self, num_blocks: int, now: float, selected: Callable[[_Node], bool]) -> list[int]:
        """Up to ``num_blocks`` blocks from the least recently used leaves that are unlocked,
        out of grace at ``now`` (``inf``: grace ignored) and ``selected``; a leaf emptied makes
        its parent a leaf."""
        queue, ignore_grace = self._queue, now == float("inf")
        if not ignore_grace:
            queue.release_ended(now)
        dropped: list[int] = []
        passed: list = []                           # live entries passed over: they go back
        while len(dropped) < num_blocks:
            entry = queue.pop_oldest(with_graced=ignore_grace)
            if entry is None:
                break
            leaf = entry[3]
            if not queue.is_live(entry) or leaf.lock_count:
                continue                            # stale, or locked (its unlock queues it again)
            if leaf.protected_until > now:
                queue.hold_in_grace(entry)
            elif not selected(leaf):
                passed.append(entry)
            else:
                dropped.extend(self._trim(leaf, num_blocks - len(dropped)))
                if leaf.block_ids:                  # trimmed, not emptied: still a leaf
                    passed.append(entry)
        queue.requeue(passed)
        return dropped

    def _set_access(self, node: _Node, tick: int) -> None:
        """Mark ``node`` and its ancestors used at ``tick``."""
        self._queue_if_leaf(node, tick)
        node = node.parent
        while node is not None and not node.is_root:
            node.last_access = tick
            node = node.parent

    def _queue_if_leaf(self, node: _Node, tick: int | None = None) -> None:
        """Set ``node``'s last use to ``tick`` (if given) and, if it is a leaf, push it on the
        LRU heap (rebuilt from the leaf set when stale entries outnumber the leaves)."""
        if node.is_root:
            return
        if tick is not None:
            node.last_access = tick
        if not node.children:
            self._queue.push(node, self._leaves)

    def _trim(self, leaf: _Node, max_blocks: int) -> list[int]:
        """Remove up to ``max_blocks`` blocks from the end of ``leaf``; unlink it if empty."""
        num = min(max_blocks, len(leaf.block_ids))
        keep = len(leaf.block_ids) - num
        self._protected_memo = None
        dropped = leaf.block_ids[keep:][::-1]
        hashes = leaf.block_hashes[keep:][::-1]
        del leaf.block_ids[keep:], leaf.block_hashes[keep:], leaf.token_ids[keep * self.block_size:]
        self.block_pool.uncache_blocks(dropped)
        self._stats.num_cached_blocks -= num
        self._stats.num_evicted_blocks += num
        self._publish(BlockRemoved(hashes))
        if keep == 0:
            parent = leaf.parent
            del parent.children[leaf.key]
            self._leaves.discard(leaf)
            self._stats.num_nodes -= 1
            if not parent.children:
                if parent.is_root:
                    self._roots.pop(parent.namespace, None)
                else:
                    self._leaves.add(parent)
                    self._queue_if_leaf(parent)
        return dropped

    # ------------------------------------------------------- events and stats
    def _publish(self, event: CacheEvent) -> None:
        if len(self._events) == self._events.maxlen:
            self._stats.num_dropped_events += 1
        self._events.append(event)

    def drain_events(self) -> list[CacheEvent]:
        """Events since the last drain, oldest first (for a cache-aware router)."""
        events = list(self._events)
        self._events.clear()
        return events

    def record_query(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        """Count one lookup made to admit a sequence (the scheduler calls this once per
        admission, not per retry of a sequence that had to wait)."""
        self._stats.num_queries += 1
        self._stats.num_query_tokens += num_query_tokens
        self._stats.num_hit_tokens += num_hit_tokens

    def stats(self) -> PrefixCacheStats:
        """A copy of the counters."""
        return PrefixCacheStats(**vars(self._stats))

    @property
    def num_cached_blocks(self) -> int:
        return self._stats.num_cached_blocks

    def largest_subtrees(self, limit: int) -> list[PrefixSubtree]:
        """The ``limit`` largest top-level branches (children of a namespace root), largest
        first: their blocks, leaves and locked blocks (one walk of the tree)."""
        branches = []
        for namespace, root in self._roots.items():
            for child in root.children.values():
                blocks = leaves = locked = 0
                for node in _walk(child):
                    blocks += len(node.block_ids)
                    leaves += not node.children
                    locked += len(node.block_ids) if node.lock_count else 0
                branches.append(PrefixSubtree(namespace.adapter_id, namespace.cache_salt, namespace.weight_epoch,
                                              blocks, leaves, locked))
        return sorted(branches, key=lambda b: -b.num_blocks)[:limit]

    def cached_block_ids(self, namespace: CacheNamespace | None = None) -> set[int]:
        """Block ids in the tree (of one namespace, or all)."""
        roots = [self._roots[namespace]] if namespace in self._roots else (
            [] if namespace is not None else list(self._roots.values()))
        return {b for root in roots for node in _walk(root) for b in node.block_ids}

    # -------------------------------------------------------------- integrity
    def check_integrity(self, locked_handles: Iterable[PrefixHandle] | None = None) -> None:
        """Assert the tree's invariants: node shapes and keys, parent links, the leaf set,
        every block once and flagged cached in the pool, counters; with the handles that
        hold locks, also that each node's lock count equals the handles locking it."""
        bs, pool = self.block_size, self.block_pool
        seen: set[int] = set()
        nodes: list[_Node] = []
        for namespace, root in self._roots.items():
            if root.namespace != namespace or root.block_ids or not root.children:
                raise AssertionError(f"bad root for {namespace}")
            for node in _walk(root):
                for key, child in node.children.items():
                    if child.parent is not node or child.key != key or key != tuple(child.token_ids[:bs]):
                        raise AssertionError("child key or parent link broken")
                    if child.namespace != namespace:
                        raise AssertionError("a node outside its namespace")
                if node.is_root:
                    continue
                nodes.append(node)
                if (not node.block_ids or len(node.token_ids) != bs * len(node.block_ids)
                        or len(node.block_hashes) != len(node.block_ids) or node.lock_count < 0):
                    raise AssertionError("node shape broken")
                if seen.intersection(node.block_ids) or len(set(node.block_ids)) != len(node.block_ids):
                    raise AssertionError("a block is cached twice")
                seen.update(node.block_ids)
        if any(not pool.is_cached(b) for b in seen) or len(seen) != pool.num_cached_blocks:
            raise AssertionError("cached blocks disagree with the block pool")
        if len(seen) != self._stats.num_cached_blocks or len(nodes) != self._stats.num_nodes:
            raise AssertionError("cache counters disagree with the tree")
        if self._leaves != {n for n in nodes if not n.children}:
            raise AssertionError("leaf set disagrees with the tree")
        queued = self._queue.queued_ids()
        if any(id(leaf) not in queued for leaf in self._leaves if not leaf.lock_count):
            raise AssertionError("an unlocked leaf is not queued for eviction at its last use")
        now = self._clock()
        if self.num_protected_blocks(now) != self._count_protected(now)[0]:
            raise AssertionError("the remembered count of protected blocks is stale")
        if locked_handles is not None:
            expected: dict[int, int] = {}
            for handle in locked_handles:
                if not handle.node.is_root:
                    expected[id(handle.node)] = expected.get(id(handle.node), 0) + 1
            for node in nodes:
                if node.lock_count != expected.pop(id(node), 0):
                    raise AssertionError(f"lock count {node.lock_count} disagrees with the live handles")
            if expected:
                raise AssertionError("a live handle locks a node that is not in the tree")


def _walk(root: _Node):
    """Depth-first nodes of a tree, root first."""
    stack = [root]
    while stack:
        node = stack.pop()
        yield node
        stack.extend(node.children.values())
