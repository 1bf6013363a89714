"""Tier 2: structured output on the real model. Every output of 22 JSON schemas x 3 prompts,
greedy and sampled, parses and validates (jsonschema); speculation on and off give the same
tokens; a grammar that allows the unconstrained greedy output does not change it."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from kvserve import LLM, SamplingParams
from kvserve.engine.structured_spec import StructuredKind, StructuredSpec
from kvserve.errors import InvalidRequestError

from tests.support.json_schemas import SCHEMAS

PROMPTS = [
    [{"role": "user", "content": "Reply with a JSON object that fits the task."}],
    [{"role": "user", "content": "Describe something in your favourite city as JSON."}],
    [{"role": "user", "content": "Make up a small record for a database, in JSON."}],
]
MAX_TOKENS = 96


def schema_spec(schema: dict) -> StructuredSpec:
    return StructuredSpec(StructuredKind.JSON_SCHEMA, json.dumps(schema))


def run_all(llm, params: SamplingParams):
    cases = [(name, prompt) for name in SCHEMAS for prompt in PROMPTS]
    outs = llm.generate([p for _n, p in cases], params, structured=[schema_spec(SCHEMAS[n]) for n, _p in cases])
    return cases, outs


def check_valid(cases, outs) -> int:
    """Every output parses and validates; returns how many ended by the grammar (EOS, "stop")."""
    failures = []
    for (name, _prompt), out in zip(cases, outs):
        completion = out.outputs[0]
        try:
            jsonschema.validate(json.loads(completion.text), SCHEMAS[name])
            assert completion.finish_reason == "stop"
        except (ValueError, AssertionError, jsonschema.ValidationError) as exc:
            failures.append(f"{name}: {completion.text!r} ({completion.finish_reason}): {exc}")
    assert not failures, "\n".join(failures)
    return sum(out.outputs[0].finish_reason == "stop" for out in outs)


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=MAX_TOKENS, temperature=0),
                                    SamplingParams(max_tokens=MAX_TOKENS, temperature=0.7, top_p=0.9)],
                         ids=["greedy", "sampled"])
def test_every_output_matches_its_schema(llm, params):
    assert len(SCHEMAS) >= 20
    cases, outs = run_all(llm, params)
    stopped = check_valid(cases, outs)
    print(f"{stopped}/{len(outs)} outputs ended by grammar termination")


def test_speculation_does_not_change_constrained_greedy_outputs(llm):
    names = ["person", "array_of_objects", "refs"]
    specs = [schema_spec(SCHEMAS[n]) for n in names]
    prompts = [PROMPTS[i % 3] for i in range(len(names))]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    plain = llm.generate(prompts, params, structured=specs)
    spec_llm = LLM(dtype="float32", kv_cache_bytes=16 * 2**20, speculative="ngram")
    spec = spec_llm.generate(prompts, params, structured=specs)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    assert sum(o.num_draft_tokens for o in spec) > 0               # drafts were verified


def literal(text: str) -> str:
    """A regex matching ``text`` only (metacharacters escaped; xgrammar knows no ``\\ ``)."""
    return re.sub(r"[.^$*+?()\[\]{}|\\]", lambda m: "\\" + m.group(0), text).replace("\n", "\\n")


def test_a_grammar_that_allows_the_greedy_output_does_not_change_it(llm, tokenizer):
    prompts = ["The capital of France is", "1, 2, 3, 4,", "def add(a, b):"]
    params = SamplingParams(max_tokens=12, temperature=0)
    free = llm.generate(prompts, params)
    texts = [o.outputs[0].text for o in free]
    assert all(t and "\ufffd" not in t for t in texts)
    choices = [StructuredSpec(StructuredKind.CHOICE, json.dumps([t, t + "!"])) for t in texts]
    regexes = [StructuredSpec(StructuredKind.REGEX, literal(t) + "(x)?") for t in texts]
    for specs in (choices, regexes):
        constrained = llm.generate(prompts, params, structured=specs)
        for f, c in zip(free, constrained):
            assert c.outputs[0].token_ids[:len(f.outputs[0].token_ids)] == f.outputs[0].token_ids


def test_choice_and_n_siblings(llm):
    spec = StructuredSpec(StructuredKind.CHOICE, json.dumps(["alpha", "beta", "gamma"]))
    out = llm.generate(["Pick one word:"], SamplingParams(max_tokens=8, temperature=1.0, n=4, seed=3),
                       structured=spec)[0]
    assert len(out.outputs) == 4
    assert all(o.text in ("alpha", "beta", "gamma") and o.finish_reason == "stop" for o in out.outputs)


def test_preemption_keeps_constrained_outputs(llm, model_path):
    """A tiny KV cache forces preemption (recompute): outputs still equal the roomy engine's."""
    names = ["person", "tags_array", "weather", "product"]
    specs = [schema_spec(SCHEMAS[n]) for n in names]
    prompts = [PROMPTS[i % 3] for i in range(len(names))]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    tight = LLM(model_path, dtype="float32", kv_cache_bytes=46_080 * 16 * 14)        # 14 blocks of 16 tokens
    got = tight.generate(prompts, params, structured=specs)
    assert tight.engine.stats().num_preemptions > 0
    want = llm.generate(prompts, params, structured=specs)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]


def test_bad_constraints_are_refused_before_anything_runs(llm):
    with pytest.raises(InvalidRequestError) as err:
        llm.generate(["x"], SamplingParams(max_tokens=4), structured=StructuredSpec(StructuredKind.REGEX, "a(b"))
    assert err.value.param == "guided_regex"
