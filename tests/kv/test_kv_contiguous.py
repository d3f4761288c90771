"""ContiguousKVCacheManager: max-length reservations, first fit, both kinds of fragmentation."""
from __future__ import annotations

import pytest
from kv_shadow import ShadowKV

from pagellm.kv import ContiguousKVCacheManager, FreeExtents, PrefixMatch


def make(num_blocks=12, block_size=4, max_model_len=16, num_cpu_blocks=0, watermark=0.0):
    return ContiguousKVCacheManager(num_blocks, block_size, max_model_len, num_cpu_blocks,
                                    watermark=watermark)


def test_free_extents_first_fit_and_merge():
    extents = FreeExtents(10)
    assert [extents.reserve(3), extents.reserve(3), extents.reserve(3)] == [0, 3, 6]
    assert extents.reserve(3) is None and extents.num_free_blocks == 1
    extents.release(3, 3)
    assert extents.extents == [(3, 3), (9, 1)]
    extents.release(0, 3)  # merges with its right neighbour
    extents.release(6, 3)  # merges with both
    assert extents.extents == [(0, 10)] and extents.num_free_blocks == 10


def test_each_sequence_reserves_a_run_of_max_model_len():
    mgr = make()
    assert mgr.blocks_per_seq == 4
    assert mgr.allocate_slots("a", [1, 2, 3], 3) == []
    assert mgr.allocate_slots("b", [1], 1) == []
    assert mgr.get_block_table("a") == [0] and mgr.get_block_table("b") == [4]
    mgr.allocate_slots("a", list(range(9)), 6)
    assert mgr.get_block_table("a") == [0, 1, 2]  # consecutive, within its run
    stats = mgr.get_stats()
    assert (stats.num_used_blocks, stats.num_free_blocks) == (8, 4)
    assert (stats.slots_allocated, stats.slots_filled) == (32, 10)
    assert stats.waste_ratio == pytest.approx(1 - 10 / 32)  # internal fragmentation
    assert stats.seq_block_counts() == {"a": 4, "b": 4}
    mgr.check_invariants()


def test_cannot_grow_past_max_model_len():
    mgr = make()
    mgr.allocate_slots("a", list(range(16)), 16)
    with pytest.raises(ValueError, match="max_model_len 16"):
        mgr.allocate_slots("a", list(range(17)), 1)
    with pytest.raises(ValueError, match="max_model_len"):
        mgr.allocate_slots("b", list(range(17)), 17)
    assert mgr.num_tokens("a") == 16


def test_no_prefix_caching():
    mgr = make()
    mgr.allocate_slots("a", list(range(9)), 9)
    assert mgr.lookup_prefix(list(range(9))) == PrefixMatch()
    assert mgr.allocate_slots("b", list(range(9)), 9, prefix=PrefixMatch()) == []
    with pytest.raises(ValueError, match="no prefix cache"):
        mgr.allocate_slots("c", list(range(9)), 1, prefix=PrefixMatch((0,), 4, ()))


def test_external_fragmentation_blocks_admission_and_is_reported():
    mgr = make(num_blocks=10, max_model_len=12)  # runs of 3 blocks
    for name in "abc":
        mgr.allocate_slots(name, [1], 1)
    stats = mgr.get_stats()
    assert stats.num_free_blocks == 1 and stats.external_fragmentation == 1.0
    assert mgr.allocate_slots("z", [1], 1) is None
    mgr.free("b")  # free: [3, 6) and [9, 10)
    stats = mgr.get_stats()
    assert stats.num_free_blocks == 4 and stats.external_fragmentation == pytest.approx(1 / 4)
    assert mgr.allocate_slots("d", [1], 1) == []  # first fit: the hole left by b
    assert mgr.get_block_table("d") == [3]
    mgr.free("a")
    mgr.free("c")  # free: [0, 3) and [6, 10)
    mgr.allocate_slots("e", [1], 1)
    mgr.allocate_slots("f", [1], 1)  # [6, 9)
    mgr.free("e")  # free: [0, 3) and [9, 10): 4 blocks, one run of 3
    mgr.allocate_slots("g", [1], 1)
    assert mgr.get_stats().num_free_blocks == 1
    mgr.free("d")  # free: [3, 6) and [9, 10)
    mgr.free("g")  # free: [0, 6) merged, [9, 10)
    assert mgr.free_extents.extents == [(0, 6), (9, 1)]
    mgr.check_invariants()


