"""A synchronous handle on one engine process of a disaggregated pair.

Spawns ``python -m kvserve.disagg.worker`` with one end of a Unix socket pair (as
``server/engine_client.py`` does for ``kvserve serve``), sends InitEngine, waits for
EngineReady, then exchanges the one codec's messages: ``send`` and ``receive``.
"""
from __future__ import annotations

import os
import select
import socket
import subprocess
import sys
import time

from kvserve.ipc import codec


class EngineStartError(RuntimeError):
    """The engine process refused its configuration or died before it was ready.
    ``status`` and ``error`` are EngineFailed's (HTTP status, ``{"error": {...}}`` body)
    when it refused; None when it died or timed out."""

    def __init__(self, message: str, status: int | None = None, error: dict | None = None):
        super().__init__(message)
        self.status, self.error = status, error


class EngineProcess:
    """One engine process (``name`` is for messages: "prefill", "decode")."""

    def __init__(self, name: str, engine_config: dict):
        self.name = name
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.process = subprocess.Popen([sys.executable, "-m", "kvserve.disagg.worker", "--fd", str(child.fileno())],
                                        pass_fds=(child.fileno(),), env=env)
        child.close()
        self.sock = parent
        self.frames = codec.FrameBuffer()
        self._backlog: list = []
        self.send(codec.InitEngine(dict(engine_config)))
        self.info: codec.EngineReady | None = None

    def wait_ready(self, timeout_s: float = 300.0) -> codec.EngineReady:
        """Block until the model is loaded (EngineReady); EngineStartError if it refused
        its configuration or exited. Start both engines before waiting on either."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for message in self.receive(min(1.0, max(0.0, deadline - time.monotonic()))):
                if isinstance(message, codec.EngineReady):
                    self.info = message
                    return message
                if isinstance(message, codec.EngineFailed):
                    raise EngineStartError(f"{self.name} engine refused its configuration: {message.error}",
                                           message.status, message.error)
            if self.process.poll() is not None:
                raise EngineStartError(f"{self.name} engine exited with {self.process.returncode} before it was ready")
        raise EngineStartError(f"{self.name} engine not ready after {timeout_s:.0f} s")

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, message) -> None:
        self.sock.sendall(codec.encode(message))

    def receive(self, timeout_s: float = 0.0) -> list:
        """Messages waiting on the socket, waiting up to ``timeout_s`` for the first."""
        messages, self._backlog = self._backlog, []
        while True:
            ready, _, _ = select.select([self.sock], [], [], 0.0 if messages else timeout_s)
            if not ready:
                return messages
            data = self.sock.recv(1 << 20)
            if not data:
                raise EOFError(f"the {self.name} engine process closed its socket")
            messages.extend(self.frames.feed(data))

    def put_back(self, messages: list) -> None:
        """Messages taken by ``receive`` that the caller has not handled yet (first next time)."""
        self._backlog = list(messages) + self._backlog

    def close(self, timeout_s: float = 10.0) -> int | None:
        """Ask the process to exit, kill it if it does not in ``timeout_s``; its exit code."""
        if self.process.poll() is None:
            try:
                self.send(codec.Shutdown())
            except OSError:
                pass
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.sock.close()
        return self.process.returncode
