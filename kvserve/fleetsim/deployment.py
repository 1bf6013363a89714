"""One model's deployment in the simulated fleet: its replicas (starting, serving, draining),
the queue of requests that wait for a first replica, routing by kvserve's router, and the
GPU-seconds it holds per residency tier.

A request for a model with ready replicas goes where the router's policy
(``router/policies.py``, ``least_loaded`` by default) sends it, from each replica's
``ReplicaState`` as the deployment's router view shows it (``router_view.py``: as the replicas
are now, or as a Ray Serve router sees their periodic stats). The prefix policies (``prefix_approx``, ``kv_aware``) read the request's
prompt ids (``prompt_ids.py``) on the simulated clock; ``kv_aware``'s block index is fed the
replicas' cache events (``SchedulerReplica(prefix_cache=True)``), and a replica that leaves is
forgotten. With none ready a request waits in the deployment's queue (as the cluster's
``assign_wait`` does) and, if nothing is starting, a replica is started at once (scale from
zero); a queued request older than ``max_queue_wait_s`` is answered 503 + Retry-After
(rejected). With ``slots`` (the cluster ingress's fleet slots, ``cluster/admission.py``) at most
that many requests are on the replicas at once: the others wait in the same queue, first come
first served (one model has one class), and each request that finishes hands its slot to the
head of the queue, routed then to whichever replica the policy picks. A replica costs from the
moment it is asked for (its GPUs are held while it starts) until it has drained. With a ``host``
(``host_cpu.SharedHost``: replicas sharing one machine's cores) the deployment tells it when a
replica starts and when that start ends. With ``session_keys`` a request of a conversation
carries its first turn's id as its session key (the client's ``prompt_cache_key``), which the
prefix policies weigh as the cluster's router does.
"""
from __future__ import annotations

from collections import deque

from kvserve.autoscale.tiers import ResidencyTier
from kvserve.fleetsim.conversations import conversation_of
from kvserve.fleetsim.log import RequestLog
from kvserve.fleetsim.prompt_ids import prompt_token_ids
from kvserve.fleetsim.replica import BatchReplica
from kvserve.fleetsim.router_view import FreshView
from kvserve.fleetsim.sizing import ReplicaSizing, weights_in_host_memory
from kvserve.router.policies import PrefixAware, make_policy
from kvserve.router.state import ReplicaState, RouteRequest

_NO_TOKENS = RouteRequest(())


class _OwnDevices:
    """The host of replicas that each have their own device (a GPU fleet): a start loads nothing
    another replica shares."""

    def starting(self, replica: str) -> None:
        pass

    def start_ended(self, replica: str) -> None:
        pass


