"""The runnable invariants of the paged KVCacheManager (pagellm.kv.manager), for tests and
state machines: ref counts equal owners, free and used blocks add up, tables hold whole
blocks, a block is full in every table or partial in all with the same fill, and the hashes
chain and match what the blocks hold."""
from __future__ import annotations

from collections import Counter
from collections.abc import Hashable
from typing import TYPE_CHECKING, Any

from pagellm.kv.block_pool import ROOT_HASH
from pagellm.kv.block_table import cdiv

if TYPE_CHECKING:
    from pagellm.kv.manager import KVCacheManager


def check_paged_manager(mgr: KVCacheManager) -> None:
    """Raise AssertionError if any invariant of KVCacheManager's docstring is broken."""
    assert not mgr._seqs.keys() & mgr._swapped.keys(), "a sequence is on both sides"
    mgr.block_pool.check_invariants(
        Counter(b for seq in mgr._seqs.values() for b in seq.table.block_ids))
    mgr.cpu_block_pool.check_invariants(
        Counter(b for seq in mgr._swapped.values() for b in seq.table.block_ids))
    partial_fill: dict[int, int] = {}
    full: set[int] = set()
    for seq_id, seq in [*mgr._seqs.items(), *mgr._swapped.items()]:
        _check_sequence(mgr, seq_id, seq, on_device=seq_id in mgr._seqs)
    for seq in mgr._seqs.values():
        table = seq.table
        if table.last_block_is_partial():
            fill = table.num_tokens_in_last_block()
            assert partial_fill.setdefault(table.block_ids[-1], fill) == fill, \
                f"block {table.block_ids[-1]} is shared with different fills"
            full.update(table.block_ids[:-1])
        else:
            full.update(table.block_ids)
    assert not full & partial_fill.keys(), "a block is full in one table, partial in another"


def _check_sequence(mgr: KVCacheManager, seq_id: Hashable, seq: Any, on_device: bool) -> None:
    table = seq.table
    assert len(table.block_ids) == cdiv(table.num_tokens, mgr.block_size), \
        f"sequence {seq_id!r}: {len(table.block_ids)} blocks for {table.num_tokens} tokens"
    assert len(set(table.block_ids)) == len(table.block_ids), f"{seq_id!r} holds a block twice"
    if not mgr.enable_prefix_caching:
        assert not seq.block_hashes
        return
    assert len(seq.block_hashes) == table.num_full_blocks or (
        seq.num_computed_hashes == len(seq.block_hashes)), f"{seq_id!r}: hash count"
    assert seq.num_computed_hashes <= len(seq.block_hashes), f"{seq_id!r}: computed count"
    parent = ROOT_HASH
    for block_id, block_hash in zip(table.block_ids, seq.block_hashes):
        assert block_hash.parent == parent and block_hash.extra_keys == seq.extra_keys
        parent = block_hash.value
        if on_device:
            held = mgr._blocks[block_id].block_hash
            assert held is None or held == block_hash, \
                f"{seq_id!r}: block {block_id} is cached as other tokens than it holds"
