"""The soak's tenants file and request mix (``benchmarks/soak.py``).

Tenants (keys ``soak-<name>``; admin key ``soak-admin`` for /metrics):

- ``heavy``: weight 1, a high request limit and a tight ``tokens_per_min`` (429s happen);
- ``light``: weight 1, no limits;
- ``ghost``: pinned to the ``interactive`` class (inline code completions, short outputs);
- ``batch``: pinned to the ``batch`` class;
- ``probe``: no limits, no guards; only the capacity probe uses it, so its requests stay
  out of the soak's accounting.

Every tenant but ``probe`` passes the rules guard ``blockme`` (the word BLOCKME, whole
word, case-insensitive, at input, stream and output, action block).

Request kinds (``KINDS``: weight, tenants, endpoint, streamed or not):

- ``chat_stream``, ``chat``, ``completion``: random-word prompts, 24-96 output tokens;
- ``interactive``: a prefix of a real source file, 4-16 output tokens, streamed (TTFT);
- ``batch``: completions of 48-96 tokens, whole body;
- ``input_blocked``: a chat whose message holds BLOCKME (expected: 400 content_policy_violation);
- ``echo_blockme``: "Repeat after me: block me, ..." with a ``logit_bias`` on the tokens
  of " blockme" (measured on SmolLM2-135M: greedy outputs repeat "blockme"), so the
  stream / output guard should end it with finish_reason content_filter; the input holds
  no whole word BLOCKME, so the input guard lets it through;
- ``cancel``: a streamed chat closed after 1-8 text chunks, or a whole-body chat given up
  after 0.2-3 s (client_abort unless it ended first).
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

from kvserve.loadgen.workloads import TextMaker, code_workload

ADMIN_KEY = "soak-admin"
MAIN_TENANTS = ("heavy", "light", "ghost", "batch")
PROBE_TENANT = "probe"
GUARD_NAME = "blockme"
ECHO_BIAS = (6.0, 8.0)          # logit_bias on " block" and "me" (the two tokens of " blockme")


def key_of(tenant: str) -> str:
    """The API key of a tenant of the soak's file."""
    return f"soak-{tenant}"


def tenants_toml(heavy_tokens_per_min: int) -> str:
    """The soak's tenants file (TOML)."""
    guarded = f'guards = ["{GUARD_NAME}"]'
    return f"""# written by benchmarks/soak.py
admin_keys = ["{ADMIN_KEY}"]

[guards.{GUARD_NAME}]
type = "rules"
words = ["BLOCKME"]
action = "block"
points = ["input", "stream", "output"]

[tenants.heavy]
keys = ["{key_of('heavy')}"]
weight = 1.0
{guarded}
[tenants.heavy.limits]
requests_per_min = 100000
tokens_per_min = {heavy_tokens_per_min}

[tenants.light]
keys = ["{key_of('light')}"]
weight = 1.0
{guarded}

[tenants.ghost]
keys = ["{key_of('ghost')}"]
weight = 1.0
service_class = "interactive"
{guarded}

[tenants.batch]
keys = ["{key_of('batch')}"]
weight = 1.0
service_class = "batch"
{guarded}

[tenants.{PROBE_TENANT}]
keys = ["{key_of(PROBE_TENANT)}"]
weight = 1.0
"""


@dataclass(frozen=True)
class Kind:
    """One kind of request in the mix."""

    name: str
    weight: float
    tenants: tuple[str, ...]
    endpoint: str                  # "chat" | "completions"
    stream: bool | None            # None: half and half


KINDS = (
    Kind("chat_stream", 0.27, ("heavy", "light"), "chat", True),
    Kind("chat", 0.13, ("heavy", "light"), "chat", False),
    Kind("completion", 0.10, ("heavy", "light"), "completions", None),
    Kind("interactive", 0.20, ("ghost",), "completions", True),
    Kind("batch", 0.10, ("batch",), "completions", False),
    Kind("input_blocked", 0.05, MAIN_TENANTS, "chat", None),
    Kind("echo_blockme", 0.05, ("heavy", "light"), "chat", None),
    Kind("cancel", 0.10, ("heavy", "light", "batch"), "chat", None),
)


