"""Calling a kvserve FastAPI app in-process, as one HTTP exchange: the replica serves each
forwarded request through the real front end (auth, limits, errors, metrics, streaming)."""
from __future__ import annotations

import asyncio
import logging
from typing import AsyncIterator

logger = logging.getLogger("kvserve.cluster")


def _scope(method: str, path: str, query: str, headers: list[tuple[str, str]]) -> dict:
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
            "path": path, "raw_path": path.encode(), "query_string": query.encode("latin-1"), "root_path": "",
            "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers],
            "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0)}


async def exchange(app, method: str, path: str, query: str, headers: list[tuple[str, str]],
                   body: bytes) -> AsyncIterator:
    """Run one request through ``app``: yields ``{"status", "headers"}`` first, then the body's
    chunks (bytes). If the consumer stops early (its client left), the app sees a disconnect."""
    messages: asyncio.Queue = asyncio.Queue()
    left = asyncio.Event()
    body_read = False

    async def receive() -> dict:
        nonlocal body_read
        if not body_read:
            body_read = True
            return {"type": "http.request", "body": body, "more_body": False}
        await left.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        await messages.put(message)

    task = asyncio.create_task(app(_scope(method, path, query, headers), receive, send))
    task.add_done_callback(lambda _t: messages.put_nowait(None))
    try:
        while (message := await messages.get()) is not None:
            if message["type"] == "http.response.start":
                yield {"status": message["status"],
                       "headers": [(k.decode("latin-1"), v.decode("latin-1")) for k, v in message["headers"]]}
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield bytes(message["body"])
                if not message.get("more_body"):
                    break
    finally:
        left.set()
        try:
            await asyncio.wait_for(task, timeout=30)
        except (asyncio.TimeoutError, asyncio.CancelledError):
            task.cancel()
        except Exception:                   # the app's own handlers answer errors; this is a bug
            logger.exception("the app failed on %s %s", method, path)
