"""The traditional allocator, as a baseline behind the KVCacheManager interface.

Each admitted sequence reserves ``max_model_len`` slots, ``ceil(max_model_len / block_size)``
consecutive blocks, in one arena (first fit over the free extents), as servers did before paged
attention. It shows both kinds of waste the paged manager avoids: internal fragmentation (slots
reserved for tokens a sequence never produces) and external fragmentation (free blocks split
between reservations into runs too short to take a new one). No prefix caching, no sharing.

Since every run has the same length, first fit keeps each one at a multiple of
``blocks_per_seq``: the free space that no reservation can use is the remainder at the end of
the arena. (Reserving each request's own maximum length instead, as some servers do, would
fragment the arena further; the interface fixes one length, max_model_len.)
"""
from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

from pagellm.kv.block_map import BlockMap, pool_map, reservation_map
from pagellm.kv.block_pool import BlockPool
from pagellm.kv.block_table import BlockTable, cdiv
from pagellm.kv.interface import NO_PREFIX, BlockCopies, KVCacheStats, PrefixMatch


class FreeExtents:
    """Free runs of consecutive blocks as (start, length), sorted by start.

    Invariant: extents are non-empty, do not overlap and are never adjacent (release merges
    neighbours), so the representation of a given free set is unique.
    """

    def __init__(self, num_blocks: int) -> None:
        self.extents: list[tuple[int, int]] = [(0, num_blocks)] if num_blocks else []
        self.num_free_blocks = num_blocks

    def reserve(self, length: int) -> int | None:
        """First fit: the start of the lowest extent that holds ``length`` blocks, or None."""
        for i, (start, free) in enumerate(self.extents):
            if free >= length:
                if free == length:
                    del self.extents[i]
                else:
                    self.extents[i] = (start + length, free - length)
                self.num_free_blocks -= length
                return start
        return None

    def release(self, start: int, length: int) -> None:
        self.num_free_blocks += length
        i = bisect.bisect_left(self.extents, (start,))
        if i > 0 and self.extents[i - 1][0] + self.extents[i - 1][1] == start:
            i -= 1
            start, length = self.extents[i][0], self.extents[i][1] + length
            del self.extents[i]
        if i < len(self.extents) and start + length == self.extents[i][0]:
            length += self.extents[i][1]
            del self.extents[i]
        self.extents.insert(i, (start, length))

    def num_blocks_in_extents_shorter_than(self, length: int) -> int:
        return sum(free for _, free in self.extents if free < length)


@dataclass(slots=True)
class _Reservation:
    start: int  # first block of the sequence's run of blocks_per_seq blocks
    num_tokens: int


