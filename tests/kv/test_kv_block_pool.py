"""Block pool: the intrusive free queue, ref counts, chained hashes, lazy eviction."""
from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter

import pytest

from pagellm.kv import (
    ROOT_HASH,
    BlockHash,
    BlockPool,
    FreeBlockQueue,
    KVCacheBlock,
    hash_block_tokens,
)


def ids(queue: FreeBlockQueue) -> list[int]:
    return [block.block_id for block in queue]


def test_free_queue_order_append_appendleft_and_remove_from_middle():
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    assert ids(queue) == [0, 1, 2, 3, 4] and len(queue) == 5

    queue.remove(blocks[2])  # from the middle
    assert ids(queue) == [0, 1, 3, 4] and len(queue) == 4
    assert blocks[2].prev_free is None and blocks[2].next_free is None

    assert queue.popleft() is blocks[0]
    queue.append(blocks[0])
    queue.appendleft(blocks[2])
    assert ids(queue) == [2, 1, 3, 4, 0]
    queue.remove(blocks[0])  # the tail
    queue.remove(blocks[2])  # the head
    assert ids(queue) == [1, 3, 4] and len(queue) == 3


def test_free_queue_empty_and_misuse():
    block = KVCacheBlock(0)
    queue = FreeBlockQueue([block])
    assert queue.popleft() is block
    with pytest.raises(IndexError):
        queue.popleft()
    with pytest.raises(ValueError, match="not in the free queue"):
        queue.remove(block)
    queue.append(block)
    with pytest.raises(ValueError, match="already in the free queue"):
        queue.append(block)
    assert len(queue) == 1


@pytest.mark.parametrize("seed", range(5))
def test_unborn_blocks_queue_as_the_initial_blocks_would(seed):
    """A queue whose blocks are created as popleft reaches them hands out, under any mix of
    popleft / append / appendleft / remove, the blocks a queue holding all of them from the
    start hands out, in the same order, and counts the same."""
    import random

    rng = random.Random(seed)
    num = 12
    eager_blocks = [KVCacheBlock(i) for i in range(num)]
    eager = FreeBlockQueue(eager_blocks)
    created: list[KVCacheBlock] = []

    def create() -> KVCacheBlock:
        created.append(KVCacheBlock(len(created)))
        return created[-1]

    lazy = FreeBlockQueue(num_unborn=num, create=create)
    taken: list[int] = []  # ids out of both queues
    for _ in range(300):
        op = rng.choice(["pop", "pop", "append", "appendleft", "remove"])
        if op == "pop" and len(eager):
            block = eager.popleft()
            assert lazy.popleft().block_id == block.block_id
            taken.append(block.block_id)
        elif op in ("append", "appendleft") and taken:
            block_id = taken.pop(rng.randrange(len(taken)))
            getattr(eager, op)(eager_blocks[block_id])
            getattr(lazy, op)(created[block_id])
        elif op == "remove":
            returned = [b.block_id for b in lazy]  # the created blocks in the queue
            if returned:
                block_id = rng.choice(returned)
                eager.remove(eager_blocks[block_id])
                lazy.remove(created[block_id])
                taken.append(block_id)
        assert len(lazy) == len(eager)
        assert ids(lazy) == [i for i in ids(eager) if i < len(created)]
        assert lazy.num_unborn == num - len(created)
    while len(eager):
        assert lazy.popleft().block_id == eager.popleft().block_id
    with pytest.raises(IndexError):
        lazy.popleft()


def test_a_pool_creates_its_blocks_only_when_handed_out():
    pool = BlockPool(10 ** 7)  # ten million blocks: nothing is built for them up front
    assert pool.num_free_blocks == 10 ** 7 and pool.blocks == []
    first = pool.get_new_blocks(3)
    assert [b.block_id for b in first] == [0, 1, 2] and pool.blocks == first
    pool.free_blocks(reversed(first))
    assert [b.block_id for b in pool.get_new_blocks(4)] == [0, 1, 2, 3]
    pool.check_invariants(Counter({0: 1, 1: 1, 2: 1, 3: 1}))


def test_get_new_blocks_and_free_keep_ref_counts():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    assert (a.block_id, b.block_id) == (0, 1) and a.ref_cnt == b.ref_cnt == 1
    assert pool.num_free_blocks == 2 and pool.num_used_blocks == 2
    pool.touch(a)
    assert a.ref_cnt == 2
    pool.free_blocks([a])
    assert a.ref_cnt == 1 and pool.num_free_blocks == 2  # still held once
    pool.free_blocks([a, b])
    assert pool.num_free_blocks == 4
    pool.check_invariants(Counter())
    with pytest.raises(ValueError, match="only 4 are free"):
        pool.get_new_blocks(5)
    assert pool.num_free_blocks == 4