class Deployment:
    """One model's replicas and queue (the module docstring)."""

    def __init__(self, index: int, sizing: ReplicaSizing, tier: ResidencyTier, log: RequestLog,
                 replica_factory=BatchReplica, router: str = "least_loaded", slots: int | None = None,
                 host=None, session_keys: bool = False, view=None):
        self.index = index
        self.view = view if view is not None else FreshView()   # what the router knows of the replicas
        self.session_keys = session_keys               # requests carry their conversation as prompt_cache_key
        self.host = host if host is not None else _OwnDevices()   # what the starts load
        self.slots = slots                             # requests on the replicas at most (None: no bound)
        self.in_flight = 0                             # requests routed and not finished
        self.sizing = sizing
        self.tier = tier
        self.log = log
        self.factory = replica_factory
        self.now = 0.0                                 # the simulated time of the last routing
        self.policy = make_policy(router, clock=self._clock)
        self.reads_prompts = isinstance(self.policy, PrefixAware)
        self.reads_cache_events = self.reads_prompts and not self.policy.learn
        self.ready: list = []
        self.starting: dict[str, float] = {}          # name -> ready time
        self.draining: list = []
        self.queue: deque[int] = deque()
        self.states: dict[str, ReplicaState] = {}
        self.serial = 0
        self.starts = 0
        self.gpu_seconds: dict[str, float] = {t.value: 0.0 for t in ResidencyTier}
        self.held_since = 0.0                          # last time the held count changed
        self.retired_prompt_tokens = 0
        self.retired_generation_tokens = 0
        self.window_tokens = [0, 0]                    # prompt, output tokens arrived since the last retier

    def _clock(self) -> float:
        return self.now

    def _cache_events(self, replica: str, events: list) -> None:
        for event in events:
            self.policy.index.apply(replica, event)

    # -- accounting -----------------------------------------------------------------------------
    @property
    def held(self) -> int:
        """Replicas holding GPUs: starting, serving or draining."""
        return len(self.ready) + len(self.starting) + len(self.draining)

    @property
    def active(self) -> int:
        """Replicas the autoscaler counts: serving or starting (draining ones are leaving)."""
        return len(self.ready) + len(self.starting)

    def account(self, now: float) -> None:
        """Charge the GPUs held since the last change to the current tier."""
        self.gpu_seconds[self.tier.value] += (now - self.held_since) * self.held * self.sizing.tp
        self.held_since = now

    # -- replicas -------------------------------------------------------------------------------
    def start_replica(self, now: float) -> tuple[str, float]:
        """Ask for a replica; (its name, when it serves) by the tier's cold-start layers."""
        self.account(now)
        self.serial += 1
        name = f"{self.sizing.model}/{self.serial}"
        ready_at = now + self.sizing.cold_start.start_s(weights_in_host_memory(self.tier))
        self.starting[name] = ready_at
        self.starts += 1
        self.host.starting(name)
        return name, ready_at

    def replica_ready(self, name: str, now: float) -> list[tuple[object, float]]:
        """A started replica serves: the queue drains into the fleet; (replica, next event) pairs."""
        if self.starting.pop(name, None) is None:
            return []                                    # cancelled while starting
        self.host.start_ended(name)
        replica = self.factory(name, self.sizing, self.log)
        replica.owner = self.index
        if self.reads_cache_events:
            replica.cache_listener = self._cache_events
        self.ready.append(replica)
        self.states[name] = ReplicaState(name, max_num_seqs=self.sizing.max_num_seqs)
        return self._admit_queued(now)

    def finished(self, count: int, now: float) -> list[tuple[object, float]]:
        """``count`` requests finished: their slots go to the queue's head; (replica, next event) pairs."""
        self.in_flight -= count
        return self._admit_queued(now)

    def _has_slot(self) -> bool:
        return self.slots is None or self.in_flight < self.slots

    def _admit_queued(self, now: float) -> list[tuple[object, float]]:
        """Route queued requests, oldest first, while a replica is ready and a slot free."""
        events = []
        while self.queue and self.ready and self._has_slot():
            events.append(self.route(self.queue.popleft(), now))
        return [e for e in events if e[1] is not None]

    @property
    def queued_without_replica(self) -> int:
        """Requests waiting because no replica serves (what Ray Serve's handle queue counts)."""
        return 0 if self.ready else len(self.queue)

    def stop_replicas(self, count: int, now: float) -> None:
        """Remove ``count`` replicas: starting ones first (newest), then the least busy serving ones."""
        self.account(now)
        for name in sorted(self.starting, key=self.starting.get, reverse=True)[:count]:
            del self.starting[name]
            self.host.start_ended(name)
            count -= 1
        for replica in sorted(self.ready, key=lambda r: (r.num_running + r.num_waiting, r.name))[:max(0, count)]:
            self.ready.remove(replica)
            del self.states[replica.name]
            self.view.forget(replica.name)
            if self.reads_prompts:
                replica.cache_listener = None          # it drains unseen by the router
                self.policy.index.forget(replica.name)
            self.draining.append(replica)
        self.release_drained(now)

    def release_drained(self, now: float) -> None:
        """Draining replicas with nothing left give their GPUs back."""
        done = [r for r in self.draining if r.idle]
        if done:
            self.account(now)
            for replica in done:
                self.draining.remove(replica)
                self.retired_prompt_tokens += replica.prompt_tokens_total
                self.retired_generation_tokens += replica.generation_tokens_total

    # -- requests -------------------------------------------------------------------------------
    def arrive(self, request: int, now: float) -> tuple[object, float | None] | None:
        """A new request: routed, or queued for a first replica or a slot (None)."""
        self.window_tokens[0] += self.log.prompt[request]
        self.window_tokens[1] += self.log.output[request]
        if self.ready and self._has_slot() and not self.queue:
            return self.route(request, now)
        self.queue.append(request)
        self.log.waited_for_start[request] = not self.ready
        return None

    def route(self, request: int, now: float) -> tuple[object, float | None]:
        """Place ``request`` on a ready replica by the router's policy; (replica, its next event)."""
        self.now = now
        ids = None
        cached = 0
        if len(self.ready) == 1 and not self.reads_prompts:
            replica = self.ready[0]
        else:
            for r in self.ready:
                self.view.fill(self.states[r.name], r, now)
            ids = prompt_token_ids(self.log, request) if self.reads_prompts else None
            route = RouteRequest(tuple(ids), session_key=self._session(request)) if ids is not None else _NO_TOKENS
            decision = self.policy.choose(list(self.states.values()), route)
            replica, cached = next(r for r in self.ready if r.name == decision.replica), decision.cached_tokens
        self.view.routed(replica.name, now, max(0, self.log.prompt[request] - cached))
        self.in_flight += 1
        return replica, replica.submit(request, now, ids)

    def _session(self, request: int) -> str | None:
        return f"conversation-{conversation_of(self.log, request)}" if self.session_keys else None

    def expire_queue(self, now: float, max_wait_s: float) -> int:
        """Reject queued requests that waited longer than ``max_wait_s``; how many."""
        rejected = 0
        while self.queue and now - self.log.arrival[self.queue[0]] > max_wait_s:
            self.log.reject(self.queue.popleft(), now)
            rejected += 1
        return rejected

    def counters(self, now: float) -> dict[str, tuple[int, int, int, int, float, int]]:
        """Per serving / draining replica: (prompt tokens computed, output tokens, running, waiting,
        request-seconds held so far, queued prompt tokens)."""
        return {r.name: (r.prompt_tokens_total, r.generation_tokens_total, r.num_running, r.num_waiting,
                         r.held.total(now), r.queued_tokens) for r in self.ready + self.draining}
