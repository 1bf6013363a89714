"""Issue 15 defects 4 and 6, tier 1: the HTTP protocol's head/body bounds, timeouts, connection
cap and JSON parser refusals, against an in-process uvicorn on 127.0.0.1 (raw sockets)."""
from __future__ import annotations

import asyncio
import contextlib
import json
import select
import socket
import threading
import time

import pytest
import uvicorn

from kvserve.server.http_protocol import HttpLimits, http_protocol_factory

FAST = HttpLimits(max_header_bytes=16 * 1024, max_header_fields=50, header_timeout_s=0.5, body_timeout_s=0.5,
                  max_connections=64, retry_after_s=3)
ERROR_KEYS = {"message", "type", "param", "code"}


async def echo_app(scope, receive, send):
    """Reads the whole body (on ``/slow`` only after a second), answers its length; ``/reject``
    answers 413 without reading it."""
    if scope["path"] == "/slow":
        await asyncio.sleep(1.0)
    if scope["path"] == "/reject":
        await send({"type": "http.response.start", "status": 413, "headers": [(b"content-length", b"0")]})
        await send({"type": "http.response.body", "body": b""})
        return
    size, more = 0, True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        size += len(message.get("body", b""))
        more = message.get("more_body", False)
    body = json.dumps({"body_bytes": size}).encode()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]})
    await send({"type": "http.response.body", "body": body})


@contextlib.contextmanager
def serving(limits: HttpLimits, refusals: list | None = None):
    """uvicorn with ``LimitedHttpProtocol`` in a background thread; yields its port."""
    on_refused = (lambda status, code: refusals.append((status, code))) if refusals is not None else None
    config = uvicorn.Config(echo_app, host="127.0.0.1", port=0, log_level="warning", lifespan="off",
                            http=http_protocol_factory(limits, on_refused))
    server = uvicorn.Server(config)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    try:
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


@pytest.fixture(scope="module")
def port():
    with serving(FAST) as p:
        yield p


def connect(port: int, timeout: float = 5.0) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def read_until_closed(s: socket.socket) -> bytes:
    """Everything the server sends until it closes (or resets) the connection."""
    out = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := s.recv(65536):
            out += chunk
    return out


