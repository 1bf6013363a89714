"""uvicorn's httptools protocol with bounds on what one connection may hold.

Stock uvicorn reads a request head of any size, waits for it for ever (its keep-alive
timer runs only after a response), takes any number of connections and answers parser
refusals with a plain-text 400. ``LimitedHttpProtocol`` adds, per connection:

- **Head size.** Bytes of the request line and headers are counted as they arrive; past
  ``max_header_bytes``, or past ``max_header_fields`` fields, the answer is 431 and the rest
  of the head is never read (at most one socket read, <= 256 KiB, past the limit is parsed).
- **Head timeout.** A new connection must deliver a complete head within
  ``header_timeout_s`` of opening; on a kept-alive connection uvicorn's keep-alive timer
  waits for the next request's first byte, and the head must then be complete within
  ``header_timeout_s``. A connection that sent part of a head gets 408; one that sent
  nothing is closed silently.
- **Body timeout.** While a body is being read, a gap of ``body_timeout_s`` without a body
  byte ends the request: 408 if no response has started, else the connection closes.
  Time during which the server itself stopped reading (flow control) does not count.
- **Connection cap.** Past ``max_connections`` open connections a new one gets 503 with
  ``Retry-After`` before anything is read.
- **Parser refusals** (malformed request line or header, negative Content-Length,
  Content-Length with chunked Transfer-Encoding, an HTTP/2 preface, an Upgrade request
  with a body) are a 400 ``invalid_http_request``. An Upgrade this server does not
  perform (h2c, websocket) on a request without a body is served as HTTP/1.1 and the
  connection closes after the response.

Every refusal is the JSON error shape of ``kvserve.errors`` with ``Connection: close``. The
response is followed by a half-close and a short linger with reading paused, so the client
can read it before the socket closes (a close with unread input sends a reset).
"""
from __future__ import annotations

import asyncio
import functools
import json
import logging
from dataclasses import dataclass
from typing import Callable

import httptools
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from kvserve.errors import KVServeError
from kvserve.server.errors import (HeaderFieldsTooLargeError, InvalidHttpRequestError, RequestTimeoutError,
                                   ServiceUnavailableError)

logger = logging.getLogger("kvserve.server")

REFUSAL_LINGER_S = 0.5          # after a refusal: half-closed, reading paused, then closed
REQUEST_LINE_OVERHEAD = 24      # method, spaces, "HTTP/1.1", CRLF: added to the URL's length


@dataclass(frozen=True)
class HttpLimits:
    """Per-connection bounds of the HTTP server (flags ``--max-header-bytes``,
    ``--max-header-fields``, ``--header-timeout``, ``--body-timeout``, ``--max-connections``;
    ``retry_after_s`` is ``--retry-after``). See the module docstring for what each bounds."""

    max_header_bytes: int = 64 * 1024
    max_header_fields: int = 100
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    max_connections: int = 1024
    retry_after_s: int = 1

    def __post_init__(self):
        for name in ("max_header_bytes", "max_header_fields", "max_connections"):
            if getattr(self, name) < 1:
                raise ValueError(f"{_flag(name)} must be at least 1, got {getattr(self, name)}")
        for name in ("header_timeout_s", "body_timeout_s"):
            if not 0 < getattr(self, name) < float("inf"):
                raise ValueError(f"{_flag(name)} must be a positive number of seconds, got {getattr(self, name)}")


def _flag(field_name: str) -> str:
    """``header_timeout_s`` -> ``--header-timeout``."""
    return "--" + field_name.removesuffix("_s").replace("_", "-")


class _Refusal(Exception):
    """Raised inside a parser callback to stop parsing and answer ``error``."""

    def __init__(self, error: KVServeError):
        super().__init__(error.message)
        self.error = error


def error_response_bytes(error: KVServeError, default_headers: list[tuple[bytes, bytes]]) -> bytes:
    """A complete ``Connection: close`` HTTP/1.1 response carrying ``error.to_dict()``."""
    body = json.dumps(error.to_dict()).encode()
    lines = [STATUS_LINE[error.http_status]]
    lines += [name + b": " + value + b"\r\n" for name, value in default_headers]
    retry_after_s = getattr(error, "retry_after_s", None)
    if retry_after_s is not None:
        lines.append(b"retry-after: %d\r\n" % retry_after_s)
    lines += [b"content-type: application/json\r\n", b"content-length: %d\r\n" % len(body),
              b"connection: close\r\n\r\n", body]
    return b"".join(lines)


