"""The events of a streamed OpenAI response (server-sent events): one parsed JSON object per
``data:`` line, the ``[DONE]`` sentinel and other lines skipped."""
from __future__ import annotations

import json
from typing import AsyncIterator

import httpx


async def sse_events(response: httpx.Response) -> AsyncIterator[dict]:
    """Each ``data: {...}`` event of ``response``'s body, parsed, in order."""
    async for line in response.aiter_lines():
        if not line.startswith("data:") or line[5:].strip() == "[DONE]":
            continue
        yield json.loads(line[5:])
