"""The KV cache memory manager: pure Python, imports no torch, testable alone.

- ``memory``: bytes per token, capacity planning, model presets (the ``kv-calc`` calculator).
- ``block_pool``: physical blocks, the O(1) free queue, ref counts, chained block hashes.
- ``block_table``: one sequence's logical -> physical mapping and its slots.
- ``block_map``: every block's state, ref count, holders and fill (the dashboard's map).
- ``manager``: KVCacheManager, the paged manager the scheduler uses.
- ``contiguous``: ContiguousKVCacheManager, the max-length-reservation baseline.
"""
from pagellm.kv.block_map import BlockMap, BlockState, PoolMap
from pagellm.kv.block_pool import (
    ROOT_HASH,
    BlockHash,
    BlockPool,
    FreeBlockQueue,
    KVCacheBlock,
    hash_block_tokens,
)
from pagellm.kv.block_table import BlockTable, cdiv, compute_slot_mapping
from pagellm.kv.contiguous import ContiguousKVCacheManager, FreeExtents
from pagellm.kv.interface import (NO_PREFIX, BlockCopies, KVCacheManagerProtocol, KVCacheStats,
                                  PrefixMatch)
from pagellm.kv.manager import KVCacheManager
from pagellm.kv.memory import (
    PRESETS,
    KVCapacity,
    KVMemoryModel,
    dtype_bytes,
    format_bytes,
    parse_size,
)

__all__ = [
    "BlockMap", "BlockState", "PoolMap",
    "ROOT_HASH", "BlockHash", "BlockPool", "FreeBlockQueue", "KVCacheBlock", "hash_block_tokens",
    "BlockTable", "cdiv", "compute_slot_mapping",
    "ContiguousKVCacheManager", "FreeExtents",
    "NO_PREFIX", "BlockCopies", "KVCacheManagerProtocol", "KVCacheStats", "PrefixMatch",
    "KVCacheManager",
    "PRESETS", "KVCapacity", "KVMemoryModel", "dtype_bytes", "format_bytes", "parse_size",
]
