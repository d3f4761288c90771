"""A hypothesis state machine over the scheduler and a KV cache manager (paged, with and
without prefix caching, or contiguous): requests added (n > 1 among them), steps with fake
runner outputs (EOS at random), steps that fail before reporting back, aborts and stop-string
finishes, with the invariants checked after every operation: no leaked block, ref counts
equal to owners (the manager's own check), running seats <= max_num_seqs, tokens per step <=
max_num_batched_tokens, and every sequence's slots matching its computed tokens."""
from __future__ import annotations

import random

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from kv_shadow import ShadowKV
from scheduler_helpers import EOS, fake_output, make_request, make_scheduler

from pagellm.core.request import SequenceStatus

STEMS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16], [20, 21, 22, 23, 24, 25, 26, 27]]


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.sched = None
        self.requests = {}
        self.next_id = 0
        self.rng = random.Random(0)

    @initialize(contiguous=st.booleans(), caching=st.booleans(),
                block_size=st.sampled_from([1, 2, 4]), num_blocks=st.integers(6, 24),
                num_cpu_blocks=st.integers(0, 16), max_num_seqs=st.integers(1, 6),
                budget=st.integers(4, 24), policy=st.sampled_from(["fcfs", "priority"]),
                mode=st.sampled_from([None, "swap", "recompute"]), chunked=st.booleans())
    def setup(self, contiguous, caching, block_size, num_blocks, num_cpu_blocks, max_num_seqs,
              budget, policy, mode, chunked):
        self.max_model_len = 24 if not contiguous else min(24, num_blocks * block_size // 2)
        if not chunked:
            budget = max(budget, self.max_model_len)
        self.sched = make_scheduler(
            num_blocks=num_blocks, block_size=block_size, num_cpu_blocks=num_cpu_blocks,
            max_num_seqs=max_num_seqs, budget=budget, max_model_len=self.max_model_len,
            policy=policy, preemption_mode=mode, caching=caching and not contiguous,
            contiguous=contiguous, chunked=chunked)
        self.num_blocks = num_blocks
        self.shadow = ShadowKV(num_blocks, num_cpu_blocks, block_size)

    @precondition(lambda self: self.sched is not None)
    @rule(data=st.data())
    def add(self, data):
        stem = data.draw(st.sampled_from(STEMS))
        prompt = stem[:data.draw(st.integers(0, len(stem)))]
        prompt += data.draw(st.lists(st.integers(30, 60), min_size=1, max_size=6))
        prompt = prompt[:self.max_model_len - 1]
        room = self.max_model_len - len(prompt)
        request = make_request(
            f"r{self.next_id}", prompt=prompt, n=data.draw(st.integers(1, 3)),
            max_tokens=data.draw(st.integers(1, min(room, 8))),
            priority=data.draw(st.integers(0, 3)), arrival_time=float(self.next_id),
            min_tokens=0)
        self.next_id += 1
        if request.params.n > self.sched.config.max_num_seqs:
            return  # the engine refuses such a request at add_request
        self.requests[request.request_id] = request
        self.sched.add_request(request)

    @precondition(lambda self: self.sched is not None and self.sched.num_unfinished())
    @rule(eos_share=st.floats(0.0, 0.5))
    def step(self, eos_share):
        plan = self.sched.schedule()
        assert plan.num_batched_tokens <= self.sched.config.max_num_batched_tokens
        assert plan.num_batched_tokens == sum(i.num_new_tokens for i in plan.scheduled)
        self._apply_copies(plan)  # the engine applies an empty plan's copies too
        if plan.is_empty:
            self._fail_unschedulable()
            return
        self._play_model_side(plan)
        output = fake_output(plan, rng=self.rng)
        for samples in output.sampled.values():
            for sample in samples:
                if self.rng.random() < eos_share:
                    sample.token_id = EOS
        self.sched.update_from_output(plan, output)

    @precondition(lambda self: self.sched is not None and self.sched.num_unfinished())
    @rule()
    def failed_step(self):
        """The runner raised: the engine aborts the plan's requests."""
        plan = self.sched.schedule()
        self._apply_copies(plan)  # done before the model fails
        ids = {self.sched.seqs[i.seq_id].request.request_id for i in plan.scheduled}
        for request_id in ids:
            self.sched.abort_request(self.requests[request_id])
        if plan.is_empty:
            self._fail_unschedulable()

    @precondition(lambda self: self.sched is not None and self.sched.num_unfinished())
    @rule(data=st.data())
    def abort(self, data):
        live = sorted({s.request.request_id for s in self.sched.seqs.values()})
        self.sched.abort_request(self.requests[data.draw(st.sampled_from(live))])

    @precondition(lambda self: self.sched is not None and self.sched.running)
    @rule(data=st.data())
    def stop_string(self, data):
        seq = data.draw(st.sampled_from(self.sched.running))
        self.sched.finish(seq, SequenceStatus.FINISHED_STOPPED, "stop")

    def _play_model_side(self, plan):
        """Apply the plan's copies, write the step's K/V, then check that every token each
        sequence attends to (prefix hits included) holds what it should: a stale prefix hit,
        a lost copy-on-write or swap would read another token."""
        for item in plan.scheduled:
            end = item.num_computed_tokens + item.num_new_tokens
            self.shadow.write(item.block_table, item.token_ids, item.num_computed_tokens, end)
        for item in plan.scheduled:
            end = item.num_computed_tokens + item.num_new_tokens
            assert self.shadow.read(item.block_table, end) == list(item.token_ids[:end]), \
                f"{item.seq_id} attends to K/V that is not its tokens'"

    def _apply_copies(self, plan):
        """The plan's block copies, in the worker's order (SchedulerOutput)."""
        self.shadow.copy_blocks(plan.blocks_to_copy_first)
        self.shadow.swap_out(plan.blocks_to_swap_out)
        self.shadow.swap_in(plan.blocks_to_swap_in)
        self.shadow.copy_blocks(plan.blocks_to_copy)

    def _fail_unschedulable(self):
        """As the engine: nothing running or swapped and the head never fits: abort it."""
        head = self.sched.next_waiting()
        if not self.sched.running and not self.sched.swapped and head is not None:
            self.sched.abort_request(head.request)

    @invariant()
    def consistent(self):
        if self.sched is None:
            return
        sched, kv = self.sched, self.sched.kv
        kv.check_invariants()
        assert sum(map(sched.seats, sched.running)) <= sched.config.max_num_seqs
        queued = sched.running + sched.waiting + sched.swapped
        assert len({s.seq_id for s in queued}) == len(queued) == len(sched.seqs)
        assert {s.seq_id for s in queued} == set(sched.seqs)
        for seq in sched.running:
            assert seq.status is SequenceStatus.RUNNING
            assert kv.num_tokens(seq.seq_id) == seq.num_computed_tokens <= seq.num_tokens
        for seq in sched.swapped:
            assert seq.status is SequenceStatus.SWAPPED and kv.is_swapped(seq.seq_id)
        for seq in sched.waiting:
            assert seq.status is SequenceStatus.WAITING and seq.num_computed_tokens == 0
        stats = kv.get_stats()
        if not sched.seqs:
            assert stats.num_used_blocks == 0 and stats.num_free_blocks == self.num_blocks
            assert stats.num_free_cpu_blocks == stats.num_cpu_blocks
        for request in self.requests.values():
            if request.is_finished:
                assert all(s.seq_id not in sched.seqs for s in request.seqs)


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(max_examples=150, stateful_step_count=40,
                                         deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow])
