"""Random sampling for the rows of a step that do not decode greedily: temperature, top-k,
top-p and min-p as one probability cut-off per row, then an inverse-CDF draw.

The cut-offs work on probabilities, not logits: one softmax (into storage the Sampler keeps)
serves both the cut-offs and the draw, with no logsumexp, and a token is kept when its
probability reaches its row's cut-off, so tokens tied with the cut-off are all kept.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
from torch import Tensor

from pagellm.sampling_params import SamplingParams

# (slot, shape, dtype) -> a [rows, vocab] tensor in the sampler's kept storage
Storage = Callable[[int, tuple[int, int], torch.dtype], Tensor]


def sample_random(logits: Tensor, params: list[SamplingParams],
                   generators: list[torch.Generator | None], storage: Storage) -> Tensor:
    """Samples one token per row of ``logits`` [rows, vocab] (a copy; modified in place).

    Top-k, top-p and min-p become one probability cut-off per row, applied in one pass: the
    probabilities come from one softmax, written into kept storage (a fresh [256, 49152]
    float32 result took ~40 ms here, most of it faulting in new pages, against ~15 ms), and no
    logsumexp is needed (its temporaries took ~100 ms at that size)."""
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], device=device)
    logits = logits.div_(temperature[:, None])
    # A row of all -inf (or NaN) gives NaN probabilities: an invalid draw, then repaired.
    probs = torch.ops.aten._softmax.out(logits, -1, False,
                                        out=storage(3, tuple(logits.shape), logits.dtype))
    cutoff = None
    if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
        cutoff = top_k_top_p_cutoff(probs, [p.top_k for p in params],
                                    [p.top_p for p in params])
    if any(p.min_p > 0.0 for p in params):
        # min-p keeps probabilities >= min_p times the largest (which top-k/top-p keep)
        min_p = torch.tensor([p.min_p for p in params], device=device)
        floor = probs.amax(dim=-1) * min_p
        cutoff = floor if cutoff is None else torch.maximum(cutoff, floor)
    if cutoff is not None:
        below = torch.lt(probs, cutoff[:, None],
                         out=storage(4, tuple(probs.shape), torch.bool))
        # twice as fast as masked_fill_ here
        torch.where(below, probs.new_zeros(()), probs, out=probs)
    return _inverse_cdf_sample(probs, generators)


def apply_top_k_top_p(probs: Tensor, top_k: list[int], top_p: list[float]) -> Tensor:
    """Sets to 0, in place, the probabilities of all but each row's top-k tokens, then of all
    but the smallest set of those whose (renormalised) probability reaches top_p. ``top_k`` 0
    and ``top_p`` 1 disable them. ``probs`` [rows, vocab]: each row sums to 1."""
    cutoff = top_k_top_p_cutoff(probs, top_k, top_p)
    return probs.masked_fill_(probs < cutoff[:, None], 0.0)


def top_k_top_p_cutoff(probs: Tensor, top_k: list[int], top_p: list[float]) -> Tensor:
    """Per row of ``probs`` [rows, vocab] (each row summing to 1), the smallest probability
    that top-k followed by top-p keep (0 where neither applies).

    Each row gets one cut-off and tokens below it are dropped, so tokens tied with the
    cut-off are all kept: which of several tied tokens survives must not depend on how a sort
    happened to order them, or on which other rows share the batch.
    """
    device = probs.device
    cutoff = torch.zeros(probs.shape[0], device=device, dtype=probs.dtype)  # [rows]
    k_rows = [i for i, k in enumerate(top_k) if k > 0]
    p_rows = [i for i, (k, p) in enumerate(zip(top_k, top_p)) if k == 0 and p < 1.0]
    if k_rows:
        rows = index_of(k_rows, device)
        cutoff[rows] = _top_k_cutoff(
            _rows_of(probs, k_rows, rows),
            torch.tensor([top_k[i] for i in k_rows], device=device),
            torch.tensor([top_p[i] for i in k_rows], device=device))
    if p_rows:
        rows = index_of(p_rows, device)
        cutoff[rows] = _top_p_cutoff(
            _rows_of(probs, p_rows, rows),
            torch.tensor([top_p[i] for i in p_rows], device=device))
    return cutoff


def _top_k_cutoff(probs: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """Per row, the smallest probability kept by top-k followed by top-p (top_k >= 1)."""
    vocab = probs.shape[1]
    k = top_k.clamp(max=vocab)  # [rows]
    values = probs.topk(int(k.max()), dim=-1).values  # [rows, max_k], descending
    positions = torch.arange(values.shape[1], device=probs.device)
    in_top_k = positions[None, :] < k[:, None]
    norm = values.masked_fill(~in_top_k, 0.0).sum(dim=-1)
    num_kept = torch.minimum(k, _nucleus_size(values, norm, top_p))
    return values.gather(1, (num_kept - 1)[:, None]).squeeze(1)


def _top_p_cutoff(probs: Tensor, top_p: Tensor) -> Tensor:
    """Per row, the smallest probability kept by top-p alone (top_p < 1 on every row).

    A full sort of the vocabulary is slow on a CPU (4.3 ms per row of 49152 here), and the
    nucleus of a trained model is usually a few dozen tokens: look for the cut in the top 64
    tokens (0.09 ms), then the top 512 (0.23 ms), then the top 4096 (0.73 ms), and sort
    everything only for rows whose nucleus is wider still. (SmolLM2-135M at temperature 1,
    top_p 0.95: 41% of the rows need more than 64 tokens, 4% more than 1024.)
    """
    vocab = probs.shape[1]
    norm = probs.sum(dim=-1)  # [rows], 1 up to rounding
    cutoff = torch.empty_like(norm)
    pending = torch.arange(probs.shape[0], device=probs.device)
    for width in (min(64, vocab), min(512, vocab), min(4096, vocab), vocab):
        rows = probs if pending.numel() == probs.shape[0] else probs[pending]
        values = rows.topk(width, dim=-1).values  # [pending, width], descending
        num_kept = _nucleus_size(values, norm[pending], top_p[pending])
        done = (num_kept < width) | (width == vocab)
        cutoff[pending[done]] = values[done].gather(1, (num_kept[done] - 1)[:, None]).squeeze(1)
        pending = pending[~done]
        if pending.numel() == 0:
            break
    return cutoff


def _nucleus_size(values: Tensor, norm: Tensor, top_p: Tensor) -> Tensor:
    """How many of the descending probabilities ``values`` [rows, width] the smallest set
    reaching ``top_p`` of ``norm`` (the rows' totals) holds (at least 1)."""
    probs = values / norm[:, None]
    before = probs.cumsum(dim=-1) - probs  # probability mass ranked above each position
    # top_p == 1 must keep everything, even where rounding pushes the cumulative sum to 1.
    threshold = torch.where(top_p < 1.0, top_p, math.inf)
    return (before < threshold[:, None]).sum(dim=-1).clamp(min=1)


_CDF_BLOCK = 128


def _inverse_cdf_sample(weights: Tensor, generators: list[torch.Generator | None]) -> Tensor:
    """Draws one token per row of ``weights`` [rows, vocab] (probabilities up to a factor per
    row, >= 0) from one uniform number per row; -1 for a row whose total is not positive
    (NaN weights, every token banned), which _repair_invalid replaces.

    A seeded row draws its number from its own generator, so its token depends only on its own
    weights and seed. One uniform and a cumulative sum per row cost a small fraction of
    drawing vocab-sized noise (exponential race, Gumbel-max) or of torch.multinomial on a CPU.
    The sum is taken in two levels over wide rows, as greedy_argmax takes its maximum: the
    cumulative sum of 128-token blocks' sums finds the block, then that block's own cumulative
    sum the token (a [256, 32000] cumsum along the rows is not vectorised: ~26 ms here). Below
    4 rows the plain cumsum is faster (one row of 49152: 0.16 against 0.22 ms).
    """
    device = weights.device
    rows, vocab = weights.shape
    uniform = torch.empty(rows, device=device)  # [rows]
    unseeded = [i for i, g in enumerate(generators) if g is None]
    seeded = [i for i, g in enumerate(generators) if g is not None]
    if unseeded:
        uniform[index_of(unseeded, device)] = torch.rand(len(unseeded), device=device)
    if seeded:
        uniform[index_of(seeded, device)] = torch.cat(
            [torch.rand(1, generator=generators[i], device=device) for i in seeded])
    if vocab < 4 * _CDF_BLOCK or rows < 4:  # a few rows' cumsums cost less than two levels
        ids = _first_above(weights.cumsum(dim=-1), uniform[:, None], scale=True)
        total = weights.sum(dim=-1)
    else:
        full = vocab - vocab % _CDF_BLOCK
        sums = weights[:, :full].reshape(rows, -1, _CDF_BLOCK).sum(dim=-1)  # [rows, blocks]
        if full < vocab:
            sums = torch.cat([sums, weights[:, full:].sum(dim=-1, keepdim=True)], dim=1)
        cum = sums.cumsum(dim=-1)
        total = cum[:, -1]
        target = torch.minimum(uniform * total, torch.nextafter(total, torch.zeros_like(total)))
        # The first block whose cumulative sum exceeds the target: it holds a token of weight
        # > 0, and the target lies within its sum.
        block = torch.searchsorted(cum, target[:, None], right=True).clamp_(max=cum.shape[1] - 1)
        before = torch.where(block > 0, cum.gather(1, (block - 1).clamp_(min=0)), 0.0)
        positions = block * _CDF_BLOCK + torch.arange(_CDF_BLOCK, device=device)  # [rows, B]
        local = weights.gather(1, positions.clamp(max=vocab - 1))
        local.masked_fill_(positions >= vocab, 0.0)  # past the last (shorter) block
        within = _first_above(local.cumsum(dim=-1), (target[:, None] - before).clamp_(min=0))
        ids = positions.gather(1, within[:, None]).squeeze(1)
    return ids.masked_fill_(~(total > 0), -1)


def _first_above(cdf: Tensor, target: Tensor, scale: bool = False) -> Tensor:
    """Per row, the first position whose ``cdf`` [rows, n] exceeds ``target`` [rows, 1] (times
    the row's total with ``scale``), the target kept strictly below the total so that the
    search never runs past the last token; a token of weight 0 is never the first."""
    total = cdf[:, -1:]
    if scale:
        target = target * total
    target = torch.minimum(target, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=cdf.shape[1] - 1)


def _rows_of(logits: Tensor, rows: list[int], index: Tensor) -> Tensor:
    """``logits[index]``, without the copy when ``rows`` are all of them (in order)."""
    return logits if len(rows) == logits.shape[0] else logits[index]


def index_of(rows: list[int], device: torch.device) -> Tensor:
    return torch.tensor(rows, dtype=torch.long, device=device)
