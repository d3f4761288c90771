"""The KV cache managers' interface to the scheduler (KVCacheManagerProtocol) and the records
they hand it: a prefix match and the statistics."""
from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from pagellm.kv.block_pool import BlockHash

if TYPE_CHECKING:
    from pagellm.kv.block_map import BlockMap

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


class KVCacheManagerProtocol(Protocol):
    """What the scheduler asks of a KV cache manager; the paged KVCacheManager and the
    contiguous baseline both implement it. Sequences are named by any hashable id; block
    copies returned must be applied by the model side before the step that needs them."""

    def lookup_prefix(self, token_ids: Sequence[int],
                      extra_keys: Iterable[Hashable] = ()) -> PrefixMatch: ...

    def allocate_slots(self, seq_id: Hashable, token_ids: Sequence[int], num_new_tokens: int,
                       prefix: PrefixMatch | None = None, extra_keys: Iterable[Hashable] = (),
                       watermark: bool = False) -> BlockCopies | None: ...

    def can_admit(self, num_tokens: int, watermark: bool = True,
                  reserved_blocks: int = 0) -> bool: ...

    def blocks_needed(self, seq_id: Hashable, num_new_tokens: int) -> int: ...

    def mark_computed(self, seq_id: Hashable) -> None: ...

    def discard_uncomputed(self, seq_id: Hashable) -> None: ...

    def get_block_table(self, seq_id: Hashable) -> list[int]: ...

    def num_tokens(self, seq_id: Hashable) -> int: ...

    def is_swapped(self, seq_id: Hashable) -> bool: ...

    def fork(self, parent_id: Hashable, child_id: Hashable) -> BlockCopies | None: ...

    def free(self, seq_id: Hashable) -> None: ...

    def swap_out(self, seq_ids: Iterable[Hashable]) -> BlockCopies | None: ...

    def swap_in(self, seq_ids: Iterable[Hashable]) -> BlockCopies | None: ...

    def can_swap_in(self, seq_ids: Iterable[Hashable], num_new_tokens: int = 0) -> bool: ...

    def get_stats(self) -> KVCacheStats: ...

    def seq_block_counts(self) -> dict[Hashable, int]: ...

    def block_map(self) -> BlockMap: ...

    def check_invariants(self) -> None: ...
