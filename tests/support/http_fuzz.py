"""Raw HTTP/1.1 requests with fuzzed request lines, headers and bodies, sent over plain
sockets (an HTTP client library would refuse to send most of them), one connection each.

Each case is ``(raw bytes, label)``; ``send_all`` returns the status of every answer
(0 when the server closed without an answer) and the bodies of the error answers.
"""
from __future__ import annotations

import asyncio
import json
import random

ROUTES = ["/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize", "/detokenize", "/health",
          "/ready", "/metrics", "/admin/reset_prefix_cache", "/v1/load_lora_adapter", "/nope", "/"]
METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD", "FOO", "get", "POST ", "P\x00ST"]


def _auth_values(key: str, rng: random.Random) -> list[bytes | None]:
    garbage = bytes(rng.randrange(33, 127) for _ in range(rng.randint(1, 80)))
    return [None, b"Bearer", b"Bearer ", b"Bearer " + garbage, b"bearer " + key.encode(), b"BEARER " + key.encode(),
            b"Bearer  " + key.encode(), b"Bearer " + key.encode() + b" extra", b"Basic " + key.encode(),
            b"Bearer " + key.encode() + b"\xff\xfe", b"Bearer \xe2\x82\xac" + garbage, b"Token " + key.encode(),
            b"Bearer " + b"k" * rng.choice([256, 4096, 60_000]), b"Bearer " + key.encode()[:-1]]


def _body(rng: random.Random, generate: bool) -> bytes:
    if not generate:
        return rng.choice([b"", b"{}", b"{", b"null", b"[]", b'{"prompt": 1}', b'{"tokens": [1, 2]}',
                           b'{"prompt": "hi", "max_tokens": -1}', bytes(rng.randrange(256) for _ in range(32))])
    body = {"model": "SmolLM2-135M-Instruct", "max_tokens": 1, "prompt": "hi"}
    return json.dumps(body).encode()


def _headers(rng: random.Random, key: str, body: bytes) -> list[bytes]:
    """Header lines (without CRLF) for one request, some of them broken on purpose."""
    lines = [b"Host: 127.0.0.1"]
    auth = rng.choice(_auth_values(key, rng) + [b"Bearer " + key.encode()] * 6)
    if auth is not None:
        lines.append(b"Authorization: " + auth)
    roll = rng.random()
    if roll < 0.55:
        lines.append(b"Content-Length: " + str(len(body)).encode())
    elif roll < 0.62:
        lines.append(b"Content-Length: " + rng.choice([b"-1", b"abc", b"1e3", b"99999999999999999999", b" 5"]))
    elif roll < 0.68:
        lines += [b"Content-Length: " + str(len(body)).encode(), b"Transfer-Encoding: chunked"]
    elif roll < 0.72:
        lines += [b"Content-Length: " + str(len(body)).encode()] * 2
    extra = rng.random()
    if extra < 0.15:
        lines.append(b"X-Injected: a\r\nX-Evil: 1")                         # CRLF injection: a second header
    elif extra < 0.2:
        lines.append(rng.choice([b"X-Bad: a\rb", b"X-Bad: a\nb", b"X Bad: 1", b"X-Bad:\x00", b": empty-name",
                                 b"X-\xff: 1", b"X-Bad"]))
    elif extra < 0.23:
        lines.append(b"X-Huge: " + b"a" * rng.choice([70_000, 300_000, 2_000_000]))
    elif extra < 0.26:
        lines += [b"X-Many-%d: v" % i for i in range(rng.choice([120, 500]))]
    elif extra < 0.35:
        lines.append(b"Content-Type: " + rng.choice([b"text/plain", b"application/json; charset=latin-1",
                                                     b"application/JSON", b"", b"multipart/form-data"]))
    return lines


def fuzz_case(rng: random.Random, key: str) -> tuple[bytes, str]:
    """One raw request and a label saying what was fuzzed."""
    roll = rng.random()
    if roll < 0.02:
        return b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", "h2-preface"
    if roll < 0.04:
        return bytes(rng.randrange(256) for _ in range(rng.randint(1, 200))) + b"\r\n\r\n", "garbage"
    method = rng.choice(METHODS) if rng.random() < 0.2 else rng.choice(["GET", "POST"])
    path = rng.choice(ROUTES)
    if rng.random() < 0.05:
        path = rng.choice(["/v1/../admin/reset_prefix_cache", "/%00", "/v1/models?x=" + "y" * 9000,
                           "/v1//completions", "/health#frag", "*", "http://evil/v1/models"])
    version = b"HTTP/1.1" if rng.random() < 0.97 else rng.choice([b"HTTP/1.0", b"HTTP/9.9", b"HTTP/1.1 x", b""])
    generate = path in ("/v1/completions", "/v1/chat/completions") and rng.random() < 0.25
    body = _body(rng, generate) if method.strip().upper() == "POST" else b""
    if path == "/v1/chat/completions" and generate:
        body = json.dumps({"model": "SmolLM2-135M-Instruct", "max_tokens": 1,
                           "messages": [{"role": "user", "content": "hi"}]}).encode()
    lines = _headers(rng, key, body) + [b"Connection: close"]
    head = b"%s %s %s\r\n" % (method.encode("latin-1"), path.encode("latin-1"), version)
    return head + b"\r\n".join(lines) + b"\r\n\r\n" + body, f"{method} {path}"


async def send_one(host: str, port: int, raw: bytes, timeout_s: float = 60.0) -> tuple[int, bytes]:
    """(status, body) of the answer to ``raw`` (status 0: closed without an answer)."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        try:
            writer.write(raw)
            await writer.drain()
        except (ConnectionError, OSError):
            pass                                          # refused mid-send (a huge header): read the answer
        data = await asyncio.wait_for(reader.read(), timeout_s)
    except (ConnectionError, OSError):
        data = b""
    finally:
        writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    parts = head.split(b" ", 2)
    status = int(parts[1]) if len(parts) >= 2 and parts[1].isdigit() else 0
    return status, body


async def send_all(host: str, port: int, cases: list[tuple[bytes, str]], concurrency: int = 16
                   ) -> list[tuple[int, bytes, str]]:
    """Send every case (``concurrency`` connections at once); (status, body, label) each."""
    gate = asyncio.Semaphore(concurrency)

    async def one(raw: bytes, label: str):
        async with gate:
            status, body = await send_one(host, port, raw)
            return status, body, label
    return await asyncio.gather(*(one(raw, label) for raw, label in cases))
