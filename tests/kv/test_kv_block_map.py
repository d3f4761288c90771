"""The block map agrees with the managers' statistics and block tables: counts add up, a shared
block lists as many holders as its ref count, swapped and prefix-cached blocks show as such."""
from __future__ import annotations

import random
from collections import Counter

import pytest

from pagellm.kv import BlockState, ContiguousKVCacheManager, KVCacheManager


def check_consistent(mgr, seq_ids) -> None:
    """Every figure the map implies matches get_stats() and the block tables."""
    stats, block_map = mgr.get_stats(), mgr.block_map()
    device, cpu = block_map.device, block_map.cpu
    assert device.num_blocks == stats.num_blocks and cpu.num_blocks == stats.num_cpu_blocks
    assert device.count(BlockState.USED) == stats.num_used_blocks
    assert (device.count(BlockState.FREE) + device.count(BlockState.CACHED_FREE)
            == stats.num_free_blocks)
    assert sum(device.cached) == stats.num_cached_blocks
    assert cpu.count(BlockState.USED) == stats.num_cpu_blocks - stats.num_free_cpu_blocks
    assert sum(f for f, s in zip(device.fill, device.state) if s == BlockState.USED) \
        == stats.slots_filled
    for pool in (device, cpu):
        assert pool.num_shown <= pool.num_blocks
        for b in range(pool.num_shown):
            assert (pool.state[b] == BlockState.USED) == (pool.ref_cnt[b] > 0)
            assert 0 <= pool.fill[b] <= block_map.block_size
            if pool.state[b] != BlockState.USED:
                assert not pool.owners[b] and pool.fill[b] == 0
    held = Counter()
    for seq_id in seq_ids:
        if mgr.is_swapped(seq_id):
            continue
        table = mgr.get_block_table(seq_id)
        held.update(table)
        for block_id in table:
            assert seq_id in device.owners[block_id]
    return held


def test_paged_map_shared_swapped_and_cached_blocks():
    mgr = KVCacheManager(16, 4, num_cpu_blocks=8, enable_prefix_caching=True, watermark=0.0)
    prompt = list(range(10))
    mgr.allocate_slots("a", prompt, 10)
    mgr.mark_computed("a")
    match = mgr.lookup_prefix(prompt + [99])
    assert match.num_tokens == 8
    mgr.allocate_slots("b", prompt + [99], 3, prefix=match)  # shares a's two full blocks
    mgr.fork("a", "a2")  # shares all of a's blocks, the partial one too
    mgr.allocate_slots("c", list(range(50, 56)), 6)
    mgr.allocate_slots("d", list(range(60, 67)), 7)
    assert mgr.swap_out(["d"]) is not None
    mgr.free("c")  # its full block keeps its hash: cached-free
    mgr.mark_computed("b")
    seqs = ["a", "a2", "b", "d"]
    held = check_consistent(mgr, seqs)
    block_map = mgr.block_map()
    device = block_map.device
    for block_id in range(device.num_blocks):
        assert device.ref_cnt[block_id] == len(device.owners[block_id]) == held[block_id]
    shared = [b for b in range(device.num_shown) if device.ref_cnt[b] > 1]
    assert set(shared) == set(mgr.get_block_table("a"))
    assert sorted(device.owners[shared[0]]) == ["a", "a2", "b"]
    assert all(device.cached[b] for b in mgr.get_block_table("a")[:2])
    # c's full block, and d's, whose device copy stays cached after its swap-out
    assert device.count(BlockState.CACHED_FREE) == 2
    cpu = block_map.cpu
    assert cpu.count(BlockState.USED) == 2
    assert sorted(f for f in cpu.fill if f) == [3, 4]
    assert all(owners == ("d",) for owners in cpu.owners if owners)
    big = KVCacheManager(4, 4, num_cpu_blocks=1000)
    big.allocate_slots("x", list(range(5)), 5)
    big.swap_out(["x"])
    assert big.block_map().cpu.num_shown == 64 and big.block_map().cpu.num_blocks == 1000
    assert big.block_map().cpu.count(BlockState.FREE) == 998
    # Owners written as indexes into a list of sequences.
    index = {s: i for i, s in enumerate(seqs)}
    as_json = block_map.to_dict(index)
    assert sorted(as_json["blocks"]["owners"][shared[0]]) == [0, 1, 2]
    assert as_json["num_blocks"] == 16 and as_json["num_cpu_blocks"] == 8


