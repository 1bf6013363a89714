"""The ghost-text workload (``kvserve bench --workload ghost``): simulated typists in a code
editor asking for inline completions on every keystroke.

Each of ``typists`` walks through a real code file (default: ``kvserve/engine/scheduler.py``
of this package) from a random line, typing one character per keystroke at
``keystrokes_per_s`` (gaps uniform in ``1/speed * [1 - jitter, 1 + jitter]``, seeded; the
indentation after a newline comes with the newline, as an editor's auto-indent does) and
pausing now and then at a line end (``pause_prob``) or after a word (``word_pause_prob``) for
``pause_s`` seconds, so some requests complete. A typist's last request (when it stops
typing at the end of the run) is left to complete too.

On every keystroke the editor cancels the previous in-flight request (closes its
connection; the server aborts a request whose client went away) and sends a new
``/v1/completions`` request: the prompt is the file up to the cursor from a window start
that stays put while the window grows from ``context_chars`` to ``context_chars * (1 +
window_slack)`` and then moves to a later line start, so consecutive prompts extend each
other (what lets the prefix cache hit); ``max_tokens`` <= 16, temperature 0,
``service_tier`` (None: the field is not sent), optionally ``suffix`` (the next
``suffix_chars`` characters after the cursor's line: fill-in-the-middle).

Per request it records cancelled / completed, client-side e2e (TTFT when ``stream``),
``usage`` (prompt and cached tokens) and the server's ``Server-Timing`` phases; summaries
are in :mod:`kvserve.loadgen.ghost_report`.
"""
from __future__ import annotations

import asyncio
import os
import random
import sys
import time
from dataclasses import asdict, dataclass

import httpx

from kvserve.loadgen.ghost_report import GhostRecord, format_ghost_line, parse_server_timing, summarize_ghost
from kvserve.loadgen.report import emit_json
from kvserve.loadgen.runner import _http_error_kind
from kvserve.loadgen.sse import sse_events

MAX_GHOST_TOKENS = 16
WORD_ENDS = frozenset(" ([{.,:=")


def default_ghost_file() -> str:
    """A real source file of this package: ``kvserve/engine/scheduler.py``."""
    import kvserve
    return os.path.join(os.path.dirname(os.path.abspath(kvserve.__file__)), "engine", "scheduler.py")


@dataclass(frozen=True)
class GhostConfig:
    """Settings of a ghost-text run (see the module docstring)."""

    typists: int = 2
    duration_s: float = 20.0
    keystrokes_per_s: float = 6.0
    jitter: float = 0.5
    pause_prob: float = 0.5                   # chance of a pause after typing a newline
    word_pause_prob: float = 0.1              # ... after a space or one of ``([{.,:=``
    pause_s: tuple[float, float] = (0.5, 2.0)
    context_chars: int = 1500
    window_slack: float = 0.25
    max_tokens: int = 8
    temperature: float = 0.0
    service_tier: str | None = "priority"     # None: not sent
    suffix_chars: int = 0                     # 0: no suffix field
    stream: bool = False
    budget_ms: float = 200.0
    timeout_s: float = 60.0
    seed: int = 0

    def __post_init__(self):
        if not 1 <= self.max_tokens <= MAX_GHOST_TOKENS:
            raise ValueError(f"ghost max_tokens must be 1..{MAX_GHOST_TOKENS}, not {self.max_tokens}")
        if self.typists < 1 or self.keystrokes_per_s <= 0 or self.context_chars < 1 or self.duration_s <= 0:
            raise ValueError("ghost typists, keystrokes_per_s, context_chars and duration_s must be positive")
        if not 0 <= self.jitter < 1 or not 0 <= min(self.pause_prob, self.word_pause_prob) \
                or max(self.pause_prob, self.word_pause_prob) > 1 or self.window_slack < 0:
            raise ValueError("ghost jitter must be in [0, 1), pause probabilities in [0, 1], window_slack >= 0")


@dataclass(frozen=True)
class Keystroke:
    """One keystroke: when (seconds after the typist starts) and the cursor after it."""

    at_s: float
    cursor: int
    pause_after: bool = False


def line_starts(text: str) -> list[int]:
    """Offsets of the first character of every non-empty line."""
    starts, offset = [], 0
    for line in text.splitlines(keepends=True):
        if line.strip():
            starts.append(offset)
        offset += len(line)
    return starts or [0]


def _skip_indent(text: str, cursor: int) -> int:
    while cursor < len(text) and text[cursor] in " \t":
        cursor += 1
    return cursor


