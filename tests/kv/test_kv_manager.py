"""KVCacheManager: every operation and its edge cases, with a model of the KV tensors."""
from __future__ import annotations

import pytest
from kv_shadow import ShadowKV

from pagellm.kv import KVCacheManager, PrefixMatch


def make(num_blocks=8, block_size=4, num_cpu_blocks=0, caching=False, watermark=0.0):
    return KVCacheManager(num_blocks, block_size, num_cpu_blocks,
                          enable_prefix_caching=caching, watermark=watermark)


def snapshot(mgr: KVCacheManager, seq_ids=()) -> tuple:
    tables = {s: (mgr.num_tokens(s), mgr.is_swapped(s),
                  None if mgr.is_swapped(s) else mgr.get_block_table(s)) for s in seq_ids}
    return mgr.get_stats().as_dict(), mgr.get_stats().seq_block_counts(), tables


def test_new_sequence_gets_ceil_blocks_and_slots():
    mgr = make()
    tokens = list(range(10))
    assert mgr.allocate_slots("a", tokens, 10) == []
    assert mgr.get_block_table("a") == [0, 1, 2]
    assert mgr.num_tokens("a") == 10
    stats = mgr.get_stats()
    assert (stats.num_used_blocks, stats.num_free_blocks) == (3, 5)
    assert (stats.slots_allocated, stats.slots_filled) == (12, 10)
    assert stats.waste_ratio == pytest.approx(1 - 10 / 12)
    assert stats.usage == pytest.approx(3 / 8)
    mgr.check_invariants()


def test_chunked_prefill_then_decode_fills_blocks_in_order():
    mgr = make()
    tokens = list(range(6))
    assert mgr.allocate_slots("a", tokens, 3) == []  # first chunk
    assert mgr.allocate_slots("a", tokens, 3) == []  # second chunk
    assert mgr.get_block_table("a") == [0, 1] and mgr.num_tokens("a") == 6
    for t in range(6, 9):
        tokens.append(t)
        assert mgr.allocate_slots("a", tokens, 1) == []
    assert mgr.get_block_table("a") == [0, 1, 2] and mgr.num_tokens("a") == 9
    mgr.check_invariants()


def test_all_or_nothing_when_blocks_are_short():
    mgr = make(num_blocks=3)
    mgr.allocate_slots("a", list(range(8)), 8)  # two blocks, ends exactly at a boundary
    before = snapshot(mgr, ["a"])
    assert mgr.allocate_slots("b", list(range(5)), 5) is None  # needs 2, 1 free
    assert snapshot(mgr, ["a"]) == before
    with pytest.raises(KeyError):
        mgr.num_tokens("b")
    assert mgr.allocate_slots("a", list(range(13)), 5) is None  # needs 2 more
    assert snapshot(mgr, ["a"]) == before
    mgr.check_invariants()


def test_empty_free_queue_fails_only_at_a_block_boundary():
    mgr = make(num_blocks=2)
    tokens = list(range(7))
    mgr.allocate_slots("a", tokens, 7)
    assert mgr.get_stats().num_free_blocks == 0
    tokens.append(7)
    assert mgr.allocate_slots("a", tokens, 1) == []  # fills the last block exactly
    tokens.append(8)
    assert mgr.allocate_slots("a", tokens, 1) is None  # the next token needs a new block
    assert mgr.num_tokens("a") == 8
    mgr.free("a")
    assert mgr.get_stats().num_free_blocks == 2
    mgr.check_invariants()


def test_block_size_one():
    mgr = make(num_blocks=5, block_size=1)
    tokens = [9, 8, 7]
    mgr.allocate_slots("a", tokens, 3)
    assert mgr.get_block_table("a") == [0, 1, 2]
    tokens.append(6)
    mgr.allocate_slots("a", tokens, 1)
    assert mgr.get_block_table("a") == [0, 1, 2, 3]
    assert mgr.get_stats().waste_ratio == 0.0
    mgr.check_invariants()


