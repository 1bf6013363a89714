"""Server lifecycle and admission: starting -> ready -> draining -> stopped (or engine dead).

Admission is decided before any response header is sent: a request is either
refused with 503 + Retry-After or handed to the engine. The waiting queue is
bounded in requests and in prompt tokens ("queued" = admitted, not yet scheduled
by the engine).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from kvserve.server.errors import ServiceUnavailableError


@dataclass(frozen=True)
class AdmissionLimits:
    max_queued_requests: int = 256
    max_queued_tokens: int = 262_144
    retry_after_s: int = 1
    stall_timeout_s: float = 60.0     # /ready turns 503 when requests run and no token came for this long


class ServerState:
    """Readiness flags plus the admission rule; the engine client supplies the counts."""

    def __init__(self, limits: AdmissionLimits):
        self.limits = limits
        self.engine_ready = False
        self.draining = False
        self.engine_dead = False
        self.startup_error: str | None = None
        self.busy_since: float | None = None      # when in-flight work last went from none to some

    def not_ready_reason(self, client) -> str | None:
        """Why /ready should answer 503 now, or None when ready."""
        if self.engine_dead or (client is not None and client.dead):
            return "the engine process is not running"
        if self.draining:
            return "the server is draining"
        if not self.engine_ready or client is None:
            return self.startup_error or "the engine is starting"
        if client.requests:
            now = time.monotonic()
            if self.busy_since is None:
                self.busy_since = now
            last_progress = max(client.last_token_time, self.busy_since)
            if now - last_progress > self.limits.stall_timeout_s:
                return f"requests are running and no token was produced for {now - last_progress:.1f} s"
        else:
            self.busy_since = None
        return None

    def check_accepting(self, client) -> None:
        """Raise 503 unless new generation requests can be taken at all."""
        retry = self.limits.retry_after_s
        if self.engine_dead or (client is not None and client.dead):
            raise ServiceUnavailableError("the engine process is not running", code="engine_unavailable",
                                          retry_after_s=retry)
        if self.draining:
            raise ServiceUnavailableError("the server is shutting down", code="server_shutting_down",
                                          retry_after_s=retry)
        if not self.engine_ready or client is None:
            raise ServiceUnavailableError("the engine is starting", code="server_starting", retry_after_s=retry)

    def admit(self, client, num_requests: int, num_prompt_tokens: int) -> None:
        """Raise 503 (overloaded) if these requests would overflow the waiting queue."""
        self.check_accepting(client)
        limits = self.limits
        queued, queued_tokens = client.num_queued, client.num_queued_tokens
        if queued + num_requests > limits.max_queued_requests:
            raise ServiceUnavailableError(
                f"the server is overloaded: {queued} requests are waiting (limit "
                f"{limits.max_queued_requests}); retry later", retry_after_s=limits.retry_after_s)
        if queued_tokens + num_prompt_tokens > limits.max_queued_tokens and queued > 0:
            raise ServiceUnavailableError(
                f"the server is overloaded: {queued_tokens} prompt tokens are waiting (limit "
                f"{limits.max_queued_tokens}); retry later", retry_after_s=limits.retry_after_s)
        if not client.requests:
            self.busy_since = time.monotonic()