def keystroke_schedule(text: str, config: GhostConfig, rng: random.Random) -> list[Keystroke]:
    """A typist's keystrokes over ``config.duration_s``: from a random line start, one
    character per keystroke (a newline brings the next line's indentation), restarting at a
    random line at the end of the file; a pause may follow a newline or a word end.
    Same rng state -> same schedule."""
    starts = line_starts(text)
    cursor = _skip_indent(text, rng.choice(starts))
    mean_gap = 1.0 / config.keystrokes_per_s
    at = rng.uniform(0, mean_gap)                        # typists do not start in lock-step
    keys: list[Keystroke] = []
    while at < config.duration_s:
        if cursor >= len(text):
            cursor = _skip_indent(text, rng.choice(starts))
        typed = text[cursor]
        cursor = _skip_indent(text, cursor + 1) if typed == "\n" else cursor + 1
        chance = config.pause_prob if typed == "\n" else config.word_pause_prob if typed in WORD_ENDS else 0.0
        pause = chance > 0 and rng.random() < chance
        keys.append(Keystroke(at, cursor, pause))
        at += mean_gap * rng.uniform(1 - config.jitter, 1 + config.jitter)
        if pause:
            at += rng.uniform(*config.pause_s)
    return keys


def window_start(text: str, cursor: int, previous: int | None, context_chars: int, slack: float) -> int:
    """Where the prompt starts: ``previous`` while it is still at or before the cursor and
    the window is at most ``context_chars * (1 + slack)``; otherwise the first line start at
    or after ``cursor - context_chars`` (the file's start when the cursor is near it)."""
    if previous is not None and previous <= cursor and cursor - previous <= context_chars * (1 + slack):
        return previous
    lo = max(0, cursor - context_chars)
    if lo == 0 or text[lo - 1] == "\n":
        return lo
    newline = text.find("\n", lo, cursor)
    return newline + 1 if newline != -1 else lo


def suffix_after(text: str, cursor: int, suffix_chars: int) -> str:
    """Fill-in-the-middle suffix: up to ``suffix_chars`` characters from the line after the cursor's."""
    if suffix_chars <= 0:
        return ""
    newline = text.find("\n", cursor)
    return "" if newline == -1 else text[newline + 1:newline + 1 + suffix_chars]


def request_body(config: GhostConfig, model: str | None, prompt: str, suffix: str) -> dict:
    """The /v1/completions body of one inline request."""
    body = {"prompt": prompt, "max_tokens": config.max_tokens, "temperature": config.temperature,
            "stream": config.stream}
    if config.stream:
        body["stream_options"] = {"include_usage": True}
    if model:
        body["model"] = model
    if config.service_tier is not None:
        body["service_tier"] = config.service_tier
    if suffix:
        body["suffix"] = suffix
    return body


def completions_url(base_url: str) -> str:
    base = base_url.rstrip("/")
    return (base if base.endswith("/v1") else base + "/v1") + "/completions"


def _fold_usage(record: GhostRecord, usage: dict | None) -> None:
    if usage:
        record.prompt_tokens = usage.get("prompt_tokens")
        record.completion_tokens = usage.get("completion_tokens")
        record.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")


class GhostRunner:
    """Runs ``config.typists`` typists against one server; ``records`` holds every request."""

    def __init__(self, config: GhostConfig, base_url: str, text: str, model: str | None = None,
                 api_key: str | None = None):
        self.config = config
        self.url = completions_url(base_url)
        self.text = text
        self.model = model
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.records: list[GhostRecord] = []

    async def run(self) -> list[GhostRecord]:
        """All typists at once for ``config.duration_s`` (plus their last request)."""
        schedules = [keystroke_schedule(self.text, self.config, random.Random(self.config.seed * 7919 + i))
                     for i in range(self.config.typists)]
        await asyncio.gather(*(self._typist(i, keys) for i, keys in enumerate(schedules)))
        return self.records

    async def _typist(self, index: int, keys: list[Keystroke]) -> None:
        timeout = httpx.Timeout(self.config.timeout_s, connect=30.0)
        async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=8)) as client:
            origin = time.perf_counter()
            tasks: list[asyncio.Task] = []
            in_flight: tuple[asyncio.Task, GhostRecord] | None = None
            start = None
            for seq, key in enumerate(keys):
                await asyncio.sleep(max(0.0, origin + key.at_s - time.perf_counter()))
                if in_flight is not None and not in_flight[0].done():
                    in_flight[1].cancelled = True
                    in_flight[0].cancel()                     # closes its connection
                start = window_start(self.text, key.cursor, start, self.config.context_chars,
                                     self.config.window_slack)
                prompt = self.text[start:key.cursor]
                body = request_body(self.config, self.model, prompt,
                                    suffix_after(self.text, key.cursor, self.config.suffix_chars))
                gap = keys[seq + 1].at_s - key.at_s if seq + 1 < len(keys) else None
                record = GhostRecord(index, seq, time.perf_counter(), prompt_chars=len(prompt), gap_s=gap)
                self.records.append(record)
                in_flight = (asyncio.create_task(self._send(client, body, record)), record)
                tasks.append(in_flight[0])
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _send(self, client: httpx.AsyncClient, body: dict, record: GhostRecord) -> None:
        try:
            if self.config.stream:
                await self._send_streamed(client, body, record)
            else:
                response = await client.post(self.url, json=body, headers=self.headers)
                record.server_timing = parse_server_timing(response.headers.get("server-timing"))
                if response.status_code != 200:
                    record.error = _http_error_kind(response.status_code, response.content)
                else:
                    _fold_usage(record, response.json().get("usage"))
        except httpx.TimeoutException:
            record.error = "timeout"
        except httpx.HTTPError as exc:
            record.error = f"connection_error:{type(exc).__name__}"
        finally:
            record.end = time.perf_counter()

    async def _send_streamed(self, client: httpx.AsyncClient, body: dict, record: GhostRecord) -> None:
        async with client.stream("POST", self.url, json=body, headers=self.headers) as response:
            record.server_timing = parse_server_timing(response.headers.get("server-timing"))
            if response.status_code != 200:
                record.error = _http_error_kind(response.status_code, await response.aread())
                return
            async for event in sse_events(response):
                if "error" in event:
                    record.error = f"stream_error:{(event['error'] or {}).get('code')}"
                if record.first_chunk is None and any(c.get("text") for c in event.get("choices") or []):
                    record.first_chunk = time.perf_counter()
                _fold_usage(record, event.get("usage"))
            trailer = response.headers.get("server-timing")
            record.server_timing = parse_server_timing(trailer) or record.server_timing


