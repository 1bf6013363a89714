"""Typed user-facing errors.

Every error a user can cause is one of these; the HTTP layer maps them to
OpenAI-shaped responses (``{"error": {"message", "type", "param", "code"}}``).
Asserts are kept for internal invariants only.
"""
from __future__ import annotations


class KVServeError(Exception):
    """Base class of every error kvserve raises on purpose."""

    http_status = 500
    error_type = "internal_error"
    code = "internal_error"

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code

    def to_dict(self) -> dict:
        """The OpenAI error body for this error."""
        return {"error": {"message": self.message, "type": self.error_type,
                          "param": self.param, "code": self.code}}


class InvalidRequestError(KVServeError):
    """A request field has a value the engine cannot honour (HTTP 400)."""

    http_status = 400
    error_type = "invalid_request_error"
    code = "invalid_parameter"


class ContextLengthExceededError(InvalidRequestError):
    """The prompt, or the prompt plus max_tokens, does not fit the context."""

    code = "context_length_exceeded"


class ModelLoadError(KVServeError):
    """A model path is missing, unreadable, corrupt or of an unsupported kind."""

    http_status = 404
    error_type = "invalid_request_error"
    code = "model_load_error"


class AdapterLoadError(InvalidRequestError):
    """A LoRA adapter folder that cannot be served: missing files, an unknown target
    module, a rank above the maximum, a shape that does not fit the base model, an
    unsupported PEFT option (HTTP 400). The message names what is wrong."""

    code = "invalid_lora_adapter"


class EngineBusyError(KVServeError):
    """The engine holds requests, or sleeps, and cannot do this now (HTTP 409)."""

    http_status = 409
    error_type = "invalid_request_error"
    code = "engine_busy"


class AdapterNotFoundError(KVServeError):
    """A request names an adapter that is not loaded (HTTP 404, as an unknown model)."""

    http_status = 404
    error_type = "invalid_request_error"
    code = "model_not_found"
