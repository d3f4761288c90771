"""The block map: every physical block of a pool, its state, ref count, owners and fill.

What the dashboard draws and the ``--html`` report embeds. Built from the managers' own
structures in one pass over the pool and one over the block tables (O(blocks + table entries)),
so the engine loop can afford it a few times a second.
"""
from __future__ import annotations

import enum
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any

from pagellm.kv.block_pool import BlockPool
from pagellm.kv.block_table import BlockTable


# A trimmed pool map lists a multiple of this many blocks (one row of the dashboard's grid).
TRIM_MULTIPLE = 64


class BlockState(enum.IntEnum):
    FREE = 0  # in the free queue, holds nothing reusable
    USED = 1  # held by at least one block table (ref count > 0)
    CACHED_FREE = 2  # free, but still holds a prefix-cache hash: a later prompt may take it back


FREE, USED, CACHED_FREE = (int(s) for s in BlockState)  # plain ints for the lists below


@dataclass(slots=True)
class PoolMap:
    """One pool's blocks as parallel lists indexed by block id.

    Invariants: ``state[b] is USED`` iff ``ref_cnt[b] > 0``; in the paged manager's pools
    ``len(owners[b]) == ref_cnt[b]`` (each holder is one block table); ``fill[b]`` is the number
    of token slots of block ``b`` that hold a token (0 for a free block, and for the unfilled
    tail of a contiguous reservation); ``cached[b]`` says the block is in the prefix index.
    The lists may stop before ``num_blocks`` (a CPU pool of many GiB): every block past their
    end is free.
    """

    num_blocks: int
    state: list[int]
    ref_cnt: list[int]
    fill: list[int]
    cached: list[int]  # 1 or 0
    owners: list[tuple[Hashable, ...]]

    @property
    def num_shown(self) -> int:
        return len(self.state)

    def count(self, state: BlockState) -> int:
        shown = sum(1 for s in self.state if s == state)
        return shown + (self.num_blocks - self.num_shown if state == BlockState.FREE else 0)

    def to_dict(self, owner_index: dict[Hashable, int] | None = None) -> dict[str, Any]:
        """JSON-friendly; with ``owner_index`` each owner is written as its index there."""
        owners: list = self.owners
        if owner_index is not None:
            owners = [[owner_index[o] for o in held] if held else () for held in owners]
        return {"num_blocks": self.num_blocks, "state": self.state, "ref_cnt": self.ref_cnt,
                "fill": self.fill, "cached": self.cached, "owners": owners}


@dataclass(slots=True)
class BlockMap:
    """The device pool and the CPU (swap) pool of one KV cache manager."""

    block_size: int
    device: PoolMap
    cpu: PoolMap
    kind: str = "paged"  # or "contiguous"
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self, owner_index: dict[Hashable, int] | None = None) -> dict[str, Any]:
        return {"kind": self.kind, "block_size": self.block_size,
                "num_blocks": self.device.num_blocks, "num_cpu_blocks": self.cpu.num_blocks,
                "blocks": self.device.to_dict(owner_index),
                "cpu_blocks": self.cpu.to_dict(owner_index), **self.extra}


def pool_map(pool: BlockPool, tables: Iterable[tuple[Hashable, BlockTable]],
             trim_free_tail: bool = False) -> PoolMap:
    """The map of a ref-counted pool whose blocks are held by these (seq_id, table) pairs.

    ``trim_free_tail`` (for an unhashed pool, the CPU's): list blocks only up to the last held
    one, rounded up to TRIM_MULTIPLE, so that a swap space of many GiB costs nothing to map.
    """
    tables = list(tables)
    num_shown = pool.num_blocks
    if trim_free_tail:
        last = max((b for _, table in tables for b in table.block_ids), default=-1)
        num_shown = min(num_shown, -(-(last + 1) // TRIM_MULTIPLE) * TRIM_MULTIPLE or
                        TRIM_MULTIPLE)
    # One shared empty tuple for every block nobody holds: most of a big pool, built for free.
    owners: list[tuple[Hashable, ...]] = [()] * num_shown
    fill = [0] * num_shown
    for seq_id, table in tables:
        block_ids = table.block_ids
        for block_id in block_ids:
            owners[block_id] += (seq_id,)
            fill[block_id] = table.block_size
        if block_ids:
            fill[block_ids[-1]] = table.num_tokens_in_last_block()
    blocks = pool.blocks[:num_shown]  # past its end, blocks never handed out: free, empty
    unborn = [0] * (num_shown - len(blocks))
    ref_cnt = [block.ref_cnt for block in blocks] + unborn
    cached = [0 if block.block_hash is None else 1 for block in blocks] + unborn
    state = [USED if refs else CACHED_FREE if hashed else FREE
             for refs, hashed in zip(ref_cnt, cached)]
    return PoolMap(pool.num_blocks, state, ref_cnt, fill, cached, owners)


def reservation_map(num_blocks: int, block_size: int, blocks_per_seq: int,
                    reservations: Iterable[tuple[Hashable, int, int]]) -> PoolMap:
    """The map of a contiguous arena: ``reservations`` are (seq_id, first block, num_tokens);
    every block of a run is held (ref count 1) whether or not it holds a token yet."""
    owners: list[tuple[Hashable, ...]] = [()] * num_blocks
    fill = [0] * num_blocks
    ref_cnt = [0] * num_blocks
    for seq_id, start, num_tokens in reservations:
        held = (seq_id,)
        for i in range(blocks_per_seq):
            block_id = start + i
            owners[block_id] = held
            ref_cnt[block_id] = 1
            fill[block_id] = max(0, min(block_size, num_tokens - i * block_size))
    state = [USED if refs else FREE for refs in ref_cnt]
    return PoolMap(num_blocks, state, ref_cnt, fill, [0] * num_blocks, owners)