def test_zero_new_tokens_and_argument_errors():
    mgr = make()
    mgr.allocate_slots("a", [1, 2], 2)
    assert mgr.allocate_slots("a", [1, 2], 0) == []
    with pytest.raises(ValueError, match="num_new_tokens"):
        mgr.allocate_slots("a", [1, 2], -1)
    with pytest.raises(ValueError, match="token ids"):
        mgr.allocate_slots("a", [1, 2], 1)  # slot 3 needs a third token
    with pytest.raises(KeyError):
        mgr.get_block_table("nope")
    with pytest.raises(ValueError, match="block_size"):
        KVCacheManager(4, 0)
    mgr.free("nope")  # unknown ids are ignored
    mgr.check_invariants()


def test_prefix_lookup_without_caching_or_hits_is_empty():
    prompt = list(range(9))
    off = make()
    off.allocate_slots("a", prompt, 9)
    assert off.lookup_prefix(prompt) == PrefixMatch()
    on = make(caching=True)
    assert on.lookup_prefix(prompt).num_tokens == 0  # nothing cached yet
    assert on.lookup_prefix([]).num_tokens == 0
    with pytest.raises(ValueError, match="disabled"):
        off.allocate_slots("b", prompt, 9, prefix=PrefixMatch((0,), 4, ()))


def test_prefix_hit_all_but_last_token():
    mgr = make(caching=True)
    prompt = list(range(9))  # blocks [0..3] [4..7] [8]
    mgr.allocate_slots("a", prompt, 9)
    match = mgr.lookup_prefix(prompt)
    assert match.block_ids == (0, 1) and match.num_tokens == 8  # all but the last token
    # A prompt that ends exactly at a block boundary recomputes its whole last block.
    match = mgr.lookup_prefix(prompt[:8])
    assert match.block_ids == (0,) and match.num_tokens == 4
    # The lookup had no side effects.
    assert mgr.get_stats().prefix_queries == 0 and mgr.get_block_table("a") == [0, 1, 2]


def test_prefix_hit_shares_blocks_and_counts_tokens():
    mgr = make(caching=True)
    shadow = ShadowKV(8, 0, 4)
    prompt = list(range(10))
    mgr.allocate_slots("a", prompt, 10, prefix=mgr.lookup_prefix(prompt))
    shadow.write(mgr.get_block_table("a"), prompt, 0, 10)
    other = prompt[:8] + [42, 43, 44]
    match = mgr.lookup_prefix(other)
    assert match.num_tokens == 8
    assert mgr.allocate_slots("b", other, len(other) - 8, prefix=match) == []
    shadow.write(mgr.get_block_table("b"), other, 8, len(other))
    assert mgr.get_block_table("b")[:2] == [0, 1]
    assert shadow.read(mgr.get_block_table("b"), 11) == other
    assert shadow.read(mgr.get_block_table("a"), 10) == prompt
    assert mgr.block_pool.blocks[0].ref_cnt == 2
    stats = mgr.get_stats()
    assert (stats.prefix_queries, stats.prefix_hits) == (10 + 11, 8)
    assert stats.prefix_hit_rate == pytest.approx(8 / 21)
    assert stats.num_used_blocks == 4  # shared blocks counted once
    assert stats.slots_filled == 8 + 2 + 3
    mgr.check_invariants()


def test_freed_blocks_stay_cached_and_a_hit_takes_them_back():
    mgr = make(num_blocks=4, caching=True)
    prompt = list(range(9))
    mgr.allocate_slots("a", prompt, 9)
    mgr.free("a")
    assert mgr.get_stats().num_cached_blocks == 2 and mgr.get_stats().num_free_blocks == 4
    match = mgr.lookup_prefix(prompt)
    assert match.num_tokens == 8
    mgr.allocate_slots("b", prompt, 1, prefix=match)
    assert mgr.get_stats().num_free_blocks == 1  # two taken back from the queue, one new
    assert mgr.get_block_table("b")[:2] == list(match.block_ids)
    mgr.check_invariants()