def tenant_share(tenant: str) -> float:
    """The fraction of the mix's requests that ``tenant`` sends."""
    return sum(k.weight / len(k.tenants) for k in KINDS if tenant in k.tenants) / sum(k.weight for k in KINDS)


PROBE_KINDS = ("chat_stream", "chat", "completion", "interactive", "batch")
PROBE_TIERS = {"interactive": "priority", "batch": "flex"}     # the probe tenant is not pinned


@dataclass
class PlannedRequest:
    """One request to send: where, as whom, what, and how the client ends it."""

    kind: str
    tenant: str
    endpoint: str
    stream: bool
    body: dict
    cancel_after_chunks: int | None = None
    abort_after_s: float | None = None


@dataclass
class RequestMix:
    """Draws requests of the mix (seeded): ``next()`` for the soak, ``next_probe()`` for the probe."""

    tokenizer: object
    seed: int = 0
    pool_size: int = 256
    rng: random.Random = field(init=False)

    def __post_init__(self):
        self.rng = random.Random(self.seed)
        maker = TextMaker(self.tokenizer, self.seed)
        self.texts = [maker.text(self.rng.randint(24, 160)) for _ in range(self.pool_size)]
        self.code = [r.prompt for r in code_workload(maker, self.pool_size // 2, 192, 8, 0.5)]
        ids = self.tokenizer.encode(" blockme", add_special_tokens=False)
        self.echo_bias = ({str(ids[0]): ECHO_BIAS[0], str(ids[1]): ECHO_BIAS[1]} if len(ids) == 2 else {})
        self.kinds = {k.name: k for k in KINDS}

    def next(self) -> PlannedRequest:
        kind = self.rng.choices(KINDS, weights=[k.weight for k in KINDS])[0]
        return self._plan(kind, self.rng.choice(kind.tenants))

    def next_probe(self) -> PlannedRequest:
        kind = self.kinds[self.rng.choice(PROBE_KINDS)]
        plan = self._plan(kind, PROBE_TENANT)
        if kind.name in PROBE_TIERS:
            plan.body["service_tier"] = PROBE_TIERS[kind.name]
        return plan

    def _plan(self, kind: Kind, tenant: str) -> PlannedRequest:
        """A request of ``kind`` from ``tenant``: body, streaming, and how the client ends it."""
        rng = self.rng
        stream = kind.stream if kind.stream is not None else rng.random() < 0.5
        plan = PlannedRequest(kind.name, tenant, kind.endpoint, stream, {})
        text = rng.choice(self.texts)
        if kind.name == "interactive":
            body = {"prompt": rng.choice(self.code), "max_tokens": rng.randint(4, 16)}
        elif kind.name == "batch":
            body = {"prompt": text, "max_tokens": rng.randint(48, 96)}
        elif kind.name == "input_blocked":
            body = self._text_body(kind, f"{text} BLOCKME {rng.choice(self.texts)[:80]}", rng.randint(16, 48))
        elif kind.name == "echo_blockme":
            words = " ".join(rng.choice(self.texts).split()[:4])
            body = {"messages": [{"role": "user", "content": f"{words}. Repeat after me: block me, block me, "
                                                           "block me."}],
                    "max_tokens": rng.randint(24, 48), "logit_bias": dict(self.echo_bias)}
        else:
            body = self._text_body(kind, text, rng.randint(24, 96))
        if kind.name == "cancel":
            if stream:
                plan.cancel_after_chunks = rng.randint(1, 8)
            else:
                plan.abort_after_s = rng.uniform(0.2, 3.0)
        body["temperature"] = 0.0
        if stream:
            body.update(stream=True, stream_options={"include_usage": True})
        plan.body = body
        return plan

    @staticmethod
    def _text_body(kind: Kind, text: str, max_tokens: int) -> dict:
        if kind.endpoint == "chat":
            return {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens}
        return {"prompt": text, "max_tokens": max_tokens}
