"""Continuous-batching scheduler with preemption by swap or recompute: the one owner of request
and sequence state and of the KV cache manager.

``schedule()`` builds one step's plan within ``max_num_batched_tokens`` tokens and
``max_num_seqs`` sequences (a request with ``n > 1`` that has not forked yet counts ``n``):

0. with the priority policy, a waiting request that outranks running ones and does not fit
   preempts the lowest-priority running sequences until it does;
1. running sequences: decodes first (one token each), then prompt chunks, each group highest
   priority first, so a long (re)prefill never stalls the decodes of a step; when blocks run
   out the lowest-priority sequence not yet scheduled is preempted (or the one at hand, when
   it is itself the lowest);
2. swapped sequences, swapped back in while blocks allow (only when nobody was preempted this
   step, so that swapping does not thrash);
3. waiting sequences (new requests, and recomputations, which keep their arrival time), with
   prefix-cache hits and the watermark left free; while sequences are swapped out, only
   waiting ones that come before them in scheduling order are admitted.

``update_from_output(plan, runner_output)`` applies what the runner computed: confirms the
blocks the step filled in the prefix cache (a step that never reports back has them
withdrawn when its sequences end), forks ``n > 1`` requests, appends tokens, applies the
token-level stop conditions (EOS, stop token ids, length) and frees finished sequences. Stop
strings need the text, so the output processor checks them and calls ``finish``.

With LoRA, a step holds sequences of at most ``max_loras`` distinct adapters (the device's
adapter slots): a sequence whose adapter would be one too many is left for a later step
(a running one keeps its blocks; a waiting one keeps its place, and the ones behind it may
be admitted).

Allocation is all or nothing per sequence (the KV cache manager guarantees it), so a sequence
that does not fit leaves no trace.
"""
from __future__ import annotations

import enum
import operator
from dataclasses import dataclass, field

from pagellm.core.plan import ModelRunnerOutput, SampledToken, ScheduledSequence, SchedulerOutput
from pagellm.core.request import Request, Sequence, SequenceStatus
from pagellm.kv.interface import KVCacheManagerProtocol


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
    max_loras: int | None = None  # distinct adapters in one step (None: no limit)


@dataclass(slots=True)
class StepUpdate:
    """What one step changed, for the output processor: the tokens each sequence received
    (in order), the prompt logprobs recorded, and the requests that progressed."""

    new_tokens: list[tuple[Sequence, SampledToken]] = field(default_factory=list)
    requests: dict[str, Request] = field(default_factory=dict)


