"""The scheduler alone, with fake runner outputs (no model), as vLLM's tests/v1/core: budgets,
max_num_seqs with forks, priority preemption, swap-then-waiting order, chunked prefill beside
decodes, prefix hits, and the defects each of these tests was written for."""
from __future__ import annotations

import random

from kv_shadow import ShadowKV
from scheduler_helpers import (EOS, fake_output, make_request, make_scheduler,
                               run_to_completion, step)

from pagellm.core.request import SequenceStatus


def test_token_budget_and_chunked_prefill():
    sched = make_scheduler(budget=16)
    sched.add_request(make_request("a", prompt_len=40))
    plans = run_to_completion(sched)
    assert [p.num_batched_tokens for p in plans[:3]] == [16, 16, 8]  # 40 tokens in chunks
    assert all(p.num_batched_tokens <= 16 for p in plans)
    assert not plans[0].scheduled[0].need_logits and plans[2].scheduled[0].need_logits
    assert sched.kv.get_stats().num_free_blocks == 64


def test_max_num_seqs_counts_forks():
    """Defect: n > 1 forks ran beside max_num_seqs. Two requests with n=2 and room for 2
    sequences: the second waits until the first has finished."""
    sched = make_scheduler(max_num_seqs=2)
    sched.add_request(make_request("a", n=2, max_tokens=3))
    sched.add_request(make_request("b", n=2, max_tokens=3))
    started_b = None
    for i in range(20):
        plan, _ = step(sched)
        assert len(sched.running) <= 2 and len(plan.scheduled) <= 2
        assert sum(sched.seats(s) for s in sched.running) <= 2
        if started_b is None and any(x.seq_id == "b#0" for x in plan.scheduled):
            started_b = i
            assert sched.seqs.get("a#0") is None and sched.seqs.get("a#1") is None
    assert started_b is not None and not sched.num_unfinished()


def test_fork_shares_the_prompt_and_samples_n_tokens_from_one_row():
    sched = make_scheduler()
    request = make_request("a", n=3, prompt_len=6, max_tokens=2)
    sched.add_request(request)
    plan = sched.schedule()
    assert plan.scheduled[0].sample_ids == ("a#0", "a#1", "a#2")
    sched.update_from_output(plan, fake_output(plan))
    assert [s.seq_id for s in request.seqs] == ["a#0", "a#1", "a#2"]
    assert all(s.num_computed_tokens == 6 and s.output_token_ids == [7] for s in request.seqs)
    tables = [sched.kv.get_block_table(s.seq_id) for s in request.seqs]
    assert tables[0] == tables[1] == tables[2]  # shared until one writes a shared block
    plan, _ = step(sched)
    assert len(plan.scheduled) == 3 and len(plan.blocks_to_copy) == 2  # copy-on-write
    assert request.is_finished
    assert sched.kv.get_stats().num_free_blocks == 64


def test_priority_preempts_lower_priority_running():
    """Defect: a waiting high-priority request was never admitted while lower-priority
    running requests held the blocks. vLLM preempts the lowest-priority running one."""
    sched = make_scheduler(num_blocks=8, block_size=4, policy="priority",
                           preemption_mode="recompute")
    sched.add_request(make_request("low1", prompt_len=8, max_tokens=8, priority=5))
    sched.add_request(make_request("low2", prompt_len=8, max_tokens=8, priority=5,
                                   arrival_time=1.0))
    step(sched)
    assert {s.seq_id for s in sched.running} == {"low1#0", "low2#0"}
    sched.add_request(make_request("high", prompt_len=12, max_tokens=2, priority=0,
                                   arrival_time=2.0))
    plan, _ = step(sched)
    assert "low2#0" in plan.preempted  # the lowest priority, latest arrival goes first
    assert "high#0" in {item.seq_id for item in plan.scheduled}
    assert sched.seqs["low2#0"].status is SequenceStatus.WAITING
    run_to_completion(sched)
    assert sched.kv.get_stats().num_free_blocks == 8


def test_equal_priority_does_not_preempt():
    sched = make_scheduler(num_blocks=4, block_size=4, policy="priority")
    sched.add_request(make_request("a", prompt_len=8, max_tokens=4, priority=1))
    step(sched)
    sched.add_request(make_request("b", prompt_len=8, max_tokens=4, priority=1,
                                   arrival_time=1.0))
    plan, _ = step(sched)
    assert not plan.preempted and [i.seq_id for i in plan.scheduled] == ["a#0"]


