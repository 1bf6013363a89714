"""Offline API: ``LLM(model=...).generate(prompts, SamplingParams(...))``."""
from __future__ import annotations

import itertools
import time
from dataclasses import fields
from typing import Any, Sequence

from kvserve.engine.config import EngineConfig
from kvserve.engine.request import EngineRequest
from kvserve.engine.service_class import ServiceClass, parse_class
from kvserve.engine.structured_spec import StructuredSpec
from kvserve.errors import InvalidRequestError
from kvserve.frontend.lora_request import LoRARequest
from kvserve.frontend.output_processor import OutputProcessor
from kvserve.frontend.outputs import RequestOutput
from kvserve.sampling.params import SamplingParams

PromptLike = Any   # str | list[int] | list[chat message dict] | {"prompt"|"prompt_token_ids"|"messages": ...}


class LLM:
    """A tokenizer, an engine core and an output processor in one process.

    Keyword arguments are EngineConfig fields (``kv_cache_bytes``, ``max_num_seqs``,
    ``max_num_batched_tokens``, ``num_threads``, ``enable_prefix_cache``, ``enable_lora``,
    ``max_loras``, ``fair_share``, ``tenant_weights``, ...).
    """

    def __init__(self, model: str | None = None, **engine_kwargs):
        from kvserve.builder import build_engine
        from kvserve.loader import resolve_model_path
        from kvserve.tokenizer import Tokenizer

        known = {f.name for f in fields(EngineConfig)}
        unknown = set(engine_kwargs) - known
        if unknown:
            raise TypeError(f"unknown LLM arguments {sorted(unknown)}; known: {sorted(known)}")
        path = resolve_model_path(model)
        self.config = EngineConfig(model=path, **engine_kwargs)
        self.tokenizer = Tokenizer.load(path)
        self.engine = build_engine(self.config)
        self.processor = OutputProcessor(self.tokenizer, self.engine.stop_sequence)
        self._request_ids = itertools.count()

    # ------------------------------------------------------------------ prompts
    def encode_prompt(self, prompt: PromptLike) -> tuple[str | None, list[int]]:
        """Turn one prompt (text, token ids, chat messages, or a dict of one of those)
        into (text or None, token ids). ``{"prompt": text, "suffix": text}`` is a
        fill-in-the-middle prompt (the vocabulary's FIM tokens, see tokenizer/fim.py)."""
        if isinstance(prompt, dict) and "role" not in prompt:
            if prompt.get("suffix") is not None:
                return self._encode_fim(prompt.get("prompt"), prompt["suffix"])
            if "prompt_token_ids" in prompt:
                return None, list(prompt["prompt_token_ids"])
            if "messages" in prompt:
                return self.encode_prompt(prompt["messages"])
            if "prompt" in prompt:
                return self.encode_prompt(prompt["prompt"])
            raise InvalidRequestError("a prompt dict needs 'prompt', 'prompt_token_ids' or 'messages'",
                                      param="prompt")
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
            text = self.tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True)
            return text, self.tokenizer.encode(text, add_special_tokens=False)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool)
                                                     for t in prompt):
            return None, list(prompt)
        raise InvalidRequestError("a prompt must be a string, a list of token ids or a list of chat messages",
                                  param="prompt")

    def _encode_fim(self, prefix, suffix) -> tuple[str, list[int]]:
        if not isinstance(prefix, str) or not isinstance(suffix, str):
            raise InvalidRequestError("a fill-in-the-middle prompt needs a text 'prompt' and a text 'suffix'",
                                      param="suffix")
        return prefix, self.tokenizer.encode_fim(prefix, suffix)

    @staticmethod
    def _as_prompt_list(prompts) -> list:
        if isinstance(prompts, (str, dict)):
            return [prompts]
        if isinstance(prompts, (list, tuple)) and prompts and (
                all(isinstance(t, int) for t in prompts) or all(isinstance(m, dict) and "role" in m
                                                                 for m in prompts)):
            return [prompts]                     # one token-id prompt or one conversation
        return list(prompts)

    # --------------------------------------------------------------- generation
    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 priority: Sequence[int] | None = None, *, cache_salt: str | None = None,
                 adapter_id: str | None = None, use_prefix_cache: bool = True,
                 prefix_cache_grace_s: float | None = None,
                 num_speculative_tokens: int | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                 service_class: str | Sequence[str] = "chat",
                 tenant: str | None | Sequence[str | None] = None,
                 structured: StructuredSpec | Sequence[StructuredSpec | None] | None = None) -> list[RequestOutput]:
        """Generate for every prompt (continuous batching); outputs in prompt order.

        ``lora_request``: one adapter for every prompt, or one (or None) per prompt; a
        loaded adapter may also be named by ``adapter_id``. ``cache_salt`` namespaces
        the prefix cache (requests share cached KV only within one namespace, and never
        across adapters); ``use_prefix_cache=False`` opts these requests
        out; ``prefix_cache_grace_s`` keeps their blocks unevictable that long after they
        finish (a conversation's next turn). ``RequestOutput.num_cached_tokens`` counts
        prompt tokens served by the cache. ``num_speculative_tokens`` caps these
        requests' drafts per step when the engine speculates (0 = off); each output
        counts its verified and accepted drafts. ``service_class``: "interactive", "chat"
        or "batch" (or an OpenAI service tier), for every prompt or one per prompt; it
        changes when tokens come, never which. ``tenant``: who the requests are for (one
        name for every prompt or one per prompt): with ``fair_share=True`` tenants share a
        saturated engine by weighted tokens served (docs/fairness.md). ``structured``: a
        ``StructuredSpec`` (JSON schema, JSON object, regex, choice or EBNF grammar) every
        output must match, for every prompt or one (or None) per prompt
        (docs/structured_output.md).
        """
        prompt_list = self._as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params_list = ([sampling_params] * len(prompt_list) if isinstance(sampling_params, SamplingParams)
                       else list(sampling_params))
        if len(params_list) != len(prompt_list):
            raise InvalidRequestError("need one SamplingParams per prompt", param="sampling_params")
        adapter_names = self._adapter_names(lora_request, adapter_id, len(prompt_list))
        classes = self._service_classes(service_class, len(prompt_list))
        tenants = self._tenants(tenant, len(prompt_list))
        specs = (list(structured) if isinstance(structured, (list, tuple)) else [structured] * len(prompt_list))
        if len(specs) != len(prompt_list):
            raise InvalidRequestError("need one structured spec (or None) per prompt", param="structured")
        requests = []
        for i, (prompt, params) in enumerate(zip(prompt_list, params_list)):
            text, token_ids = self.encode_prompt(prompt)
            request = EngineRequest(str(next(self._request_ids)), token_ids, params,
                                    frozenset(self.tokenizer.eos_token_ids),
                                    priority[i] if priority is not None else 0, cache_salt=cache_salt,
                                    adapter_id=adapter_names[i], use_prefix_cache=use_prefix_cache,
                                    prefix_cache_grace_s=prefix_cache_grace_s,
                                    num_speculative_tokens=num_speculative_tokens,
                                    service_class=classes[i], tenant=tenants[i], structured=specs[i])
            requests.append((text, request))
        for _text, request in requests:
            self.engine.validate_request(request)      # all or nothing
        for text, request in requests:
            self.add_request(request, text)
        results = self._run_to_completion()
        return [results[request.request_id] for _text, request in requests]

    @staticmethod
    def _service_classes(service_class: str | Sequence[str], count: int) -> list[ServiceClass]:
        names = [service_class] * count if isinstance(service_class, str) else list(service_class)
        if len(names) != count:
            raise InvalidRequestError("need one service_class per prompt", param="service_class")
        try:
            return [parse_class(name) for name in names]
        except ValueError as e:
            raise InvalidRequestError(str(e), param="service_class") from None

    @staticmethod
    def _tenants(tenant: str | None | Sequence[str | None], count: int) -> list[str | None]:
        tenants = [tenant] * count if tenant is None or isinstance(tenant, str) else list(tenant)
        if len(tenants) != count or not all(t is None or isinstance(t, str) for t in tenants):
            raise InvalidRequestError("tenant: one name (or None) for every prompt, or one per prompt",
                                      param="tenant")
        return tenants

    def _adapter_names(self, lora_request, adapter_id: str | None, count: int) -> list[str | None]:
        """The adapter name of each prompt, loading (or reloading) what ``lora_request`` names."""
        if lora_request is None:
            return [adapter_id] * count
        per_prompt = [lora_request] * count if isinstance(lora_request, LoRARequest) else list(lora_request)
        if len(per_prompt) != count:
            raise InvalidRequestError("need one LoRARequest (or None) per prompt", param="lora_request")
        chosen: dict[str, LoRARequest] = {}
        for lora in (r for r in per_prompt if r is not None):
            if chosen.setdefault(lora.name, lora).path != lora.path:
                raise InvalidRequestError(f"adapter {lora.name!r} is named with two paths in one call",
                                          param="lora_request")
        for lora in chosen.values():
            self.load_lora(lora)
        return [r.name if r is not None else adapter_id for r in per_prompt]

    def load_lora(self, lora: LoRARequest) -> dict:
        """Make ``lora.name`` resolve to the adapter at ``lora.path`` (loaded once; a new
        path under a known name replaces it). Its description."""
        import os
        loaded = {a["name"]: a for a in self.engine.list_adapters()}
        current = loaded.get(lora.name)
        if current is not None and current["path"] == os.path.abspath(lora.path):
            return current
        if current is not None:
            self.engine.unload_adapter(lora.name)
        return self.engine.load_adapter(lora.name, lora.path)

    def add_request(self, request: EngineRequest, prompt_text: str | None = None) -> None:
        """Queue one request in the engine and the output processor (``generate`` does this
        for every prompt; outputs come from stepping ``self.engine``)."""
        self.engine.add_request(request)
        self.processor.add_request(request.request_id, prompt_text, request.prompt_token_ids, request.params)

    def chat(self, conversations, sampling_params: SamplingParams | None = None,
             **cache_kwargs) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of messages) or a list of them;
        ``cache_kwargs`` as in ``generate`` (cache_salt, adapter_id, use_prefix_cache,
        prefix_cache_grace_s)."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        return self.generate([{"messages": c} for c in conversations], sampling_params, **cache_kwargs)

    def spec_stats(self) -> dict | None:
        """Engine-wide speculation counters, or None when speculation is off."""
        return self.engine.spec_stats()

    def reset_prefix_cache(self) -> int:
        """Drop every cached KV block no running request uses; returns how many."""
        return self.engine.reset_prefix_cache()

    def _run_to_completion(self) -> dict[str, RequestOutput]:
        done: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished():
            for output in self.processor.process(self.engine.step()):
                done[output.request_id] = output
            held_s = self.engine.idle_wait_s()       # a batching window holds every request
            if held_s:
                time.sleep(held_s)
        return done