class Scheduler:
    """Owns the waiting, running and swapped queues and the KV cache manager.

    Invariants: a sequence is in exactly one queue while unfinished; a RUNNING sequence holds
    ``num_computed_tokens`` device slots; a SWAPPED one holds CPU blocks only; a WAITING one
    holds nothing (its ``num_computed_tokens`` is 0); the running sequences' seat count
    (``seats``) never exceeds ``max_num_seqs``.
    """

    def __init__(self, config: SchedulerConfig, kv: KVCacheManagerProtocol,
                 eos_token_ids: frozenset[int] = frozenset()) -> None:
        self.config = config
        self.kv = kv
        self.eos_token_ids = eos_token_ids
        self.use_priority = config.policy == "priority"
        self._key = operator.attrgetter("priority_key" if self.use_priority else "fcfs_key")
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.swapped: list[Sequence] = []
        self.seqs: dict[str, Sequence] = {}  # every unfinished sequence, by id
        self.num_preemptions = 0
        self.num_swap_outs = 0
        self.num_swap_ins = 0
        self._pending_copies: list[tuple[int, int]] = []  # forks' copies, for the next plan
        self._finished_seq_ids: list[str] = []
        self._step_loras: set[int] = set()  # adapter ids in the plan being built

    # ------------------------------------------------------------------ requests
    def add_request(self, request: Request) -> Sequence:
        """Queue a new request's prompt sequence."""
        seq = Sequence(f"{request.request_id}#0", 0, request, list(request.prompt_token_ids))
        request.seqs.append(seq)
        self._add_waiting(seq)
        return seq

    def _add_waiting(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.seqs[seq.seq_id] = seq
        self.waiting.append(seq)

    def finish(self, seq: Sequence, status: SequenceStatus,
               stop_reason: int | str | None = None) -> None:
        """End a sequence (a stop string, an abort): out of its queue, blocks released."""
        if seq.seq_id in self.seqs:
            for queue in (self.running, self.waiting, self.swapped):
                if seq in queue:
                    queue.remove(seq)
                    break
            del self.seqs[seq.seq_id]
            self.kv.discard_uncomputed(seq.seq_id)  # a step that failed wrote nothing
            self.kv.free(seq.seq_id)
            self._finished_seq_ids.append(seq.seq_id)
        seq.status = status
        if stop_reason is not None:
            seq.stop_reason = stop_reason

    def abort_request(self, request: Request) -> None:
        for seq in request.seqs:
            if not seq.status.is_finished:
                self.finish(seq, SequenceStatus.FINISHED_ABORTED)

    def num_unfinished(self) -> int:
        return len(self.seqs)


    def next_waiting(self) -> Sequence | None:
        """The waiting sequence that would be admitted first (None when none waits)."""
        return min(self.waiting, key=self._key, default=None)

    @staticmethod
    def seats(seq: Sequence) -> int:
        """Sequences ``seq`` will be: ``n`` for a prompt that forks into n samples."""
        request = seq.request
        return request.params.n if seq.index == 0 and not request.forked else 1

    def _num_seats(self) -> int:
        return sum(map(self.seats, self.running))

    # ------------------------------------------------------------------ schedule
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(blocks_to_copy_first=self._pending_copies,
                              finished_seq_ids=self._finished_seq_ids)
        self._pending_copies, self._finished_seq_ids = [], []
        self._step_loras = set()
        budget = [self.config.max_num_batched_tokens]
        if self.use_priority:
            self._preempt_for_waiting(out)
        made_room = len(out.preempted)
        self._schedule_running(out, budget)
        # after preempting for lack of blocks, resuming or admitting others would thrash
        if len(out.preempted) == made_room:
            self._schedule_swapped(out, budget)
        if len(out.preempted) == made_room:
            self._schedule_waiting(out, budget)
        out.num_batched_tokens = self.config.max_num_batched_tokens - budget[0]
        return out

    def _num_new_tokens(self, seq: Sequence, num_computed: int, budget: int) -> int:
        remaining = seq.num_tokens - num_computed
        if remaining <= budget:
            return remaining
        return budget if self.config.enable_chunked_prefill else 0

    def _schedule_running(self, out: SchedulerOutput, budget: list[int]) -> None:
        decodes, prefills = [], []
        for seq in self.running:
            (prefills if seq.num_tokens - seq.num_computed_tokens > 1 else decodes).append(seq)
        queue = sorted(decodes, key=self._key) + sorted(prefills, key=self._key)
        preempted: set[str] = set()
        for i, seq in enumerate(queue):
            if seq.seq_id in preempted or not self._lora_fits(seq):
                continue
            num_new = self._num_new_tokens(seq, seq.num_computed_tokens, budget[0])
            if num_new == 0:
                continue
            while (copies := self.kv.allocate_slots(seq.seq_id, seq.token_ids,
                                                    num_new)) is None:
                # The lowest priority among those not yet scheduled this step.
                rest = [s for s in queue[i + 1:] if s.seq_id not in preempted]
                victim = max(rest, key=self._key, default=seq)
                if self._key(victim) < self._key(seq):
                    victim = seq
                preempted.add(victim.seq_id)
                self._preempt(victim, out)
                if victim is seq:
                    break
            if copies is not None:
                self._add_to_plan(out, seq, num_new, copies, budget)

    def _schedule_swapped(self, out: SchedulerOutput, budget: list[int]) -> None:
        self.swapped.sort(key=self._key)
        first_waiting = self.next_waiting()
        while self.swapped:
            seq = self.swapped[0]
            if first_waiting is not None and self._key(first_waiting) < self._key(seq):
                break  # a waiting sequence comes first (e.g. the one a preemption made room for)
            num_new = self._num_new_tokens(seq, seq.num_computed_tokens, budget[0])
            if (num_new == 0 or self._num_seats() + self.seats(seq) > self.config.max_num_seqs
                    or not self._lora_fits(seq)):
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
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self._add_to_plan(out, seq, num_new, copies, budget)

    def _schedule_waiting(self, out: SchedulerOutput, budget: list[int]) -> None:
        self.waiting.sort(key=self._key)
        first_swapped = min(map(self._key, self.swapped), default=None)
        index = 0  # waiting[:index]: passed over this step, for their adapter
        while index < len(self.waiting) and budget[0] > 0:
            seq = self.waiting[index]
            if first_swapped is not None and self._key(seq) > first_swapped:
                break  # swapped-out sequences come first
            if self._num_seats() + self.seats(seq) > self.config.max_num_seqs:
                break
            if not self._lora_fits(seq):
                index += 1
                continue
            request = seq.request
            prefix = None
            if not request.wants_prompt_logprobs:
                prefix = self.kv.lookup_prefix(seq.token_ids, request.extra_keys)
            num_cached = prefix.num_tokens if prefix is not None else 0
            num_new = self._num_new_tokens(seq, num_cached, budget[0])
            if num_new == 0:
                break
            # Keep the watermark free for running sequences, unless nothing else could use it.
            copies = self.kv.allocate_slots(seq.seq_id, seq.token_ids, num_new, prefix=prefix,
                                            extra_keys=request.extra_keys,
                                            watermark=bool(self.running))
            if copies is None:
                break
            self.waiting.pop(index)
            seq.status = SequenceStatus.RUNNING
            seq.num_computed_tokens = num_cached
            if seq.index == 0 and request.num_cached_tokens is None:
                request.num_cached_tokens = num_cached
            self.running.append(seq)
            self._add_to_plan(out, seq, num_new, copies, budget)

    def _add_to_plan(self, out: SchedulerOutput, seq: Sequence, num_new: int,
                     copies: list[tuple[int, int]], budget: list[int]) -> None:
        out.blocks_to_copy.extend(copies)
        budget[0] -= num_new
        lora = seq.request.lora_request
        if lora is not None:
            self._step_loras.add(lora.lora_int_id)
        out.scheduled.append(self._scheduled(seq, num_new))

    def _lora_fits(self, seq: Sequence) -> bool:
        """Whether the step can take ``seq`` without one adapter too many."""
        lora = seq.request.lora_request
        limit = self.config.max_loras
        if lora is None or limit is None or lora.lora_int_id in self._step_loras:
            return True
        return len(self._step_loras) < limit

    def _scheduled(self, seq: Sequence, num_new: int) -> ScheduledSequence:
        request = seq.request
        params = request.params
        start = seq.num_computed_tokens
        samples = start + num_new == len(seq.token_ids)
        sample_ids = ()
        if samples:
            sample_ids = (seq.seq_id,)
            if self.seats(seq) > 1:  # the prompt forks into n samples after the step
                sample_ids += tuple(f"{request.request_id}#{i}" for i in range(1, params.n))
        k = params.prompt_logprobs
        return ScheduledSequence(
            seq.seq_id, seq.token_ids, start, num_new, self.kv.get_block_table(seq.seq_id),
            samples, k is not None and seq.index == 0 and start < request.num_prompt_tokens - 1,
            k or 0, request.num_prompt_tokens, params, sample_ids, request.lora_request)

    # ------------------------------------------------------------------ preemption
    def _preempt_for_waiting(self, out: SchedulerOutput) -> None:
        """Priority policy: preempt running sequences of lower priority (largest value,
        latest arrival first) while the best waiting sequence cannot be admitted."""
        head = self.next_waiting()
        while head is not None and self.running:
            victim = max(self.running, key=self._key)
            if victim.request.priority <= head.request.priority or self._admissible(head):
                return
            self._preempt(victim, out)

    def _admissible(self, seq: Sequence) -> bool:
        """Whether ``seq`` would be admitted this step beside the running sequences' own
        next tokens (their new blocks are reserved first)."""
        chunk = min(seq.num_tokens, self.config.max_num_batched_tokens)
        reserved = sum(self.kv.blocks_needed(s.seq_id, s.num_tokens - s.num_computed_tokens)
                       for s in self.running)
        return (self._num_seats() + self.seats(seq) <= self.config.max_num_seqs
                and self.kv.can_admit(chunk, bool(self.running), reserved))

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.num_preemptions += 1
        out.preempted.append(seq.seq_id)
        if self.config.preemption_mode != PreemptionMode.RECOMPUTE.value:
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

    # ------------------------------------------------------------------ update
    def update_from_output(self, plan: SchedulerOutput,
                           output: ModelRunnerOutput) -> StepUpdate:
        update = StepUpdate()
        new_tokens, requests = update.new_tokens, update.requests
        sampled, prompt_logprobs = output.sampled, output.prompt_logprobs
        for item in plan.scheduled:
            seq = self.seqs.get(item.seq_id)
            if seq is None:  # finished (aborted) while the step ran
                continue
            seq.num_computed_tokens = item.num_computed_tokens + item.num_new_tokens
            self.kv.mark_computed(item.seq_id)  # its new blocks' hashes are final now
            request = seq.request
            if prompt_logprobs and item.seq_id in prompt_logprobs:
                request.pending_prompt_logprobs.extend(prompt_logprobs[item.seq_id])
            samples = sampled.get(item.seq_id)
            if not samples:
                continue
            requests[request.request_id] = request
            targets = [seq]
            if len(samples) > 1:  # the first samples of an n > 1 request: fork the prompt
                request.forked = True
                targets += [self._fork(seq, i) for i in range(1, len(samples))]
            for target, sample in zip(targets, samples):
                target.token_ids.append(sample.token_id)
                new_tokens.append((target, sample))
                self._check_stop(target, sample.token_id)
        return update

    def _fork(self, parent: Sequence, index: int) -> Sequence:
        """Sample ``index`` of a request whose prompt just completed: a sequence sharing the
        prompt's blocks (copy-on-write), running and counted in max_num_seqs from now on."""
        request = parent.request
        child = Sequence(f"{request.request_id}#{index}", index, request,
                         parent.token_ids[:parent.num_computed_tokens])
        child.num_computed_tokens = parent.num_computed_tokens
        request.seqs.append(child)
        self.seqs[child.seq_id] = child
        copies = self.kv.fork(parent.seq_id, child.seq_id)
        if copies is None:
            # The contiguous baseline found no free reservation for the child: it waits and
            # recomputes its tokens when admitted, like a sequence preempted by recompute.
            child.num_computed_tokens = 0
            self._add_waiting(child)
            return child
        self._pending_copies.extend(copies)  # the contiguous baseline copies, never shares
        child.status = SequenceStatus.RUNNING
        self.running.append(child)
        return child

    def _check_stop(self, seq: Sequence, token: int) -> None:
        """EOS and stop token ids once min_tokens are out, then length (vLLM's order; stop
        strings come after, in the output processor)."""
        request = seq.request
        params = request.params
        num_tokens = len(seq.token_ids)
        num_output = num_tokens - seq.num_prompt_tokens
        if num_output >= params.min_tokens:
            if not params.ignore_eos and token in self.eos_token_ids:
                self.finish(seq, SequenceStatus.FINISHED_STOPPED)
                return
            if params.stop_token_ids and token in params.stop_token_ids:
                self.finish(seq, SequenceStatus.FINISHED_STOPPED, token)
                return
        if num_output >= request.max_tokens or num_tokens >= self.config.max_model_len:
            self.finish(seq, SequenceStatus.FINISHED_LENGTH)