def read_response(s: socket.socket) -> tuple[int, dict, bytes]:
    """One response with a Content-Length body: (status, headers, body)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        assert chunk, f"closed before a response: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    while len(body) < int(headers["content-length"]):
        body += s.recv(65536)
    return int(lines[0].split()[1]), headers, body


def parse(raw: bytes) -> tuple[int, dict, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, json.loads(body)


def assert_error(raw: bytes, status: int, code: str) -> dict:
    got_status, headers, body = parse(raw)
    assert got_status == status, raw[:300]
    assert headers["content-type"] == "application/json" and headers["connection"] == "close"
    assert set(body["error"]) == ERROR_KEYS and body["error"]["code"] == code
    assert isinstance(body["error"]["message"], str)
    return headers


def get(path: str = "/", extra: bytes = b"") -> bytes:
    return b"GET " + path.encode() + b" HTTP/1.1\r\nHost: t\r\n" + extra + b"\r\n"


# ------------------------------------------------------------------ normal traffic
def test_keep_alive_requests_and_a_normal_sized_header(port):
    with connect(port) as s:
        s.sendall(get(extra=b"X-Big: " + b"a" * 12_000 + b"\r\n"))
        assert read_response(s)[0] == 200
        s.sendall(b"POST /x HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\n\r\nhello")
        status, _, body = read_response(s)
        assert status == 200 and json.loads(body) == {"body_bytes": 5}
        s.sendall(get())
        assert read_response(s)[0] == 200


# ------------------------------------------------------------------------ head size
def test_huge_header_is_refused_without_reading_it():
    total = 16 * 2**20
    with serving(HttpLimits(header_timeout_s=5, body_timeout_s=5)) as p, connect(p) as s:
        s.setblocking(False)
        payload = b"GET / HTTP/1.1\r\nHost: t\r\nX-Huge: " + b"a" * total
        sent, received, closed = 0, b"", False
        start = time.monotonic()
        while not closed and time.monotonic() - start < 10:
            readable, writable, _ = select.select([s], [s] if sent < len(payload) else [], [], 1.0)
            if readable:
                try:
                    chunk = s.recv(65536)
                except ConnectionResetError:
                    chunk = b""
                received += chunk
                closed = not chunk
            if writable and not closed:
                try:
                    sent += s.send(payload[sent:sent + 65536])
                except (BrokenPipeError, ConnectionResetError):
                    closed = True
        elapsed = time.monotonic() - start
    assert_error(received, 431, "request_header_fields_too_large")
    assert sent < len(payload), "the server read the whole 16 MiB header"
    assert elapsed < 5


def test_header_over_the_limit_in_one_read_is_refused(port):
    with connect(port) as s:
        s.sendall(get(extra=b"X-Big: " + b"a" * 20_000 + b"\r\n"))
        assert_error(read_until_closed(s), 431, "request_header_fields_too_large")


def test_too_many_header_fields(port):
    with connect(port) as s:
        s.sendall(get(extra=b"".join(b"X-F%d: v\r\n" % i for i in range(60))))
        assert_error(read_until_closed(s), 431, "request_header_fields_too_large")


# ----------------------------------------------------------------------- timeouts
def test_slowloris_head_gets_408_after_the_header_timeout(port):
    with connect(port) as s:
        start = time.monotonic()
        s.sendall(b"GET / HTTP/1.1\r\nHost: t\r\nX-Slow: ")
        raw = read_until_closed(s)
        elapsed = time.monotonic() - start
    assert_error(raw, 408, "request_timeout")
    assert 0.4 < elapsed < 3


def test_slow_head_on_a_kept_alive_connection(port):
    with connect(port) as s:
        s.sendall(get())
        assert read_response(s)[0] == 200
        time.sleep(0.3)                                  # idle within uvicorn's keep-alive
        s.sendall(b"GET / HTTP/1.1\r\n")
        start = time.monotonic()
        raw = read_until_closed(s)
    assert_error(raw, 408, "request_timeout")
    assert time.monotonic() - start < 3


def test_silent_socket_is_closed(port):
    with connect(port) as s:
        start = time.monotonic()
        assert read_until_closed(s) == b""
        assert 0.4 < time.monotonic() - start < 3


def test_stalled_body_gets_408_after_the_body_timeout(port):
    with connect(port) as s:
        s.sendall(b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 100\r\n\r\nabc")
        start = time.monotonic()
        raw = read_until_closed(s)
    assert_error(raw, 408, "request_timeout")
    assert 0.4 < time.monotonic() - start < 3


def test_slow_but_steady_body_is_fine(port):
    with connect(port) as s:
        s.sendall(b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 4\r\n\r\n")
        for byte in b"abcd":
            time.sleep(0.3)                              # each gap under the 0.5 s body timeout
            s.sendall(bytes([byte]))
        status, _, body = read_response(s)
    assert status == 200 and json.loads(body) == {"body_bytes": 4}


def test_stalled_body_after_an_early_answer_is_closed_without_a_second_answer(port):
    with connect(port) as s:
        s.sendall(b"POST /reject HTTP/1.1\r\nHost: t\r\nContent-Length: 100\r\n\r\nabc")
        raw = read_until_closed(s)
    assert raw.startswith(b"HTTP/1.1 413") and raw.count(b"HTTP/1.1") == 1


def test_body_held_back_by_flow_control_is_not_a_timeout(port):
    body = b"x" * 2**20                                  # past uvicorn's 64 KiB high-water mark: reading pauses
    with connect(port) as s:
        s.sendall(b"POST /slow HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        status, _, answer = read_response(s)
    assert status == 200 and json.loads(answer) == {"body_bytes": len(body)}


# ------------------------------------------------------------------ connection cap
def test_connections_past_the_cap_get_503():
    refusals = []
    with serving(HttpLimits(max_connections=3, retry_after_s=7), refusals) as p:
        held = [connect(p) for _ in range(3)]
        for s in held:                                   # served, so surely counted, and kept alive
            s.sendall(get())
            assert read_response(s)[0] == 200
        with connect(p) as extra:
            extra.sendall(get())
            headers = assert_error(read_until_closed(extra), 503, "too_many_connections")
        assert headers["retry-after"] == "7"
        held.pop().close()                               # a place frees once the server sees the close
        deadline = time.monotonic() + 5
        while True:
            with connect(p) as again:
                again.sendall(get())
                status = read_response(again)[0]
            if status == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert status == 200
        for s in held:
            s.close()
    assert refusals and set(refusals) == {(503, "too_many_connections")}


# ------------------------------------------------------------------ parser refusals
@pytest.mark.parametrize("raw", [
    b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: -1\r\n\r\n",
    b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
    b"\x16\x03\x01\x02\x00garbage\r\n\r\n",
    b"GET / HTTP/1.1\r\nBad Header: x\r\n\r\n",
    b"GET /\xff HTTP/1.1\r\nHost: t\r\n\r\n",
    b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n",
    b"POST / HTTP/1.1\r\nHost: t\r\nConnection: Upgrade\r\nUpgrade: h2c\r\nContent-Length: 5\r\n\r\nhello",
    b"POST / HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
], ids=["negative-cl", "cl-and-chunked", "h2-preface", "garbage", "bad-header-name", "non-ascii-path", "connect",
        "upgrade-with-body", "bad-chunk-size"])
def test_parser_refusals_are_json_400(port, raw):
    with connect(port) as s:
        s.sendall(raw)
        headers = assert_error(read_until_closed(s), 400, "invalid_http_request")
    assert "retry-after" not in headers


def test_h2_preface_message_names_http2(port):
    with connect(port) as s:
        s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        assert "HTTP/2" in parse(read_until_closed(s))[2]["error"]["message"]


def test_unperformed_upgrade_is_served_then_closed(port):
    with connect(port) as s:
        s.sendall(get(extra=b"Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABk\r\n")
                  + get())
        raw = read_until_closed(s)
    assert raw.startswith(b"HTTP/1.1 200") and raw.count(b"HTTP/1.1") == 1


def test_limits_are_checked():
    with pytest.raises(ValueError, match="--header-timeout"):
        HttpLimits(header_timeout_s=0)
    with pytest.raises(ValueError, match="--max-connections"):
        HttpLimits(max_connections=0)
