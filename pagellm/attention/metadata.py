"""AttentionMetadata: everything attention needs for one step, built once and shared by layers.

A step computes, for each scheduled sequence, ``query_len`` new tokens at positions
``context_len .. seq_len - 1`` (``seq_len = context_len + query_len``). The tokens of the step are
packed in one flat batch, sequence after sequence; sequences with ``query_len > 1`` ("prefills":
whole prompts, prompt chunks, prompts after a prefix-cache hit) come first, single-token
sequences ("decodes") after them. Attention treats the two groups differently: each prefill
attends causally over its own context (a mask only when it has cached tokens or a sliding
window cuts in), decodes need only a key-length mask.

Every tensor here is built from Python lists in a handful of vectorised ops, once per step;
the masks are built lazily on first use (per sequence or per sliding window) and reused by
every layer.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class PrefillMetadata:
    """The prefill group: sequences [0, num_prefills) and tokens [0, num_prefill_tokens).

    Prefill attention runs sequence by sequence (a step holds a few dozen prompts at most), so
    the group keeps each sequence's query and context lengths as Python ints.
    """

    block_tables: torch.Tensor  # [num_prefills, max_num_blocks] int64
    query_lens: list[int]  # tokens each sequence computes this step
    context_lens: list[int]  # tokens already in the cache before this step
    max_query_len: int
    block_size: int
    _masks: dict[tuple[int, int | None], torch.Tensor] = field(default_factory=dict)

    def mask(self, index: int, sliding_window: int | None = None) -> torch.Tensor | None:
        """[query_len, context_len + query_len] bool (True = attend) for sequence ``index``, or
        None when plain causal attention over the step's own keys is the same thing.

        Key position j is visible to a query at position p iff j <= p and, with a sliding
        window w, j > p - w (as in transformers). Built once per step and window."""
        context, query = self.context_lens[index], self.query_lens[index]
        if context == 0 and (sliding_window is None or sliding_window >= query):
            return None
        cached = self._masks.get((index, sliding_window))
        if cached is None:
            device = self.block_tables.device
            query_pos = torch.arange(context, context + query, device=device)[:, None]
            key_pos = torch.arange(context + query, device=device)
            cached = key_pos <= query_pos
            if sliding_window is not None:
                cached &= key_pos > query_pos - sliding_window
            self._masks[(index, sliding_window)] = cached
        return cached


@dataclass(slots=True)
class DecodeMetadata:
    """The decode group: sequences [num_prefills, num_seqs), one token each, at the end."""

    block_tables: torch.Tensor  # [num_decodes, max_num_blocks] int64
    seq_lens: torch.Tensor  # [num_decodes] int64
    max_seq_len: int
    block_size: int
    _masks: dict[int | None, torch.Tensor] = field(default_factory=dict)
    _pairs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def block_pairs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(sequence, logical block, physical block) of every block the decodes read, sorted
        by physical block id, each [num_pairs] int64: the order in which the CPU kernel
        streams the cache (ascending addresses, whatever the block tables look like)."""
        if self._pairs is None:
            num_blocks = -(-self.seq_lens // self.block_size)  # [D]
            positions = torch.arange(self.block_tables.shape[1], device=self.seq_lens.device)
            seq, block = (positions < num_blocks[:, None]).nonzero(as_tuple=True)
            physical = self.block_tables[seq, block]
            order = torch.argsort(physical, stable=True)
            self._pairs = (seq[order].contiguous(), block[order].contiguous(),
                           physical[order].contiguous())
        return self._pairs

    def mask(self, sliding_window: int | None = None) -> torch.Tensor:
        """[num_decodes, 1, 1, max_num_blocks * block_size] bool: keys of the sequence (within
        the sliding window of its last position), True = attend."""
        cached = self._masks.get(sliding_window)
        if cached is None:
            num_keys = self.block_tables.shape[1] * self.block_size
            key_pos = torch.arange(num_keys, device=self.seq_lens.device)  # [num_keys]
            seq_lens = self.seq_lens[:, None]  # [D, 1]
            cached = key_pos < seq_lens
            if sliding_window is not None:
                cached &= key_pos > seq_lens - 1 - sliding_window
            cached = cached[:, None, None]
            self._masks[sliding_window] = cached
        return cached


@dataclass(slots=True)
class AttentionMetadata:
    """Per-step attention inputs. Invariants: prefills (query_len > 1) precede decodes;
    ``query_start_loc[-1] == num_prefill_tokens + num_decode_tokens``; block table row ``s``
    covers the first ``seq_lens[s]`` tokens of sequence ``s`` (padding entries are 0 and never
    read unmasked); ``slot_mapping[i] == -1`` means token ``i`` is padding and is not written."""

    slot_mapping: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64, position of each token in its sequence
    block_tables: torch.Tensor  # [num_seqs, max_num_blocks] int64
    seq_lens: torch.Tensor  # [num_seqs] int64, context after this step
    query_start_loc: torch.Tensor  # [num_seqs + 1] int64
    num_prefills: int
    num_prefill_tokens: int
    num_decode_tokens: int
    max_query_len: int
    max_seq_len: int
    block_size: int
    prefill: PrefillMetadata | None
    decode: DecodeMetadata | None
    write_index: torch.Tensor | None = None  # tokens to write when slot_mapping has -1 padding

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    @staticmethod
    def build(query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]],
              block_size: int, device: torch.device | str = "cpu",
              slot_mapping: torch.Tensor | None = None) -> AttentionMetadata:
        """Build the metadata of a step from per-sequence lists (prefills first).

        ``block_tables[s]`` may be longer than the sequence needs; only the first
        ``ceil(seq_lens[s] / block_size)`` entries are used. ``slot_mapping`` defaults to the
        slots of positions ``seq_lens[s] - query_lens[s] .. seq_lens[s] - 1`` of each sequence.
        """
        num_prefills = _count_prefills(query_lens)
        if num_prefills == 0 and slot_mapping is None and seq_lens:
            return _build_decodes(seq_lens, block_tables, block_size, device)
        num_blocks, rows = _table_rows(seq_lens, block_tables, block_size)
        max_blocks = max(num_blocks, default=0)
        table = torch.tensor(rows, dtype=torch.int64).reshape(len(seq_lens), max_blocks)
        query_lens_t = torch.tensor(query_lens, dtype=torch.int64)
        seq_lens_t = torch.tensor(seq_lens, dtype=torch.int64)
        query_start_loc = torch.zeros(len(query_lens) + 1, dtype=torch.int64)
        torch.cumsum(query_lens_t, 0, out=query_start_loc[1:])
        positions, seq_index = _token_positions(query_lens_t, seq_lens_t, query_start_loc)
        if slot_mapping is None:
            blocks = table[seq_index, positions // block_size]  # [num_tokens]
            slot_mapping = blocks * block_size + positions % block_size
        num_prefill_tokens = int(query_start_loc[num_prefills])
        prefill = decode = None
        if num_prefills:
            prefill = _build_prefill(query_lens[:num_prefills], seq_lens[:num_prefills],
                                     table[:num_prefills], block_size, device)
        if num_prefills < len(query_lens):
            decode_blocks = max(num_blocks[num_prefills:])
            decode = DecodeMetadata(table[num_prefills:, :decode_blocks].to(device),
                                    seq_lens_t[num_prefills:].to(device),
                                    max(seq_lens[num_prefills:]), block_size)
        write_index = None
        if bool((slot_mapping < 0).any()):
            write_index = torch.nonzero(slot_mapping >= 0).flatten().to(device)
        return AttentionMetadata(
            slot_mapping=slot_mapping.to(device), positions=positions.to(device),
            block_tables=table.to(device), seq_lens=seq_lens_t.to(device),
            query_start_loc=query_start_loc.to(device), num_prefills=num_prefills,
            num_prefill_tokens=num_prefill_tokens,
            num_decode_tokens=len(query_lens) - num_prefills,
            max_query_len=max(query_lens, default=0), max_seq_len=max(seq_lens, default=0),
            block_size=block_size, prefill=prefill, decode=decode, write_index=write_index)


def _build_decodes(seq_lens: list[int], block_tables: list[list[int]], block_size: int,
                   device: torch.device | str) -> AttentionMetadata:
    """build's result for a step of decodes only (one new token per sequence, its slot from
    the table), from the lists in Python: a decode step of a few sequences spent ~0.1 ms in
    the two dozen tensor ops the general path runs (docs/BENCHMARKS.md)."""
    num_seqs = len(seq_lens)
    num_blocks, rows = _table_rows(seq_lens, block_tables, block_size)
    table = torch.tensor(rows, dtype=torch.int64).reshape(num_seqs, max(num_blocks)).to(device)
    positions = [n - 1 for n in seq_lens]
    slots = [row[p // block_size] * block_size + p % block_size
             for row, p in zip(rows, positions)]
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int64).to(device)
    slot_mapping = torch.tensor(slots, dtype=torch.int64).to(device)
    write_index = None
    if min(slots) < 0:
        write_index = torch.nonzero(slot_mapping >= 0).flatten()
    max_seq_len = max(seq_lens)
    return AttentionMetadata(
        slot_mapping=slot_mapping, positions=torch.tensor(positions, dtype=torch.int64).to(device),
        block_tables=table, seq_lens=seq_lens_t,
        query_start_loc=torch.arange(num_seqs + 1, dtype=torch.int64).to(device),
        num_prefills=0, num_prefill_tokens=0, num_decode_tokens=num_seqs, max_query_len=1,
        max_seq_len=max_seq_len, block_size=block_size, prefill=None,
        decode=DecodeMetadata(table, seq_lens_t, max_seq_len, block_size),
        write_index=write_index)


def _table_rows(seq_lens: list[int], block_tables: list[list[int]], block_size: int
                ) -> tuple[list[int], list[list[int]]]:
    """Each sequence's block count and its table's first that many entries, zero-padded to
    the longest."""
    num_blocks = [-(-n // block_size) for n in seq_lens]
    width = max(num_blocks, default=0)
    return num_blocks, [t[:n] + [0] * (width - n) for t, n in zip(block_tables, num_blocks)]


def _token_positions(query_lens: torch.Tensor, seq_lens: torch.Tensor,
                     query_start_loc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(position, sequence index) of every packed token, without a Python loop over tokens."""
    num_tokens = int(query_start_loc[-1])
    seq_index = torch.repeat_interleave(torch.arange(len(query_lens)), query_lens)  # [T]
    offset_in_seq = torch.arange(num_tokens) - query_start_loc[:-1][seq_index]
    positions = (seq_lens - query_lens)[seq_index] + offset_in_seq
    return positions, seq_index


def _count_prefills(query_lens: list[int]) -> int:
    num_prefills = sum(1 for n in query_lens if n > 1)
    if any(n < 1 for n in query_lens):
        raise ValueError(f"every scheduled sequence computes >= 1 token, got {query_lens}")
    if any(n == 1 for n in query_lens[:num_prefills]):
        raise ValueError("sequences with query_len > 1 (prefills) must precede decodes")
    return num_prefills


def _build_prefill(query_lens: list[int], seq_lens: list[int], table: torch.Tensor,
                   block_size: int, device: torch.device | str) -> PrefillMetadata:
    return PrefillMetadata(
        block_tables=table[:, :-(-max(seq_lens) // block_size)].to(device),
        query_lens=list(query_lens), context_lens=[s - q for s, q in zip(seq_lens, query_lens)],
        max_query_len=max(query_lens), block_size=block_size)