def test_taking_back_free_cached_blocks_counts_against_free_blocks():
    mgr = make(num_blocks=3, caching=True)
    prompt = list(range(9))
    mgr.allocate_slots("a", prompt, 9)
    mgr.free("a")
    mgr.allocate_slots("x", [5], 1)  # evicts the unhashed tail block first
    assert mgr.get_stats().num_cached_blocks == 2
    match = mgr.lookup_prefix(prompt)
    assert match.num_tokens == 8
    before = snapshot(mgr, ["x"])
    assert mgr.allocate_slots("b", prompt, 1, prefix=match) is None  # needs 2 free + 1 new
    assert snapshot(mgr, ["x"]) == before
    assert mgr.lookup_prefix(prompt) == match


def test_extra_keys_separate_caches():
    mgr = make(caching=True)
    prompt = list(range(9))
    mgr.allocate_slots("a", prompt, 9, extra_keys=("tenant-1",))
    assert mgr.lookup_prefix(prompt, ("tenant-1",)).num_tokens == 8
    assert mgr.lookup_prefix(prompt, ("tenant-2",)).num_tokens == 0
    assert mgr.lookup_prefix(prompt).num_tokens == 0
    with pytest.raises(ValueError, match="other tokens or extra keys"):
        mgr.allocate_slots("b", prompt, 1, prefix=mgr.lookup_prefix(prompt, ("tenant-1",)),
                           extra_keys=("tenant-2",))


def test_stale_prefix_match_is_refused():
    mgr = make(num_blocks=3, caching=True)
    prompt = list(range(9))
    mgr.allocate_slots("a", prompt, 9)
    mgr.free("a")
    match = mgr.lookup_prefix(prompt)
    mgr.allocate_slots("x", list(range(100, 112)), 12)  # reuses (evicts) every block
    with pytest.raises(ValueError, match="stale"):
        mgr.allocate_slots("b", prompt, 1, prefix=match)
    mgr.check_invariants()


def test_prefix_only_applies_to_new_sequences():
    mgr = make(caching=True)
    prompt = list(range(9))
    mgr.allocate_slots("a", prompt, 9)
    mgr.allocate_slots("b", prompt, 4)
    match = mgr.lookup_prefix(prompt)
    mgr.allocate_slots("b", prompt, 1, prefix=match)  # ignored: b exists
    assert mgr.num_tokens("b") == 5 and mgr.get_block_table("b") == [3, 4]


def test_fork_with_partly_filled_last_block_copies_on_write():
    mgr = make()
    shadow = ShadowKV(8, 0, 4)
    parent = list(range(6))
    mgr.allocate_slots("p", parent, 6)
    shadow.write(mgr.get_block_table("p"), parent, 0, 6)
    assert mgr.fork("p", "c") == []
    child = list(parent)
    assert mgr.get_block_table("c") == mgr.get_block_table("p") == [0, 1]
    assert mgr.block_pool.blocks[1].ref_cnt == 2
    assert mgr.get_stats().slots_filled == 6  # the shared partial block counts once

    parent.append(100)
    copies = mgr.allocate_slots("p", parent, 1)
    assert copies == [(1, 2)]
    shadow.copy_blocks(copies)
    shadow.write(mgr.get_block_table("p"), parent, 6, 7)
    assert mgr.get_block_table("p") == [0, 2] and mgr.get_block_table("c") == [0, 1]

    child.append(200)
    assert mgr.allocate_slots("c", child, 1) == []  # block 1 is now its own: no copy
    shadow.write(mgr.get_block_table("c"), child, 6, 7)
    assert shadow.read(mgr.get_block_table("p"), 7) == parent
    assert shadow.read(mgr.get_block_table("c"), 7) == child
    mgr.check_invariants()