def test_waiting_is_not_blocked_by_swapped_when_it_comes_first():
    """Defect: anything swapped out blocked every waiting request. Now a waiting request
    that comes before the swapped ones in scheduling order (here: higher priority) runs."""
    sched = make_scheduler(num_blocks=8, block_size=4, num_cpu_blocks=16, policy="priority",
                           preemption_mode="swap")
    sched.add_request(make_request("a", prompt_len=8, max_tokens=16, priority=3))
    sched.add_request(make_request("b", prompt_len=8, max_tokens=16, priority=4,
                                   arrival_time=1.0))
    for _ in range(10):
        step(sched)
    assert sched.swapped, "b was swapped out for a's growth"
    sched.add_request(make_request("urgent", prompt_len=4, max_tokens=1, priority=0,
                                   arrival_time=5.0))
    sched.add_request(make_request("later", prompt_len=4, max_tokens=1, priority=9,
                                   arrival_time=5.0))
    admitted = set()
    for _ in range(3):
        plan, _ = step(sched)
        admitted |= {i.seq_id for i in plan.scheduled}
    assert "urgent#0" in admitted and "later#0" not in admitted  # swapped b comes first
    run_to_completion(sched)


def test_fcfs_swapped_sequences_resume_before_newer_waiting():
    sched = make_scheduler(num_blocks=8, block_size=4, num_cpu_blocks=16,
                           preemption_mode="swap")
    sched.add_request(make_request("a", prompt_len=8, max_tokens=16))
    sched.add_request(make_request("b", prompt_len=8, max_tokens=16, arrival_time=1.0))
    for _ in range(10):
        step(sched)
    assert [s.seq_id for s in sched.swapped] == ["b#0"]
    sched.add_request(make_request("c", prompt_len=4, max_tokens=2, arrival_time=9.0))
    order = []
    for plan in run_to_completion(sched):
        order += [i.seq_id for i in plan.scheduled if i.seq_id not in order]
    assert order.index("b#0") < order.index("c#0")


def test_decodes_are_not_starved_by_a_long_prefill():
    """Defect: the oldest running sequence first, so a long (re)prefill chunk took the whole
    budget. Decodes go first; prompt chunks share what is left."""
    sched = make_scheduler(budget=8)
    sched.add_request(make_request("chat", prompt_len=4, max_tokens=10))
    step(sched)
    sched.add_request(make_request("long", prompt_len=64, max_tokens=1, arrival_time=-1.0))
    for _ in range(5):
        plan, _ = step(sched)
        ids = [i.seq_id for i in plan.scheduled]
        assert ids[0] == "chat#0" and plan.scheduled[0].num_new_tokens == 1
        assert plan.num_batched_tokens <= 8


def test_stop_on_eos_stop_token_and_length_and_min_tokens():
    sched = make_scheduler()
    eos = make_request("eos", max_tokens=10)
    stop = make_request("stop", max_tokens=10, stop_token_ids=[9], ignore_eos=True)
    early = make_request("min", max_tokens=10, min_tokens=2)
    for r in (eos, stop, early):
        sched.add_request(r)
    step(sched, token=EOS)
    assert eos.seqs[0].status is SequenceStatus.FINISHED_STOPPED
    assert early.seqs[0].status is SequenceStatus.RUNNING  # EOS before min_tokens: ignored
    step(sched, token=9)
    assert stop.seqs[0].status is SequenceStatus.FINISHED_STOPPED
    assert stop.seqs[0].stop_reason == 9
    step(sched, token=5)
    step(sched, token=5)
    step(sched, token=EOS)
    assert early.seqs[0].status is SequenceStatus.FINISHED_STOPPED
    length = make_request("len", max_tokens=2)
    sched.add_request(length)
    run_to_completion(sched)
    assert length.seqs[0].status is SequenceStatus.FINISHED_LENGTH
    assert sched.kv.get_stats().num_free_blocks == 64


def test_prefix_hits_are_reported_even_within_one_step():
    """Defect: num_cached_tokens was always 0. A request admitted in the same step as the
    one that computes a prefix shares its blocks (the step writes K/V before reading)."""
    sched = make_scheduler(caching=True)
    prompt = list(range(10, 30))
    first = make_request("first", prompt=prompt, max_tokens=1)
    second = make_request("second", prompt=prompt, max_tokens=1)
    sched.add_request(first)
    sched.add_request(second)
    plan, _ = step(sched)
    assert [(i.num_computed_tokens, i.num_new_tokens) for i in plan.scheduled] == [(0, 20),
                                                                                   (16, 4)]
    assert second.num_cached_tokens == 16 and first.num_cached_tokens == 0
    third = make_request("third", prompt=prompt, max_tokens=1)
    sched.add_request(third)
    step(sched)
    assert third.num_cached_tokens == 16


