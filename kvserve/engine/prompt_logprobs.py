"""Prompt-logprob bookkeeping: which chunks must return them, and reporting each
prompt position once, even when a preempted sequence recomputes its prompt. Pure Python."""
from __future__ import annotations

from kvserve.engine.step import ScheduledSeq, StepResult


def wants_prompt_logprobs(seq, start: int, num_new: int) -> bool:
    """Whether the chunk ``[start, start + num_new)`` of ``seq`` predicts prompt tokens
    not reported yet (only the first sibling reports them)."""
    return (seq.params.prompt_logprobs is not None and seq.sibling_index == 0
            and start + num_new > seq.num_prompt_logprobs_done - 1
            and start < len(seq.prompt_token_ids) - 1)


def new_prompt_logprobs(seq, item: ScheduledSeq, result: StepResult) -> list:
    """The prompt logprobs this chunk produced that were not reported before (and mark
    them reported)."""
    produced = result.prompt_logprobs.get(item.seq_id)
    if not produced:
        return []
    first_position = item.start_position + 1              # position of produced[0]
    skip = max(0, seq.num_prompt_logprobs_done - first_position)
    seq.num_prompt_logprobs_done = max(seq.num_prompt_logprobs_done, first_position + len(produced))
    return produced[skip:]
