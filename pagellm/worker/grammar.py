"""Token masks for one step's sampled rows: structured outputs, allowed_token_ids, bad_words,
and OpenAI's logit_bias (the same additive bias, with finite values).

A constrained row gets an additive bias ``[vocab]``: 0 for the tokens it may sample, -inf for
the others, which the sampler adds to its logits (``SamplingMetadata.token_bias``). Rows
without a constraint get none and cost nothing: a batch without constrained rows never reaches
this module's torch code.

llguidance writes a grammar's mask as bits (one int32 word per 32 tokens). They become the bias
through a 256-entry table indexed by each byte of the mask (8 biases per byte): one gather,
about 5x faster on a CPU than unpacking the bits into a boolean mask and filling -inf through
it. ``unpack_bitmask`` is the plain reference the tests compare it with.

Grammar state (one llguidance matcher per sequence) lives here, keyed by sample id, because
the worker is what samples. It is advanced lazily: before computing a row's mask, the matcher
consumes the sequence's output tokens it has not seen yet (``token_ids`` of the plan). So a
sequence preempted by recompute, a forked sample (its matcher starts fresh when the prompt
forks, with no output yet), or a sequence whose matcher was dropped all resynchronise from the
one source of truth, the scheduler's token list, and nothing depends on the order in which
steps reported their tokens.
"""
from __future__ import annotations

import logging
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from pagellm.core.plan import ScheduledSequence
from pagellm.sampling_params import SamplingParams
from pagellm.structured_outputs import GrammarCompiler

logger = logging.getLogger("pagellm")

_BITS = 32


@dataclass(slots=True)
class _MatcherState:
    matcher: Any  # llguidance.LLMatcher
    num_output_tokens: int  # output tokens consumed so far


def needs_mask(p: SamplingParams) -> bool:
    return (p.structured_outputs is not None or p.allowed_token_ids is not None
            or bool(p.bad_words_token_ids) or bool(p.logit_bias))


class TokenMasks:
    """Invariant: ``states[sample_id]`` has consumed exactly the first ``num_output_tokens``
    output tokens of that sequence (as the latest plan listed them); dropped when the plan
    reports the sequence finished."""

    def __init__(self, compiler: GrammarCompiler | None, vocab_size: int) -> None:
        self.compiler = compiler
        self.vocab_size = vocab_size
        self.states: dict[str, _MatcherState] = {}
        self._executor = None

    def drop(self, seq_id: str) -> None:
        self.states.pop(seq_id, None)

    def build(self, rows: list[tuple[ScheduledSequence, int]], device: torch.device
              ) -> tuple[Tensor, Tensor] | None:
        """(row indices [k], bias [k, vocab]: 0 allowed, -inf not) of the constrained rows,
        or None when no row is constrained."""
        constrained = [i for i, (item, _) in enumerate(rows) if needs_mask(item.params)]
        if not constrained:
            return None
        grammar_rows = [j for j, i in enumerate(constrained)
                        if rows[i][0].params.structured_outputs is not None]
        if grammar_rows:
            matchers = [self._synced_matcher(*rows[constrained[j]]) for j in grammar_rows]
            grammar_bias = self._grammar_bias(matchers)  # [len(grammar_rows), vocab]
        if len(grammar_rows) == len(constrained):
            bias = grammar_bias
        else:
            bias = torch.zeros(len(constrained), self.vocab_size)
            if grammar_rows:
                bias[grammar_rows] = grammar_bias
        for j, i in enumerate(constrained):
            item, _ = rows[i]
            p = item.params
            if p.allowed_token_ids is not None:
                only = torch.full((self.vocab_size,), -math.inf)
                only[[t for t in p.allowed_token_ids if t < self.vocab_size]] = 0.0
                bias[j] += only
            if p.bad_words_token_ids:
                banned = _banned_bad_words(p.bad_words_token_ids, _outputs(item))
                bias[j, [t for t in banned if t < self.vocab_size]] = -math.inf
            if p.logit_bias:
                tokens = [t for t in p.logit_bias if t < self.vocab_size]
                bias[j, tokens] += torch.tensor([p.logit_bias[t] for t in tokens])
        return torch.tensor(constrained, dtype=torch.long, device=device), bias.to(device)

    def _synced_matcher(self, item: ScheduledSequence, index: int):
        sample_id = item.sample_ids[index]
        outputs = _outputs(item)  # a forking prompt has none: every sample starts fresh
        state = self.states.get(sample_id)
        if state is None or state.num_output_tokens > len(outputs):
            state = _MatcherState(self.compiler.new_matcher(item.params.structured_outputs), 0)
            self.states[sample_id] = state
        new = list(outputs[state.num_output_tokens:])
        # a stopped matcher (its grammar complete, or in error) takes nothing more; with
        # ignore_eos a sequence may go on sampling the EOS its mask allows
        if new and not state.matcher.is_stopped():
            if not state.matcher.consume_tokens(new):
                # Only a token the mask forbade gets here (e.g. min_tokens banned the EOS the
                # grammar demanded, and the sampler fell back to the raw logits).
                logger.warning("sequence %s left its grammar: %s", sample_id,
                               state.matcher.get_error())
        state.num_output_tokens = len(outputs)
        return state.matcher

    def _grammar_bias(self, matchers: list[Any]) -> Tensor:
        """[len(matchers), vocab] float32: 0 for the tokens each matcher accepts next, -inf
        for the others. A stopped matcher (complete, or in error) allows only EOS."""
        import llguidance

        words = -(-self.vocab_size // _BITS)
        bitmask = torch.full((len(matchers), words), -1, dtype=torch.int32)
        if len(matchers) == 1:
            row = bitmask[0]
            matchers[0].unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)
        else:
            if self._executor is None:
                self._executor = llguidance.LLExecutor()
            self._executor.unsafe_compute_mask_ptr(
                [(m, i) for i, m in enumerate(matchers)], bitmask.data_ptr(), words * 4,
                len(matchers))
        return bitmask_to_bias(bitmask, self.vocab_size).contiguous()


