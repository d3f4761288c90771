"""What one engine step hands between the scheduler and the model runner, in both directions.

The scheduler owns every sequence's state; the runner sees only the ``SchedulerOutput`` it is
given (with tensor parallelism, what the driver would broadcast) and answers with a
``ModelRunnerOutput`` keyed by sequence id, which ``Scheduler.update_from_output`` applies.
Plain data, no torch: the runner (pagellm.worker) turns it into tensors and back.
"""
from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagellm.lora.request import LoRARequest
    from pagellm.sampling_params import SamplingParams

BlockPairs = list[tuple[int, int]]  # (src, dst) block ids


@dataclass(slots=True)
class ScheduledSequence:
    """One sequence's share of a step.

    The step computes positions ``num_computed_tokens .. num_computed_tokens +
    num_new_tokens - 1`` of ``token_ids`` (every known token: prompt and output), whose slots
    ``block_table`` already covers. ``need_logits``: the step reaches the last known token, so
    the sequence samples: ``len(sample_ids)`` tokens from that one row (more than one for the
    first sample of a request with ``n > 1``: sample i goes to sequence ``sample_ids[i]``,
    forked from this one after the step). ``need_prompt_logits``: also return the logprobs of
    the prompt tokens this chunk predicts (``prompt_logprobs`` of them). ``lora_request``: the
    adapter its tokens run with (None: the base model).
    """

    seq_id: str
    token_ids: Seq[int]
    num_computed_tokens: int
    num_new_tokens: int
    block_table: list[int]
    need_logits: bool
    need_prompt_logits: bool = False
    prompt_logprobs: int = 0
    num_prompt_tokens: int = 0
    params: SamplingParams | None = None
    sample_ids: tuple[str, ...] = ()
    lora_request: LoRARequest | None = None


@dataclass(slots=True)
class SchedulerOutput:
    """One step's plan. Its block copies run before the model, in this order:
    ``blocks_to_copy_first`` (the contiguous baseline's fork copies, made by the last step's
    update: this step may swap out their destinations, or give their sources or destinations
    to a swapped-in sequence), then swap-outs before swap-ins (a swapped-in sequence may
    reuse blocks another one just left), then ``blocks_to_copy`` (copy-on-write into blocks
    allocated this step, which the swap-outs may have just freed).
    ``finished_seq_ids``: sequences that ended since the last plan (the runner drops their
    per-sequence state, e.g. random generators)."""

    scheduled: list[ScheduledSequence] = field(default_factory=list)
    blocks_to_copy_first: BlockPairs = field(default_factory=list)
    blocks_to_copy: BlockPairs = field(default_factory=list)
    blocks_to_swap_out: BlockPairs = field(default_factory=list)
    blocks_to_swap_in: BlockPairs = field(default_factory=list)
    num_batched_tokens: int = 0
    preempted: list[str] = field(default_factory=list)  # seq ids preempted this step
    finished_seq_ids: list[str] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(slots=True)
class SampledToken:
    """A sampled token with its raw log-probability and rank (1 = most likely) when the
    request asked for logprobs, and the ``logprobs`` most likely (token id, logprob) pairs."""

    token_id: int
    logprob: float | None = None
    rank: int | None = None
    top: list[tuple[int, float]] | None = None


@dataclass(slots=True)
class PromptLogprob:
    """The log-probability and rank of one prompt token given the tokens before it, with the
    top (token id, logprob) pairs."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]


@dataclass(slots=True)
class ModelRunnerOutput:
    """What the runner computed, keyed by sequence id: the sampled tokens of each sampling
    sequence (one per ``sample_ids`` entry, in that order) and the prompt logprobs of the
    positions its chunk predicted (position ``num_computed_tokens + i + 1`` for row i, prompt
    positions only)."""

    sampled: dict[str, list[SampledToken]] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[tuple[int, PromptLogprob]]] = field(default_factory=dict)
