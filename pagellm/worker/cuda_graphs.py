"""CUDA graphs for decode steps: the model forward of a decode-only batch, captured at start-up
for a ladder of batch sizes and replayed with the batch padded to the next captured size.

A decode step of a small model is bound by kernel launches, not by the GPU: a 28-layer model
launches a few hundred kernels whose Python dispatch takes longer than their execution. A
graph replays them all with one launch. What is inside the graph: the model forward (embedding,
every layer with its K/V write and Triton decode attention, the final norm) over static input
buffers, for exactly ``size`` sequences. What stays outside: building the inputs, copying them
into the buffers, the vocabulary projection of the rows that sample, sampling, and every
prefill or mixed step (those run eagerly).

For the forward to be capturable, nothing in it may depend on a per-step host value:

- no host syncs (``.item()``, ``int(tensor)``, data-dependent shapes such as ``nonzero``);
  this is why padding rows use ``slot_mapping = -1`` (the Triton write kernel skips them)
  instead of the torch path's ``write_index``;
- every kernel's launch grid depends only on ``size`` and the model's shapes: the Triton
  decode kernel's grid is (sequences, KV heads), and each program reads its sequence length
  from ``seq_lens`` in device memory (triton_backend.decode_attention);
- every tensor the graph reads lives at a fixed address: the KV cache (allocated once), the
  weights, and the buffers here, which the runner overwrites in place before each replay.

Padding rows (batch rows ``n .. size - 1``) have token 0 at position 0, slot -1 (nothing is
written), a block table of block 0 and length 1: their attention reads one finite slot of
block 0 and their hidden states, computed row by row, are dropped before the logits.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from pagellm.attention import AttentionMetadata
from pagellm.attention.metadata import DecodeMetadata

logger = logging.getLogger("pagellm")

# vLLM's ladder: small sizes one by one (a lone request is the latency case), then steps of 8,
# so that padding wastes at most 7 rows; beyond MAX_CAPTURE_SIZE steps run eagerly.
MAX_CAPTURE_SIZE = 512
_PAD_TOKEN, _PAD_SLOT, _PAD_SEQ_LEN = 0, -1, 1


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, 16, 24, ... up to ``max_num_seqs`` (which is
    included, so every decode batch the scheduler may form has a size to pad to), at most
    MAX_CAPTURE_SIZE."""
    limit = min(max_num_seqs, MAX_CAPTURE_SIZE)
    sizes = [s for s in [1, 2, 4] + list(range(8, limit + 1, 8)) if s <= limit]
    if sizes[-1] != limit:
        sizes.append(limit)
    return sizes