def parser_error(exc: httptools.HttpParserError) -> KVServeError:
    """The error to answer for an exception out of ``feed_data``."""
    if isinstance(exc.__context__, _Refusal):
        return exc.__context__.error
    reason = str(exc) or type(exc).__name__
    if "PRI" in reason:
        reason = "HTTP/2 is not supported on this port; send HTTP/1.1"
    elif isinstance(exc, httptools.HttpParserCallbackError):
        reason = "the request line or a header cannot be read"
    return InvalidHttpRequestError(f"invalid HTTP request: {reason}")


class _ReadClockFlowControl(FlowControl):
    """uvicorn's flow control that calls ``on_read_change()`` when reading pauses or resumes,
    so time the server spent not reading never counts against the client."""

    def __init__(self, transport, on_read_change: Callable[[], None]):
        super().__init__(transport)
        self._on_read_change = on_read_change

    def pause_reading(self) -> None:
        if not self.read_paused:
            super().pause_reading()
            self._on_read_change()

    def resume_reading(self) -> None:
        if self.read_paused:
            super().resume_reading()
            self._on_read_change()


class LimitedHttpProtocol(HttpToolsProtocol):
    """uvicorn's ``HttpToolsProtocol`` with ``HttpLimits`` enforced (module docstring).
    ``on_refused(status, code)`` is called once for every refusal this class answers."""

    def __init__(self, config, server_state, app_state, _loop=None, *, limits: HttpLimits = HttpLimits(),
                 on_refused: Callable[[int, str], None] | None = None):
        super().__init__(config, server_state, app_state, _loop)
        self.limits = limits
        self.on_refused = on_refused
        self.head_begun = False            # a request head has started and is not complete
        self.head_bytes_received = 0       # bytes of that head counted so far (whole socket reads)
        self.head_field_bytes = 0          # bytes of its header fields parsed so far
        self.head_fields_parsed = 0        # header fields parsed so far
        self.body_pending = False          # headers complete, body not yet complete
        self.last_body_byte_at = 0.0       # loop time of the last body byte (or of the headers)
        self.upgrade_ignored = False       # an Upgrade we do not perform: no more input is parsed
        self.refused = False
        self._feed_crossed_head_end = False
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None

    # ------------------------------------------------------------ connection
    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.flow = _ReadClockFlowControl(transport, self._restart_body_clock)
        if len(self.connections) > self.limits.max_connections:
            self.connections.discard(self)          # a refused connection does not hold a place
            self.refuse(ServiceUnavailableError(
                f"too many open connections (limit {self.limits.max_connections}); retry later",
                code="too_many_connections", retry_after_s=self.limits.retry_after_s))
            return
        self._arm_head_timer()

    def connection_lost(self, exc) -> None:
        self._cancel_timers()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.refused or self.upgrade_ignored:
            return
        self._unset_keepalive_if_required()
        if self._head_timer is None and not self._request_in_progress() and not self.body_pending:
            self._arm_head_timer()                  # first bytes after a response
        self._feed_crossed_head_end = False
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._on_upgrade()
            return
        except httptools.HttpParserError as exc:
            self.refuse(parser_error(exc))
            return
        if self.head_begun and not self._feed_crossed_head_end:
            self.head_bytes_received += len(data)   # the whole read lies inside the head
            if self.head_bytes_received > self.limits.max_header_bytes:
                self.refuse(self._head_too_large())
                return
        if self.body_pending and self._body_timer is None:
            self._arm_body_timer()

    def send_400_response(self, msg: str) -> None:
        """uvicorn's plain-text 400, as the JSON error shape."""
        self.refuse(InvalidHttpRequestError(f"invalid HTTP request: {msg}"))

    # ------------------------------------------------------- parser callbacks
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.head_begun = True
        self.head_bytes_received = self.head_field_bytes = self.head_fields_parsed = 0

    def on_header(self, name: bytes, value: bytes) -> None:
        self.head_fields_parsed += 1
        self.head_field_bytes += len(name) + len(value) + 4
        if self.head_fields_parsed > self.limits.max_header_fields:
            raise _Refusal(HeaderFieldsTooLargeError(
                f"the request has more than {self.limits.max_header_fields} header fields"))
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        if len(self.url) + REQUEST_LINE_OVERHEAD + self.head_field_bytes > self.limits.max_header_bytes:
            raise _Refusal(self._head_too_large())
        self.head_begun = False
        self._feed_crossed_head_end = True
        self._cancel_head_timer()
        unsupported_upgrade = self.parser.should_upgrade() and not self._should_upgrade()
        if unsupported_upgrade and self._declares_body():
            raise _Refusal(InvalidHttpRequestError("invalid HTTP request: an Upgrade request may not carry a body "
                                                   "(this server does not switch protocols)"))
        super().on_headers_complete()
        if unsupported_upgrade:
            self.upgrade_ignored = True             # served as HTTP/1.1, then closed
            self.cycle.keep_alive = False
        self.body_pending = True
        self.last_body_byte_at = self.loop.time()

    def on_body(self, body: bytes) -> None:
        self.last_body_byte_at = self.loop.time()
        super().on_body(body)

    def on_message_complete(self) -> None:
        self.body_pending = False
        self._feed_crossed_head_end = True
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        super().on_message_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.head_begun and not self.transport.is_closing() and self._head_timer is None:
            self._arm_head_timer()                  # a pipelined head arrived in part

    # -------------------------------------------------------------- refusals
    def refuse(self, error: KVServeError) -> None:
        """Answer ``error`` (unless a response is under way), half-close, stop reading, and
        close after ``REFUSAL_LINGER_S``; the request in progress, if any, sees a disconnect."""
        if self.refused or self.transport.is_closing():
            return
        self.refused = True
        self._cancel_timers()
        self._unset_keepalive_if_required()
        logger.debug("HTTP refusal %d %s: %s", error.http_status, error.code, error.message)
        if self.on_refused is not None:
            self.on_refused(error.http_status, str(error.code))
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            if cycle.response_started or self.pipeline:     # a response is under way: just close
                self.transport.close()
                return
            cycle.disconnected = True               # the app's receive() returns http.disconnect
            cycle.message_event.set()
        self.transport.write(error_response_bytes(error, self.server_state.default_headers))
        if not self.transport.can_write_eof():
            self.transport.close()
            return
        self.transport.write_eof()
        self.flow.pause_reading()
        self.loop.call_later(REFUSAL_LINGER_S, self.transport.close)

    def _head_too_large(self) -> HeaderFieldsTooLargeError:
        return HeaderFieldsTooLargeError(f"the request line and headers exceed {self.limits.max_header_bytes} bytes")

    def _on_upgrade(self) -> None:
        if self._should_upgrade():
            self.handle_websocket_upgrade()
        elif not self.upgrade_ignored:              # the parser switched without a request to serve
            self.refuse(InvalidHttpRequestError("invalid HTTP request: protocol upgrade is not supported"))

    def _declares_body(self) -> bool:
        for name, value in self.headers:
            if name == b"transfer-encoding" or (name == b"content-length" and value.strip() not in (b"", b"0")):
                return True
        return False

    def _request_in_progress(self) -> bool:
        return self.cycle is not None and not self.cycle.response_complete

    # ---------------------------------------------------------------- timers
    def _arm_head_timer(self) -> None:
        self._head_timer = self.loop.call_later(self.limits.header_timeout_s, self._on_head_timeout)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _on_head_timeout(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or self._request_in_progress():
            return
        if self.head_begun:
            self.refuse(RequestTimeoutError(
                f"the request headers did not arrive within {self.limits.header_timeout_s:g} s"))
        else:
            self.transport.close()                  # nothing (or only blank lines) was sent

    def _restart_body_clock(self) -> None:
        self.last_body_byte_at = self.loop.time()

    def _arm_body_timer(self, delay_s: float | None = None) -> None:
        delay_s = self.limits.body_timeout_s if delay_s is None else delay_s
        self._body_timer = self.loop.call_later(delay_s, self._on_body_timeout)

    def _on_body_timeout(self) -> None:
        self._body_timer = None
        if not self.body_pending or self.transport.is_closing():
            return
        if self.flow.read_paused:                   # we are not reading: the client cannot be late
            self._arm_body_timer()
            return
        idle_s = self.loop.time() - self.last_body_byte_at    # since a body byte, or since reading resumed
        if idle_s < self.limits.body_timeout_s:
            self._arm_body_timer(self.limits.body_timeout_s - idle_s)
            return
        if self.cycle is not None and self.cycle.response_complete:
            self.transport.close()                  # answered without the body (a 413): nothing more to say
            return
        self.refuse(RequestTimeoutError(
            f"no request body bytes arrived for {self.limits.body_timeout_s:g} s"))

    def _cancel_timers(self) -> None:
        self._cancel_head_timer()
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None


def http_protocol_factory(limits: HttpLimits, on_refused: Callable[[int, str], None] | None = None):
    """What ``uvicorn.Config(http=...)`` takes: builds a ``LimitedHttpProtocol`` per connection."""
    return functools.partial(LimitedHttpProtocol, limits=limits, on_refused=on_refused)
