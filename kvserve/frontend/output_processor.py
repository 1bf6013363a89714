"""Output processing: engine SeqUpdates -> detokenised text, stop strings, RequestOutputs.

Runs in the front end (the offline LLM and the HTTP process). Stop strings are
matched here on text; a match finishes the sequence in the engine. ``process``
returns finished requests (offline use); ``process_deltas`` also returns what each
update added to a completion, for streaming.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from kvserve.engine.step import SeqUpdate
from kvserve.frontend.outputs import CompletionOutput, RequestOutput
from kvserve.sampling.params import SamplingParams
from kvserve.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class CompletionDelta:
    """What one engine update added to one completion (a streaming chunk's worth).

    ``text`` is safe to send (no broken character, no possible stop-string start);
    ``logprobs`` has one ``{chosen id: lp, top ids: lp}`` dict per new token when asked.
    """

    request_id: str
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    prompt_logprobs: list[dict[int, float]] | None = None   # prompt tokens' entries this update added


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
        output = RequestOutput(request_id, prompt, list(prompt_token_ids),
                               prompt_logprobs=[None] if params.prompt_logprobs is not None else None)
        state = _RequestState(output, params)
        for index in range(params.n):
            output.outputs.append(CompletionOutput(index=index, text="", token_ids=[],
                                                   logprobs=[] if params.logprobs is not None else None,
                                                   cumulative_logprob=0.0 if params.logprobs is not None else None))
            state.detokenizers.append(IncrementalDetokenizer(
                self.tokenizer, prompt_token_ids, skip_special_tokens=params.skip_special_tokens,
                stop=params.stop or (), include_stop_str_in_output=params.include_stop_str_in_output))
        self._requests[request_id] = state

    def has_request(self, request_id: str) -> bool:
        """Whether ``request_id`` is live here (added, not finished, not aborted)."""
        return request_id in self._requests

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Forget a request the front end ended (client gone, deadline, drain); its
        unfinished completions get finish_reason ``abort``. Returns its output, or None."""
        state = self._requests.pop(request_id, None)
        if state is None:
            return None
        for completion in state.output.outputs:
            if not completion.finished:
                completion.text += state.detokenizers[completion.index].finish()
                completion.finish_reason = "abort"
        return state.output

    def process(self, updates: list[SeqUpdate]) -> list[RequestOutput]:
        """Apply updates; return the requests that finished with them."""
        return self.process_deltas(updates)[0]

    def process_deltas(self, updates: list[SeqUpdate]) -> tuple[list[RequestOutput], list[CompletionDelta]]:
        """Apply updates; return the requests that finished with them and, in update
        order, the delta each update made to its completion."""
        finished, deltas = [], []
        for update in updates:
            state = self._requests.get(update.request_id)
            if state is None:
                continue
            completion = state.output.outputs[update.sibling_index]
            state.output.num_cached_tokens = max(state.output.num_cached_tokens, update.num_cached_tokens)
            state.output.num_draft_tokens += update.num_draft_proposed
            state.output.num_accepted_draft_tokens += update.num_draft_accepted
            if completion.finished:
                continue
            delta = self._append(state, completion, update)
            if update.prompt_logprobs and state.output.prompt_logprobs is not None:
                delta.prompt_logprobs = [_entry(s) for s in update.prompt_logprobs]
                state.output.prompt_logprobs.extend(delta.prompt_logprobs)
            deltas.append(delta)
            if state.output.finished:
                finished.append(self._requests.pop(update.request_id).output)
        return finished, deltas

    def _append(self, state: _RequestState, completion: CompletionOutput,
                update: SeqUpdate) -> CompletionDelta:
        detok = state.detokenizers[completion.index]
        delta = CompletionDelta(update.request_id, completion.index, "", [],
                                [] if completion.logprobs is not None else None)
        stopped = False
        # One token at a time (a speculative step brings several): a stop string ends
        # the completion at the token that completed it, exactly as without speculation.
        for i, token_id in enumerate(update.new_token_ids):
            completion.token_ids.append(token_id)
            delta.token_ids.append(token_id)
            if completion.logprobs is not None and i < len(update.new_logprobs):
                sampled = update.new_logprobs[i]
                entry = _entry(sampled)
                completion.logprobs.append(entry)
                delta.logprobs.append(entry)
                completion.cumulative_logprob += sampled.logprob
            released = detok.add([token_id])
            delta.text += released.text
            if released.stopped:
                stopped = True
                break
        if stopped and update.finish_reason is None:
            self._stop_sequence(update.seq_id)
        if stopped:
            completion.finish_reason = "stop"
            completion.stop_reason = detok.stop_hit
        elif update.finish_reason is not None:
            delta.text += detok.finish()
            completion.finish_reason = update.finish_reason
            last = completion.token_ids[-1] if completion.token_ids else None
            if update.finish_reason == "stop" and last is not None and last not in self.tokenizer.eos_token_ids:
                completion.stop_reason = last
        completion.text += delta.text
        delta.finish_reason, delta.stop_reason = completion.finish_reason, completion.stop_reason
        return delta


def _entry(sampled) -> dict[int, float]:
    """``{chosen id: lp, top-k ids: lp}`` for one SampledToken."""
    entry = {sampled.token_id: sampled.logprob}
    entry.update({tid: lp for tid, lp in sampled.top_logprobs if tid not in entry})
    return entry