def padded_size(num_seqs: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds ``num_seqs`` sequences, or None (run eagerly)."""
    return next((size for size in sizes if size >= num_seqs), None)


@dataclass(slots=True)
class DecodeBuffers:
    """The static inputs of every captured size, sized for the largest; a graph of size ``s``
    reads rows ``[0, s)``. ``query_start_loc`` is ``0, 1, 2, ...`` once and for all (a decode
    has one token)."""

    input_ids: torch.Tensor  # [max_size] int64
    positions: torch.Tensor  # [max_size] int64
    slot_mapping: torch.Tensor  # [max_size] int64
    block_tables: torch.Tensor  # [max_size, max_blocks_per_seq] int64
    seq_lens: torch.Tensor  # [max_size] int64
    query_start_loc: torch.Tensor  # [max_size + 1] int64

    @classmethod
    def allocate(cls, max_size: int, max_blocks_per_seq: int,
                 device: torch.device | str) -> DecodeBuffers:
        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.int64, device=device)

        buffers = cls(zeros(max_size), zeros(max_size), zeros(max_size),
                      zeros(max_size, max_blocks_per_seq), zeros(max_size),
                      torch.arange(max_size + 1, dtype=torch.int64, device=device))
        buffers.pad(0, max_size)
        return buffers

    def metadata(self, size: int, max_model_len: int, block_size: int) -> AttentionMetadata:
        """The metadata a graph of ``size`` is captured with: views of the buffers. Its
        ``max_seq_len`` is the bound ``max_model_len``: no decode kernel launch reads it."""
        tables, seq_lens = self.block_tables[:size], self.seq_lens[:size]
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size], positions=self.positions[:size],
            block_tables=tables, seq_lens=seq_lens,
            query_start_loc=self.query_start_loc[:size + 1], num_prefills=0,
            num_prefill_tokens=0, num_decode_tokens=size, max_query_len=1,
            max_seq_len=max_model_len, block_size=block_size, prefill=None,
            decode=DecodeMetadata(tables, seq_lens, max_model_len, block_size))

    def fill(self, input_ids: torch.Tensor, metadata: AttentionMetadata, size: int) -> None:
        """Copy a decode-only step of ``n <= size`` sequences into rows ``[0, n)`` and make
        rows ``[n, size)`` padding."""
        n = input_ids.shape[0]
        width = metadata.block_tables.shape[1]
        if width > self.block_tables.shape[1]:
            raise ValueError(f"block tables of {width} blocks exceed the captured "
                             f"{self.block_tables.shape[1]}")
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(metadata.positions, non_blocking=True)
        self.slot_mapping[:n].copy_(metadata.slot_mapping, non_blocking=True)
        self.block_tables[:n, :width].copy_(metadata.block_tables, non_blocking=True)
        self.seq_lens[:n].copy_(metadata.seq_lens, non_blocking=True)
        self.pad(n, size)

    def pad(self, start: int, end: int) -> None:
        """Rows [start, end) become padding: they write nothing and read one slot of block 0."""
        self.input_ids[start:end] = _PAD_TOKEN
        self.positions[start:end] = 0
        self.slot_mapping[start:end] = _PAD_SLOT
        self.block_tables[start:end] = 0
        self.seq_lens[start:end] = _PAD_SEQ_LEN


class DecodeGraphRunner:
    """Runs decode-only steps of the model over static buffers, padded to a captured size.

    Invariants: ``sizes`` is ascending; after ``capture()`` each size has a graph and its output
    tensor (the hidden states of its rows, overwritten by each replay: the caller reads them
    before the next step); all graphs share one memory pool. Before ``capture()`` (the CPU
    tests), ``run`` executes the same padded forward eagerly.
    """

    def __init__(self, model: torch.nn.Module, kv_caches: list, sizes: list[int],
                 max_model_len: int, block_size: int, device: torch.device | str) -> None:
        self.model, self.kv_caches, self.sizes = model, kv_caches, sorted(sizes)
        self.device = torch.device(device)
        with torch.inference_mode():
            self.buffers = DecodeBuffers.allocate(self.sizes[-1], -(-max_model_len // block_size),
                                                  self.device)
        self.metadata = {size: self.buffers.metadata(size, max_model_len, block_size)
                         for size in self.sizes}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # [size, hidden] per captured size

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture one graph per size, largest first so the smaller ones reuse its memory.
        Each size runs once eagerly first: Triton compiles its kernels and cuBLAS picks its
        algorithms outside the capture."""
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        for size in reversed(self.sizes):
            self.buffers.pad(0, size)  # every row padding: the warm-up run writes nothing
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                self._forward(size)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self._forward(size)
            self.graphs[size] = graph
        torch.cuda.synchronize(self.device)
        logger.info("CUDA graphs: captured decode steps of %d batch sizes (%s) in %.1f s",
                    len(self.sizes), ", ".join(map(str, self.sizes)), time.perf_counter() - start)

    def run(self, input_ids: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor | None:
        """Hidden states [n, hidden] of a decode-only step of n sequences, or None when the step
        has prefills or no captured size holds it (the caller runs it eagerly)."""
        n = input_ids.shape[0]
        size = padded_size(n, self.sizes)
        if metadata.num_prefills or size is None:
            return None
        self.buffers.fill(input_ids, metadata, size)
        if size in self.graphs:
            self.graphs[size].replay()
            return self.outputs[size][:n]
        return self._forward(size)[:n]

    def _forward(self, size: int) -> torch.Tensor:
        buffers = self.buffers
        return self.model(buffers.input_ids[:size], buffers.positions[:size], self.kv_caches,
                          self.metadata[size])