def test_fork_with_full_last_block_needs_no_copy():
    mgr = make()
    tokens = list(range(8))
    mgr.allocate_slots("p", tokens, 8)
    mgr.fork("p", "c")
    assert mgr.allocate_slots("p", tokens + [1], 1) == []
    assert mgr.allocate_slots("c", tokens + [2], 1) == []
    assert mgr.get_block_table("p") == [0, 1, 2] and mgr.get_block_table("c") == [0, 1, 3]
    mgr.free("p")
    assert mgr.block_pool.blocks[0].ref_cnt == 1
    mgr.check_invariants()


def test_copy_on_write_is_all_or_nothing():
    mgr = make(num_blocks=2)
    mgr.allocate_slots("p", [1, 2, 3, 4, 5], 5)
    mgr.fork("p", "c")
    before = snapshot(mgr, ["p", "c"])
    assert mgr.allocate_slots("p", [1, 2, 3, 4, 5, 6], 1) is None  # the copy needs a block
    assert snapshot(mgr, ["p", "c"]) == before


def test_fork_errors():
    mgr = make()
    mgr.allocate_slots("p", [1], 1)
    with pytest.raises(ValueError, match="not on the device"):
        mgr.fork("nope", "c")
    with pytest.raises(ValueError, match="exists"):
        mgr.fork("p", "p")


def test_watermark_only_for_admission():
    mgr = make(num_blocks=8, watermark=0.25)  # keep 2 blocks free when admitting
    assert mgr.watermark_blocks == 2
    mgr.allocate_slots("a", list(range(16)), 16, watermark=True)  # 4 blocks, leaves 4
    assert mgr.allocate_slots("b", list(range(12)), 12, watermark=True) is None  # would leave 1
    assert mgr.allocate_slots("b", list(range(8)), 8, watermark=True) == []  # leaves 2
    assert mgr.allocate_slots("a", list(range(24)), 8) == []  # running work may use them
    assert mgr.get_stats().num_free_blocks == 0


def test_free_returns_blocks_tail_first_and_keeps_hashes():
    mgr = make(num_blocks=4, caching=True)
    mgr.allocate_slots("a", list(range(12)), 12)
    mgr.free("a")
    # block 3, never handed out, is evicted first (it exists once the queue reaches it)
    queue = mgr.block_pool.free_queue
    assert queue.num_unborn == 1 and [b.block_id for b in queue] == [2, 1, 0]
    assert mgr.get_stats().num_cached_blocks == 3
    assert [b.block_id for b in mgr.block_pool.get_new_blocks(1)] == [3]
    mgr.block_pool.free_blocks(mgr.block_pool.blocks[3:])
    assert mgr.lookup_prefix(list(range(13))).num_tokens == 12


def test_swap_out_and_in_round_trip():
    mgr = make(num_blocks=6, num_cpu_blocks=4)
    shadow = ShadowKV(6, 4, 4)
    tokens = list(range(10))
    mgr.allocate_slots("a", tokens, 10)
    shadow.write(mgr.get_block_table("a"), tokens, 0, 10)
    out = mgr.swap_out(["a"])
    assert [d for d, _ in out] == [0, 1, 2] and len({c for _, c in out}) == 3
    shadow.swap_out(out)
    assert mgr.is_swapped("a") and mgr.num_tokens("a") == 10
    stats = mgr.get_stats()
    assert (stats.num_free_blocks, stats.num_free_cpu_blocks, stats.num_swapped_seqs) == (6, 1, 1)
    with pytest.raises(KeyError):
        mgr.get_block_table("a")
    with pytest.raises(ValueError, match="swapped out"):
        mgr.allocate_slots("a", tokens + [1], 1)
    mgr.allocate_slots("x", list(range(8)), 8)  # overwrite blocks 0, 1
    shadow.write(mgr.get_block_table("x"), list(range(8)), 0, 8)
    mgr.check_invariants()

    assert mgr.can_swap_in(["a"], 1)
    back = mgr.swap_in(["a"])
    shadow.swap_in(back)
    assert sorted(c for c, _ in back) == sorted(c for _, c in out)
    assert shadow.read(mgr.get_block_table("a"), 10) == tokens
    assert mgr.get_stats().num_free_cpu_blocks == 4
    mgr.check_invariants()