def test_free_block_keeps_its_hash_until_reused_and_unhashed_blocks_go_first():
    pool = BlockPool(3, enable_caching=True)
    blocks = pool.get_new_blocks(3)
    h = hash_block_tokens(None, [1, 2])
    assert pool.cache_full_block(blocks[0], h)
    pool.free_blocks(blocks)  # in eviction order: 0 (cached) then 1, 2 (unhashed)

    assert pool.get_cached_block(h) is blocks[0]  # lazy eviction: still reusable
    assert ids(pool.free_queue)[-1] == 0  # the cached block is evicted last
    first_two = pool.get_new_blocks(2)
    assert {b.block_id for b in first_two} == {1, 2}
    assert pool.get_cached_block(h) is blocks[0]

    pool.touch(blocks[0])  # a prefix hit takes it out of the middle of the queue
    assert blocks[0].ref_cnt == 1 and pool.num_free_blocks == 0
    pool.free_blocks([blocks[0]])
    (again,) = pool.get_new_blocks(1)  # now it is reused: its hash is evicted
    assert again is blocks[0] and again.block_hash is None
    assert pool.get_cached_block(h) is None and pool.num_cached_blocks == 0


def test_cached_blocks_are_evicted_least_recently_freed_first():
    pool = BlockPool(4, enable_caching=True)
    blocks = pool.get_new_blocks(4)
    for i, block in enumerate(blocks):
        pool.cache_full_block(block, hash_block_tokens(None, [i]))
    pool.free_blocks([blocks[3], blocks[2]])
    pool.free_blocks([blocks[0], blocks[1]])
    assert ids(pool.free_queue) == [3, 2, 0, 1]
    assert [b.block_id for b in pool.get_new_blocks(2)] == [3, 2]


def test_first_cached_copy_wins():
    pool = BlockPool(2, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    h = hash_block_tokens(None, [7, 7])
    assert pool.cache_full_block(a, h)
    assert not pool.cache_full_block(b, h)
    assert pool.get_cached_block(h) is a and b.block_hash is None


def test_caching_disabled_indexes_nothing():
    pool = BlockPool(1)
    (block,) = pool.get_new_blocks(1)
    assert not pool.cache_full_block(block, hash_block_tokens(None, [1]))
    assert pool.num_cached_blocks == 0


def test_hash_chains_parent_tokens_and_extra_keys():
    h = hash_block_tokens(None, [1, 2, 3])
    assert len(h.value) == 32 and h.parent == ROOT_HASH
    assert h == hash_block_tokens(None, (1, 2, 3))  # deterministic, any sequence type
    assert hash_block_tokens(None, [3, 2, 1]).value != h.value
    assert hash_block_tokens(h.value, [1, 2, 3]).value != h.value  # the prefix matters
    assert hash_block_tokens(None, [1, 2, 3], ("lora-1",)).value != h.value
    assert hash_block_tokens(None, [1, 2, 3], ("lora-1",)).value != \
        hash_block_tokens(None, [1, 2, 3], ("lora-2",)).value
    # Unambiguous encoding: one token of value 1 vs the same bytes split differently.
    assert hash_block_tokens(None, [1, 0]).value != hash_block_tokens(None, [1]).value
    assert hash_block_tokens(None, [1], (1,)).value != hash_block_tokens(None, [1], ("1",)).value


def test_hash_does_not_depend_on_python_hash_seed():
    code = ("from pagellm.kv import hash_block_tokens;"
            "print(hash_block_tokens(None, [5, 6], ('salt', 3)).value.hex())")
    digests = set()
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, check=True)
        digests.add(out.stdout.strip())
    assert digests == {hash_block_tokens(None, [5, 6], ("salt", 3)).value.hex()}


def test_a_digest_collision_does_not_hit_other_tokens():
    """A block registered under a digest equal to ours but holding other tokens (what a hash
    collision would look like) is not a hit: the lookup compares token ids."""
    pool = BlockPool(1, enable_caching=True)
    (victim,) = pool.get_new_blocks(1)
    attacker = hash_block_tokens(None, [6, 6])
    forged = BlockHash(attacker.value, attacker.parent, (1, 2), ())
    victim.block_hash = forged
    pool.cached[attacker.value] = victim
    assert pool.get_cached_block(attacker) is None
    assert pool.get_cached_block(forged) is victim


def test_check_invariants_catches_a_wrong_ref_count_and_a_lost_block():
    pool = BlockPool(3)
    (block,) = pool.get_new_blocks(1)
    pool.check_invariants(Counter({0: 1}))
    with pytest.raises(AssertionError, match="ref_cnt"):
        pool.check_invariants(Counter({0: 2}))
    block.ref_cnt = 0  # neither free nor held: lost
    with pytest.raises(AssertionError):
        pool.check_invariants(Counter())