def test_fork_copies_filled_blocks_into_a_new_run():
    mgr = make(num_blocks=8)
    shadow = ShadowKV(8, 0, 4)
    tokens = list(range(6))
    mgr.allocate_slots("p", tokens, 6)
    shadow.write(mgr.get_block_table("p"), tokens, 0, 6)
    copies = mgr.fork("p", "c")
    assert copies == [(0, 4), (1, 5)]
    shadow.copy_blocks(copies)
    assert shadow.read(mgr.get_block_table("c"), 6) == tokens
    assert mgr.fork("p", "d") is None  # no room for a third run
    with pytest.raises(ValueError, match="exists"):
        mgr.fork("p", "c")
    mgr.check_invariants()


def test_swap_out_and_in_move_only_filled_blocks():
    mgr = make(num_blocks=8, num_cpu_blocks=3)
    shadow = ShadowKV(8, 3, 4)
    tokens = list(range(6))
    mgr.allocate_slots("a", tokens, 6)
    shadow.write(mgr.get_block_table("a"), tokens, 0, 6)
    out = mgr.swap_out(["a"])
    assert [d for d, _ in out] == [0, 1]
    shadow.swap_out(out)
    assert mgr.is_swapped("a") and mgr.num_tokens("a") == 6
    assert mgr.get_stats().num_free_blocks == 8
    mgr.allocate_slots("x", [7], 1)  # takes [0, 4): a comes back elsewhere
    shadow.write(mgr.get_block_table("x"), [7], 0, 1)
    assert mgr.can_swap_in(["a"])
    back = mgr.swap_in(["a"])
    shadow.swap_in(back)
    assert mgr.get_block_table("a") == [4, 5]
    assert shadow.read(mgr.get_block_table("a"), 6) == tokens
    mgr.check_invariants()


def test_swap_is_all_or_nothing():
    mgr = make(num_blocks=8, num_cpu_blocks=8)
    mgr.allocate_slots("a", [1], 1)
    mgr.allocate_slots("b", [1], 1)
    assert mgr.swap_out(["a", "b"]) is not None
    mgr.allocate_slots("x", [1], 1)
    before = mgr.get_stats().as_dict()
    assert not mgr.can_swap_in(["a", "b"])
    assert mgr.swap_in(["a", "b"]) is None  # only one run is free: the first is given back
    assert mgr.get_stats().as_dict() == before
    assert mgr.swap_in(["a"]) is not None
    small = make(num_blocks=8, num_cpu_blocks=1)
    small.allocate_slots("a", list(range(5)), 5)
    assert small.swap_out(["a"]) is None
    small.check_invariants()
    mgr.check_invariants()


def test_watermark_and_configuration_errors():
    mgr = make(num_blocks=12, watermark=0.2)  # keep 2 blocks free when admitting
    assert mgr.allocate_slots("a", [1], 1, watermark=True) == []
    assert mgr.allocate_slots("b", [1], 1, watermark=True) == []  # leaves 4
    assert mgr.allocate_slots("c", [1], 1, watermark=True) is None  # would leave 0
    assert mgr.allocate_slots("c", [1], 1) == []
    with pytest.raises(ValueError, match="only 3"):
        ContiguousKVCacheManager(3, 4, 16)
    with pytest.raises(ValueError, match="token ids"):
        mgr.allocate_slots("a", [1], 1)


def test_check_invariants_catches_double_booking():
    mgr = make()
    mgr.allocate_slots("a", [1], 1)
    mgr.check_invariants()
    mgr._seqs["a"].start = 4  # overlaps the free extent
    with pytest.raises(AssertionError):
        mgr.check_invariants()