def test_swapping_sequences_that_share_blocks_together_keeps_them_shared():
    mgr = make(num_blocks=8, num_cpu_blocks=8)
    shadow = ShadowKV(8, 8, 4)
    tokens = list(range(6))
    mgr.allocate_slots("p", tokens, 6)
    shadow.write(mgr.get_block_table("p"), tokens, 0, 6)
    mgr.fork("p", "c")  # shares blocks 0 and 1 (1 partly filled)
    out = mgr.swap_out(["p", "c"])
    assert len(out) == 2 and mgr.get_stats().num_free_cpu_blocks == 6
    shadow.swap_out(out)
    mgr.check_invariants()
    assert mgr.cpu_block_pool.blocks[out[1][1]].ref_cnt == 2
    back = mgr.swap_in(["p", "c"])
    assert len(back) == 2
    shadow.swap_in(back)
    assert mgr.get_block_table("p") == mgr.get_block_table("c")
    assert all(mgr.block_pool.blocks[b].ref_cnt == 2 for b in mgr.get_block_table("p"))
    # The shared partial block is still copied on write after the round trip.
    copies = mgr.allocate_slots("c", tokens + [9], 1)
    assert len(copies) == 1
    shadow.copy_blocks(copies)
    shadow.write(mgr.get_block_table("c"), tokens + [9], 6, 7)
    assert shadow.read(mgr.get_block_table("p"), 6) == tokens
    assert shadow.read(mgr.get_block_table("c"), 7) == tokens + [9]
    mgr.check_invariants()


def test_swapping_one_of_two_sharing_sequences_copies_only_for_it():
    mgr = make(num_blocks=8, num_cpu_blocks=8)
    mgr.allocate_slots("p", list(range(6)), 6)
    mgr.fork("p", "c")
    out = mgr.swap_out(["p"])
    assert [d for d, _ in out] == [0, 1]
    assert mgr.get_block_table("c") == [0, 1]
    assert all(mgr.block_pool.blocks[b].ref_cnt == 1 for b in (0, 1))
    assert mgr.allocate_slots("c", list(range(7)), 1) == []  # no longer shared: no copy
    mgr.check_invariants()


def test_swap_fails_without_space_and_changes_nothing():
    mgr = make(num_blocks=4, num_cpu_blocks=2)
    mgr.allocate_slots("a", list(range(12)), 12)
    before = snapshot(mgr, ["a"])
    assert mgr.swap_out(["a"]) is None  # 3 blocks, 2 CPU blocks
    assert snapshot(mgr, ["a"]) == before
    with pytest.raises(ValueError, match="not on the device"):
        mgr.swap_out(["a", "zzz"])
    assert snapshot(mgr, ["a"]) == before

    mgr2 = make(num_blocks=3, num_cpu_blocks=3)
    mgr2.allocate_slots("a", list(range(8)), 8)
    mgr2.swap_out(["a"])
    mgr2.allocate_slots("x", list(range(5)), 5)
    before = snapshot(mgr2, ["a", "x"])
    assert not mgr2.can_swap_in(["a"])
    assert mgr2.swap_in(["a"]) is None
    assert snapshot(mgr2, ["a", "x"]) == before
    mgr2.free("a")  # freeing a swapped sequence releases its CPU blocks
    assert mgr2.get_stats().num_free_cpu_blocks == 3
    mgr2.check_invariants()


def test_can_swap_in_counts_the_next_tokens():
    mgr = make(num_blocks=3, num_cpu_blocks=3)
    mgr.allocate_slots("a", list(range(8)), 8)
    mgr.swap_out(["a"])
    mgr.allocate_slots("x", [1], 1)
    assert mgr.can_swap_in(["a"], 0)
    assert not mgr.can_swap_in(["a"], 1)  # the 9th token needs a third block


