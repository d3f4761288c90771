"""Batched sampling: logits processors, token choice and logprobs for one engine step.

One ``Sampler`` call handles every row of the step's logits at once, whatever mix of requests
they belong to. The order of operations is vLLM's:

0. Token bias: a row restricted to some tokens (structured outputs, allowed_token_ids,
   bad_words) gets -inf for every other token, and logit_bias adds its values, before anything
   else, so that penalties and top-k/top-p choose among the allowed tokens only.
1. min_tokens: while a row has generated fewer than ``min_tokens`` tokens, EOS (unless
   ``ignore_eos``) and its ``stop_token_ids`` get -inf, so it cannot stop early.
2. Penalties: repetition over prompt and output tokens, presence and frequency over output tokens.
3. Temperature, then top-k, top-p and min-p (random rows only).
4. Choice: argmax for greedy rows; inverse-CDF sampling for random rows.
5. Repair: a row whose choice is not a token id (its logits held NaN or +inf, or every token
   was banned, so its probabilities are NaN) falls back to the argmax of its processed logits,
   NaN read as -inf, then of its raw logits: whatever the logits, every id returned is in
   ``[0, vocab_size)``, so one bad row never reaches the next step's embedding lookup.

Logprobs are those of the raw model distribution (before any of the above), as vLLM returns
by default, so they mean the same thing whatever the sampling settings.

Work a step does not need is skipped: a batch of greedy rows without penalties or min_tokens
costs one argmax and one logsumexp over the logits, plus a top-k for the rows asking for logprobs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import chain
from typing import Iterable, Sequence

import torch
from torch import Tensor

from pagellm.sampling_params import SAMPLING_EPS, SamplingParams
from pagellm.worker.random_sampling import index_of, sample_random


@dataclass(slots=True)
class SamplingMetadata:
    """What the sampler needs to know about each row of one step's logits.

    All lists have one entry per row. A row's token histories are read only for penalties
    and min_tokens, and may be empty for a row that has neither. A row's generator is its request's own
    ``torch.Generator`` (on the logits' device) when the request has a seed, so that its samples
    depend only on its seed and its own history, never on which other requests share the batch;
    None means the global random generator.
    """

    params: list[SamplingParams]
    prompt_token_ids: list[Sequence[int]]
    output_token_ids: list[Sequence[int]]
    generators: list[torch.Generator | None]
    # (row indices [k], bias [k, vocab]: 0 for allowed tokens, -inf for the others) of the
    # rows whose choice is restricted (structured outputs, allowed_token_ids, bad_words; see
    # worker/grammar.py), or None
    token_bias: tuple[Tensor, Tensor] | None = None


@dataclass(slots=True)
class SamplerOutput:
    """Per row: the chosen token, its raw logprob and rank (1 = most likely), and the
    ``params.logprobs`` most likely tokens as (token_id, logprob) pairs, or None when the
    request did not ask for logprobs. ``logprobs`` and ``ranks`` are None when no row of the
    batch asked for logprobs."""

    token_ids: list[int]
    logprobs: list[float] | None
    ranks: list[int] | None
    top_logprobs: list[list[tuple[int, float]] | None]


class Sampler:
    """Turns a step's logits into next tokens.

    Invariants: the logits passed in are never modified; every returned token id is in
    ``[0, vocab_size)``; greedy rows are deterministic (first
    maximum on ties); a seeded row's token is a function of its logits, its params, its token
    history and its generator's state only.
    """

    def __init__(self, vocab_size: int, eos_token_id: int | Iterable[int] | None) -> None:
        self.vocab_size = vocab_size
        # every token that ends a sequence (a model may have several: Llama 3's <|eot_id|>)
        self.eos_token_ids = ((eos_token_id,) if isinstance(eos_token_id, int)
                              else tuple(sorted(eos_token_id or ())))
        # Storage of the processed copy of the logits, kept from step to step (valid only
        # during a call): a fresh copy of [256, 49152] float32 logits took 53 ms on a 2-core
        # EPYC, since glibc maps an allocation that large afresh and every page faults on
        # first touch; the whole call, penalties included, now takes ~9 ms there.
        # Up to four [rows, vocab] buffers of the logits' dtype and one of bools, each kept at
        # the largest batch seen. Slot 0: the processed copy; 1: a row-major copy of
        # column-major logits; 2: the random rows, which sampling works on in place; 3: their
        # probabilities (and then compute_logprobs' intermediates); 4: the mask of the
        # probabilities below a row's cut-off.
        self._scratch: list[Tensor | None] = [None] * 5

    def _storage(self, slot: int, shape: tuple[int, int], dtype: torch.dtype,
                 device: torch.device) -> Tensor:
        """Row-major ``shape`` in the sampler's scratch storage ``slot`` (grown as needed)."""
        scratch, size = self._scratch[slot], shape[0] * shape[1]
        if (scratch is None or scratch.numel() < size
                or scratch.device != device or scratch.dtype != dtype):
            scratch = self._scratch[slot] = torch.empty(size, dtype=dtype, device=device)
        return scratch[:size].view(shape)

    def _copy_of(self, logits: Tensor, slot: int = 0) -> Tensor:
        """A row-major copy of ``logits`` in the sampler's scratch storage ``slot``."""
        return self._storage(slot, tuple(logits.shape), logits.dtype,
                             logits.device).copy_(logits)

    def __call__(self, logits: Tensor, meta: SamplingMetadata) -> SamplerOutput:
        # Models may pad the output projection beyond the tokenizer's vocabulary.
        logits = logits[:, : self.vocab_size].float()  # [num_rows, vocab_size]
        num_rows = logits.shape[0]
        if len(meta.params) != num_rows:
            raise ValueError(f"SamplingMetadata has {len(meta.params)} rows, logits {num_rows}")
        greedy_rows = [i for i, p in enumerate(meta.params) if p.temperature < SAMPLING_EPS]
        if num_rows > 1 and logits.stride(-1) != 1 and (
                len(greedy_rows) < num_rows or any(p.logprobs is not None for p in meta.params)):
            # Column-major logits (the CPU's float32 GEMM writes the vocabulary projection
            # transposed): row-wise softmax, sort and cumsum over them run several times slower,
            # so they get one row-major copy. greedy_argmax reads them as they are.
            logits = self._copy_of(logits, slot=1)
        processed = self._apply_min_tokens_and_penalties(logits, meta)

        if len(greedy_rows) == num_rows:
            token_ids = greedy_argmax(processed)  # [num_rows]
        else:
            token_ids = torch.empty(num_rows, dtype=torch.long, device=logits.device)
            random_rows = [i for i, p in enumerate(meta.params) if p.temperature >= SAMPLING_EPS]
            if greedy_rows:
                rows = index_of(greedy_rows, logits.device)
                token_ids[rows] = greedy_argmax(processed[rows])
            rows = index_of(random_rows, logits.device)
            work = self._storage(2, (len(random_rows), processed.shape[1]), processed.dtype,
                                 processed.device)
            if len(random_rows) == num_rows:
                work.copy_(processed)
            else:
                torch.index_select(processed, 0, rows, out=work)
            token_ids[rows] = sample_random(
                work, [meta.params[i] for i in random_rows],
                [meta.generators[i] for i in random_rows],
                lambda slot, shape, dtype: self._storage(slot, shape, dtype, work.device))
            # only the random draws can fall outside the vocabulary (argmax cannot)
            token_ids = _repair_invalid(token_ids, processed, logits)
        num_logprobs = [p.logprobs for p in meta.params]
        if all(k is None for k in num_logprobs):
            # Nobody asked: skip the [rows, vocab] logsumexp (as vLLM does).
            return SamplerOutput(token_ids.tolist(), None, None, [None] * num_rows)
        # Argmax of the untouched logits is rank 1 by definition: no need to count.
        raw_argmax = processed is logits and len(greedy_rows) == num_rows
        # slot 3 (the random rows' probabilities) is free again by now
        work = self._storage(3, tuple(logits.shape), torch.float32, logits.device)
        return compute_logprobs(logits, token_ids, num_logprobs, ranks_are_one=raw_argmax,
                                work=work)

    def _apply_min_tokens_and_penalties(self, logits: Tensor, meta: SamplingMetadata) -> Tensor:
        """Returns ``logits`` itself when no row needs a mask, min_tokens or penalties, else a
        processed copy."""
        banned_rows, banned_tokens = self._min_tokens_bans(meta)
        penalised = [i for i, p in enumerate(meta.params) if has_penalties(p)]
        if not banned_rows and not penalised and meta.token_bias is None:
            return logits
        logits = self._copy_of(logits)
        if meta.token_bias is not None:
            rows, bias = meta.token_bias  # [k], [k, vocab]
            logits.index_add_(0, rows, bias)
        if banned_rows:
            logits[banned_rows, banned_tokens] = -math.inf
        if penalised:
            _apply_penalties(logits, index_of(penalised, logits.device),
                             [meta.params[i] for i in penalised],
                             [meta.prompt_token_ids[i] for i in penalised],
                             [meta.output_token_ids[i] for i in penalised])
        return logits

    def _min_tokens_bans(self, meta: SamplingMetadata) -> tuple[list[int], list[int]]:
        """(row, token) pairs that must not be sampled because the row is below min_tokens."""
        rows: list[int] = []
        tokens: list[int] = []
        for i, p in enumerate(meta.params):
            if p.min_tokens == 0 or len(meta.output_token_ids[i]) >= p.min_tokens:
                continue
            stops = list(p.stop_token_ids)
            if not p.ignore_eos:
                stops.extend(self.eos_token_ids)
            stops = [t for t in stops if t < self.vocab_size]
            rows.extend([i] * len(stops))
            tokens.extend(stops)
        return rows, tokens


def _repair_invalid(token_ids: Tensor, processed: Tensor, logits: Tensor) -> Tensor:
    """Replace ids outside ``[0, vocab)`` (NaN probabilities make the inverse-CDF search run
    past the end) by the argmax of the processed row with NaN as -inf, or, when that row is
    all -inf, of the raw row (an all -inf row gives id 0)."""
    vocab = logits.shape[1]
    bad = (token_ids < 0) | (token_ids >= vocab)  # [num_rows]
    if not bool(bad.any()):
        return token_ids
    rows = bad.nonzero().squeeze(1)
    fallback = processed[rows].nan_to_num(nan=-math.inf)  # [bad rows, vocab]
    dead = torch.isneginf(fallback).all(dim=-1)
    fallback[dead] = logits[rows[dead]].nan_to_num(nan=-math.inf)
    token_ids = token_ids.clone()
    token_ids[rows] = fallback.argmax(dim=-1)
    return token_ids


_ARGMAX_BLOCK = 128
# (from _ARGMAX_MAX_ROWS rows) below this many logits one argmax costs less than the two
# levels' five ops (1 x 16384 and 4 x 4096 were about level on an AMX Xeon)
_ARGMAX_TWO_LEVELS = 1 << 14
# below this many rows one torch.max(dim) (the first maximum too, NaN counting as the maximum)
# costs less than the two levels. Right after a decode step, with the caches full of the
# weights, 49152 logits took 87 against 201 us for one row, 147 against 232 for four (an AMX
# Xeon; timed alone in warm caches, 32 against 42 us for one row, and both beat torch's
# argmax, 85); from 8 rows on the two levels win
_ARGMAX_MAX_ROWS = 8


def greedy_argmax(logits: Tensor) -> Tensor:
    """``logits.argmax(-1)`` (the first maximum of each row, NaN counting as the maximum): on
    the CPU below _ARGMAX_MAX_ROWS rows torch's ``max`` along the rows (fewer ops), from there
    in two levels: the maximum of each 128-wide block (torch's ``amax`` is vectorised, its
    ``argmax`` is not: 4-5x faster over a [256, 32000] float32 batch here), the first block
    holding the row's maximum, then the first position in that block."""
    rows, vocab = logits.shape
    if logits.device.type == "cpu" and rows < _ARGMAX_MAX_ROWS:
        return torch.max(logits, dim=-1).indices
    if (logits.device.type != "cpu" or vocab < 4 * _ARGMAX_BLOCK
            or rows * vocab < _ARGMAX_TWO_LEVELS or logits.dtype != torch.float32):
        return logits.argmax(dim=-1)
    if logits.stride(-1) != 1:
        if logits.stride(0) == 1:
            return _greedy_argmax_columns(logits)
        return logits.argmax(dim=-1)
    pad = -vocab % _ARGMAX_BLOCK
    if pad:
        logits = torch.nn.functional.pad(logits, (0, pad), value=-math.inf)
    blocks = logits.view(rows, -1, _ARGMAX_BLOCK)  # [rows, num_blocks, block]
    block = blocks.amax(dim=-1).argmax(dim=-1)  # [rows]
    within = blocks[torch.arange(rows, device=logits.device), block].argmax(dim=-1)
    return block * _ARGMAX_BLOCK + within


def _greedy_argmax_columns(logits: Tensor) -> Tensor:
    """greedy_argmax of column-major logits [rows, vocab] (``logits.t()`` has unit stride
    along the rows), as the float32 GEMM writes them: the blocks' maxima are reduced across
    the vocabulary with the rows in lanes (torch's ``argmax`` along the rows' strided axis is
    ~15x slower over [256, 32000] here), then the rows' chosen blocks are gathered."""
    rows, vocab = logits.shape
    by_token = logits.t()  # [vocab, rows]
    full = vocab - vocab % _ARGMAX_BLOCK
    maxima = by_token[:full].view(-1, _ARGMAX_BLOCK, rows).amax(dim=1)  # [blocks, rows]
    if full < vocab:
        maxima = torch.cat([maxima, by_token[full:].amax(dim=0, keepdim=True)])
    block = maxima.argmax(dim=0)  # [rows]: the first block holding the row's maximum
    # The last block's positions past the vocabulary repeat its last token: never first.
    positions = (block[:, None] * _ARGMAX_BLOCK
                 + torch.arange(_ARGMAX_BLOCK, device=logits.device)).clamp_(max=vocab - 1)
    within = logits.gather(1, positions).argmax(dim=-1, keepdim=True)  # [rows, 1]
    return positions.gather(1, within).squeeze(1)


def compute_logprobs(logits: Tensor, token_ids: Tensor, num_logprobs: Sequence[int | None],
                     ranks_are_one: bool = False, work: Tensor | None = None) -> SamplerOutput:
    """Raw logprob and rank of ``token_ids[i]`` under row i of ``logits``, plus the row's top-k.

    Also serves prompt logprobs: pass the logits of prompt positions and the prompt tokens that
    follow them. Uses ``logit - logsumexp`` rather than a full log_softmax so that only the rows
    asking for top-k logprobs pay for a [rows, vocab] result.

    ``work``: float32 storage of ``logits``' shape for the [rows, vocab] intermediates (the
    Sampler passes storage it keeps: a fresh [256, 49152] result costs ~40 ms of page faults on
    a CPU). The logsumexp is torch.logsumexp's own arithmetic; the ranks count in float32
    (exact below 2^24 tokens), several times faster than summing a bool mask into integers.
    """
    logits = logits.float()
    if work is None:
        work = torch.empty_like(logits)
    maxes = logits.amax(dim=-1, keepdim=True)  # [num_rows, 1]
    maxes.masked_fill_(maxes.abs() == math.inf, 0.0)  # as torch.logsumexp: no inf - inf
    torch.sub(logits, maxes, out=work).exp_()
    lse = work.sum(dim=-1).log_().add_(maxes.squeeze(1))  # [num_rows]
    chosen = logits.gather(1, token_ids[:, None]).squeeze(1)  # [num_rows]
    logprobs = (chosen - lse).tolist()
    if ranks_are_one:
        ranks = [1] * len(logprobs)
    else:
        torch.gt(logits, chosen[:, None], out=work)  # 1.0 where a token is more likely
        ranks = (work.sum(dim=-1) + 1).int().tolist()
    top: list[list[tuple[int, float]] | None] = [None] * len(logprobs)
    wanted = [i for i, k in enumerate(num_logprobs) if k is not None]
    for i in wanted:
        top[i] = []  # logprobs=0: only the chosen token's logprob
    max_k = max((num_logprobs[i] for i in wanted), default=0)
    if max_k > 0:
        rows = index_of(wanted, logits.device)
        asking = logits if len(wanted) == logits.shape[0] else logits[rows]
        values, indices = asking.topk(min(max_k, logits.shape[1]), dim=-1)
        values = (values - lse[rows][:, None]).tolist()  # [len(wanted), max_k]
        indices = indices.tolist()
        for j, i in enumerate(wanted):
            k = num_logprobs[i]
            top[i] = list(zip(indices[j][:k], values[j][:k]))
    return SamplerOutput(token_ids.tolist(), logprobs, ranks, top)


def has_penalties(p: SamplingParams) -> bool:
    return (p.repetition_penalty != 1.0 or p.presence_penalty != 0.0
            or p.frequency_penalty != 0.0)


def _apply_penalties(logits: Tensor, at: Tensor, params: list[SamplingParams],
                     prompt_ids: list[Sequence[int]], output_ids: list[Sequence[int]]) -> None:
    """vLLM's penalties on rows ``at`` [k] of ``logits`` [rows, vocab], in place; ``params``
    and the token lists have one entry per row of ``at`` (no [k, vocab] copy is made).

    Repetition divides positive logits and multiplies negative ones by the penalty for every
    token seen in the prompt or the output; frequency subtracts penalty × count and presence
    subtracts the penalty once, for tokens of the output only. Only the (row, token) pairs that
    occur are touched: dense [rows, vocab] count tensors would cost more than the whole
    sampling step.
    """
    device = logits.device
    vocab = logits.shape[1]
    out_rows, out_tokens = _flatten(output_ids, device)  # one entry per output token
    repetition = torch.tensor([p.repetition_penalty for p in params], device=device)
    if any(p.repetition_penalty != 1.0 for p in params):
        prompt_rows, prompt_tokens = _flatten(prompt_ids, device)
        rows, tokens = _unique_pairs(torch.cat([out_rows, prompt_rows]),
                                     torch.cat([out_tokens, prompt_tokens]), vocab)
        where = (at[rows], tokens)
        values = logits[where]
        factor = repetition[rows]
        logits[where] = torch.where(values > 0, values / factor, values * factor)
    if any(p.frequency_penalty != 0.0 for p in params):
        frequency = torch.tensor([p.frequency_penalty for p in params], device=device)
        # Accumulating once per occurrence subtracts penalty × count.
        logits.index_put_((at[out_rows], out_tokens), -frequency[out_rows], accumulate=True)
    if any(p.presence_penalty != 0.0 for p in params):
        presence = torch.tensor([p.presence_penalty for p in params], device=device)
        rows, tokens = _unique_pairs(out_rows, out_tokens, vocab)
        logits[at[rows], tokens] -= presence[rows]


def _flatten(token_ids: list[Sequence[int]], device: torch.device) -> tuple[Tensor, Tensor]:
    """(row index, token id) of every token of every row, as two flat tensors."""
    lengths = torch.tensor([len(ids) for ids in token_ids], device=device)
    rows = torch.repeat_interleave(torch.arange(len(token_ids), device=device), lengths)
    tokens = torch.tensor(list(chain.from_iterable(token_ids)), dtype=torch.long, device=device)
    return rows, tokens


def _unique_pairs(rows: Tensor, tokens: Tensor, vocab: int) -> tuple[Tensor, Tensor]:
    keys = torch.unique(rows * vocab + tokens)
    return keys // vocab, keys % vocab
