"""The audit log: one JSON line per generation request, written when it ends (finished,
refused, filtered, aborted or failed).

A line holds the request id, tenant, model / adapter, class, token counts, guard
decisions, finish reasons, the HTTP status and error code, and the timings
(``Server-Timing``'s phases) — never the prompt or the output text, unless the
tenant's policy (``audit_text = true`` in the tenants file) asks for them.
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass, field

logger = logging.getLogger("kvserve.server")


@dataclass
class AuditRecord:
    """What one request leaves in the audit log; filled in as the request goes."""

    id: str
    tenant: str | None
    endpoint: str                          # "chat" or "completion"
    time: float = field(default_factory=time.time)    # arrival, Unix seconds
    model: str | None = None
    adapter: str | None = None
    service_class: str | None = None
    stream: bool | None = None
    status: int = 200
    error_code: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    finish_reasons: list[str] = field(default_factory=list)
    guards: list[dict] = field(default_factory=list)        # {guard, point, decision, reason, ms}
    timings_ms: dict[str, float] = field(default_factory=dict)
    prompt_text: str | None = None         # only with the tenant's audit_text
    output_text: list[str] | None = None

    def refuse(self, status: int, code: str | None) -> None:
        """The request was refused (or failed) with this status and error code."""
        self.status, self.error_code = status, code

    def add_guard(self, guard: str, point: str, decision: str, reason: str | None, seconds: float) -> None:
        self.guards.append({"guard": guard, "point": point, "decision": decision, "reason": reason,
                            "ms": round(seconds * 1000.0, 3)})


class AuditLog:
    """Appends records to a JSON-lines file (line-buffered: a crash loses at most a line)."""

    def __init__(self, path: str):
        self.path = path
        self._file = open(path, "a", encoding="utf-8", buffering=1)
        self.num_written = 0

    def write(self, record: AuditRecord) -> None:
        entry = {k: v for k, v in asdict(record).items() if v is not None}
        try:
            self._file.write(json.dumps(entry, ensure_ascii=False, separators=(",", ":")) + "\n")
            self.num_written += 1
        except (OSError, ValueError) as exc:      # a full disk must not fail the request
            logger.error("audit log %s: cannot write: %s", self.path, exc)

    def close(self) -> None:
        self._file.close()
