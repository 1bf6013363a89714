"""HTTP-level errors of the server, in the OpenAI error shape (KVServeError.to_dict)."""
from __future__ import annotations

from kvserve.errors import KVServeError


class AuthenticationError(KVServeError):
    """Missing or wrong API key (401)."""

    http_status = 401
    error_type = "authentication_error"
    code = "invalid_api_key"


class ModelNotFoundError(KVServeError):
    """The request names a model this server does not serve (404)."""

    http_status = 404
    error_type = "invalid_request_error"
    code = "model_not_found"


class NotFoundError(KVServeError):
    """Unknown route (404) or method (405)."""

    http_status = 404
    error_type = "invalid_request_error"
    code = "not_found"

    def __init__(self, message: str, status: int = 404):
        super().__init__(message)
        self.http_status = status
        if status == 405:
            self.code = "method_not_allowed"


class BodyTooLargeError(KVServeError):
    """The request body exceeds --max-body-bytes (413)."""

    http_status = 413
    error_type = "invalid_request_error"
    code = "request_too_large"


class UnsupportedMediaTypeError(KVServeError):
    """The body is not sent as application/json (415)."""

    http_status = 415
    error_type = "invalid_request_error"
    code = "unsupported_media_type"


class ServiceUnavailableError(KVServeError):
    """Overloaded, starting, draining or without an engine (503, with Retry-After)."""

    http_status = 503
    error_type = "server_error"
    code = "server_overloaded"

    def __init__(self, message: str, code: str = "server_overloaded", retry_after_s: int = 1):
        super().__init__(message, code=code)
        self.retry_after_s = retry_after_s


class DeadlineExceededError(KVServeError):
    """The request's deadline passed before it finished (504)."""

    http_status = 504
    error_type = "timeout_error"
    code = "deadline_exceeded"


class InternalServerError(KVServeError):
    """Anything unexpected (500): the message never carries a stack trace."""

    http_status = 500
    error_type = "server_error"
    code = "internal_error"


class PermissionDeniedError(KVServeError):
    """A valid key on a route it may not use: an admin route when --admin-api-key is set (403)."""

    http_status = 403
    error_type = "permission_error"
    code = "permission_denied"


class EngineStartError(KVServeError):
    """The engine process refused its configuration at start (a bad --lora-modules adapter,
    an impossible setting): the server exits 2 with this message."""

    http_status = 500
    error_type = "server_error"
    code = "engine_start_failed"


class InvalidHttpRequestError(KVServeError):
    """The HTTP parser refused the request itself (a malformed request line or header, a
    negative Content-Length, Content-Length with chunked Transfer-Encoding, an HTTP/2
    preface): 400, and the connection is closed (``http_protocol.py``)."""

    http_status = 400
    error_type = "invalid_request_error"
    code = "invalid_http_request"


class RequestTimeoutError(KVServeError):
    """The request head, or the body while it was being read, did not arrive in time
    (--header-timeout, --body-timeout): 408, and the connection is closed."""

    http_status = 408
    error_type = "timeout_error"
    code = "request_timeout"


class HeaderFieldsTooLargeError(KVServeError):
    """The request line and headers exceed --max-header-bytes, or there are more header
    fields than the limit: 431, and the connection is closed."""

    http_status = 431
    error_type = "invalid_request_error"
    code = "request_header_fields_too_large"