def test_a_step_that_never_reports_back_leaves_no_hash_behind():
    """Defect: an interrupted step left blocks hashed whose K/V was never written, and a later
    request reused that garbage through the prefix cache."""
    sched = make_scheduler(caching=True)
    prompt = list(range(10, 30))
    request = make_request("a", prompt=prompt, max_tokens=4)
    sched.add_request(request)
    sched.schedule()  # the step fails: no update_from_output
    assert sched.kv.lookup_prefix(prompt).num_tokens == 16  # provisional, for this step
    sched.abort_request(request)
    assert request.seqs[0].status is SequenceStatus.FINISHED_ABORTED
    assert sched.kv.lookup_prefix(prompt).num_tokens == 0
    assert sched.kv.get_stats().num_free_blocks == 64 and not sched.num_unfinished()
    sched.kv.check_invariants()


def test_contiguous_fork_without_room_recomputes_the_child():
    sched = make_scheduler(num_blocks=8, block_size=4, max_model_len=16, contiguous=True)
    request = make_request("a", n=3, prompt_len=4, max_tokens=3)
    sched.add_request(request)
    run_to_completion(sched)
    assert all(len(s.output_token_ids) == 3 for s in request.seqs)
    assert sched.kv.get_stats().num_free_blocks == 8


def test_a_swap_made_for_priority_is_not_undone_in_the_same_step():
    """The victim swapped out for a higher-priority request must not be swapped straight back
    in (found with the contiguous allocator, whose freed reservation the victim fit again)."""
    sched = make_scheduler(num_blocks=8, block_size=4, num_cpu_blocks=16, max_model_len=16,
                           policy="priority", preemption_mode="swap", contiguous=True)
    sched.add_request(make_request("low1", prompt_len=4, max_tokens=8, priority=5))
    sched.add_request(make_request("low2", prompt_len=4, max_tokens=8, priority=5,
                                   arrival_time=1.0))
    step(sched)
    sched.add_request(make_request("high", prompt_len=4, max_tokens=2, priority=0,
                                   arrival_time=2.0))
    plan, _ = step(sched)
    assert plan.preempted == ["low2#0"] and not plan.blocks_to_swap_in
    assert "high#0" in {i.seq_id for i in plan.scheduled}
    assert [s.seq_id for s in sched.swapped] == ["low2#0"]
    run_to_completion(sched)
    assert sched.kv.get_stats().num_free_blocks == 8


def test_a_contiguous_fork_swapped_out_in_the_next_step_keeps_its_copy():
    """Defect: the contiguous baseline's fork copies (the parent's blocks into the child's
    reservation) ran after the next step's swap-outs, so a child preempted by swap in that
    step took the reservation's old contents to the CPU (found by the state machine). They
    now run first (blocks_to_copy_first), and the swapped-in child reads its own prompt."""
    sched = make_scheduler(num_blocks=6, block_size=1, num_cpu_blocks=1, max_num_seqs=3,
                           budget=24, max_model_len=3, policy="priority", contiguous=True,
                           chunked=False)
    shadow = ShadowKV(6, 1, 1)
    rng = random.Random(0)
    names = iter(range(100))

    def add(token: int, n: int = 1, priority: int = 0) -> None:
        i = next(names)
        sched.add_request(make_request(f"r{i}", prompt=[token], n=n, max_tokens=n,
                                       priority=priority, arrival_time=float(i), min_tokens=0))

    def run_step() -> list[str]:
        plan = sched.schedule()
        shadow.copy_blocks(plan.blocks_to_copy_first)  # the worker's order
        shadow.swap_out(plan.blocks_to_swap_out)
        shadow.swap_in(plan.blocks_to_swap_in)
        shadow.copy_blocks(plan.blocks_to_copy)
        wrong = []
        for item in plan.scheduled:
            end = item.num_computed_tokens + item.num_new_tokens
            shadow.write(item.block_table, item.token_ids, item.num_computed_tokens, end)
        for item in plan.scheduled:
            end = item.num_computed_tokens + item.num_new_tokens
            if shadow.read(item.block_table, end) != list(item.token_ids[:end]):
                wrong.append(item.seq_id)
        sched.update_from_output(plan, fake_output(plan, rng=rng))
        return wrong

    add(30)
    assert run_step() == []
    for token in (30, 30, 30):
        add(token)
    assert run_step() == []
    add(30)
    assert run_step() == []
    add(31)  # takes the block the child's reservation will start at
    add(30, n=2, priority=1)  # forks after its prompt step
    assert run_step() == []
    add(30)  # admitted before the child: the child is swapped out as its fork copy runs
    assert run_step() == [] and sched.num_swap_outs == 1
    assert run_step() == []  # the child swapped back in reads its prompt
    assert not sched.swapped
