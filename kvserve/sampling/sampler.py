"""The batched sampler: one pass of torch ops turns a logits batch into token ids.

Pipeline for a batch of ``B`` rows (``V`` = vocabulary size)::

    raw logits [B, V] ──▶ process_logits ──────────────────────────▶ greedy rows: argmax
                    (logit_bias, penalties, min_tokens mask)     │
                                                                 └▶ sampling rows:
        apply_temperature (÷T, shifted so the max is 0) ─▶ apply_filters (min-p, top-k,
        top-p, one sort) ─▶ softmax ─▶ argmax(probs / q), q ~ Exp(1)   (exponential race)

    raw logits ──▶ log_softmax ──▶ logprobs / top_logprobs   (only when some row asks)

``logit_bias`` is added first (as vLLM, whose logit-bias processor runs before the
penalties), so the repetition penalty scales the biased logit, and the ``min_tokens``
mask still wins over any bias: greedy and sampled rows see the same processed logits.

Seeded rows draw ``q`` from a generator seeded by a hash of
``(seed, seed_offset, len(output_token_ids))``: their token depends only on that
triple and the row's own logits, never on the rest of the batch or the number of
engine steps, so preemption/recompute and batch composition do not change them.
Unseeded rows share one batched draw from the sampler's own generator.
"""
from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass
from typing import Sequence

import torch

from kvserve.sampling.params import SamplingParams

_NEG_INF = float("-inf")


@dataclass
class SamplingRow:
    """Everything the sampler needs about one row of the logits batch.

    ``output_token_ids`` are the tokens generated so far for this sequence (for the
    penalties, ``min_tokens`` and the seeded draw's position). ``eos_token_ids``
    (with ``params.stop_token_ids``) are masked to -inf while fewer than
    ``params.min_tokens`` tokens exist; ``ignore_eos`` only affects stopping, which
    is the scheduler's job. ``seed_offset`` tells the ``n > 1`` siblings of one
    request apart (the sibling index). ``allowed`` (structured output) is a bool ``[V]``
    tensor of the tokens the row's grammar allows next; None = every token.
    """

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    eos_token_ids: frozenset[int]
    seed_offset: int = 0
    allowed: torch.Tensor | None = None


@dataclass
class SamplerOutput:
    """Per-row results, in row order; plain Python values (no tensors).

    ``logprobs[i]`` is the chosen token's logprob under the model's raw distribution
    (log_softmax of the unmodified logits), ``None`` where ``params.logprobs`` is None.
    ``top_logprobs[i]`` holds ``params.logprobs`` ``(token id, raw logprob)`` pairs,
    sorted by logprob descending; ``[]`` where not asked (or asked for 0).
    A token the raw distribution gives no mass has logprob ``-inf``.
    """

    token_ids: list[int]
    logprobs: list[float | None]
    top_logprobs: list[list[tuple[int, float]]]


# ---------------------------------------------------------------- logits processing
def _flat_index(id_lists: Sequence[Sequence[int]], vocab_size: int,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index, token id) pairs for ``id_lists[row]``; ids outside [0, V) are dropped."""
    lengths = torch.tensor([len(ids) for ids in id_lists], dtype=torch.long)
    tokens = torch.tensor(list(itertools.chain.from_iterable(id_lists)), dtype=torch.long)
    rows = torch.repeat_interleave(torch.arange(len(id_lists)), lengths)
    keep = (tokens >= 0) & (tokens < vocab_size)
    return rows[keep].to(device), tokens[keep].to(device)


def _token_counts(id_lists: Sequence[Sequence[int]], vocab_size: int,
                  device: torch.device) -> torch.Tensor:
    """How often each token occurs in each list: float32 ``[len(id_lists), V]``."""
    counts = torch.zeros(len(id_lists), vocab_size, dtype=torch.float32, device=device)
    rows, tokens = _flat_index(id_lists, vocab_size, device)
    counts.index_put_((rows, tokens), torch.ones_like(tokens, dtype=torch.float32), accumulate=True)
    return counts


def apply_logit_bias(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Add each row's ``params.logit_bias`` (``{token id: bias}``) to its logits.

    One ``index_put_`` over the ``(row, token)`` pairs of every biased row; ids outside
    [0, V) and zero biases are skipped. Returns a new tensor when any row has a bias,
    else ``logits`` itself; rows without a bias are bit-for-bit unchanged.
    """
    row_idx: list[int] = []
    tok_idx: list[int] = []
    values: list[float] = []
    vocab_size = logits.shape[1]
    for i, r in enumerate(rows):
        bias = r.params.logit_bias
        if not bias:
            continue
        for tid, value in bias.items():
            if value and 0 <= tid < vocab_size:
                row_idx.append(i)
                tok_idx.append(tid)
                values.append(value)
    if not values:
        return logits
    device = logits.device
    rows_t = torch.tensor(row_idx, dtype=torch.long, device=device)
    toks_t = torch.tensor(tok_idx, dtype=torch.long, device=device)
    out = logits.clone()
    out.index_put_((rows_t, toks_t), torch.tensor(values, dtype=logits.dtype, device=device),
                   accumulate=True)
    return out


def apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Repetition, frequency and presence penalties; returns a new tensor (input untouched).

    For each row, in this order (as vLLM):

    - repetition (HF semantics) over tokens seen in prompt + output:
      ``l / r`` where ``l > 0`` else ``l * r``;
    - ``l -= frequency_penalty * count + presence_penalty * (count > 0)`` with
      ``count`` the token's occurrences in the output (OpenAI semantics).

    Rows without penalties are returned bit-for-bit unchanged. ``logits``: ``[B, V]``.
    """
    idx = [i for i, r in enumerate(rows) if r.params.has_penalties]
    if not idx:
        return logits
    vocab_size, device = logits.shape[1], logits.device
    sel = [rows[i] for i in idx]
    sub = logits[idx]                                                       # [P, V]
    counts = _token_counts([r.output_token_ids for r in sel], vocab_size, device)  # [P, V]
    rep = torch.tensor([r.params.repetition_penalty for r in sel],
                       dtype=logits.dtype, device=device)[:, None]          # [P, 1]
    if bool((rep != 1.0).any()):
        # Prompt tokens only matter to the repetition penalty: skip them where it is off.
        prompts = [r.prompt_token_ids if r.params.repetition_penalty != 1.0 else ()
                   for r in sel]
        seen = (_token_counts(prompts, vocab_size, device) > 0) | (counts > 0)
        sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    freq = torch.tensor([r.params.frequency_penalty for r in sel],
                        dtype=logits.dtype, device=device)[:, None]
    pres = torch.tensor([r.params.presence_penalty for r in sel],
                        dtype=logits.dtype, device=device)[:, None]
    sub = sub - freq * counts - pres * (counts > 0).to(logits.dtype)
    out = logits.clone()
    out[idx] = sub
    return out


def apply_min_tokens_mask(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Set EOS and ``stop_token_ids`` to -inf on rows with fewer than ``min_tokens`` outputs.

    Returns a new tensor when any row is masked, else ``logits`` itself. Ids outside
    the vocabulary are ignored.
    """
    id_lists: list[Sequence[int]] = []
    for r in rows:
        if len(r.output_token_ids) < r.params.min_tokens:
            id_lists.append(sorted(set(r.eos_token_ids) | set(r.params.stop_token_ids or ())))
        else:
            id_lists.append(())
    if not any(id_lists):
        return logits
    row_idx, tok_idx = _flat_index(id_lists, logits.shape[1], logits.device)
    out = logits.clone()
    out[row_idx, tok_idx] = _NEG_INF
    return out


