"""Fuzz the running server with schemathesis from its own /openapi.json (bounded).

Bodies valid and invalid by the published request schemas go to every tenant route
(the admin routes are left out: they change the server for everyone); no answer may be
a 5xx, and the server is still ready and serving afterwards. Generation stays short:
the server caps ``max_tokens`` at 8, so the whole run takes tens of seconds.
"""
from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from benchmarks.server_process import ServerProcess

pytestmark = pytest.mark.model

KEY, ADMIN = "fuzz-key", "fuzz-admin-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
EXAMPLES_PER_OPERATION = 20       # per operation and mode (valid / invalid bodies)
GENERATION_EXAMPLES = 12          # per generation route: plain bodies, most of which run


@pytest.fixture(scope="module")
def server():
    with ServerProcess("--api-key", KEY, "--admin-api-key", ADMIN, "--threads", "1", "--dtype", "float32",
                       "--kv-cache-gib", "0.1", "--max-num-seqs", "16", "--max-tokens-limit", "8",
                       "--default-max-tokens", "8") as proc:
        yield proc


def _operations(server) -> list:
    """The document's operations but the admin routes, loaded from the running server."""
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json", headers=AUTH)
    schema = schema.exclude(path_regex=r"^/(admin/|v1/(load|unload)_lora_adapter)")
    return [result.ok() for result in schema.get_all_operations()]


def _deadline_answer(case, response) -> bool:
    """The one 5xx the API documents: a 504 ``deadline_exceeded`` for a request whose own
    ``deadline_s`` passed before it finished (docs/server.md)."""
    body = case.body if isinstance(case.body, dict) else {}
    if response.status_code != 504 or not body.get("deadline_s"):
        return False
    return response.json().get("error", {}).get("code") == "deadline_exceeded"


def test_no_server_errors(server):
    """Every tenant operation, with bodies valid and invalid by the document: never a 5xx but
    the documented deadline answer."""
    operations = _operations(server)
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/tokenize"}
    assert not any(op.path.startswith("/admin/") for op in operations)
    calls = []
    for operation in operations:
        has_input = bool(len(operation.body) or len(operation.path_parameters))
        for mode in (GenerationMode if has_input else [GenerationMode.POSITIVE]):   # nothing to make invalid
            @settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, database=None, derandomize=True,
                      suppress_health_check=list(HealthCheck))
            @given(case=operation.as_strategy(generation_mode=mode))
            def fuzz(case):
                response = case.call(headers=AUTH, timeout=60)
                if not _deadline_answer(case, response):
                    case.validate_response(response, checks=[not_a_server_error])
                calls.append(response.status_code)
            fuzz()
    assert len(calls) >= len(operations) * EXAMPLES_PER_OPERATION
    assert any(status == 200 for status in calls) and any(status == 400 for status in calls)


GENERATION_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "presence_penalty",
                     "frequency_penalty", "repetition_penalty", "ignore_eos", "skip_special_tokens",
                     "include_stop_str_in_output", "stream", "user", "safety_identifier", "prompt_cache_key",
                     "metadata", "store", "priority", "logit_bias")
# non-empty text: the published schema allows "" (a model that adds BOS can run it), this model cannot
PLAIN_PROMPT = {"anyOf": [{"type": "string", "minLength": 1},
                          {"type": "array", "minItems": 1, "maxItems": 2, "items": {"type": "string", "minLength": 1}}]}
PLAIN_MESSAGES = {"type": "array", "minItems": 1, "maxItems": 3, "items": {
    "type": "object", "required": ["role", "content"], "additionalProperties": False,
    "properties": {"role": {"enum": ["system", "developer", "user", "assistant"]}, "content": {"type": "string"}}}}


def _plain_document(doc: dict) -> dict:
    """The published document narrowed to plain generation requests this server runs: its
    own schemas of the sampling fields, non-empty string prompts, text messages, n <= 2 and
    this server's max_tokens cap (8), so that most generated bodies are accepted and generate."""
    paths = {}
    for path, prompt_field in (("/v1/completions", "prompt"), ("/v1/chat/completions", "messages")):
        operation = doc["paths"][path]["post"]
        published = operation["requestBody"]["content"]["application/json"]["schema"]["properties"]
        properties = {name: published[name] for name in GENERATION_FIELDS}
        properties["prompt" if prompt_field == "prompt" else "messages"] = (
            PLAIN_PROMPT if prompt_field == "prompt" else PLAIN_MESSAGES)
        properties["max_tokens"] = {"type": "integer", "minimum": 1, "maximum": 8}
        properties["n"] = {"type": "integer", "minimum": 1, "maximum": 2}
        body = {"type": "object", "required": [prompt_field], "properties": properties, "additionalProperties": False}
        paths[path] = {"post": {**operation, "requestBody": {
            "required": True, "content": {"application/json": {"schema": body}}}}}
    return {**doc, "paths": paths}


def test_generation_requests_never_fail(server):
    """Valid generation bodies (whole and streamed): never a 5xx, and most are served."""
    doc = httpx.get(server.url + "/openapi.json", headers=AUTH).json()
    statuses = []
    for result in schemathesis.openapi.from_dict(_plain_document(doc)).get_all_operations():
        @settings(max_examples=GENERATION_EXAMPLES, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(case=result.ok().as_strategy())
        def fuzz(case):
            response = case.call_and_validate(base_url=server.url, headers=AUTH, checks=[not_a_server_error],
                                              timeout=60)
            statuses.append(response.status_code)
        fuzz()
    assert len(statuses) >= 2 * GENERATION_EXAMPLES
    assert statuses.count(200) >= len(statuses) // 2, statuses


def test_ready_and_serving_after_the_fuzz(server):
    assert httpx.get(server.url + "/ready").status_code == 200
    r = httpx.post(server.url + "/v1/completions", headers=AUTH, timeout=60,
                   json={"prompt": "Hello", "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    assert "kvserve_requests_rejected_total" in httpx.get(server.url + "/metrics", headers={
        "Authorization": f"Bearer {ADMIN}"}).text