def test_contiguous_map_reservations_and_stranded_blocks():
    mgr = ContiguousKVCacheManager(10, 4, max_model_len=12, num_cpu_blocks=4, watermark=0.0)
    mgr.allocate_slots("a", list(range(5)), 5)
    mgr.allocate_slots("b", list(range(2)), 2)
    mgr.allocate_slots("c", list(range(7)), 7)
    assert mgr.swap_out(["b"]) is not None
    seqs = ["a", "b", "c"]
    check_consistent(mgr, seqs)
    block_map = mgr.block_map()
    device = block_map.device
    assert block_map.kind == "contiguous" and block_map.extra["blocks_per_seq"] == 3
    assert device.owners[0:3] == [("a",)] * 3 and device.fill[0:3] == [4, 1, 0]
    assert device.fill[6:9] == [4, 3, 0]  # c's run; b's old run 3..5 is free again
    assert device.state[3:6] == [BlockState.FREE] * 3
    assert block_map.extra["stranded_blocks"] == [9]
    stats = mgr.get_stats()
    free = device.count(BlockState.FREE)
    assert len(block_map.extra["stranded_blocks"]) / free == pytest.approx(
        stats.external_fragmentation)
    assert block_map.cpu.fill[:1] == [2] and block_map.cpu.owners[0] == ("b",)


@pytest.mark.parametrize("kind", ["paged", "contiguous"])
def test_map_consistent_through_random_operations(kind):
    rng = random.Random(7)
    if kind == "paged":
        mgr = KVCacheManager(24, 4, num_cpu_blocks=24, enable_prefix_caching=True,
                             watermark=0.0)
    else:
        mgr = ContiguousKVCacheManager(24, 4, max_model_len=16, num_cpu_blocks=24,
                                       watermark=0.0)
    tokens: dict[str, list[int]] = {}
    for step in range(300):
        op = rng.choice(["add", "grow", "grow", "fork", "free", "swap_out", "swap_in"])
        device = [s for s in tokens if not mgr.is_swapped(s)]
        swapped = [s for s in tokens if mgr.is_swapped(s)]
        if op == "add":
            seq_id = f"s{step}"
            prompt = [rng.randrange(4) for _ in range(rng.randint(1, 9))]
            match = mgr.lookup_prefix(prompt)
            if mgr.allocate_slots(seq_id, prompt, len(prompt) - match.num_tokens,
                                  prefix=match) is not None:
                tokens[seq_id] = prompt
        elif op == "grow" and device:
            seq_id = rng.choice(device)
            if mgr.num_tokens(seq_id) < 16:
                tokens[seq_id].append(rng.randrange(4))
                if mgr.allocate_slots(seq_id, tokens[seq_id], 1) is None:
                    tokens[seq_id].pop()
        elif op == "fork" and device:
            parent = rng.choice(device)
            if mgr.fork(parent, f"f{step}") is not None:
                tokens[f"f{step}"] = list(tokens[parent])
        elif op == "free" and tokens:
            mgr.free(seq_id := rng.choice(list(tokens)))
            del tokens[seq_id]
        elif op == "swap_out" and device:
            mgr.swap_out([rng.choice(device)])
        elif op == "swap_in" and swapped:
            mgr.swap_in([rng.choice(swapped)])
        for seq_id in device:
            if not mgr.is_swapped(seq_id) and seq_id in tokens:
                mgr.mark_computed(seq_id)
        held = check_consistent(mgr, list(tokens))
        if kind == "paged":
            device_map = mgr.block_map().device
            assert device_map.num_shown == device_map.num_blocks
            assert all(device_map.ref_cnt[b] == len(device_map.owners[b]) == held[b]
                       for b in range(device_map.num_blocks))
