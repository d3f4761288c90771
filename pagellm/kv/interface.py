"""Records the KV cache managers hand to the scheduler: a prefix match and the statistics."""
from __future__ import annotations

from collections.abc import Hashable
from dataclasses import asdict, dataclass, field
from typing import Any

from pagellm.kv.block_pool import BlockHash

# (src, dst) block pairs the model side copies before the step: copy-on-write (device -> device),
# swap_out (device -> cpu) or swap_in (cpu -> device).
BlockCopies = list[tuple[int, int]]


@dataclass(slots=True, frozen=True)
class PrefixMatch:
    """The longest run of full cached blocks at the start of a prompt.

    Invariant: ``num_tokens == len(block_ids) * block_size <= len(prompt) - 1``; the last prompt
    token is always computed so that the step produces its logits. ``block_hashes`` are the hashes
    the blocks held at lookup time; allocate_slots checks that they still do.
    """

    block_ids: tuple[int, ...] = ()
    num_tokens: int = 0
    block_hashes: tuple[BlockHash, ...] = ()


NO_PREFIX = PrefixMatch()


@dataclass(slots=True)
class KVCacheStats:
    """A snapshot of the KV cache. Block counts are device blocks; slots are token slots.

    ``slots_allocated - slots_filled`` is internal fragmentation (slots held but holding no token);
    ``external_fragmentation`` is the share of free blocks that cannot serve a new reservation
    (always 0 for the paged manager, which needs no contiguity).
    """

    num_blocks: int
    num_free_blocks: int
    num_used_blocks: int
    num_cached_blocks: int  # blocks holding a reusable hash, in use or free
    usage: float = field(init=False)
    prefix_queries: int = 0  # prompt tokens of new sequences admitted with a prefix lookup
    prefix_hits: int = 0  # of those, tokens found in the prefix cache
    prefix_hit_rate: float = field(init=False)
    slots_allocated: int = 0
    slots_filled: int = 0  # a block shared by several sequences counts once
    waste_ratio: float = field(init=False)
    external_fragmentation: float = 0.0
    num_cpu_blocks: int = 0
    num_free_cpu_blocks: int = 0
    num_swapped_seqs: int = 0
    num_seqs: int = 0  # sequences on the device
    block_counts: dict[Hashable, int] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.usage = self.num_used_blocks / self.num_blocks if self.num_blocks else 0.0
        self.prefix_hit_rate = (self.prefix_hits / self.prefix_queries
                                if self.prefix_queries else 0.0)
        self.waste_ratio = (1.0 - self.slots_filled / self.slots_allocated
                            if self.slots_allocated else 0.0)

    @property
    def wasted_slots(self) -> int:
        return self.slots_allocated - self.slots_filled

    def seq_block_counts(self) -> dict[Hashable, int]:
        """Device blocks held by each sequence on the device (shared blocks count for each)."""
        return dict(self.block_counts)

    def as_dict(self) -> dict[str, Any]:
        """JSON-friendly: every statistic but the per-sequence counts."""
        out = asdict(self)
        del out["block_counts"]
        return out
