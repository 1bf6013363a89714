"""Classifier backends of the model guard: the server's engine, or an offline ``LLM``.

Both ask for one token, greedily, with the label tokens' logits raised by +100
(``logit_bias``) so the token chosen is a label, and with the top-20 raw logprobs; the
labels' logprobs are read from those. A label outside the top 20 gets the lowest
reported logprob (an upper bound on its own). The request is salted with the tenant's
cache salt (``kvserve.server.auth.cache_salt``): the fixed instruction and examples are
prefix-cached per tenant and never shared across tenants.
"""
from __future__ import annotations

import asyncio
import threading
import time
import uuid
from typing import Callable, Sequence

from kvserve.engine.request import EngineRequest
from kvserve.engine.service_class import ServiceClass
from kvserve.errors import KVServeError
from kvserve.frontend.outputs import RequestOutput
from kvserve.sampling.params import MAX_ABS_LOGIT_BIAS, MAX_LOGPROBS, SamplingParams
from kvserve.server.auth import cache_salt


def label_token_ids(tokenizer, labels: Sequence[str]) -> list[int]:
    """The one token id of each label (with its leading space, as it follows the prompt).
    ValueError when a label is not exactly one token, or two labels share a token."""
    ids = []
    for label in labels:
        tokens = tokenizer.encode(label, add_special_tokens=False)
        if len(tokens) != 1:
            raise ValueError(f"guard label {label!r} is {len(tokens)} tokens ({tokens}) for this model's "
                             "tokenizer; each label must be exactly one token")
        ids.append(tokens[0])
    if len(set(ids)) != len(ids):
        raise ValueError(f"guard labels {list(labels)!r} share a token")
    return ids


def classification_params(label_ids: Sequence[int]) -> SamplingParams:
    """One greedy token forced to be a label; raw top-20 logprobs reported."""
    return SamplingParams(n=1, max_tokens=1, temperature=0.0, logprobs=MAX_LOGPROBS,
                          logit_bias={tid: MAX_ABS_LOGIT_BIAS for tid in label_ids})


def read_label_logprobs(output: RequestOutput, labels: Sequence[str], label_ids: Sequence[int]) -> dict[str, float]:
    """Each label's logprob from the first token's logprob entry of ``output``."""
    completion = output.outputs[0] if output.outputs else None
    if completion is None or not completion.logprobs:
        reason = completion.finish_reason if completion is not None else "no output"
        raise RuntimeError(f"the classification request returned no logprobs (finish reason {reason!r})")
    entry = completion.logprobs[0]
    floor = min(entry.values())
    return {label: entry.get(tid, floor) for label, tid in zip(labels, label_ids)}


class EngineClassifier:
    """Classifies with the server's engine: one ``EngineRequest`` per check, submitted
    like any other request, so it is batched with normal traffic.

    ``client``: the ``EngineClient``, or a zero-argument callable returning it (the
    tenancy is built before the engine starts: pass ``lambda: ctx.client``).
    ``adapter``: a loaded LoRA adapter's name to classify with (None: the base model).
    The request runs as ``service_class`` (interactive: it enters the next step), under
    the tenant and the tenant's cache salt; a cancelled check (its timeout) aborts it.
    """

    def __init__(self, client, tokenizer, *, adapter: str | None = None,
                 service_class: ServiceClass = ServiceClass.INTERACTIVE,
                 salt: Callable[[str | None], str] = cache_salt):
        self._client, self.tokenizer, self.adapter = client, tokenizer, adapter
        self.service_class, self.salt = service_class, salt

    def client(self):
        """The engine client (resolving a callable)."""
        return self._client if hasattr(self._client, "submit") else self._client()

    def request(self, prompt: str, label_ids: Sequence[int], tenant: str | None) -> EngineRequest:
        """The engine request that classifies ``prompt``."""
        return EngineRequest(f"guard-{uuid.uuid4().hex[:24]}", self.tokenizer.encode(prompt),
                             classification_params(label_ids), frozenset(self.tokenizer.eos_token_ids),
                             tenant=tenant, cache_salt=self.salt(tenant), adapter_id=self.adapter,
                             num_speculative_tokens=0, service_class=self.service_class)

    async def label_logprobs(self, prompt: str, labels: Sequence[str], tenant: str | None) -> dict[str, float]:
        """Submit, wait for the final ``RequestOutput`` on a private sink, read the labels."""
        label_ids = label_token_ids(self.tokenizer, labels)
        request = self.request(prompt, label_ids, tenant)
        client = self.client()
        sink: asyncio.Queue = asyncio.Queue()
        client.submit(request, prompt, sink, 0, time.monotonic())
        try:
            output = await _final_output(sink)
        except BaseException:                   # cancelled (timeout) or failed: free its engine slot
            client.abort(request.request_id)
            raise
        return read_label_logprobs(output, labels, label_ids)


async def _final_output(sink: asyncio.Queue) -> RequestOutput:
    """The request's ``RequestOutput`` from its sink (deltas skipped); its error raised."""
    while True:
        _tag, event = await sink.get()
        if isinstance(event, RequestOutput):
            return event
        if isinstance(event, KVServeError):
            raise event


class LLMClassifier:
    """Classifies with an offline ``kvserve.LLM`` (tests, batch jobs). ``LLM`` is
    synchronous and single-threaded: each call runs ``generate`` in a worker thread, one
    at a time (the prefix cache serves the shared instruction and examples)."""

    def __init__(self, llm, *, adapter: str | None = None, salt: Callable[[str | None], str] = cache_salt):
        self.llm, self.adapter, self.salt = llm, adapter, salt
        self._lock = threading.Lock()

    def label_logprobs_many(self, prompts: Sequence[str], labels: Sequence[str],
                            tenant: str | None) -> list[dict[str, float]]:
        """Synchronous and batched: the labels' logprobs after each prompt."""
        label_ids = label_token_ids(self.llm.tokenizer, labels)
        with self._lock:
            outputs = self.llm.generate(list(prompts), classification_params(label_ids),
                                        cache_salt=self.salt(tenant), adapter_id=self.adapter,
                                        service_class="interactive")
        return [read_label_logprobs(out, labels, label_ids) for out in outputs]

    async def label_logprobs(self, prompt: str, labels: Sequence[str], tenant: str | None) -> dict[str, float]:
        """``label_logprobs_many([prompt])[0]`` in a worker thread."""
        results = await asyncio.to_thread(self.label_logprobs_many, [prompt], labels, tenant)
        return results[0]