# ------------------------------------------------------------------ CLI
def add_ghost_arguments(parser) -> None:
    """The ``--ghost-*`` options of ``kvserve bench``."""
    d = GhostConfig()
    g = parser.add_argument_group("ghost workload (--workload ghost)")
    g.add_argument("--ghost-file", default=None, help="code file the typists type (default: kvserve's scheduler.py)")
    g.add_argument("--ghost-typists", type=int, default=d.typists)
    g.add_argument("--ghost-duration", type=float, default=d.duration_s, help="seconds of typing")
    g.add_argument("--ghost-keystrokes-per-s", type=float, default=d.keystrokes_per_s)
    g.add_argument("--ghost-jitter", type=float, default=d.jitter, help="keystroke gaps: mean * [1-j, 1+j]")
    g.add_argument("--ghost-pause-prob", type=float, default=d.pause_prob, help="chance of a pause at a line end")
    g.add_argument("--ghost-word-pause-prob", type=float, default=d.word_pause_prob,
                   help="chance of a pause after a word")
    g.add_argument("--ghost-context-chars", type=int, default=d.context_chars, help="prompt: chars before the cursor")
    g.add_argument("--ghost-max-tokens", type=int, default=d.max_tokens, help=f"1..{MAX_GHOST_TOKENS}")
    g.add_argument("--ghost-service-tier", default=d.service_tier, help="'none': do not send service_tier")
    g.add_argument("--ghost-suffix-chars", type=int, default=d.suffix_chars, help="FIM suffix length (0: none)")
    g.add_argument("--ghost-stream", action="store_true", help="stream (measures client-side TTFT)")
    g.add_argument("--ghost-budget-ms", type=float, default=d.budget_ms, help="the latency budget (goodput)")


def config_from_args(args) -> GhostConfig:
    """A GhostConfig from ``kvserve bench`` arguments."""
    tier = args.ghost_service_tier
    return GhostConfig(typists=args.ghost_typists, duration_s=args.ghost_duration,
                       keystrokes_per_s=args.ghost_keystrokes_per_s, jitter=args.ghost_jitter,
                       pause_prob=args.ghost_pause_prob, word_pause_prob=args.ghost_word_pause_prob,
                       context_chars=args.ghost_context_chars,
                       max_tokens=args.ghost_max_tokens, temperature=args.temperature,
                       service_tier=None if tier is None or tier.lower() in ("", "none") else tier,
                       suffix_chars=args.ghost_suffix_chars, stream=args.ghost_stream,
                       budget_ms=args.ghost_budget_ms, timeout_s=args.timeout, seed=args.seed)


def read_ghost_file(path: str | None) -> str:
    with open(path or default_ghost_file(), encoding="utf-8", errors="replace") as f:
        text = f.read()
    if len(text) < 2:
        raise ValueError(f"{path}: too short to type")
    return text


def run_ghost(config: GhostConfig, base_url: str, text: str, model: str | None = None,
              api_key: str | None = None) -> tuple[list[GhostRecord], dict]:
    """One ghost run (blocking): the records and their summary."""
    runner = GhostRunner(config, base_url, text, model, api_key)
    asyncio.run(runner.run())
    return runner.records, summarize_ghost(runner.records, config.budget_ms)


def run_ghost_cli(args, model: str | None) -> int:
    """``kvserve bench --workload ghost``: prints (or writes) the JSON report."""
    config = config_from_args(args)
    path = args.ghost_file or default_ghost_file()
    _, summary = run_ghost(config, args.url, read_ghost_file(path), model, args.api_key)
    report = {"url": args.url, "model": model, "endpoint": "completions", "workload": "ghost",
              "ghost_file": path, "ghost": asdict(config),
              "results": [{"typists": config.typists, "summary": summary}]}
    print(format_ghost_line(summary), file=sys.stderr)
    emit_json(report, args.out)
    return 0 if summary["num_completed"] else 1
