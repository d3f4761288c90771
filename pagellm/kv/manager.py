"""KVCacheManager: the paged KV cache as the scheduler sees it.

Layering: the scheduler calls this manager; the manager keeps one block table per sequence and
asks the BlockPool (kv/block_pool.py) for physical blocks. Pure Python, no torch: the model side
receives block ids and (src, dst) copy lists and moves the actual K/V.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field

from pagellm.kv.block_map import BlockMap, pool_map
from pagellm.kv.block_pool import BlockHash, BlockPool, KVCacheBlock, hash_block_tokens
from pagellm.kv.block_table import BlockTable, cdiv
from pagellm.kv.interface import NO_PREFIX, BlockCopies, KVCacheStats, PrefixMatch
from pagellm.kv.invariants import check_paged_manager


@dataclass(slots=True)
class _Sequence:
    """Per-sequence state. Invariant: with prefix caching on, ``block_hashes[i]`` is the chained
    hash of full block ``i`` and there is one per full block (none when caching is off); the
    first ``num_computed_hashes`` of them cover blocks whose K/V a finished step computed."""

    table: BlockTable
    extra_keys: tuple[Hashable, ...] = ()
    block_hashes: list[BlockHash] = field(default_factory=list)
    num_computed_hashes: int = 0


class KVCacheManager:
    """Paged KV cache manager: block tables, copy-on-write, prefix caching, swap to CPU.

    Invariants (``check_invariants``): every device block is free or held, never both; its ref
    count equals the number of device block tables that hold it; the same holds for the CPU pool
    and the tables of swapped-out sequences; a table holds ``cdiv(num_tokens, block_size)`` blocks;
    a block shared by several tables is never written (appending into it copies it first), so a
    shared block is either full or equally filled in every table holding it.

    Every operation either succeeds completely or reports failure (None) having changed nothing.

    Prefix caching: a block enters the index when allocate_slots makes it full, i.e. when the step
    that writes its K/V is scheduled, as in vLLM. A sequence must therefore not be freed between
    allocate_slots and the step that computes those slots, or its last blocks would be indexed
    without their K/V.
    """

    def __init__(self, num_blocks: int, block_size: int, num_cpu_blocks: int = 0,
                 enable_prefix_caching: bool = False, watermark: float = 0.01) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {watermark}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.num_cpu_blocks = num_cpu_blocks
        self.enable_prefix_caching = enable_prefix_caching
        # Admission keeps this many blocks free so that running sequences can still grow.
        self.watermark_blocks = int(watermark * num_blocks)
        self.block_pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self.cpu_block_pool = BlockPool(num_cpu_blocks)
        self._blocks = self.block_pool.blocks
        self._seqs: dict[Hashable, _Sequence] = {}  # on the device
        self._swapped: dict[Hashable, _Sequence] = {}  # their tables hold CPU block ids
        self._prefix_queries = 0
        self._prefix_hits = 0

    def lookup_prefix(self, token_ids: Sequence[int],
                      extra_keys: Iterable[Hashable] = ()) -> PrefixMatch:
        """The longest run of cached full blocks starting the prompt, never the whole prompt.

        No side effects. Call it right before allocate_slots: any allocation in between may evict
        the blocks it found (allocate_slots then raises ValueError).
        """
        if not self.enable_prefix_caching:
            return NO_PREFIX
        extra_keys, bs = tuple(extra_keys), self.block_size
        block_ids: list[int] = []
        hashes: list[BlockHash] = []
        parent = None
        for i in range((len(token_ids) - 1) // bs):
            block_hash = hash_block_tokens(parent, token_ids[i * bs:(i + 1) * bs], extra_keys)
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            block_ids.append(block.block_id)
            hashes.append(block_hash)
            parent = block_hash.value
        return PrefixMatch(tuple(block_ids), len(block_ids) * bs, tuple(hashes))

    def allocate_slots(self, seq_id: Hashable, token_ids: Sequence[int], num_new_tokens: int,
                       prefix: PrefixMatch | None = None, extra_keys: Iterable[Hashable] = (),
                       watermark: bool = False) -> BlockCopies | None:
        """Grow ``seq_id`` by ``num_new_tokens`` slots; a new sequence starts at
        ``prefix.num_tokens`` (``prefix`` and ``extra_keys`` only matter for a new sequence).

        ``token_ids`` holds at least ``num_tokens + num_new_tokens`` tokens (blocks that become
        full are hashed from them). Returns the copy-on-write (src, dst) copies to perform before
        the step, or None, having changed nothing, when blocks are short. ``watermark=True``
        (admitting new work) also keeps ``watermark_blocks`` free.

        Full blocks enter the prefix index at once, so that a sequence admitted later in the
        same step shares them (the step writes every K/V before any attention reads it, as in
        vLLM). Until ``mark_computed`` says the step ran, they are provisional:
        ``discard_uncomputed`` (called by free when a step failed or was interrupted) takes
        them out of the index again, so no hash ever outlives a step that did not write its
        K/V.
        """
        seq = self._seqs.get(seq_id)
        if seq is not None and num_new_tokens == 1:
            # Decode fast path: one token into the sequence's own, partly filled, last block.
            table = seq.table
            n = table.num_tokens
            if (n % self.block_size and len(token_ids) > n
                    and self._blocks[table.block_ids[-1]].ref_cnt == 1):
                table.num_tokens = n = n + 1
                if self.enable_prefix_caching and n % self.block_size == 0:
                    self._cache_full_blocks(seq, token_ids)
                return []
        return self._allocate(seq_id, seq, token_ids, num_new_tokens, prefix, extra_keys, watermark)

    def _allocate(self, seq_id: Hashable, seq: _Sequence | None, token_ids: Sequence[int],
                  num_new_tokens: int, prefix: PrefixMatch | None,
                  extra_keys: Iterable[Hashable], watermark: bool) -> BlockCopies | None:
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        is_new = seq is None
        if seq is None:
            if seq_id in self._swapped:
                raise ValueError(f"sequence {seq_id!r} is swapped out: swap it in first")
            seq = self._new_sequence(token_ids, prefix, tuple(extra_keys))
        table = seq.table
        total = table.num_tokens + num_new_tokens
        if len(token_ids) < total:
            raise ValueError(f"sequence {seq_id!r}: {total} slots need as many token ids, "
                             f"got {len(token_ids)}")
        num_new_blocks = table.num_blocks_needed(num_new_tokens)
        copy_on_write = (num_new_tokens > 0 and table.last_block_is_partial()
                         and self._blocks[table.block_ids[-1]].ref_cnt > 1)
        hit_blocks = [self._blocks[i] for i in table.block_ids] if is_new else []
        # Cached blocks sitting in the free queue leave it when the new sequence takes them.
        num_needed = num_new_blocks + copy_on_write + sum(b.ref_cnt == 0 for b in hit_blocks)
        if not self._can_allocate(num_needed, watermark):
            return None

        for block in hit_blocks:  # before get_new_blocks, which could evict them
            self.block_pool.touch(block)
        if is_new and prefix is not None:
            self._prefix_queries += len(token_ids)
            self._prefix_hits += table.num_tokens
        copies = [self._copy_on_write(table)] if copy_on_write else []
        if num_new_blocks > 0:
            new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
            table.block_ids.extend(block.block_id for block in new_blocks)
        table.num_tokens = total
        if self.enable_prefix_caching:
            self._cache_full_blocks(seq, token_ids)
        if is_new:
            self._seqs[seq_id] = seq
        return copies

    def _new_sequence(self, token_ids: Sequence[int], prefix: PrefixMatch | None,
                      extra_keys: tuple[Hashable, ...]) -> _Sequence:
        """A sequence (not yet registered) starting with the prefix blocks, not yet referenced."""
        seq = _Sequence(BlockTable(self.block_size), extra_keys)
        if prefix is not None and prefix.num_tokens:
            self._check_prefix(prefix, token_ids, extra_keys)
            seq.table.block_ids.extend(prefix.block_ids)
            seq.table.num_tokens = prefix.num_tokens
            seq.block_hashes.extend(prefix.block_hashes)
        return seq

    def _check_prefix(self, prefix: PrefixMatch, token_ids: Sequence[int],
                      extra_keys: tuple[Hashable, ...]) -> None:
        bs = self.block_size
        if not self.enable_prefix_caching:
            raise ValueError("a prefix match was passed but prefix caching is disabled")
        if not (prefix.num_tokens == len(prefix.block_ids) * bs == len(prefix.block_hashes) * bs
                and prefix.num_tokens <= len(token_ids) - 1):
            raise ValueError(f"malformed prefix match of {prefix.num_tokens} tokens for a prompt "
                             f"of {len(token_ids)}")
        for i, (block_id, block_hash) in enumerate(zip(prefix.block_ids, prefix.block_hashes)):
            if (block_hash.token_ids != tuple(token_ids[i * bs:(i + 1) * bs])
                    or block_hash.extra_keys != extra_keys):
                raise ValueError("the prefix match was looked up for other tokens or extra keys")
            if self._blocks[block_id].block_hash != block_hash:
                raise ValueError("stale prefix match: its blocks were evicted since lookup_prefix; "
                                 "look the prefix up right before allocate_slots")

    def _can_allocate(self, num_blocks: int, watermark: bool) -> bool:
        num_free = self.block_pool.num_free_blocks
        if watermark:
            return num_free - num_blocks >= self.watermark_blocks
        return num_free >= num_blocks

    def _copy_on_write(self, table: BlockTable) -> tuple[int, int]:
        """Give the table a private copy of its shared, partly filled last block."""
        old = self._blocks[table.block_ids[-1]]
        new = self.block_pool.get_new_blocks(1)[0]
        self.block_pool.free_blocks([old])  # drops one reference; others still hold it
        table.block_ids[-1] = new.block_id
        return old.block_id, new.block_id

    def can_admit(self, num_tokens: int, watermark: bool = True, reserved_blocks: int = 0
                  ) -> bool:
        """Whether a new sequence of ``num_tokens`` slots fits now (ignoring prefix hits),
        leaving ``reserved_blocks`` free for others."""
        return self._can_allocate(cdiv(num_tokens, self.block_size) + reserved_blocks,
                                  watermark)

    def blocks_needed(self, seq_id: Hashable, num_new_tokens: int) -> int:
        """New device blocks ``allocate_slots(seq_id, ..., num_new_tokens)`` would take."""
        seq = self._seqs.get(seq_id)
        if seq is None:
            return 0
        table = seq.table
        copy_on_write = (num_new_tokens > 0 and table.last_block_is_partial()
                         and self._blocks[table.block_ids[-1]].ref_cnt > 1)
        return table.num_blocks_needed(num_new_tokens) + copy_on_write

    def mark_computed(self, seq_id: Hashable) -> None:
        """The step that filled the sequence's slots ran: its provisional hashes are final."""
        seq = self._seqs.get(seq_id)
        if seq is not None:
            seq.num_computed_hashes = len(seq.block_hashes)

    def discard_uncomputed(self, seq_id: Hashable) -> None:
        """Withdraw the hashes of blocks whose K/V was never computed (the step that was to
        fill them failed): they leave the prefix index, so no later prompt can hit them."""
        seq = self._seqs.get(seq_id)
        if seq is None or seq.num_computed_hashes == len(seq.block_hashes):
            return
        start = seq.num_computed_hashes
        for block_id, block_hash in zip(seq.table.block_ids[start:], seq.block_hashes[start:]):
            block = self._blocks[block_id]
            if block.block_hash == block_hash:
                self.block_pool.uncache(block)
        del seq.block_hashes[start:]

    def _cache_full_blocks(self, seq: _Sequence, token_ids: Sequence[int]) -> None:
        bs, hashes, table = self.block_size, seq.block_hashes, seq.table
        parent = hashes[-1].value if hashes else None
        for i in range(len(hashes), table.num_tokens // bs):
            block_hash = hash_block_tokens(parent, token_ids[i * bs:(i + 1) * bs], seq.extra_keys)
            self.block_pool.cache_full_block(self._blocks[table.block_ids[i]], block_hash)
            hashes.append(block_hash)
            parent = block_hash.value

    def num_tokens(self, seq_id: Hashable) -> int:
        """Token slots the sequence holds, on the device or swapped out."""
        seq = self._seqs.get(seq_id) or self._swapped.get(seq_id)
        if seq is None:
            raise KeyError(f"unknown sequence {seq_id!r}")
        return seq.table.num_tokens

    def get_block_table(self, seq_id: Hashable) -> list[int]:
        """Physical device block of each logical block (a copy)."""
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise KeyError(f"sequence {seq_id!r} is not on the device")
        return list(seq.table.block_ids)

    def is_swapped(self, seq_id: Hashable) -> bool:
        return seq_id in self._swapped

    def fork(self, parent_id: Hashable, child_id: Hashable) -> BlockCopies:
        """The child shares every block of the parent (ref counts up); a later append into a
        shared, partly filled block copies it. Returns the block copies to perform, always
        none here (the interface returns them because the contiguous manager has to copy)."""
        parent = self._seqs.get(parent_id)
        if parent is None:
            raise ValueError(f"cannot fork {parent_id!r}: it is not on the device")
        if child_id in self._seqs or child_id in self._swapped:
            raise ValueError(f"cannot fork into {child_id!r}: the sequence exists")
        for block_id in parent.table.block_ids:
            self._blocks[block_id].ref_cnt += 1
        self._seqs[child_id] = _Sequence(parent.table.copy(), parent.extra_keys,
                                         list(parent.block_hashes), parent.num_computed_hashes)
        return []

    def free(self, seq_id: Hashable) -> None:
        """Release a sequence, on the device or swapped; unknown ids are ignored (an abort may
        race with completion). Freed blocks keep their hashes until reused (lazy eviction), tail
        first in eviction order."""
        seq = self._seqs.pop(seq_id, None)
        if seq is not None:
            self.block_pool.free_blocks(self._blocks[b] for b in reversed(seq.table.block_ids))
            return
        seq = self._swapped.pop(seq_id, None)
        if seq is not None:
            cpu_blocks = self.cpu_block_pool.blocks
            self.cpu_block_pool.free_blocks(cpu_blocks[b] for b in reversed(seq.table.block_ids))

    def swap_out(self, seq_ids: Iterable[Hashable]) -> BlockCopies | None:
        """Move the sequences' blocks to the CPU pool: returns (device, cpu) copies, or None if
        the CPU pool is short. A block shared within the group gets one CPU block, still shared;
        the device blocks are freed (cached ones stay reusable until evicted)."""
        seqs = self._collect(seq_ids, self._seqs, "on the device")
        holders = Counter(b for _, seq in seqs for b in seq.table.block_ids)
        if len(holders) > self.cpu_block_pool.num_free_blocks:
            return None
        mapping: dict[int, int] = {}
        for (device_id, num_holders), cpu_block in zip(
                holders.items(), self.cpu_block_pool.get_new_blocks(len(holders))):
            cpu_block.ref_cnt = num_holders
            mapping[device_id] = cpu_block.block_id
        for seq_id, seq in seqs:
            self.block_pool.free_blocks(self._blocks[b] for b in reversed(seq.table.block_ids))
            seq.table.block_ids = [mapping[b] for b in seq.table.block_ids]
            self._swapped[seq_id] = self._seqs.pop(seq_id)
        return list(mapping.items())

    def swap_in(self, seq_ids: Iterable[Hashable]) -> BlockCopies | None:
        """Bring swapped sequences back: returns (cpu, device) copies, or None if device blocks
        are short. Full blocks whose contents are still cached on the device are taken back
        from the prefix cache instead of copied."""
        seqs = self._collect(seq_ids, self._swapped, "swapped out")
        holders, reuse, num_needed = self._swap_in_plan(seqs)
        if num_needed > self.block_pool.num_free_blocks:
            return None
        for cpu_id, block in reuse.items():  # before get_new_blocks, which could evict them
            self.block_pool.touch(block, holders[cpu_id])
        mapping = {cpu_id: block.block_id for cpu_id, block in reuse.items()}
        to_copy = [cpu_id for cpu_id in holders if cpu_id not in reuse]
        copies: BlockCopies = []
        for cpu_id, block in zip(to_copy, self.block_pool.get_new_blocks(len(to_copy))):
            block.ref_cnt = holders[cpu_id]
            mapping[cpu_id] = block.block_id
            copies.append((cpu_id, block.block_id))
        cpu_blocks = self.cpu_block_pool.blocks
        for seq_id, seq in seqs:
            self.cpu_block_pool.free_blocks(cpu_blocks[b] for b in reversed(seq.table.block_ids))
            seq.table.block_ids = [mapping[b] for b in seq.table.block_ids]
            for block_id, block_hash in zip(seq.table.block_ids, seq.block_hashes):
                self.block_pool.cache_full_block(self._blocks[block_id], block_hash)
            self._seqs[seq_id] = self._swapped.pop(seq_id)
        return copies

    def can_swap_in(self, seq_ids: Iterable[Hashable], num_new_tokens: int = 0) -> bool:
        """Whether swap_in(seq_ids) and then allocate_slots(s, ..., num_new_tokens) for each of
        them would both succeed now (a shared, partly filled last block counts as copied)."""
        seqs = self._collect(seq_ids, self._swapped, "swapped out")
        holders, _, num_needed = self._swap_in_plan(seqs)
        for _, seq in seqs:
            table = seq.table
            num_needed += table.num_blocks_needed(num_new_tokens) + (
                num_new_tokens > 0 and table.last_block_is_partial()
                and holders[table.block_ids[-1]] > 1)
        return num_needed <= self.block_pool.num_free_blocks

    def _swap_in_plan(self, seqs: list[tuple[Hashable, _Sequence]]
                      ) -> tuple[Counter[int], dict[int, KVCacheBlock], int]:
        """(holders of each CPU block, device blocks to take back, device blocks needed)."""
        holders = Counter(b for _, seq in seqs for b in seq.table.block_ids)
        reuse = self._cached_on_device(seqs)
        num_needed = (len(holders) - len(reuse)
                      + len({b.block_id for b in reuse.values() if b.ref_cnt == 0}))
        return holders, reuse, num_needed

    def _cached_on_device(self, seqs: list[tuple[Hashable, _Sequence]]) -> dict[int, KVCacheBlock]:
        """CPU block id -> device block that still caches the same contents."""
        reuse: dict[int, KVCacheBlock] = {}
        if self.enable_prefix_caching:
            for _, seq in seqs:
                for cpu_id, block_hash in zip(seq.table.block_ids, seq.block_hashes):
                    block = self.block_pool.get_cached_block(block_hash)
                    if block is not None:
                        reuse[cpu_id] = block
        return reuse

    @staticmethod
    def _collect(seq_ids: Iterable[Hashable], where: dict[Hashable, _Sequence],
                 state: str) -> list[tuple[Hashable, _Sequence]]:
        ids = list(dict.fromkeys(seq_ids))
        missing = [seq_id for seq_id in ids if seq_id not in where]
        if missing:
            raise ValueError(f"sequences {missing!r} are not {state}")
        return [(seq_id, where[seq_id]) for seq_id in ids]

    def get_stats(self) -> KVCacheStats:
        bs = self.block_size
        partial: dict[int, int] = {}  # partly filled block -> tokens it holds
        for seq in self._seqs.values():
            if seq.table.num_tokens % bs:
                partial[seq.table.block_ids[-1]] = seq.table.num_tokens % bs
        used = self.block_pool.num_used_blocks
        return KVCacheStats(
            num_blocks=self.num_blocks, num_free_blocks=self.block_pool.num_free_blocks,
            num_used_blocks=used, num_cached_blocks=self.block_pool.num_cached_blocks,
            prefix_queries=self._prefix_queries, prefix_hits=self._prefix_hits,
            slots_allocated=used * bs,
            slots_filled=(used - len(partial)) * bs + sum(partial.values()),
            num_cpu_blocks=self.num_cpu_blocks,
            num_free_cpu_blocks=self.cpu_block_pool.num_free_blocks,
            num_swapped_seqs=len(self._swapped), num_seqs=len(self._seqs),
            block_counts=self.seq_block_counts(),
        )

    def seq_block_counts(self) -> dict[Hashable, int]:
        """Device blocks held by each sequence on the device (shared blocks count for each)."""
        return {seq_id: len(seq.table.block_ids) for seq_id, seq in self._seqs.items()}

    def block_map(self) -> BlockMap:
        """Every device and CPU block: state, ref count, holders, tokens held (the dashboard)."""
        return BlockMap(self.block_size,
                        pool_map(self.block_pool, ((s, q.table) for s, q in self._seqs.items())),
                        pool_map(self.cpu_block_pool,
                                 ((s, q.table) for s, q in self._swapped.items()),
                                 trim_free_tail=True))

    def check_invariants(self) -> None:
        """Raise AssertionError if any invariant of the class docstring is broken (for tests;
        the checks are in pagellm.kv.invariants)."""
        check_paged_manager(self)