class ContiguousKVCacheManager:
    """Contiguous max-length reservations behind the KVCacheManager interface.

    Invariants (``check_invariants``): the reservations and the free extents tile
    ``[0, num_blocks)`` exactly; every reservation is ``blocks_per_seq`` blocks long and holds at
    most ``max_model_len`` tokens; CPU blocks are held by swapped sequences' tables only, with
    matching ref counts. A block table is the run of blocks covering the sequence's tokens.
    """

    enable_prefix_caching = False

    def __init__(self, num_blocks: int, block_size: int, max_model_len: int,
                 num_cpu_blocks: int = 0, watermark: float = 0.01) -> None:
        if block_size <= 0 or max_model_len <= 0:
            raise ValueError(f"block_size ({block_size}) and max_model_len ({max_model_len}) "
                             "must be positive")
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {watermark}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.num_cpu_blocks = num_cpu_blocks
        self.max_model_len = max_model_len
        self.blocks_per_seq = cdiv(max_model_len, block_size)
        if self.blocks_per_seq > num_blocks:
            raise ValueError(f"one reservation of max_model_len {max_model_len} tokens needs "
                             f"{self.blocks_per_seq} blocks, but there are only {num_blocks}")
        self.watermark_blocks = int(watermark * num_blocks)
        self.free_extents = FreeExtents(num_blocks)
        self.cpu_block_pool = BlockPool(num_cpu_blocks)
        self._seqs: dict[Hashable, _Reservation] = {}
        self._swapped: dict[Hashable, BlockTable] = {}  # CPU block ids of the filled blocks

    def lookup_prefix(self, token_ids: Sequence[int],
                      extra_keys: Iterable[Hashable] = ()) -> PrefixMatch:
        """No prefix caching: always an empty match."""
        return NO_PREFIX

    def allocate_slots(self, seq_id: Hashable, token_ids: Sequence[int], num_new_tokens: int,
                       prefix: PrefixMatch | None = None, extra_keys: Iterable[Hashable] = (),
                       watermark: bool = False) -> BlockCopies | None:
        """A new sequence reserves its whole run (None if no free extent is long enough); later
        calls only advance within it. Growing past max_model_len raises ValueError."""
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        seq = self._seqs.get(seq_id)
        if seq is None and seq_id in self._swapped:
            raise ValueError(f"sequence {seq_id!r} is swapped out: swap it in first")
        if seq is None and prefix is not None and prefix.num_tokens:
            raise ValueError("the contiguous manager has no prefix cache to attach a match from")
        total = num_new_tokens + (seq.num_tokens if seq is not None else 0)
        if total > self.max_model_len:
            raise ValueError(f"sequence {seq_id!r} would hold {total} tokens, past max_model_len "
                             f"{self.max_model_len}: a contiguous reservation cannot grow")
        if len(token_ids) < total:
            raise ValueError(f"sequence {seq_id!r}: {total} slots need as many token ids, "
                             f"got {len(token_ids)}")
        if seq is not None:
            seq.num_tokens = total
            return []
        if watermark and (self.free_extents.num_free_blocks - self.blocks_per_seq
                          < self.watermark_blocks):
            return None
        start = self.free_extents.reserve(self.blocks_per_seq)
        if start is None:
            return None
        self._seqs[seq_id] = _Reservation(start, total)
        return []

    def can_admit(self, num_tokens: int, watermark: bool = True, reserved_blocks: int = 0
                  ) -> bool:
        """Whether a new sequence would get a reservation now (its length does not matter;
        running sequences grow inside their own reservations, so nothing needs reserving)."""
        if watermark and (self.free_extents.num_free_blocks - self.blocks_per_seq
                          < self.watermark_blocks):
            return False
        return any(free >= self.blocks_per_seq for _, free in self.free_extents.extents)

    def mark_computed(self, seq_id: Hashable) -> None:
        """No prefix cache: nothing is provisional."""

    def discard_uncomputed(self, seq_id: Hashable) -> None:
        """No prefix cache: nothing to withdraw."""

    def blocks_needed(self, seq_id: Hashable, num_new_tokens: int) -> int:
        """Growth stays inside the reservation: no new blocks."""
        return 0

    def num_tokens(self, seq_id: Hashable) -> int:
        if seq_id in self._seqs:
            return self._seqs[seq_id].num_tokens
        if seq_id in self._swapped:
            return self._swapped[seq_id].num_tokens
        raise KeyError(f"unknown sequence {seq_id!r}")

    def get_block_table(self, seq_id: Hashable) -> list[int]:
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise KeyError(f"sequence {seq_id!r} is not on the device")
        return list(range(seq.start, seq.start + cdiv(seq.num_tokens, self.block_size)))

    def is_swapped(self, seq_id: Hashable) -> bool:
        return seq_id in self._swapped

    def fork(self, parent_id: Hashable, child_id: Hashable) -> BlockCopies | None:
        """The child gets a reservation of its own and a copy of the parent's filled blocks:
        returns the (parent, child) copies, or None when no free extent is long enough."""
        parent = self._seqs.get(parent_id)
        if parent is None:
            raise ValueError(f"cannot fork {parent_id!r}: it is not on the device")
        if child_id in self._seqs or child_id in self._swapped:
            raise ValueError(f"cannot fork into {child_id!r}: the sequence exists")
        start = self.free_extents.reserve(self.blocks_per_seq)
        if start is None:
            return None
        self._seqs[child_id] = _Reservation(start, parent.num_tokens)
        num_filled = cdiv(parent.num_tokens, self.block_size)
        return [(parent.start + i, start + i) for i in range(num_filled)]

    def free(self, seq_id: Hashable) -> None:
        """Release a sequence, on the device or swapped; unknown ids are ignored."""
        seq = self._seqs.pop(seq_id, None)
        if seq is not None:
            self.free_extents.release(seq.start, self.blocks_per_seq)
            return
        table = self._swapped.pop(seq_id, None)
        if table is not None:
            cpu_blocks = self.cpu_block_pool.blocks
            self.cpu_block_pool.free_blocks(cpu_blocks[b] for b in reversed(table.block_ids))

    def swap_out(self, seq_ids: Iterable[Hashable]) -> BlockCopies | None:
        """Copy each sequence's filled blocks to the CPU pool and release its reservation."""
        ids = self._collect(seq_ids, self._seqs, "on the device")
        filled = {seq_id: cdiv(self._seqs[seq_id].num_tokens, self.block_size) for seq_id in ids}
        if sum(filled.values()) > self.cpu_block_pool.num_free_blocks:
            return None
        copies: BlockCopies = []
        for seq_id in ids:
            seq = self._seqs.pop(seq_id)
            cpu_ids = [b.block_id for b in self.cpu_block_pool.get_new_blocks(filled[seq_id])]
            copies.extend((seq.start + i, cpu_id) for i, cpu_id in enumerate(cpu_ids))
            self.free_extents.release(seq.start, self.blocks_per_seq)
            self._swapped[seq_id] = BlockTable(self.block_size, cpu_ids, seq.num_tokens)
        return copies

    def swap_in(self, seq_ids: Iterable[Hashable]) -> BlockCopies | None:
        """Reserve a fresh run for each sequence and copy its blocks back, or None (nothing
        changed) when the runs do not all fit."""
        ids = self._collect(seq_ids, self._swapped, "swapped out")
        starts: list[int] = []
        for _ in ids:
            start = self.free_extents.reserve(self.blocks_per_seq)
            if start is None:
                for reserved in starts:
                    self.free_extents.release(reserved, self.blocks_per_seq)
                return None
            starts.append(start)
        copies: BlockCopies = []
        cpu_blocks = self.cpu_block_pool.blocks
        for seq_id, start in zip(ids, starts):
            table = self._swapped.pop(seq_id)
            copies.extend((cpu_id, start + i) for i, cpu_id in enumerate(table.block_ids))
            self.cpu_block_pool.free_blocks(cpu_blocks[b] for b in reversed(table.block_ids))
            self._seqs[seq_id] = _Reservation(start, table.num_tokens)
        return copies

    def can_swap_in(self, seq_ids: Iterable[Hashable], num_new_tokens: int = 0) -> bool:
        """Whether swap_in(seq_ids) would succeed now (a run never needs more blocks to grow)."""
        ids = self._collect(seq_ids, self._swapped, "swapped out")
        starts = []
        for _ in ids:
            start = self.free_extents.reserve(self.blocks_per_seq)
            if start is None:
                break
            starts.append(start)
        for start in starts:
            self.free_extents.release(start, self.blocks_per_seq)
        return len(starts) == len(ids)

    @staticmethod
    def _collect(seq_ids: Iterable[Hashable], where: dict, state: str) -> list[Hashable]:
        ids = list(dict.fromkeys(seq_ids))
        missing = [seq_id for seq_id in ids if seq_id not in where]
        if missing:
            raise ValueError(f"sequences {missing!r} are not {state}")
        return ids

    def get_stats(self) -> KVCacheStats:
        num_free = self.free_extents.num_free_blocks
        used = self.num_blocks - num_free
        stranded = self.free_extents.num_blocks_in_extents_shorter_than(self.blocks_per_seq)
        return KVCacheStats(
            num_blocks=self.num_blocks, num_free_blocks=num_free, num_used_blocks=used,
            num_cached_blocks=0, slots_allocated=used * self.block_size,
            slots_filled=sum(seq.num_tokens for seq in self._seqs.values()),
            external_fragmentation=stranded / num_free if num_free else 0.0,
            num_cpu_blocks=self.num_cpu_blocks,
            num_free_cpu_blocks=self.cpu_block_pool.num_free_blocks,
            num_swapped_seqs=len(self._swapped), num_seqs=len(self._seqs),
            block_counts=self.seq_block_counts(),
        )

    def seq_block_counts(self) -> dict[Hashable, int]:
        """Blocks reserved by each sequence on the device."""
        return {seq_id: self.blocks_per_seq for seq_id in self._seqs}

    def block_map(self) -> BlockMap:
        """Every block of the arena (a reservation's unfilled tail is held with fill 0) and of
        the CPU pool; ``stranded_blocks`` are free blocks in runs too short for a reservation."""
        device = reservation_map(self.num_blocks, self.block_size, self.blocks_per_seq,
                                 ((s, r.start, r.num_tokens) for s, r in self._seqs.items()))
        stranded = [b for start, length in self.free_extents.extents
                    if length < self.blocks_per_seq for b in range(start, start + length)]
        return BlockMap(self.block_size, device,
                        pool_map(self.cpu_block_pool, self._swapped.items(), trim_free_tail=True),
                        kind="contiguous",
                        extra={"blocks_per_seq": self.blocks_per_seq,
                               "stranded_blocks": stranded})

    def check_invariants(self) -> None:
        """Raise AssertionError if the reservations and free extents do not tile the arena."""
        assert not self._seqs.keys() & self._swapped.keys(), "a sequence is on both sides"
        extents = self.free_extents.extents
        assert all(length > 0 for _, length in extents), "empty free extent"
        assert all(a[0] + a[1] < b[0] for a, b in zip(extents, extents[1:])), \
            "free extents overlap, are unsorted or are adjacent without being merged"
        assert self.free_extents.num_free_blocks == sum(length for _, length in extents)
        runs = sorted([*extents, *((s.start, self.blocks_per_seq) for s in self._seqs.values())])
        position = 0
        for start, length in runs:
            assert start == position, f"blocks {min(start, position)}.. are lost or double-booked"
            position += length
        assert position == self.num_blocks, "the arena is not fully accounted for"
        for seq_id, seq in self._seqs.items():
            assert 0 <= seq.num_tokens <= self.max_model_len, f"{seq_id!r} overflows its run"
        for seq_id, table in self._swapped.items():
            assert len(table.block_ids) == cdiv(table.num_tokens, self.block_size), \
                f"swapped {seq_id!r}: {len(table.block_ids)} blocks for {table.num_tokens} tokens"
        self.cpu_block_pool.check_invariants(
            Counter(b for table in self._swapped.values() for b in table.block_ids))
