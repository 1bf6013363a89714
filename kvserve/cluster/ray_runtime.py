"""Starting Ray on this machine for the cluster mode: loopback only.

By default Ray (2.60) rewrites 127.0.0.1 to the host's routable address and its GCS,
raylet and workers listen on every interface. Ray treats a node as single-machine (the
mode it uses on macOS and Windows) when ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``: the node
address is then the loopback one, and its servers bind to the node address. Those
variables are read when ``ray`` is imported, so this module sets them before it imports
Ray and checks the node address after start (a RuntimeError if Ray did not honour them).
Usage statistics are off. Ray's token authentication stays as Ray sets it.

One listener those settings miss: every Ray Serve 2.60 replica starts an inter-deployment
gRPC server on ``[::]:0`` (all interfaces; hard-coded in ``ray/serve/_private/replica.py``).
``pin_replica_grpc_to_loopback``, called first in each kvserve deployment's constructor,
makes that replica bind it on 127.0.0.1 instead (the other replicas reach it at the node
address, which is loopback here). It patches one name in a pinned Ray's private module and
fails loudly if the name is gone.
"""
from __future__ import annotations

import os

LOOPBACK = "127.0.0.1"
RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}
os.environ.update(RAY_ENV)

import ray  # noqa: E402  (after the environment above)


def start_local_ray(num_cpus: int | None = None) -> str:
    """Start a local Ray (or reuse the one this process started) on 127.0.0.1 only; returns
    the node address. ``num_cpus``: the CPUs Ray may hand to replicas (default: all)."""
    if not ray.is_initialized():
        ray.init(_node_ip_address=LOOPBACK, include_dashboard=False, num_cpus=num_cpus, namespace="kvserve",
                 configure_logging=False, log_to_driver=False)
    address = ray.util.get_node_ip_address()
    if address != LOOPBACK:
        raise RuntimeError(f"Ray's node address is {address}, not {LOOPBACK}: Ray was imported before "
                           "kvserve.cluster.ray_runtime could pin it to loopback")
    return address


def gcs_address() -> str:
    """The local Ray's GCS address (``host:port``), for a driver that joins it (the tests)."""
    return ray.get_runtime_context().gcs_address


def logs_dir() -> str:
    """This Ray session's log folder (Serve's controller log is under ``serve/``)."""
    return ray._private.worker.global_worker.node.get_logs_dir_path()


def pin_replica_grpc_to_loopback() -> None:
    """In a Ray Serve replica process: bind its inter-deployment gRPC server on 127.0.0.1."""
    from ray.serve._private import replica as serve_replica
    original = serve_replica.add_port_to_grpc_server
    if getattr(original, "kvserve_loopback", False):
        return

    def add_port(server, address: str):
        return original(server, address.replace("[::]", LOOPBACK))
    add_port.kvserve_loopback = True
    serve_replica.add_port_to_grpc_server = add_port


def ray_listen_addresses() -> set[str]:
    """The local addresses that Ray's processes (this one's children, and every process whose
    name says Ray) listen on, for a check that they are all loopback."""
    import psutil
    ray_pids = {p.pid for p in psutil.process_iter(["name", "cmdline"])
                if _is_ray_process(p.info["name"] or "", p.info["cmdline"] or [])}
    return {c.laddr.ip for c in psutil.net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN and c.pid in ray_pids}


def _is_ray_process(name: str, cmdline: list[str]) -> bool:
    text = " ".join([name, *cmdline[:3]])
    return any(marker in text for marker in ("ray::", "raylet", "gcs_server", "ray/_private", "ray/dashboard",
                                             "default_worker.py"))


def stop_local_ray() -> None:
    """Shut Ray (and Serve with it) down."""
    if ray.is_initialized():
        ray.shutdown()
