"""What the autoscaling policy last decided, where the ingress can read it: the tier a model is
in now (re-tiering moves it), its planned tier, the replicas the policy asked for and why.

The policy runs inside Ray Serve's controller and keeps its state in Ray's ``policy_state``,
which nothing outside the controller reads. On each change of its decision (the moments it
logs) it also writes a small JSON record into Ray's key-value store in the GCS (the store Serve
itself checkpoints into; ``ray.experimental.internal_kv``, a private API of the pinned Ray),
under namespace ``kvserve`` and key ``autoscale/<app>/<deployment>``; the ingress's
``GET /cluster/status`` reads it back per deployment (``serve_status.py``). A process not
connected to Ray (a unit test calling the policy) writes nothing.
"""
from __future__ import annotations

import json
import logging

NAMESPACE = "kvserve"
logger = logging.getLogger("kvserve.cluster")


def key(app: str | None, deployment: str) -> bytes:
    """The store key of ``deployment`` in application ``app``."""
    return f"autoscale/{app or 'default'}/{deployment}".encode()


def publish(app: str | None, deployment: str, record: dict) -> None:
    """Write ``record`` (JSON-able) for the deployment; nothing outside a Ray process, and a
    failed write is logged, never raised (the policy's decision stands either way)."""
    try:
        from ray.experimental import internal_kv
        if not internal_kv._internal_kv_initialized():
            return
        internal_kv._internal_kv_put(key(app, deployment), json.dumps(record).encode(), overwrite=True,
                                     namespace=NAMESPACE)
    except Exception as exc:                    # the controller keeps scaling without the board
        logger.warning("autoscale board: %s", exc)


def read(app: str | None, deployment: str) -> dict | None:
    """The deployment's last published record, or None (no policy, or not yet run)."""
    from ray.experimental import internal_kv
    value = internal_kv._internal_kv_get(key(app, deployment), namespace=NAMESPACE)
    return json.loads(value) if value else None
