"""Routing requests across engine replicas: pure scoring, no transport.

``state.py`` holds what a router knows of each replica and of a request; ``index.py`` the
per-replica sets of cached block hashes (fed by the replicas' cache events, or by the
router's own history); ``policies.py`` the policies by name (``round_robin``,
``least_loaded``, ``prefix_approx``, ``kv_aware``). A runtime (Ray Serve's request
router, a test, the fleet simulator) keeps the states up to date and calls
``policy.choose(replicas, request)``.
"""
from kvserve.router.index import BlockIndex, request_block_hashes
from kvserve.router.policies import POLICIES, RouterWeights, make_policy
from kvserve.router.state import Decision, ReplicaState, RouteRequest

__all__ = ["BlockIndex", "Decision", "POLICIES", "ReplicaState", "RouteRequest", "RouterWeights", "make_policy",
           "request_block_hashes"]
