"""Output processing: engine SeqUpdates -> detokenised text, stop strings, RequestOutputs.

Runs in the front end (the offline LLM, later the HTTP process). Stop strings are
matched here on text; a match finishes the sequence in the engine.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from kvserve.engine.step import SeqUpdate
from kvserve.outputs import CompletionOutput, RequestOutput
from kvserve.sampling.params import SamplingParams
from kvserve.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class _RequestState:
    output: RequestOutput
    params: SamplingParams
    detokenizers: list[IncrementalDetokenizer] = field(default_factory=list)


class OutputProcessor:
    """Tracks live requests; ``process`` folds a step's updates into their outputs."""

    def __init__(self, tokenizer: Tokenizer, stop_sequence: Callable[[int], None]):
        self.tokenizer = tokenizer
        self._stop_sequence = stop_sequence        # tells the engine a stop string matched
        self._requests: dict[str, _RequestState] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams) -> None:
        output = RequestOutput(request_id, prompt, list(prompt_token_ids))
        state = _RequestState(output, params)
        for index in range(params.n):
            output.outputs.append(CompletionOutput(index=index, text="", token_ids=[],
                                                   logprobs=[] if params.logprobs is not None else None,
                                                   cumulative_logprob=0.0 if params.logprobs is not None else None))
            state.detokenizers.append(IncrementalDetokenizer(
                self.tokenizer, prompt_token_ids, skip_special_tokens=params.skip_special_tokens,
                stop=params.stop or (), include_stop_str_in_output=params.include_stop_str_in_output))
        self._requests[request_id] = state

    def process(self, updates: list[SeqUpdate]) -> list[RequestOutput]:
        """Apply updates; return the requests that finished with them."""
        finished = []
        for update in updates:
            state = self._requests.get(update.request_id)
            if state is None:
                continue
            completion = state.output.outputs[update.sibling_index]
            if completion.finished:
                continue
            self._append(state, completion, update)
            if state.output.finished:
                finished.append(self._requests.pop(update.request_id).output)
        return finished

    def _append(self, state: _RequestState, completion: CompletionOutput, update: SeqUpdate) -> None:
        detok = state.detokenizers[completion.index]
        completion.token_ids.extend(update.new_token_ids)
        for sampled in update.new_logprobs:
            if completion.logprobs is not None:
                entry = {sampled.token_id: sampled.logprob}
                entry.update({tid: lp for tid, lp in sampled.top_logprobs if tid not in entry})
                completion.logprobs.append(entry)
                completion.cumulative_logprob += sampled.logprob
        stopped = False
        if update.new_token_ids:
            delta = detok.add(update.new_token_ids)
            completion.text += delta.text
            stopped = delta.stopped
        if stopped and update.finish_reason is None:
            self._stop_sequence(update.seq_id)
        if stopped:
            completion.finish_reason = "stop"
            completion.stop_reason = detok.stop_hit
        elif update.finish_reason is not None:
            completion.text += detok.finish()
            completion.finish_reason = update.finish_reason
            last = completion.token_ids[-1] if completion.token_ids else None
            if update.finish_reason == "stop" and last is not None and last not in self.tokenizer.eos_token_ids:
                completion.stop_reason = last
