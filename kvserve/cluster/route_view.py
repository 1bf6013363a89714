"""The router's view of a request at the cluster ingress (``route_for``): the prompt's token
ids as the replica's engine will see them, the caller's prefix-cache salt (from its key, as
the replica's auth derives it), the session key, and for the ladder and overflow the tenant,
the service class and the model the body names."""
from __future__ import annotations

import json

from kvserve.cluster.degrade import request_class
from kvserve.server.auth import cache_salt, match_key

GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions")


def route_for(path: str, body: bytes, authorization: bytes | None, tokenizer, keys: dict) -> dict:
    """The router's view of a request: ``tokens`` (the first prompt's ids; empty when the
    body is not a generation request the server would accept), ``cache_salt``, ``session``,
    ``adapter`` (the body's model: the router resolves a LoRA adapter's name to its identity);
    and for the ladder ``tenant``, ``service_class`` (None: not a generation request) and
    ``model`` (the body's, for overflow)."""
    from kvserve.server import protocol
    from kvserve.server.tool_prompt import render_chat_prompt
    grant = match_key(keys, authorization) if keys else None
    route = {"tokens": [], "cache_salt": cache_salt(grant.tenant if grant else None), "session": None,
             "tenant": grant.tenant if grant else None, "service_class": None, "model": None}
    if path not in GENERATION_PATHS:
        return route
    try:
        values = json.loads(body)
        route["session"] = values.get("prompt_cache_key")
        route["model"] = route["adapter"] = values.get("model")     # the router tells an adapter's name
        route["service_class"] = request_class(values, grant.service_class if grant else None)
        if path == "/v1/chat/completions":
            spec = protocol.parse_chat(values)
            route["tokens"] = tokenizer.encode(render_chat_prompt(tokenizer, spec.messages, spec.tools),
                                               add_special_tokens=False)
        elif not values.get("suffix"):
            first = protocol.parse_completion(values).prompts[0]
            route["tokens"] = list(first.token_ids) if first.token_ids is not None else tokenizer.encode(first.text)
    except Exception:               # the replica refuses it with the right error; route it anywhere
        route["tokens"] = []
    return route


def sse_error(message: str) -> bytes:
    """The SSE error event and ``[DONE]`` that end a stream whose replica failed."""
    body = {"error": {"message": message, "type": "server_error", "code": "replica_failed"}}
    return f"data: {json.dumps(body)}\n\ndata: [DONE]\n\n".encode()
