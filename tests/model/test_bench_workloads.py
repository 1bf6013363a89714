"""kvserve bench: the workloads' shapes (no server; the default model's tokenizer)."""
from __future__ import annotations

from kvserve.loadgen.workloads import build_workload


def test_workloads_have_the_asked_shapes(tokenizer):
    rand = build_workload("random", tokenizer, 5, input_len=50, output_len=7, spread=0.2, chat=False, seed=3)
    assert len(rand) == 5 and all(r.prompt and 35 <= r.input_tokens <= 70 and 5 <= r.max_tokens <= 9 for r in rand)
    assert [r.prompt for r in rand] == [r.prompt for r in build_workload("random", tokenizer, 5, 50, 7, 0.2,
                                                                         chat=False, seed=3)]
    shared = build_workload("shared-prefix", tokenizer, 3, input_len=10, output_len=4, prefix_len=100)
    assert len({r.messages[0]["content"] for r in shared}) == 1 and shared[0].input_tokens > 100
    turns = build_workload("multi-turn", tokenizer, 2, input_len=10, output_len=4, turns=3)
    assert all(r.turns == 3 and len(r.followups) == 2 for r in turns)
    code = build_workload("code", tokenizer, 3, input_len=60, output_len=4, chat=False)
    assert all(r.prompt and r.input_tokens == 60 for r in code)