def test_swap_in_takes_back_blocks_still_cached_on_the_device():
    mgr = make(num_blocks=8, num_cpu_blocks=8, caching=True)
    shadow = ShadowKV(8, 8, 4)
    prompt = list(range(10))
    mgr.allocate_slots("a", prompt, 10)
    shadow.write(mgr.get_block_table("a"), prompt, 0, 10)
    out = mgr.swap_out(["a"])
    shadow.swap_out(out)
    back = mgr.swap_in(["a"])
    shadow.swap_in(back)
    assert len(back) == 1  # only the partial last block is copied; 0 and 1 are reused
    assert mgr.get_block_table("a")[:2] == [0, 1]
    assert shadow.read(mgr.get_block_table("a"), 10) == prompt
    mgr.check_invariants()


def test_stats_per_sequence_block_counts():
    mgr = make(num_blocks=8, num_cpu_blocks=4)
    mgr.allocate_slots("a", list(range(5)), 5)
    mgr.allocate_slots("b", list(range(1)), 1)
    mgr.fork("a", "c")
    stats = mgr.get_stats()
    assert stats.seq_block_counts() == {"a": 2, "b": 1, "c": 2} == mgr.seq_block_counts()
    assert stats.num_seqs == 3 and stats.num_used_blocks == 3
    assert stats.slots_filled == 4 + 1 + 1 and stats.slots_allocated == 12
    assert stats.external_fragmentation == 0.0 and stats.num_cpu_blocks == 4
    assert "block_counts" not in stats.as_dict()


def test_check_invariants_catches_corruption():
    mgr = make()
    mgr.allocate_slots("a", list(range(5)), 5)
    mgr.check_invariants()
    mgr.block_pool.blocks[0].ref_cnt += 1
    with pytest.raises(AssertionError):
        mgr.check_invariants()
    mgr.block_pool.blocks[0].ref_cnt -= 1
    mgr._seqs["a"].table.num_tokens = 9  # three blocks' worth of tokens in two blocks
    with pytest.raises(AssertionError, match="blocks for"):
        mgr.check_invariants()


def test_uncomputed_blocks_can_be_withdrawn_from_the_prefix_index():
    """Full blocks are indexed when allocated (so the same step can share them); if the step
    that was to compute them fails, discard_uncomputed takes them out again, and once a step
    ran, mark_computed makes them final."""
    mgr = make(caching=True)
    prompt = list(range(9))
    mgr.allocate_slots("a", prompt, 9)
    assert mgr.lookup_prefix(prompt).num_tokens == 8  # provisional
    mgr.discard_uncomputed("a")
    mgr.check_invariants()
    mgr.free("a")
    assert mgr.lookup_prefix(prompt).num_tokens == 0
    mgr.allocate_slots("b", prompt, 9)
    mgr.mark_computed("b")
    mgr.allocate_slots("b", prompt + [50, 51, 52], 3)  # fills the third block, not computed
    mgr.discard_uncomputed("b")  # withdraws only the third block
    assert mgr.lookup_prefix(prompt + [50, 51, 52, 53]).num_tokens == 8
    mgr.check_invariants()
    mgr.free("b")
    assert mgr.lookup_prefix(prompt).num_tokens == 8  # computed blocks stay reusable
    mgr.check_invariants()


def test_can_admit_and_blocks_needed():
    mgr = make(num_blocks=8, block_size=4, watermark=0.25)  # 2 blocks of watermark
    assert mgr.can_admit(24) and not mgr.can_admit(25)
    assert mgr.can_admit(32, watermark=False) and not mgr.can_admit(33, watermark=False)
    assert not mgr.can_admit(24, reserved_blocks=1)
    mgr.allocate_slots("a", list(range(6)), 6)
    assert mgr.blocks_needed("a", 2) == 0 and mgr.blocks_needed("a", 3) == 1
    mgr.fork("a", "b")
    assert mgr.blocks_needed("b", 1) == 1  # its shared, partly filled block is copied
    assert mgr.blocks_needed("unknown", 5) == 0
