"""Continuous-batching scheduler with preemption by swap or recompute.

Every step it builds one batch, in this order, within ``max_num_batched_tokens`` tokens and
``max_num_seqs`` sequences:

1. running sequences, highest priority first: a decode token each, or the next prompt chunk;
   when blocks run out it preempts the lowest-priority running sequence (ties: the latest
   arrival) until the one at hand fits, or preempts the one at hand if it is itself the lowest;
2. swapped sequences, swapped back in while blocks allow (only when nobody was preempted this
   step, so that swapping does not thrash);
3. waiting sequences (new requests, and recomputations, which keep their old arrival time and so
   come before newer requests), using prefix-cache hits and leaving the watermark free.

Allocation is all or nothing per sequence (the KV cache manager guarantees it), so a sequence that
does not fit leaves no trace. A prompt longer than the remaining token budget is chunked when
chunked prefill is enabled.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from pagellm.core.request import Sequence, SequenceStatus


class PreemptionMode(enum.Enum):
    SWAP = "swap"
    RECOMPUTE = "recompute"


@dataclass(slots=True)
class SchedulerConfig:
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    enable_chunked_prefill: bool = True
    preemption_mode: str | None = None  # "swap", "recompute", or None: swap while room
    policy: str = "fcfs"  # or "priority"


@dataclass(slots=True)
class ScheduledItem:
    seq: Sequence
    num_new_tokens: int


@dataclass(slots=True)
class SchedulerOutput:
    """One step's plan. Copies must be done before the model runs, swap-outs before swap-ins
    (a swapped-in sequence may reuse blocks another one just left)."""

    scheduled: list[ScheduledItem] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    num_batched_tokens: int = 0
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Owns the waiting, running and swapped queues.

    Invariants: a sequence is in exactly one queue while unfinished; a RUNNING sequence holds
    ``num_computed_tokens`` device slots; a SWAPPED one holds CPU blocks only; a WAITING one holds
    nothing (its ``num_computed_tokens`` is 0).
    """

    def __init__(self, config: SchedulerConfig, kv) -> None:
        self.config = config
        self.kv = kv
        self.use_priority = config.policy == "priority"
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.swapped: list[Sequence] = []
        self.num_preemptions = 0
        self.num_swap_outs = 0
        self.num_swap_ins = 0

    # ------------------------------------------------------------------ queues
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """A sequence forked from a running one: it already holds (shared) blocks."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Take an unfinished sequence out of its queue and release its blocks."""
        for queue in (self.running, self.waiting, self.swapped):
            if seq in queue:
                queue.remove(seq)
                break
        self.kv.free(seq.seq_id)

    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.swapped)

    def _key(self, seq: Sequence) -> tuple:
        return seq.sort_key(self.use_priority)

    def next_waiting(self) -> Sequence | None:
        """The waiting sequence that would be admitted first (None when none waits)."""
        return min(self.waiting, key=self._key, default=None)

    # ------------------------------------------------------------------ schedule
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = [self.config.max_num_batched_tokens]
        self.running.sort(key=self._key)
        self._schedule_running(out, budget)
        if not out.preempted:
            self._schedule_swapped(out, budget)
        if not out.preempted and not self.swapped:
            self._schedule_waiting(out, budget)
        out.num_batched_tokens = self.config.max_num_batched_tokens - budget[0]
        return out

    def _num_new_tokens(self, seq: Sequence, budget: int) -> int:
        remaining = seq.num_tokens - seq.num_computed_tokens
        if remaining <= budget:
            return remaining
        return budget if self.config.enable_chunked_prefill else 0

    def _schedule_running(self, out: SchedulerOutput, budget: list[int]) -> None:
        queue = list(self.running)
        while queue:
            seq = queue.pop(0)
            num_new = self._num_new_tokens(seq, budget[0])
            if num_new == 0:
                continue
            while True:
                copies = self.kv.allocate_slots(seq.seq_id, seq.token_ids, num_new)
                if copies is not None:
                    break
                # Lowest priority among those not yet scheduled this step (queue is sorted).
                victim = queue.pop() if queue else seq
                self._preempt(victim, out)
                if victim is seq:
                    break
            if copies is None:
                continue
            out.blocks_to_copy.extend(copies)
            seq.num_computed_tokens += num_new
            budget[0] -= num_new
            out.scheduled.append(ScheduledItem(seq, num_new))

    def _schedule_swapped(self, out: SchedulerOutput, budget: list[int]) -> None:
        self.swapped.sort(key=self._key)
        while self.swapped and len(self.running) < self.config.max_num_seqs:
            seq = self.swapped[0]
            num_new = self._num_new_tokens(seq, budget[0])
            if num_new == 0:
                break
            # Swap in only when its blocks and those for its next tokens fit; otherwise the
            # step would have to undo a swap-in whose copies it never made.
            if not self.kv.can_swap_in([seq.seq_id], num_new):
                break
            mapping = self.kv.swap_in([seq.seq_id])
            copies = self.kv.allocate_slots(seq.seq_id, seq.token_ids, num_new)
            assert mapping is not None and copies is not None
            self.swapped.pop(0)
            self.num_swap_ins += 1
            out.blocks_to_swap_in.extend(mapping)
            out.blocks_to_copy.extend(copies)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            seq.num_computed_tokens += num_new
            budget[0] -= num_new
            out.scheduled.append(ScheduledItem(seq, num_new))

    def _schedule_waiting(self, out: SchedulerOutput, budget: list[int]) -> None:
        self.waiting.sort(key=self._key)
        while self.waiting and len(self.running) < self.config.max_num_seqs and budget[0] > 0:
            seq = self.waiting[0]
            request = seq.request
            prefix = None
            if not request.wants_prompt_logprobs:
                prefix = self.kv.lookup_prefix(seq.token_ids, request.extra_keys)
            num_cached = prefix.num_tokens if prefix is not None else 0
            remaining = seq.num_tokens - num_cached
            num_new = remaining if remaining <= budget[0] else (
                budget[0] if self.config.enable_chunked_prefill else 0)
            if num_new == 0:
                break
            # Keep the watermark free for running sequences, unless nothing else could use it.
            use_watermark = bool(self.running)
            copies = self.kv.allocate_slots(seq.seq_id, seq.token_ids, num_new, prefix=prefix,
                                            extra_keys=request.extra_keys,
                                            watermark=use_watermark)
            if copies is None:
                break
            self.waiting.pop(0)
            out.blocks_to_copy.extend(copies)
            seq.status = SequenceStatus.RUNNING
            seq.num_computed_tokens = num_cached + num_new
            self.running.append(seq)
            budget[0] -= num_new
            out.scheduled.append(ScheduledItem(seq, num_new))

    # ------------------------------------------------------------------ preemption
    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.num_preemptions += 1
        out.preempted.append(seq)
        mode = self.config.preemption_mode
        if mode != PreemptionMode.RECOMPUTE.value:
            mapping = self.kv.swap_out([seq.seq_id])
            if mapping is not None:
                self.num_swap_outs += 1
                out.blocks_to_swap_out.extend(mapping)
                seq.status = SequenceStatus.SWAPPED
                self.swapped.append(seq)
                return
        # Recompute: drop the blocks; the sequence recomputes its tokens (prompt + outputs so
        # far) when readmitted. It keeps its arrival time, so it goes before newer requests.
        self.kv.free(seq.seq_id)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)
