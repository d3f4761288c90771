"""The engine's KV view (what /stats/blocks serves) agrees with its statistics at every step, for
the paged and the contiguous manager, through prefix hits, n > 1 sharing, preemption and swap."""
from __future__ import annotations

import json
from collections import Counter

import pytest

from pagellm import LLM, SamplingParams
from pagellm.core.kv_view import MetricsHistory, history_point

USED, CACHED_FREE = 1, 2


def check_view(view: dict) -> None:
    stats, blocks, cpu = view["stats"], view["blocks"], view["cpu_blocks"]
    states = Counter(blocks["state"])
    assert len(blocks["state"]) == view["num_blocks"] == stats["num_blocks"]
    assert states[USED] == stats["num_blocks"] - stats["num_free_blocks"]
    assert sum(blocks["cached"]) == stats["num_cached_blocks"]
    assert sum(f for f, s in zip(blocks["fill"], blocks["state"]) if s == USED) \
        == stats["slots_filled"]
    assert Counter(cpu["state"])[USED] == stats["num_cpu_blocks"] - stats["num_free_cpu_blocks"]
    seqs = view["sequences"]
    for pool, where in ((blocks, ("running",)), (cpu, ("swapped",))):
        for refs, owners in zip(pool["ref_cnt"], pool["owners"]):
            if view["kind"] == "paged":
                assert refs == len(owners)  # a shared block names each of its holders
            assert all(seqs[o]["status"] in where for o in owners)
    running = {s["seq_id"] for s in seqs if s["status"] == "running"}
    assert len(running) == stats["num_running"]
    assert sum(s["status"] == "swapped" for s in seqs) == stats["num_swapped"]


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams, num_late: int) -> Counter:
    """Step the engine through the prompts, checking the view after every step: the last
    ``num_late`` arrive two steps late and outrank the others (they preempt them). Returns how
    often the views showed shared, cached-free and swapped blocks."""
    engine = llm.llm_engine
    early, late = prompts[:-num_late], prompts[-num_late:]
    for i, prompt in enumerate(early):
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, params, priority=1)
    seen: Counter = Counter()
    step = 0
    while engine.has_unfinished_requests():
        if step == 2:
            for i, prompt in enumerate(late):
                engine.add_request(f"late{i}", {"prompt_token_ids": prompt}, params, priority=0)
        engine.step()
        step += 1
        view = engine.get_kv_view()
        check_view(view)
        json.dumps(view)
        blocks = view["blocks"]
        seen["shared"] += any(r > 1 for r in blocks["ref_cnt"])
        seen["cached_free"] += CACHED_FREE in blocks["state"]
        seen["swapped"] += any(s == USED for s in view["cpu_blocks"]["state"])
    return seen


@pytest.mark.parametrize("allocator", ["paged", "contiguous"])
def test_view_matches_stats_under_pressure(llama_dir, allocator):
    # 40 blocks of 4 tokens: the early requests fill the cache, the late ones outrank them and
    # swap some of them out (the contiguous manager never preempts for growth, only for rank).
    llm = LLM(str(llama_dir), num_gpu_blocks_override=40, block_size=4, max_model_len=48,
              kv_allocator=allocator, enable_prefix_caching=allocator == "paged",
              preemption_mode="swap", swap_space=0.01, max_num_seqs=8,
              scheduling_policy="priority")
    shared_head = list(range(3, 19))
    prompts = [shared_head + [20 + i, 21, 22, 23] for i in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    seen = run(llm, prompts, params, num_late=3)
    stats = llm.llm_engine.get_stats()
    assert stats.num_swap_outs > 0
    if allocator == "paged":
        assert seen["swapped"] > 0  # (the contiguous case's swapped blocks: tests/kv)
        assert seen["shared"] > 0  # the prompts' common head, from the prefix cache
        assert seen["cached_free"] > 0  # finished sequences leave cached blocks behind
    final = llm.llm_engine.get_kv_view()
    assert Counter(final["blocks"]["state"])[USED] == 0 and final["sequences"] == []


def test_forked_samples_share_the_prompt_blocks(llama_dir):
    llm = LLM(str(llama_dir), num_gpu_blocks_override=64, block_size=4, max_model_len=64)
    engine = llm.llm_engine
    engine.add_request("fork", {"prompt_token_ids": list(range(3, 13))},
                       SamplingParams(temperature=1.0, seed=1, max_tokens=6, n=3))
    engine.step()
    engine.step()
    view = engine.get_kv_view()
    check_view(view)
    shared = [(r, o) for r, o in zip(view["blocks"]["ref_cnt"], view["blocks"]["owners"]) if r > 1]
    assert shared and all(r == 3 and len(o) == 3 for r, o in shared)
    assert {view["sequences"][o]["request_id"] for _, owners in shared for o in owners} == {"fork"}
    while engine.has_unfinished_requests():
        engine.step()


def test_history_keeps_the_latest_points_at_most_one_per_interval(llama_dir):
    llm = LLM(str(llama_dir), num_gpu_blocks_override=16, block_size=4, max_model_len=32)
    stats = llm.llm_engine.get_stats()
    history = MetricsHistory(max_points=3, interval_s=1.0)
    for t in (0.0, 0.5, 1.0, 2.0, 3.5, 4.0):
        history.add(stats, now=t)
    assert [p["t"] for p in history.points()] == [1.0, 2.0, 3.5]
    assert set(history_point(stats, 0.0)) >= {"kv_usage", "kv_waste_ratio", "num_running",
                                              "num_waiting", "num_swapped", "num_preemptions",
                                              "prefix_hit_rate"}
    with pytest.raises(ValueError, match="max_points"):
        MetricsHistory(max_points=0)
