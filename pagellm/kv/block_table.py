"""Logical -> physical block mapping of one sequence, and the slot of each token.

Token ``i`` of a sequence lives in logical block ``i // block_size`` at offset ``i % block_size``;
its physical slot in the KV cache tensors is ``block_ids[i // block_size] * block_size +
i % block_size``. The model side writes K/V at ``slot_mapping`` and attends through the table.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


def cdiv(a: int, b: int) -> int:
    """Ceiling division: blocks needed for ``a`` tokens at ``b`` tokens per block."""
    return -(-a // b)


def compute_slot_mapping(block_ids: Sequence[int], block_size: int,
                         start: int, end: int) -> list[int]:
    """Slots of token positions ``start .. end-1`` of a sequence with this block table."""
    if not 0 <= start <= end <= len(block_ids) * block_size:
        raise ValueError(f"positions [{start}, {end}) are outside a table of {len(block_ids)} "
                         f"blocks of {block_size}")
    slots = []
    pos = start
    while pos < end:
        block_index, offset = divmod(pos, block_size)
        base = block_ids[block_index] * block_size
        run = min(end - pos, block_size - offset)
        slots.extend(range(base + offset, base + offset + run))
        pos += run
    return slots


@dataclass(slots=True)
class BlockTable:
    """The blocks one sequence holds and how many token slots of them it uses.

    Invariant: ``len(block_ids) == cdiv(num_tokens, block_size)``; every block but the last is
    full, and the last holds ``num_tokens - (len(block_ids) - 1) * block_size`` tokens.
    """

    block_size: int
    block_ids: list[int] = field(default_factory=list)
    num_tokens: int = 0

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)

    @property
    def num_full_blocks(self) -> int:
        return self.num_tokens // self.block_size

    def last_block_is_partial(self) -> bool:
        return self.num_tokens % self.block_size != 0

    def num_tokens_in_last_block(self) -> int:
        return self.num_tokens - (len(self.block_ids) - 1) * self.block_size

    def num_blocks_needed(self, num_new_tokens: int) -> int:
        """New physical blocks needed to hold ``num_new_tokens`` more tokens."""
        return cdiv(self.num_tokens + num_new_tokens, self.block_size) - len(self.block_ids)

    def slot(self, position: int) -> int:
        if not 0 <= position < len(self.block_ids) * self.block_size:
            raise IndexError(f"position {position} is outside the table")
        block_index, offset = divmod(position, self.block_size)
        return self.block_ids[block_index] * self.block_size + offset

    def slot_mapping(self, start: int, end: int) -> list[int]:
        return compute_slot_mapping(self.block_ids, self.block_size, start, end)

    def copy(self) -> BlockTable:
        return BlockTable(self.block_size, list(self.block_ids), self.num_tokens)
