"""The one codec between the HTTP process and the engine process.

Messages are plain dataclasses. On the wire each is a msgpack map
``{"t": <type tag>, ...fields}`` framed by a 4-byte big-endian length. No pickle:
decoding builds only the dataclasses registered here, from ints, floats, strings,
lists and dicts.

HTTP -> engine: InitEngine (once, first), EngineRequest (the engine's own request type,
sent as it is), AbortRequests, StopSequences, ResetPrefixCache, LoadAdapter, UnloadAdapter,
Shutdown. Engine -> HTTP: EngineReady or EngineFailed (once), StepOutputs, RequestError,
EngineStatsUpdate, and the answers to the control messages, in the order those were sent:
PrefixCacheReset (to ResetPrefixCache), AdapterResult (to LoadAdapter / UnloadAdapter).
The messages that move prompt KV between a prefill and a decode engine (kvserve/disagg/)
are in ``kv_messages.py`` and registered here too.
"""
from __future__ import annotations

import dataclasses
import struct
from dataclasses import dataclass, field
from typing import Any

import msgpack

from kvserve.engine.request import EngineRequest
from kvserve.engine.service_class import ServiceClass
from kvserve.engine.structured_spec import StructuredSpec
from kvserve.engine.stats import EngineStats
from kvserve.engine.step import SampledToken, SeqUpdate
from kvserve.ipc.kv_messages import KV_MESSAGES
from kvserve.sampling.params import SamplingParams

FRAME_HEADER = struct.Struct(">I")
MAX_FRAME_BYTES = 256 * 2**20


class CodecError(ValueError):
    """A frame that is not a message of this codec (a bug or a corrupt stream)."""


# ------------------------------------------------------------------ messages
@dataclass
class InitEngine:
    """The engine's configuration: EngineConfig fields by name."""

    engine_config: dict


@dataclass
class EngineReady:
    """Sent once the model is loaded: the numbers the HTTP process validates against."""

    max_model_len: int
    vocab_size: int
    num_blocks: int
    block_size: int
    kv_max_tokens: int
    eos_token_ids: list[int]
    kv_explanation: str
    pid: int
    adapters: list[dict] = field(default_factory=list)    # EngineCore.list_adapters() at start
    kv_layout: dict = field(default_factory=dict)          # KV block shape (engine_proc.kv_layout); {} if none
    start_timings: dict = field(default_factory=dict)      # EngineCore.start_timings: start-up phase -> seconds


@dataclass
class EngineFailed:
    """Sent instead of EngineReady when the engine cannot be built from its configuration
    (a bad start-up adapter, an impossible setting): the typed error's status and body.
    The engine process exits after it."""

    status: int
    error: dict


@dataclass
class AbortRequests:
    """Abort these requests now (client gone, deadline, drain); their blocks are freed."""

    request_ids: list[str]


@dataclass
class StopSequences:
    """Finish these sequences with reason ``stop`` (a stop string matched in the front end)."""

    seq_ids: list[int]


@dataclass
class ResetPrefixCache:
    """Admin: drop every prefix-cached block no running request uses."""


@dataclass
class PrefixCacheReset:
    """The answer to ResetPrefixCache: how many cached blocks were dropped."""

    num_blocks: int


@dataclass
class LoadAdapter:
    """Admin: load the PEFT LoRA folder ``path`` as ``name`` (answered by AdapterResult)."""

    name: str
    path: str


@dataclass
class UnloadAdapter:
    """Admin: ``name`` no longer selects an adapter; running requests finish with it
    (answered by AdapterResult)."""

    name: str


@dataclass
class AdapterResult:
    """The answer to LoadAdapter / UnloadAdapter: ``adapters`` is the engine's list after
    the operation either way; on success ``status`` is 200 and ``adapter`` the loaded
    adapter's description (None for an unload), otherwise ``error`` is the OpenAI error
    body of the engine's typed error."""

    status: int
    adapters: list[dict]
    adapter: dict | None = None
    error: dict | None = None


@dataclass
class WeightsCommand:
    """Admin: ``action`` "load" (the checkpoint at ``path``, same shape), "sleep" or "wake"
    (``kvserve.engine.weight_swap``). The engine runs it once the requests already in flight
    have finished, holding newer ones until it is done (answered by WeightsResult)."""

    action: str
    path: str | None = None


@dataclass
class WeightsResult:
    """The answer to WeightsCommand: ``status`` 200 with ``result`` (epoch, seconds, bytes
    freed), or the typed error's status and OpenAI error body."""

    status: int
    result: dict | None = None
    error: dict | None = None


@dataclass
class Shutdown:
    """Abort everything and exit."""


@dataclass
class EngineStatsUpdate:
    """Gauges and counters of the engine (EngineCore.stats plus the loop's own)."""

    stats: EngineStats


@dataclass
class StepOutputs:
    """What one engine step produced, plus the request ids that were scheduled for the
    first time (their queue time ended) and the engine's stats after the step.
    ``step_start`` is the engine process's ``time.monotonic()`` just before the step
    scheduled (CLOCK_MONOTONIC is system-wide, so the HTTP process compares it with its
    own readings); 0.0 = not known."""

    updates: list[SeqUpdate]
    started: list[str] = field(default_factory=list)
    stats: EngineStats = field(default_factory=EngineStats)
    step_start: float = 0.0


