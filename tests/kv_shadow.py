"""Test helpers: a model of what the KV cache tensors would hold.

ShadowKV plays the model side: it applies the copies the manager returns (copy-on-write, swap out,
swap in) and writes each computed token into its slot, so a test can read a sequence back through
its block table and see whether the manager's bookkeeping kept its K/V intact.
"""
from __future__ import annotations

from collections.abc import Sequence


class ShadowKV:
    def __init__(self, num_blocks: int, num_cpu_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.device: list[list[int | None]] = [[None] * block_size for _ in range(num_blocks)]
        self.cpu: list[list[int | None]] = [[None] * block_size for _ in range(num_cpu_blocks)]

    def copy_blocks(self, pairs: Sequence[tuple[int, int]] | None) -> None:
        # Copies of one step read the state before any of them (the runner copies before the step).
        sources = {src: list(self.device[src]) for src, _ in pairs or ()}
        for src, dst in pairs or ():
            self.device[dst] = list(sources[src])

    def swap_out(self, pairs: Sequence[tuple[int, int]]) -> None:
        for device_id, cpu_id in pairs:
            self.cpu[cpu_id] = list(self.device[device_id])

    def swap_in(self, pairs: Sequence[tuple[int, int]]) -> None:
        for cpu_id, device_id in pairs:
            self.device[device_id] = list(self.cpu[cpu_id])

    def write(self, block_table: Sequence[int], token_ids: Sequence[int],
              start: int, end: int) -> None:
        """The step computes positions start..end-1 and writes their K/V into their slots."""
        for pos in range(start, end):
            block, offset = divmod(pos, self.block_size)
            self.device[block_table[block]][offset] = token_ids[pos]

    def read(self, block_table: Sequence[int], num_tokens: int) -> list[int | None]:
        return [self.device[block_table[pos // self.block_size]][pos % self.block_size]
                for pos in range(num_tokens)]

    def holds(self, block_id: int, token_ids: Sequence[int]) -> bool:
        return self.device[block_id] == list(token_ids)
