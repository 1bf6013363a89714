"""Send a workload to an OpenAI-compatible server and time every streamed response.

Two arrival modes:
- fixed concurrency: ``concurrency`` workers, each sends its next request (or
  conversation) as soon as the previous one ends;
- Poisson: requests start at exponential intervals of mean ``1 / rate``
  (optionally capped at ``concurrency`` in flight).

Per request it records the send time, the time of every chunk that carries text,
the end time and the server's ``usage`` (token counts come from there, never from
re-tokenising), or the kind of error.
"""
from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import httpx

from kvserve.loadgen.workloads import BenchRequest


@dataclass
class RequestRecord:
    """Timings of one request (one turn of a conversation), in seconds of time.perf_counter."""

    request_id: int
    turn: int
    start: float
    end: float = 0.0
    chunk_times: list[float] = field(default_factory=list)   # chunks that carried text
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    error: str | None = None
    text: str = ""

    @property
    def ttft_s(self) -> float | None:
        return self.chunk_times[0] - self.start if self.chunk_times else None

    @property
    def e2e_s(self) -> float:
        return self.end - self.start

    @property
    def tpot_s(self) -> float | None:
        """(end - first token) / (output tokens - 1): time per output token after the first."""
        if self.ttft_s is None or not self.output_tokens or self.output_tokens < 2:
            return None
        return (self.end - self.chunk_times[0]) / (self.output_tokens - 1)

    @property
    def itls_s(self) -> list[float]:
        """Gaps between consecutive text chunks."""
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]


@dataclass
class ClientConfig:
    base_url: str                      # e.g. http://127.0.0.1:8000 (with or without /v1)
    model: str | None = None
    endpoint: str = "chat"             # "chat" | "completions"
    api_key: str | None = None
    temperature: float = 0.0
    ignore_eos: bool = True
    timeout_s: float = 600.0
    extra_body: dict = field(default_factory=dict)

    @property
    def url(self) -> str:
        base = self.base_url.rstrip("/")
        base = base if base.endswith("/v1") else base + "/v1"
        return base + ("/chat/completions" if self.endpoint == "chat" else "/completions")


class Runner:
    """Drives one server with a shared HTTP connection pool."""

    def __init__(self, config: ClientConfig, progress=None):
        self.config = config
        self.progress = progress
        self.records: list[RequestRecord] = []

    def _body(self, request: BenchRequest, messages: list[dict] | None) -> dict:
        body = {"max_tokens": request.max_tokens, "temperature": self.config.temperature, "stream": True,
                "stream_options": {"include_usage": True}, **self.config.extra_body}
        if self.config.model:
            body["model"] = self.config.model
        if self.config.ignore_eos:
            body["ignore_eos"] = True
        if self.config.endpoint == "chat":
            body["messages"] = messages if messages is not None else (
                request.messages or [{"role": "user", "content": request.prompt}])
        else:
            body["prompt"] = request.prompt if request.prompt is not None else "\n".join(
                m["content"] for m in (messages or request.messages))
        return body

    async def _send(self, client: httpx.AsyncClient, body: dict, record: RequestRecord) -> None:
        headers = {"Authorization": f"Bearer {self.config.api_key}"} if self.config.api_key else {}
        try:
            async with client.stream("POST", self.config.url, json=body, headers=headers) as response:
                if response.status_code != 200:
                    record.error = _http_error_kind(response.status_code, await response.aread())
                    return
                async for line in response.aiter_lines():
                    if self._on_line(line, record):
                        break
            if record.error is None and record.output_tokens is None:
                record.error = "missing_usage"
        except httpx.TimeoutException:
            record.error = "timeout"
        except httpx.HTTPError as exc:
            record.error = f"connection_error:{type(exc).__name__}"
        finally:
            record.end = time.perf_counter()

    @staticmethod
    def _on_line(line: str, record: RequestRecord) -> bool:
        """Fold one SSE line into the record; True at the end of the stream."""
        if not line.startswith("data:"):
            return False
        data = line[5:].strip()
        if data == "[DONE]":
            return True
        event = json.loads(data)
        if "error" in event:
            record.error = f"stream_error:{(event['error'] or {}).get('code')}"
            return False
        now = time.perf_counter()
        for choice in event.get("choices") or []:
            text = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
            if text:
                record.chunk_times.append(now)
                record.text += text
                break
        usage = event.get("usage")
        if usage:
            record.prompt_tokens = usage.get("prompt_tokens")
            record.output_tokens = usage.get("completion_tokens")
        return False

    async def _conversation(self, client: httpx.AsyncClient, request: BenchRequest) -> None:
        """Send every turn of ``request``; later turns resend the history with the replies."""
        messages = list(request.messages) if request.messages is not None else None
        record = None
        for turn in range(request.turns):
            if turn > 0:
                messages = messages + [{"role": "assistant", "content": record.text},
                                       {"role": "user", "content": request.followups[turn - 1]}]
            record = RequestRecord(request.id, turn, time.perf_counter())
            self.records.append(record)
            await self._send(client, self._body(request, messages), record)
            if self.progress is not None:
                self.progress.update(1)
            if record.error is not None:
                return

    async def run(self, requests: list[BenchRequest], concurrency: int | None = None,
                  rate: float | None = None, seed: int = 0) -> float:
        """Send everything; returns the wall time in seconds from the first send to the last end."""
        limit = concurrency or len(requests) or 1
        limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
        timeout = httpx.Timeout(self.config.timeout_s, connect=30.0)
        started = time.perf_counter()
        async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
            if rate:
                await self._run_poisson(client, requests, rate, concurrency, seed)
            else:
                await self._run_fixed(client, requests, limit)
        return time.perf_counter() - started

    async def _run_fixed(self, client, requests: list[BenchRequest], concurrency: int) -> None:
        queue = list(reversed(requests))

        async def worker():
            while queue:
                await self._conversation(client, queue.pop())

        await asyncio.gather(*(worker() for _ in range(min(concurrency, len(requests)))))

    async def _run_poisson(self, client, requests: list[BenchRequest], rate: float, concurrency: int | None,
                           seed: int) -> None:
        rng = random.Random(seed)
        gate = asyncio.Semaphore(concurrency) if concurrency else None
        tasks = []

        async def one(request: BenchRequest):
            if gate is None:
                return await self._conversation(client, request)
            async with gate:
                await self._conversation(client, request)

        for request in requests:
            tasks.append(asyncio.create_task(one(request)))
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks)


def _http_error_kind(status: int, body: bytes) -> str:
    try:
        code = json.loads(body).get("error", {}).get("code")
    except (ValueError, AttributeError):
        code = None
    return f"http_{status}" + (f":{code}" if code else "")