@dataclass
class CacheBlocks:
    """The prefix cache's changes since the last message, as block hashes (cache_events.py):
    what a cache-aware router counts to know which blocks this engine holds."""

    stored: list[int] = field(default_factory=list)
    removed: list[int] = field(default_factory=list)


@dataclass
class RequestError:
    """The engine refused or lost a request; ``error`` is the OpenAI error body."""

    request_id: str
    status: int
    error: dict


_TYPES: dict[str, type] = {cls.__name__: cls for cls in (
    InitEngine, EngineReady, EngineRequest, AbortRequests, StopSequences, Shutdown, EngineStatsUpdate,
    StepOutputs, RequestError, ResetPrefixCache, PrefixCacheReset, EngineFailed, LoadAdapter, UnloadAdapter,
    AdapterResult, CacheBlocks, WeightsCommand, WeightsResult, *KV_MESSAGES)}


# --------------------------------------------------------------- conversion
def _sampled_to_wire(s: SampledToken) -> list:
    return [s.token_id, s.logprob, [[t, lp] for t, lp in s.top_logprobs]]


def _sampled_from_wire(raw: list) -> SampledToken:
    return SampledToken(int(raw[0]), raw[1], [(int(t), float(lp)) for t, lp in raw[2]])


def _update_to_wire(u: SeqUpdate) -> list:
    return [u.seq_id, u.request_id, u.sibling_index, list(u.new_token_ids),
            [_sampled_to_wire(s) for s in u.new_logprobs if s.logprob is not None], u.finish_reason,
            u.num_cached_tokens, u.num_draft_proposed, u.num_draft_accepted,
            [_sampled_to_wire(s) for s in u.prompt_logprobs]]


def _update_from_wire(raw: list) -> SeqUpdate:
    seq_id, request_id, sibling, tokens, logprobs, finish, num_cached, proposed, accepted, prompt_lps = raw
    return SeqUpdate(seq_id, request_id, sibling, list(tokens), [_sampled_from_wire(s) for s in logprobs],
                     finish, num_cached, proposed, accepted, [_sampled_from_wire(s) for s in prompt_lps])


def to_wire(message) -> dict:
    """A message as a msgpack-able dict with its type tag."""
    name = type(message).__name__
    if name not in _TYPES:
        raise CodecError(f"not a codec message: {name}")
    if isinstance(message, StepOutputs):
        return {"t": name, "updates": [_update_to_wire(u) for u in message.updates],
                "started": message.started, "stats": message.stats.to_dict(),
                "step_start": float(message.step_start)}
    if isinstance(message, EngineStatsUpdate):
        return {"t": name, "stats": message.stats.to_dict()}
    body = {f.name: getattr(message, f.name) for f in dataclasses.fields(message)}
    if isinstance(message, EngineRequest):
        body["params"] = dataclasses.asdict(message.params)
        body["prompt_token_ids"] = list(message.prompt_token_ids)
        if message.eos_token_ids is not None:
            body["eos_token_ids"] = sorted(message.eos_token_ids)
        if message.structured is not None:
            body["structured"] = message.structured.to_wire()
    return {"t": name, **body}


def from_wire(raw: Any):
    """The message a decoded map describes (CodecError if it is not one)."""
    if not isinstance(raw, dict) or raw.get("t") not in _TYPES:
        raise CodecError(f"unknown message: {str(raw)[:80]}")
    cls = _TYPES[raw.pop("t")]
    try:
        if cls is StepOutputs:
            return StepOutputs([_update_from_wire(u) for u in raw["updates"]], raw["started"],
                               EngineStats.from_dict(raw["stats"]), float(raw["step_start"]))
        if cls is EngineStatsUpdate:
            return EngineStatsUpdate(EngineStats.from_dict(raw["stats"]))
        if cls is EngineRequest:
            raw["params"] = SamplingParams(**raw["params"])
            if raw.get("eos_token_ids") is not None:
                raw["eos_token_ids"] = frozenset(raw["eos_token_ids"])
            if "service_class" in raw:
                raw["service_class"] = ServiceClass(raw["service_class"])
            if raw.get("structured") is not None:
                raw["structured"] = StructuredSpec.from_wire(raw["structured"])
        return cls(**raw)
    except (TypeError, KeyError, ValueError) as exc:
        raise CodecError(f"malformed {cls.__name__}: {exc}") from exc


def encode(message) -> bytes:
    """One framed message: 4-byte length, then msgpack."""
    payload = msgpack.packb(to_wire(message), use_bin_type=True)
    return FRAME_HEADER.pack(len(payload)) + payload


def decode_payload(payload: bytes):
    """The message in one frame's payload (without the length header)."""
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, ValueError) as exc:
        raise CodecError(f"undecodable frame: {exc}") from exc
    return from_wire(raw)


class FrameBuffer:
    """Accumulates bytes from a stream socket and yields complete messages."""

    def __init__(self):
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list:
        """Append ``data``; return every message completed by it, in order."""
        self._buffer += data
        messages = []
        while len(self._buffer) >= FRAME_HEADER.size:
            (size,) = FRAME_HEADER.unpack_from(self._buffer)
            if size > MAX_FRAME_BYTES:
                raise CodecError(f"frame of {size} bytes exceeds {MAX_FRAME_BYTES}")
            end = FRAME_HEADER.size + size
            if len(self._buffer) < end:
                break
            messages.append(decode_payload(bytes(self._buffer[FRAME_HEADER.size:end])))
            del self._buffer[:end]
        return messages
