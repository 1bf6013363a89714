"""The token ids of a simulated request's prompt: a prefix its group shares, then its own tokens.

A request of prefix group ``g`` of model ``m`` starts with that group's ``prefix_len`` tokens,
the same for every request of the group (a system prompt, few-shot examples, the document a
conversation is about); the rest of its prompt is its own. A request without a group (``-1``)
shares nothing. The ids are a deterministic function of (model, group, position) and of
(request, position), drawn in ``[FIRST_ID, vocab_size)``, so one log gives the same prompts to
the simulator's prefix caches (``SchedulerReplica(prefix_cache=True)``, ``PrefixCachingReplica``),
to the router's block hashes, to a real engine (``validate.run_engine_trace``) and to a cluster
over HTTP (``replay.replay_trace``); a ``salt`` keeps logs played into one engine apart (a probe before a
trace). Two requests' own tokens share a 16-token block with probability ~``vocab^-16``: never,
in practice. A later turn of a conversation (``log.parent``) starts with its previous turn's
prompt and output, the output as the simulated replicas sample it (``REPLY_ID``, one id for every
token), so the blocks a replica committed for the previous turn are the next one's prefix.
"""
from __future__ import annotations

import numpy as np

from kvserve.fleetsim.log import RequestLog

FIRST_ID = 100                  # clear of the special tokens at the start of a vocabulary
REPLY_ID = 1                    # every simulated output token (what SchedulerReplica samples)
DEFAULT_VOCAB = 49_152          # the default model's (SmolLM2); any size above FIRST_ID works
_GROUP_STREAM, _OWN_STREAM = 1, 2


def prompt_token_ids(log: RequestLog, request: int, vocab_size: int = DEFAULT_VOCAB, salt: int = 0) -> list[int]:
    """``request``'s prompt: its group's shared prefix, then tokens of its own; a later turn of a
    conversation starts with the previous turn's prompt and its output (``REPLY_ID`` tokens).
    Logs played into one engine with different ``salt`` share nothing (a probe before a trace)."""
    turns = [request]
    while log.parent[turns[-1]] >= 0:
        turns.append(log.parent[turns[-1]])
    first = turns[-1]
    ids: list[int] = []
    if log.prefix_group[first] >= 0:
        group = np.random.default_rng([_GROUP_STREAM, salt, log.model[first], log.prefix_group[first]])
        ids = group.integers(FIRST_ID, vocab_size, log.prefix_len[first]).tolist()
    for turn in reversed(turns):
        if turn != first:
            ids += [REPLY_ID] * log.output[log.parent[turn]]
        own = np.random.default_rng([_OWN_STREAM, salt, turn]).integers(FIRST_ID, vocab_size, log.prompt[turn] - len(ids))
        ids += own.tolist()
    return ids


def continued_prompt(log: RequestLog, request: int, history: list[int], vocab_size: int = DEFAULT_VOCAB,
                     salt: int = 0) -> list[int]:
    """A later turn's prompt as a real engine or server is sent it in a closed loop: ``history``
    (the ids the previous turn was sent, then the ids it was answered with), then the turn's own
    tokens (``prompt_token_ids``'s). A history cut short (a refused or broken turn) is filled
    with ``REPLY_ID``, so the prompt keeps the trace's length."""
    ids = prompt_token_ids(log, request, vocab_size, salt)
    parent = log.parent[request]
    length = log.prompt[parent] + log.output[parent]
    return (history + [REPLY_ID] * length)[:length] + ids[length:]


def add_prefix_groups(log: RequestLog, rng: np.random.Generator, groups: int, prefix_tokens: int,
                      requests=None) -> RequestLog:
    """Give ``requests`` of ``log`` (default: all) a shared prefix of ``prefix_tokens`` tokens, each
    of one of ``groups`` groups drawn uniformly from ``rng``: their prompts grow by it (the drawn
    lengths are the tokens of their own). In place (a log drawn for several grouped models is not
    copied once per model); returns ``log``."""
    chosen = list(range(len(log))) if requests is None else list(requests)
    for request, group in zip(chosen, rng.integers(0, groups, len(chosen)).tolist()):
        log.prefix_group[request] = group
        log.prefix_len[request] = prefix_tokens
        log.prompt[request] += prefix_tokens
    return log
