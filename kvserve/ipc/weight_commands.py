"""The engine process's side of a weights command (load in place, sleep, wake): it waits for
the requests already in flight to finish on the current weights, holds requests that arrive
meanwhile, runs the command between steps, then admits what it held — so no request ever
runs on two sets of weights, and none is refused for the swap."""
from __future__ import annotations

import logging

from kvserve.ipc import codec

logger = logging.getLogger("kvserve.engine_proc")


class WeightsGate:
    """At most one pending ``WeightsCommand`` and the requests held behind it."""

    def __init__(self):
        self.pending: codec.WeightsCommand | None = None
        self.held: list[codec.EngineRequest] = []

    def offer(self, command: codec.WeightsCommand) -> codec.WeightsResult | None:
        """Take ``command`` (None), or refuse it at once (a result) when one is pending."""
        if self.pending is not None:
            return codec.WeightsResult(409, error={"error": {
                "message": f"a weights command ({self.pending.action}) is already pending",
                "type": "invalid_request_error", "param": None, "code": "engine_busy"}})
        self.pending = command
        return None

    def hold(self, request: codec.EngineRequest) -> bool:
        """Keep ``request`` back while a command waits (True), else let it through."""
        if self.pending is None:
            return False
        self.held.append(request)
        return True

    def release(self, request_id: str) -> bool:
        """Drop a held request (aborted before it was admitted); True if it was held."""
        before = len(self.held)
        self.held = [r for r in self.held if r.request_id != request_id]
        return len(self.held) != before

    def run_if_idle(self, engine) -> tuple[codec.WeightsResult | None, list[codec.EngineRequest]]:
        """When the engine holds no request: run the command; returns its result and the
        held requests to admit now (else (None, []))."""
        if self.pending is None or engine.has_unfinished():
            return None, []
        command, self.pending = self.pending, None
        held, self.held = self.held, []
        return self._run(engine, command), held

    @staticmethod
    def _run(engine, command: codec.WeightsCommand) -> codec.WeightsResult:
        from kvserve.errors import InvalidRequestError, KVServeError
        try:
            if command.action == "load":
                if not command.path:
                    raise InvalidRequestError("load needs a model path", param="model")
                result = engine.load_weights(command.path)
            elif command.action in ("sleep", "wake"):
                result = getattr(engine, command.action)()
            else:
                raise InvalidRequestError(f"unknown weights action {command.action!r}", param="action")
        except KVServeError as err:
            return codec.WeightsResult(err.http_status, error=err.to_dict())
        except Exception:                      # an unreadable file the loader's checks missed
            logger.exception("weights command %s failed", command.action)
            err = KVServeError(f"weights command {command.action} failed; see the server log")
            return codec.WeightsResult(err.http_status, error=err.to_dict())
        return codec.WeightsResult(200, result=result)
