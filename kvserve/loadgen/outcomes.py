"""Send one request to an OpenAI-compatible server and say how it ended, in exactly one
of these outcomes (for soak tests and guard benchmarks, where a request may be refused,
filtered or cancelled on purpose):

- ``completed``: a 200 whose choice ended with finish_reason ``stop`` or ``length``;
- ``rate_limited``: 429 (the tenant's limits);
- ``overloaded``: 503 (the server's queue bound, or starting / draining: ``detail`` says);
- ``content_filter``: a 200 whose choice ended with finish_reason ``content_filter``;
- ``input_blocked``: 400 with error code ``content_policy_violation``;
- ``client_abort``: this client closed the connection on purpose (a stream closed after
  some chunks, or a whole-body request given up after a time) before the end came;
- ``other``: anything else (another status or code, an error event in the stream, a
  stream without ``[DONE]``, a connection error, an unplanned client timeout); ``detail``
  names it.

One choice per request (``n`` = 1). Times are ``time.perf_counter`` seconds.
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx

from kvserve.loadgen.ghost_report import parse_server_timing

OUTCOMES = ("completed", "rate_limited", "overloaded", "content_filter", "input_blocked", "client_abort", "other")


@dataclass
class OutcomeRecord:
    """One request: what was asked, what came back, and its single outcome."""

    kind: str                              # the caller's label (e.g. "chat_stream")
    tenant: str | None
    stream: bool
    start: float = 0.0
    end: float = 0.0
    first_token: float | None = None       # first chunk with text (streamed)
    num_chunks: int = 0                    # chunks that carried text
    status: int | None = None
    error_code: str | None = None          # the error body's ``code`` (or the stream's error event)
    finish_reason: str | None = None
    saw_done: bool = False                 # the stream's ``[DONE]`` arrived
    aborted: bool = False                  # this client closed it on purpose before the end
    client_error: str | None = None        # connection error, unplanned timeout, bad body
    completion_tokens: int | None = None
    prompt_tokens: int | None = None
    retry_after: str | None = None
    ratelimit_headers: bool = False        # any x-ratelimit-* header in the response
    server_timing: dict[str, float] = field(default_factory=dict)
    outcome: str | None = None
    detail: str | None = None              # for ``other`` (and ``overloaded``): what exactly

    @property
    def ttft_s(self) -> float | None:
        return self.first_token - self.start if self.first_token is not None else None

    @property
    def e2e_s(self) -> float:
        return self.end - self.start


def classify(record: OutcomeRecord) -> tuple[str, str | None]:
    """(outcome, detail) of a finished exchange; see the module docstring."""
    if record.aborted:
        return "client_abort", None
    if record.client_error is not None:
        return "other", record.client_error
    status, code = record.status, record.error_code
    if status == 429:
        return "rate_limited", code
    if status == 503:
        return "overloaded", code
    if status == 400 and code == "content_policy_violation":
        return "input_blocked", None
    if status != 200:
        return "other", f"http_{status}:{code}"
    if code is not None:
        return "other", f"stream_error:{code}"
    if record.stream and not record.saw_done:
        return "other", "stream_without_done"
    if record.finish_reason == "content_filter":
        return "content_filter", None
    if record.finish_reason in ("stop", "length"):
        return "completed", None
    return "other", f"finish_reason:{record.finish_reason}"


def _error_code(body: bytes) -> str | None:
    try:
        return (json.loads(body).get("error") or {}).get("code")
    except (ValueError, AttributeError):
        return None


def _read_headers(record: OutcomeRecord, response: httpx.Response) -> None:
    record.status = response.status_code
    record.retry_after = response.headers.get("retry-after")
    record.ratelimit_headers = any(k.lower().startswith("x-ratelimit-") for k in response.headers)
    record.server_timing = parse_server_timing(response.headers.get("server-timing"))


def _read_choice(record: OutcomeRecord, payload: dict) -> None:
    """finish_reason and usage of a whole-body answer (or of one stream event)."""
    for choice in payload.get("choices") or []:
        if choice.get("finish_reason"):
            record.finish_reason = choice["finish_reason"]
    usage = payload.get("usage")
    if usage:
        record.prompt_tokens = usage.get("prompt_tokens")
        record.completion_tokens = usage.get("completion_tokens")


def _on_event(record: OutcomeRecord, data: str) -> None:
    """Fold one SSE ``data:`` payload into the record."""
    if data == "[DONE]":
        record.saw_done = True
        return
    event = json.loads(data)
    if "error" in event:
        record.error_code = (event.get("error") or {}).get("code") or "unknown"
        return
    for choice in event.get("choices") or []:
        text = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
        if text:
            record.num_chunks += 1
            if record.first_token is None:
                record.first_token = time.perf_counter()
    _read_choice(record, event)


async def _streamed(client: httpx.AsyncClient, url: str, body: dict, headers: dict, record: OutcomeRecord,
                    cancel_after_chunks: int | None) -> None:
    """A streamed exchange, event by event; closes early after ``cancel_after_chunks`` text chunks."""
    async with client.stream("POST", url, json=body, headers=headers) as response:
        _read_headers(record, response)
        if response.status_code != 200:
            record.error_code = _error_code(await response.aread())
            return
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            _on_event(record, line[5:].strip())
            if record.saw_done:
                return
            if (cancel_after_chunks is not None and record.num_chunks >= cancel_after_chunks
                    and record.finish_reason is None):
                record.aborted = True          # leaving the block closes the connection
                return


async def _whole(client: httpx.AsyncClient, url: str, body: dict, headers: dict, record: OutcomeRecord) -> None:
    """A whole-body exchange."""
    response = await client.post(url, json=body, headers=headers)
    _read_headers(record, response)
    if response.status_code != 200:
        record.error_code = _error_code(response.content)
        return
    _read_choice(record, response.json())


async def send_classified(client: httpx.AsyncClient, url: str, body: dict, record: OutcomeRecord,
                          api_key: str | None = None, cancel_after_chunks: int | None = None,
                          abort_after_s: float | None = None) -> OutcomeRecord:
    """Send ``body`` (``record.stream`` says whether it streams) and fill ``record``,
    ``outcome`` included. ``cancel_after_chunks``: close a stream after that many text
    chunks; ``abort_after_s``: give the whole exchange up after that many seconds. Either
    counts as ``client_abort`` only if the end had not come yet. Never raises (but lets a
    cancellation of the calling task through, after classifying)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    record.start = record.start or time.perf_counter()
    try:
        if record.stream:
            exchange = _streamed(client, url, body, headers, record, cancel_after_chunks)
        else:
            exchange = _whole(client, url, body, headers, record)
        if abort_after_s is None:
            await exchange
        else:
            try:
                await asyncio.wait_for(exchange, abort_after_s)
            except asyncio.TimeoutError:
                record.aborted = record.status is None or (record.finish_reason is None and not record.saw_done)
    except httpx.TimeoutException:
        record.client_error = "client_timeout"
    except httpx.HTTPError as exc:
        record.client_error = f"connection_error:{type(exc).__name__}"
    except asyncio.CancelledError:
        record.client_error = record.client_error or "cancelled_by_client_runner"
        raise
    except Exception as exc:                   # a malformed body or event: still one outcome
        record.client_error = f"client_exception:{type(exc).__name__}"
    finally:
        record.end = time.perf_counter()
        record.outcome, record.detail = classify(record)
    return record
