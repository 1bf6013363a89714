"""The local cluster's engine processes, found from outside (tests and benchmarks that kill one)."""
from __future__ import annotations

import time

import psutil


def engine_processes() -> list[psutil.Process]:
    """The live engine processes of the cluster's replicas (children of Serve replica actors); a
    killed engine its replica has not reaped yet (a zombie) or one gone meanwhile is not one."""
    engines = []
    for proc in psutil.process_iter(["name"]):
        if (proc.info["name"] or "").startswith("ray::ServeRepl"):
            engines += [c for c in _children(proc) if _is_engine(c)]
    return engines


def _children(proc: psutil.Process) -> list[psutil.Process]:
    try:
        return proc.children()
    except psutil.Error:                        # the actor ended meanwhile
        return []


def _is_engine(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE and "kvserve.ipc.engine_proc" in " ".join(proc.cmdline())
    except psutil.Error:                        # a zombie's cmdline, or gone meanwhile
        return False


def busiest(engines: list[psutil.Process], window_s: float = 1.0) -> psutil.Process:
    """The engine process that used the most CPU over ``window_s``: one serving streams, which
    the router may have put all on one replica."""
    for engine in engines:
        engine.cpu_percent(None)
    time.sleep(window_s)
    return max(engines, key=lambda engine: engine.cpu_percent(None))
