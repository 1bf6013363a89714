"""Run ``kvserve serve`` as a child process on a free local port (tests and benchmarks)."""
from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx


RAY_WORKER_PORT_MAX = 19999     # Ray's workers listen on 10002-19999 by default


def ephemeral_port_low() -> int:
    """The lowest port the kernel hands to ``bind(0)`` and to outgoing connections (Linux: 32768)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(rng: random.Random | None = None, tries: int = 200) -> int:
    """A free 127.0.0.1 port that nothing else on the host is about to take.

    The port is chosen above Ray's worker ports and below the kernel's ephemeral range.
    A port from ``bind(0)`` lies inside that range, and so do the ports Ray picks at random
    for its own listeners and the local ports of every outgoing connection. Between this
    call and the server's bind, one of those could take it: a Ray Serve proxy once failed
    with ``Failed to bind to address``. When no port in the band is free, the kernel picks.
    """
    rng = rng or random.Random()
    low, high = RAY_WORKER_PORT_MAX + 1, ephemeral_port_low() - 1
    for _ in range(tries if high > low else 0):
        port = rng.randint(low, high)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``kvserve serve ARGS`` on 127.0.0.1:<free port>; a context manager that waits for /ready."""

    def __init__(self, *args: str, port: int | None = None, cpus: str | None = None,
                 startup_timeout_s: float = 300.0, env: dict | None = None, command: tuple[str, ...] = ("serve",)):
        """``command``: the kvserve subcommand (``("cluster", "serve")`` for the cluster mode)."""
        self.args = list(args)
        self.command = command
        self.port = port or free_port()
        self.cpus = cpus
        self.startup_timeout_s = startup_timeout_s
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.process: subprocess.Popen | None = None
        self.log = tempfile.NamedTemporaryFile(prefix="kvserve-server-", suffix=".log", delete=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def start(self) -> "ServerProcess":
        command = [sys.executable, "-m", "kvserve.cli", *self.command, "--port", str(self.port), *self.args]
        if self.cpus:
            command = ["taskset", "-c", self.cpus, *command]
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, env=self.env)
        self.wait_ready()
        return self

    def wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/ready", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise TimeoutError(f"server not ready after {self.startup_timeout_s} s:\n{self.log_tail()}")

    def engine_pid(self) -> int:
        return httpx.get(self.url + "/health", timeout=10).json()["engine_pid"]

    def log_tail(self, chars: int = 4000) -> str:
        with open(self.log.name, encoding="utf-8", errors="replace") as f:
            return f.read()[-chars:]

    def stop(self, timeout_s: float = 60.0) -> int | None:
        """SIGTERM (drain), then SIGKILL if it does not exit in time; the exit code."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
        try:
            os.unlink(self.log.name)
        except OSError:
            pass
