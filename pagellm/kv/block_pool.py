"""Physical KV blocks: the free queue, reference counts and the prefix-cache index.

A block is either referenced (``ref_cnt > 0``, held by that many block tables) or free (in the
free queue, ``ref_cnt == 0``). A free block may still hold a valid hash: its K/V are intact until
the pool hands it out again, so a later prompt with the same prefix can take it back from the
middle of the free queue (lazy eviction). The free queue is therefore also the eviction order.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

# Parent of a sequence's first block. Any fixed 32-byte value works: what matters is that every
# block's digest covers its whole prefix.
ROOT_HASH = hashlib.sha256(b"pagellm.kv.prefix-cache.root").digest()


class BlockHash(NamedTuple):
    """Identity of the contents of one full block, and of every token before it.

    ``value`` is sha256 over (parent's value, the block's token ids, extra keys). The inputs are
    kept too, so that a prefix hit compares token ids and keys instead of trusting the digest alone:
    equality of two BlockHash tuples compares all four fields. Extra keys (a LoRA adapter, a
    per-tenant cache salt) separate caches that must not share KV even for identical tokens.
    """

    value: bytes
    parent: bytes
    token_ids: tuple[int, ...]
    extra_keys: tuple[Hashable, ...]


def hash_block_tokens(parent: bytes | None, token_ids: Sequence[int],
                      extra_keys: tuple[Hashable, ...] = ()) -> BlockHash:
    """Chained, collision-resistant hash of one full block.

    The encoding is unambiguous: a fixed 32-byte parent, the token count, the tokens as int64, then
    ``repr`` of the extra keys (which should therefore be str, int, bytes or tuples of them).
    Python's ``hash()`` is never used: it is cheap to collide, and a collision would let one user's
    prompt read another user's cached KV.
    """
    parent = ROOT_HASH if parent is None else parent
    tokens = tuple(token_ids)
    h = hashlib.sha256(parent)
    h.update(len(tokens).to_bytes(4, "little"))
    h.update(array("q", tokens).tobytes())
    if extra_keys:
        h.update(repr(extra_keys).encode())
    return BlockHash(h.digest(), parent, tokens, extra_keys)


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    """One physical block. ``prev_free``/``next_free`` link it into the free queue (intrusive list);
    both are None exactly when the block is not in the queue."""

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    prev_free: KVCacheBlock | None = field(default=None, repr=False)
    next_free: KVCacheBlock | None = field(default=None, repr=False)


class FreeBlockQueue:
    """Doubly linked list of free blocks threaded through the blocks themselves.

    Why not a deque: a prefix hit takes a cached block out of the *middle* of the free queue, which
    is O(n) for ``deque.remove`` and O(1) here. The head is evicted first; the tail last.

    Blocks never handed out yet need not exist as objects: ``num_unborn`` of them wait as one
    run at the marker's place in the list (where the pool's initial blocks would stand), and
    ``popleft`` reaching the marker creates the next one with ``create``. A pool of a million
    blocks (a swap space of GiBs for a small model) thus costs nothing until it is used.
    Invariant: ``num_free_blocks`` equals the number of blocks between the two sentinels plus
    ``num_unborn``.
    """

    def __init__(self, blocks: Iterable[KVCacheBlock] = (), num_unborn: int = 0,
                 create: Callable[[], KVCacheBlock] | None = None) -> None:
        if num_unborn and create is None:
            raise ValueError("unborn blocks need a create function")
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)
        self._marker = KVCacheBlock(-2)
        self._create = create
        self.num_unborn = num_unborn
        if num_unborn:
            self._insert(self._marker, self._tail.prev_free, self._tail)
            self.num_free_blocks += num_unborn - 1

    def __len__(self) -> int:
        return self.num_free_blocks

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail:
            raise IndexError("no free blocks")
        if block is self._marker:
            assert self._create is not None
            self.num_unborn -= 1
            if self.num_unborn:
                self.num_free_blocks -= 1
            else:
                self.remove(block)
            return self._create()
        self.remove(block)
        return block

    def append(self, block: KVCacheBlock) -> None:
        self._insert(block, self._tail.prev_free, self._tail)

    def appendleft(self, block: KVCacheBlock) -> None:
        self._insert(block, self._head, self._head.next_free)

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def _insert(self, block: KVCacheBlock, prev: KVCacheBlock, nxt: KVCacheBlock) -> None:
        if block.prev_free is not None or block.next_free is not None:
            raise ValueError(f"block {block.block_id} is already in the free queue")
        block.prev_free, block.next_free = prev, nxt
        prev.next_free = block
        nxt.prev_free = block
        self.num_free_blocks += 1

    def __iter__(self) -> Iterator[KVCacheBlock]:
        """The blocks that exist, in queue order (the unborn ones are not yielded)."""
        block = self._head.next_free
        while block is not self._tail:
            if block is not self._marker:
                yield block
            block = block.next_free


class BlockPool:
    """A fixed set of ``num_blocks`` physical blocks with reference counts and a prefix index.

    Invariants (see ``check_invariants``): a block is in the free queue iff its ref count is 0;
    ``free + used == num_blocks``; a block holds a hash iff the index maps that hash's value to it.
    Eviction order: unhashed blocks first (they hold nothing reusable), then cached blocks least
    recently freed first; callers free a sequence's blocks tail first, so that a prompt's shared
    head outlives its private tail.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = False) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        # The blocks handed out so far, indexed by id: ids are handed out first in increasing
        # order, so this list is blocks 0 .. len - 1 and every block past it is free and empty.
        self.blocks: list[KVCacheBlock] = []
        self.free_queue = FreeBlockQueue(num_unborn=num_blocks, create=self._create_block)
        self.cached: dict[bytes, KVCacheBlock] = {}  # hash value -> block holding it

    def _create_block(self) -> KVCacheBlock:
        block = KVCacheBlock(len(self.blocks))
        self.blocks.append(block)
        return block

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.free_queue.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take blocks from the head of the free queue, ref count 1, evicting their old hash."""
        if num_blocks > self.free_queue.num_free_blocks:
            raise ValueError(
                f"asked for {num_blocks} blocks, only {self.free_queue.num_free_blocks} are free")
        blocks = []
        for _ in range(num_blocks):
            block = self.free_queue.popleft()
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def touch(self, block: KVCacheBlock, num_refs: int = 1) -> None:
        """Add references to a block, taking it out of the free queue if it was free (a hit)."""
        if block.ref_cnt == 0:
            self.free_queue.remove(block)
        block.ref_cnt += num_refs

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; pass them in the order they should be evicted."""
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self.free_queue.appendleft(block)
                else:
                    self.free_queue.append(block)
            elif block.ref_cnt < 0:
                raise AssertionError(f"block {block.block_id} freed more often than referenced")

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        """The block holding exactly these tokens after exactly this prefix, or None."""
        block = self.cached.get(block_hash.value)
        if block is None or block.block_hash != block_hash:
            return None
        return block

    def cache_full_block(self, block: KVCacheBlock, block_hash: BlockHash) -> bool:
        """Enter a block that has just become full in the index. If another block already holds
        this hash the first one stays the cached copy and this one remains private."""
        if (not self.enable_caching or block.block_hash is not None
                or block_hash.value in self.cached):
            return False
        block.block_hash = block_hash
        self.cached[block_hash.value] = block
        return True

    def uncache(self, block: KVCacheBlock) -> None:
        """Take a block out of the prefix index (its K/V turned out never to be written)."""
        if block.block_hash is not None and self.cached.get(block.block_hash.value) is block:
            self._evict(block)

    def _evict(self, block: KVCacheBlock) -> None:
        assert block.block_hash is not None
        del self.cached[block.block_hash.value]
        block.block_hash = None

    def check_invariants(self, ref_counts: Counter[int]) -> None:
        """``ref_counts``: how many block tables hold each block id. Raises AssertionError."""
        free_ids = [block.block_id for block in self.free_queue]
        queue = self.free_queue
        assert len(free_ids) == len(set(free_ids)) == queue.num_free_blocks - queue.num_unborn, \
            "free queue holds a block twice or miscounts"
        assert len(self.blocks) + queue.num_unborn == self.num_blocks, "blocks lost or made twice"
        assert all(block.block_id == i for i, block in enumerate(self.blocks))
        free = set(free_ids)
        for block in self.blocks:
            expected = ref_counts.get(block.block_id, 0)
            assert block.ref_cnt == expected, \
                f"block {block.block_id}: ref_cnt {block.ref_cnt} but held by {expected} tables"
            assert (block.ref_cnt == 0) == (block.block_id in free), (
                f"block {block.block_id}: ref_cnt {block.ref_cnt}, "
                f"in free queue: {block.block_id in free}")
            if block.block_hash is not None:
                assert self.cached.get(block.block_hash.value) is block, \
                    f"block {block.block_id} holds a hash the index does not map to it"
        assert all(0 <= b < len(self.blocks) for b in ref_counts), \
            "a table holds a block the pool never handed out"
        assert self.num_free_blocks + sum(1 for b in self.blocks if b.ref_cnt) == self.num_blocks
        for value, block in self.cached.items():
            assert block.block_hash is not None and block.block_hash.value == value
            h = block.block_hash
            assert hash_block_tokens(h.parent, h.token_ids, h.extra_keys) == h, \
                f"block {block.block_id}: stored hash does not match its tokens"
