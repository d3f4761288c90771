"""Requests and their sequences: the state the scheduler and the engine share.

A `Request` is what a user submitted (one prompt, one SamplingParams). It owns one `Sequence`
until its prompt has been computed; with ``n > 1`` the engine then forks the prompt sequence into
``n`` sequences that share the prompt's KV blocks. The sequence, not the request, is the unit of
scheduling: each has ``num_computed_tokens`` catching up with ``len(token_ids)``, so a whole
prompt, a prompt chunk, a prefix-cache hit, a recomputation after preemption and a decode step are
all "compute the next k tokens".
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagellm.outputs import Logprob, RequestMetrics

if TYPE_CHECKING:
    from pagellm.core.detokenizer import IncrementalDetokenizer
    from pagellm.core.stop_strings import StopStringMatcher
    from pagellm.lora.request import LoRARequest
    from pagellm.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # holds no device blocks; (re)computes from num_computed_tokens = 0
    RUNNING = "running"  # holds device blocks for its first num_computed_tokens tokens
    SWAPPED = "swapped"  # its blocks live in the CPU swap space
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED


_FINISHED = {SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH,
             SequenceStatus.FINISHED_ABORTED}


class Sequence:
    """One token stream. Invariant: ``num_computed_tokens <= len(token_ids)``; the KV cache
    manager holds exactly ``num_computed_tokens`` slots for it while it is RUNNING."""

    __slots__ = ("seq_id", "index", "request", "token_ids", "num_prompt_tokens",
                 "num_computed_tokens", "status", "stop_reason", "cumulative_logprob",
                 "logprobs", "detokenizer", "text", "last_token_time", "num_sent_tokens",
                 "num_sent_text", "fcfs_key", "priority_key", "stop_state")

    def __init__(self, seq_id: str, index: int, request: Request, token_ids: list[int]) -> None:
        self.seq_id = seq_id
        self.index = index  # position among the request's n samples
        self.request = request
        self.token_ids = token_ids
        self.num_prompt_tokens = request.num_prompt_tokens
        self.num_computed_tokens = 0
        self.status = SequenceStatus.WAITING
        self.stop_reason: int | str | None = None
        self.cumulative_logprob = 0.0
        self.logprobs: list[dict[int, Logprob]] | None = (
            [] if request.params.logprobs is not None else None)
        self.detokenizer: IncrementalDetokenizer | None = None
        self.text = ""
        self.last_token_time = 0.0
        self.num_sent_tokens = 0  # output tokens and text already in a DELTA output
        self.num_sent_text = 0
        # scheduling order, smaller first (lower priority value = served earlier, as vLLM);
        # fixed for the sequence's life, so computed once
        self.fcfs_key = (0, request.arrival_time, request.seq_no, index)
        self.priority_key = (request.priority, *self.fcfs_key[1:])
        self.stop_state = 0  # its state in the request's StopStringMatcher

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_prefill(self) -> bool:
        """True while more than the last token remains to compute (prompt or recomputation)."""
        return self.num_tokens - self.num_computed_tokens > 1

@dataclass(eq=False)
class Request:
    """A user request. ``seqs`` holds its live and finished sequences, by sample index."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # resolved: params.max_tokens, or what max_model_len leaves
    priority: int = 0
    arrival_time: float = field(default_factory=time.time)
    seq_no: int = 0  # arrival order in the engine: breaks arrival-time ties
    extra_keys: tuple = ()  # prefix-cache isolation (e.g. a per-tenant cache_salt)
    seqs: list[Sequence] = field(default_factory=list)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # (position, PromptLogprob) from the runner, not yet turned into prompt_logprobs
    pending_prompt_logprobs: list = field(default_factory=list)
    metrics: RequestMetrics | None = None
    error: str | None = None
    error_internal: bool = False  # the engine failed (a fault of its own), not the request
    forked: bool = False
    num_cached_tokens: int | None = None  # prompt tokens served from the prefix cache
    prompt_logprobs_sent: bool = False  # a DELTA output carries them once
    stop_matcher: StopStringMatcher | None = None  # StopStringMatcher of params.stop, built on first use
    lora_request: LoRARequest | None = None  # the adapter it runs with (None: the base model)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        seqs = self.seqs
        if len(seqs) == 1:  # the common case, asked several times per token
            return seqs[0].status in _FINISHED
        return bool(seqs) and all(s.status in _FINISHED for s in seqs)

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs is not None