def apply_grammar_masks(logits: torch.Tensor, fallback: torch.Tensor,
                        rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Set the tokens a row's grammar forbids (``row.allowed`` False) to -inf, on the rows
    that have a mask only (one batched ``masked_fill`` over them; the rest untouched).

    A masked row left with no finite logit (``min_tokens`` or a bias removed every token the
    grammar allows, say EOS where only EOS may come) takes the grammar mask over ``fallback``
    instead: the grammar always wins. Returns ``logits`` itself when no row has a mask.
    """
    idx = [i for i, r in enumerate(rows) if r.allowed is not None]
    if not idx:
        return logits
    allowed = torch.stack([rows[i].allowed for i in idx]).to(logits.device)     # [C, V]
    masked = logits[idx].masked_fill(~allowed, _NEG_INF)
    dead = torch.isneginf(masked.amax(dim=-1))
    if bool(dead.any()):
        masked[dead] = fallback[idx][dead].masked_fill(~allowed[dead], _NEG_INF)
    out = logits.clone()
    out[idx] = masked
    return out


def process_logits(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """The temperature-independent step: ``logit_bias``, penalties, the ``min_tokens`` mask,
    then the structured-output grammar mask (``apply_grammar_masks``).

    The bias comes first (vLLM's order): the repetition penalty then scales the biased
    logit, presence/frequency penalties add to it, and the ``min_tokens`` mask (-inf)
    overrides any bias. A row left with no finite logit (everything masked) falls back
    to its biased logits (its raw logits when it has no bias), so the sampler never sees
    an empty distribution. Returns ``logits`` itself when no row needs processing; never
    modifies ``logits``. ``logits``: ``[B, V]``.
    """
    biased = apply_logit_bias(logits, rows)
    out = apply_min_tokens_mask(apply_penalties(biased, rows), rows)
    if out is not biased:
        dead = torch.isneginf(out.amax(dim=-1))                            # [B]
        if bool(dead.any()):
            out[dead] = biased[dead]
    return apply_grammar_masks(out, biased, rows)


def apply_temperature(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """``(logits - row max) / T`` with ``temperatures`` ``[S]`` all > 0.

    Shifting first keeps tiny temperatures finite (the best token is at 0, the rest
    at most -inf); ``+inf`` entries and all ``-inf`` rows give 0 instead of NaN.
    """
    row_max = logits.amax(dim=-1, keepdim=True)                           # [S, 1]
    shifted = torch.where(logits == row_max, torch.zeros_like(logits), logits - row_max)
    return shifted / temperatures[:, None]


def apply_filters(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                  min_p: torch.Tensor) -> torch.Tensor:
    """Min-p, then top-k, then top-p (on the renormalised survivors), with one sort.

    ``logits`` ``[S, V]`` are temperature-scaled; ``top_k`` (long), ``top_p``,
    ``min_p`` are ``[S]``. A filter is applied only to rows that enable it
    (``top_k > 0``, ``top_p < 1``, ``min_p > 0``); other rows are untouched.
    Removed tokens become -inf; the most likely token always survives.

    - min-p removes tokens with ``p < min_p * p_max``;
    - top-k keeps exactly ``k`` tokens (ties broken towards the lower id);
    - top-p keeps the minimal prefix of the sorted tokens whose mass reaches ``top_p``:
      token ``i`` survives iff the mass strictly before it is ``< top_p``.
    """
    vocab_size = logits.shape[1]
    use_k = (top_k > 0) & (top_k < vocab_size)
    use_p = top_p < 1.0
    use_m = min_p > 0.0
    if not bool((use_k | use_p | use_m).any()):
        return logits
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True, stable=True)  # [S, V]
    remove = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if bool(use_m.any()):
        threshold = sorted_logits[:, :1] + torch.log(min_p)[:, None]     # log p_max + log min_p
        remove |= (sorted_logits < threshold) & use_m[:, None]
    if bool(use_k.any()):
        positions = torch.arange(vocab_size, device=logits.device)[None, :]
        remove |= (positions >= top_k[:, None]) & use_k[:, None]
    if bool(use_p.any()):
        probs = sorted_logits.masked_fill(remove, _NEG_INF).softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        remove |= (mass_before >= top_p[:, None]) & use_p[:, None]
    remove[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(remove, _NEG_INF)
    return torch.empty_like(logits).scatter_(1, sorted_idx, sorted_logits)


def derive_row_seed(seed: int, seed_offset: int, position: int) -> int:
    """A 63-bit generator seed that is a pure function of the three ints."""
    key = f"{seed}:{seed_offset}:{position}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


# --------------------------------------------------------------------- the sampler
class Sampler:
    """Samples one token per row of a logits batch (see the module docstring).

    ``seed`` seeds the generator used for unseeded rows (``None`` = fresh entropy);
    it is the sampler's only state, one generator per device.
    """

    def __init__(self, seed: int | None = None):
        self._seed = seed
        self._generators: dict[str, torch.Generator] = {}

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """Sample ``len(rows)`` tokens from ``logits`` ``[num_rows, vocab]`` (float32).

        Neither ``logits`` nor ``rows`` is modified.
        """
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits must be [num_rows={len(rows)}, vocab], got {tuple(logits.shape)}")
        if not rows:
            return SamplerOutput([], [], [])
        raw = logits.float()                                                # [B, V]
        processed = process_logits(raw, rows)                               # [B, V]
        tokens = torch.empty(len(rows), dtype=torch.long, device=raw.device)  # [B]
        greedy = [i for i, r in enumerate(rows) if r.params.is_greedy]
        sampled = [i for i, r in enumerate(rows) if not r.params.is_greedy]
        if greedy:
            tokens[greedy] = processed[greedy].argmax(dim=-1)
        if sampled:
            tokens[sampled] = self._sample([rows[i] for i in sampled], processed[sampled])
        logprobs, top_logprobs = raw_logprobs(raw, rows, tokens)
        return SamplerOutput(tokens.tolist(), logprobs, top_logprobs)

    def _sample(self, rows: list[SamplingRow], logits: torch.Tensor) -> torch.Tensor:
        """Temperature, filters and the exponential race for non-greedy rows: ``[S]`` ids."""
        probs = sampling_probs(logits, rows)                                # [S, V]
        q = self._exponentials(rows, logits.shape[1], logits.device)        # [S, V]
        return (probs / q).argmax(dim=-1)

    def _exponentials(self, rows: list[SamplingRow], vocab_size: int,
                      device: torch.device) -> torch.Tensor:
        """Exp(1) noise ``[S, V]``: per-row generators for seeded rows, one batched draw otherwise.

        Clamped away from 0 so a zero-probability token can never win (0 / 0).
        """
        unseeded = [j for j, r in enumerate(rows) if r.params.seed is None]
        if len(unseeded) == len(rows):
            q = torch.empty(len(rows), vocab_size, device=device)
            q.exponential_(generator=self._generator(device))
        else:
            q = torch.empty(len(rows), vocab_size, device=device)
            if unseeded:
                q[unseeded] = torch.empty(len(unseeded), vocab_size, device=device).exponential_(
                    generator=self._generator(device))
            for j, r in enumerate(rows):
                if r.params.seed is not None:
                    q[j] = seeded_exponentials(r, vocab_size, device)
        return q.clamp_min_(torch.finfo(q.dtype).tiny)

    def _generator(self, device: torch.device) -> torch.Generator:
        """The sampler's generator for ``device``, created (and seeded) on first use."""
        key = str(device)
        gen = self._generators.get(key)
        if gen is None:
            gen = torch.Generator(device=device)
            if self._seed is None:
                gen.seed()
            else:
                gen.manual_seed(self._seed)
            self._generators[key] = gen
        return gen


def sampling_probs(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """The distribution non-greedy rows sample from: softmax of the processed ``logits``
    ``[S, V]`` after temperature and the min-p / top-k / top-p filters."""
    device, dtype = logits.device, logits.dtype
    temps = torch.tensor([r.params.temperature for r in rows], dtype=dtype, device=device)
    top_k = torch.tensor([r.params.top_k for r in rows], dtype=torch.long, device=device)
    top_p = torch.tensor([r.params.top_p for r in rows], dtype=dtype, device=device)
    min_p = torch.tensor([r.params.min_p for r in rows], dtype=dtype, device=device)
    return apply_filters(apply_temperature(logits, temps), top_k, top_p, min_p).softmax(dim=-1)


def seeded_exponentials(row: SamplingRow, vocab_size: int, device: torch.device) -> torch.Tensor:
    """The Exp(1) noise ``[V]`` a seeded row draws at its current output position: a pure
    function of ``(seed, seed_offset, len(output_token_ids))``, clamped away from 0."""
    gen = torch.Generator(device=device)
    gen.manual_seed(derive_row_seed(row.params.seed, row.seed_offset, len(row.output_token_ids)))
    noise = torch.empty(vocab_size, device=device).exponential_(generator=gen)
    return noise.clamp_min_(torch.finfo(noise.dtype).tiny)


def raw_logprobs(raw: torch.Tensor, rows: Sequence[SamplingRow], tokens: torch.Tensor
                  ) -> tuple[list[float | None], list[list[tuple[int, float]]]]:
    """Chosen-token and top-k logprobs under ``log_softmax(raw)`` for rows that ask."""
    logprobs: list[float | None] = [None] * len(rows)
    top: list[list[tuple[int, float]]] = [[] for _ in rows]
    want = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    if not want:
        return logprobs, top
    k_max = max(rows[i].params.logprobs for i in want)
    chosen, tops = token_logprobs(raw[want], tokens[want], k_max)
    for w, i in enumerate(want):
        logprobs[i] = chosen[w]
        top[i] = tops[w][:rows[i].params.logprobs]
    return logprobs, top


def token_logprobs(raw: torch.Tensor, tokens: torch.Tensor, k: int
                   ) -> tuple[list[float], list[list[tuple[int, float]]]]:
    """Under ``log_softmax(raw)`` (``[R, V]``): each row's logprob of ``tokens[row]`` and its
    top ``k`` ``(id, logprob)`` pairs, best first (``[]`` when ``k`` is 0)."""
    lp = torch.log_softmax(raw, dim=-1)                                     # [R, V]
    lp = lp.masked_fill(torch.isnan(lp), _NEG_INF)  # an all -inf row has no distribution
    chosen = lp.gather(1, tokens[:, None]).squeeze(1).tolist()
    k = min(k, lp.shape[1])
    if k <= 0:
        return chosen, [[] for _ in chosen]
    values, ids = lp.topk(k, dim=-1)                                        # [R, k]
    return chosen, [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