def unpack_bitmask(bitmask: Tensor, vocab_size: int) -> Tensor:
    """Reference: int32 words [rows, words] (bit b of word w: token 32w + b) -> bool
    [rows, vocab], True where allowed."""
    shifts = torch.arange(_BITS, dtype=torch.int32)
    bits = (bitmask[:, :, None] >> shifts) & 1  # [rows, words, 32]
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


_BYTE_BIAS: Tensor | None = None  # [256, 8]: byte value -> the bias of its 8 tokens


def bitmask_to_bias(bitmask: Tensor, vocab_size: int) -> Tensor:
    """int32 words [rows, words] -> float32 [rows, vocab]: 0 where the bit is set, else -inf.
    Reads the words as little-endian bytes (bit b of word w is bit b % 8 of byte 4w + b // 8)."""
    global _BYTE_BIAS
    if sys.byteorder != "little":
        return torch.zeros(unpack_bitmask(bitmask, vocab_size).shape).masked_fill_(
            ~unpack_bitmask(bitmask, vocab_size), -math.inf)
    if _BYTE_BIAS is None:
        bits = (torch.arange(256)[:, None] >> torch.arange(8)) & 1  # [256, 8]
        _BYTE_BIAS = torch.zeros(256, 8).masked_fill_(bits == 0, -math.inf)
    rows = bitmask.shape[0]
    index = bitmask.view(torch.uint8).reshape(-1).int()  # [rows * words * 4]
    return _BYTE_BIAS.index_select(0, index).view(rows, -1)[:, :vocab_size]


def _outputs(item: ScheduledSequence) -> Sequence[int]:
    return item.token_ids[item.num_prompt_tokens:]


def _banned_bad_words(words: list[list[int]], outputs: Sequence[int]) -> list[int]:
    """vLLM's rule: a bad word's last token is banned when the output ends with its other
    tokens (a one-token word is always banned)."""
    banned = []
    for word in words:
        prefix = word[:-1]
        if not prefix or list(outputs[len(outputs) - len(prefix):]) == prefix:
            banned.append(word[-1])
    return banned
