"""CacheEngine: the KV cache tensors of every layer, block copies, and swap to CPU memory.

The block manager (pagellm.kv) decides which block holds what; this class owns the memory the
block ids point into and moves it when the manager says so (copy-on-write copies before a
step, swap out/in on preemption).

On CUDA, swaps run on a side stream, so that the copies over PCIe overlap the model's work:

- swap_out: the side stream waits for the compute stream (whose kernels may still be writing
  the blocks), gathers the blocks into one device tensor and copies it, non-blocking, into a
  pinned staging buffer; the compute stream waits only for the gather, then may reuse the
  device blocks. Once the copy has completed, the staging buffer is scattered into the CPU
  cache (on the host) and released.
- swap_in: staged swap-outs are completed first (their blocks may be the ones read); the
  blocks are gathered on the host into a pinned staging buffer, copied non-blocking and
  scattered into the device cache on the side stream, and the compute stream waits for that
  before the model reads them. The staging buffer lives until the copy has completed.

On the CPU everything is a plain synchronous copy.
"""
from __future__ import annotations

import math
import mmap
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pagellm.attention import KVCache
from pagellm.attention.kv_quant import SCALE_BYTES, KVFormat, QuantizedKVCache
from pagellm.kv.memory import KVMemoryModel
from pagellm.model.decoder import head_dim_of
from pagellm.model.layers.linear import heads_per_rank


class CacheEngine:
    """Per-layer K and V caches ``[num_blocks, block_size, num_kv_heads, head_dim]``.

    Invariants: all layers live in one allocation ``[num_layers, 2, num_blocks, ...]`` (so a
    block copy or swap is one indexed copy for all layers); the CPU swap cache has the same
    layout with ``num_cpu_blocks`` blocks. The device cache is zero-filled at start so that masked
    reads of never-written slots are finite (softmax weight 0 times NaN would still be NaN).

    With an 8-bit ``kv_format`` (attention/kv_quant.py) the caches are uint8 rows of
    ``head_dim + 2`` bytes (the values, then the row's scale), so block copies and swaps move
    the scales with the values; each layer's entry of ``kv_caches`` is a QuantizedKVCache.
    """

    def __init__(self, hf_config: Any, num_blocks: int, num_cpu_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device | str,
                 kv_format: KVFormat | None = None, tp_size: int = 1) -> None:
        """``tp_size``: under tensor parallelism the cache holds this rank's KV heads only."""
        if block_size <= 0 or num_blocks < 0 or num_cpu_blocks < 0:
            raise ValueError(f"bad cache shape: num_blocks={num_blocks}, "
                             f"num_cpu_blocks={num_cpu_blocks}, block_size={block_size}")
        self.device = torch.device(device)
        self.kv_format = kv_format
        self.dtype = dtype = torch.uint8 if kv_format is not None else dtype
        self.num_blocks, self.num_cpu_blocks, self.block_size = num_blocks, num_cpu_blocks, block_size
        self.num_layers = hf_config.num_hidden_layers
        self.num_kv_heads = heads_per_rank(hf_config.num_attention_heads,
                                           hf_config.num_key_value_heads, tp_size)[1]
        self.head_dim = head_dim_of(hf_config)
        self.block_bytes = self.bytes_per_block(hf_config, block_size, dtype, kv_format,
                                                tp_size)
        row = self.head_dim + (SCALE_BYTES if kv_format is not None else 0)
        block_shape = (block_size, self.num_kv_heads, row)
        self.device_cache = _allocate_zeroed((self.num_layers, 2, num_blocks, *block_shape),
                                             dtype, self.device)
        # The swap space is only ever read where a swap-out wrote first, so it need not be
        # zero-filled: left empty, the OS commits its pages only as swapped blocks land there.
        self.cpu_cache = torch.empty((self.num_layers, 2, num_cpu_blocks, *block_shape),
                                     dtype=dtype, device="cpu",
                                     pin_memory=self.device.type == "cuda")
        self.kv_caches: list[KVCache] = [
            (self.device_cache[i, 0], self.device_cache[i, 1]) if kv_format is None
            else QuantizedKVCache(self.device_cache[i, 0], self.device_cache[i, 1], kv_format)
            for i in range(self.num_layers)]
        self.swap_stream = (torch.cuda.Stream(self.device) if self.device.type == "cuda"
                            else None)
        self.in_flight = InFlightCopies()

    @staticmethod
    def bytes_per_block(hf_config: Any, block_size: int, dtype: torch.dtype,
                        kv_format: KVFormat | None = None, tp_size: int = 1) -> int:
        """K and V of ``block_size`` tokens over all layers, by the KV memory model
        (pagellm.kv.memory: 2 x layers x num_kv_heads x head_dim x dtype bytes per token, plus
        the row scales of an 8-bit cache), the one formula kv-calc and the KV sizing share;
        one rank's KV heads under tensor parallelism."""
        return kv_memory_model(hf_config, dtype, kv_format, tp_size).bytes_per_block(block_size)

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy device block src -> dst for each (src, dst), all layers (copy-on-write)."""
        if not pairs:
            return
        src, dst = self._indices(pairs, self.num_blocks, self.num_blocks, self.device)
        self.device_cache[:, :, dst] = self.device_cache[:, :, src]

    def swap_out(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy device block -> CPU block for each (device, cpu) pair."""
        if not pairs:
            return
        device_ids, cpu_ids = self._indices(pairs, self.num_blocks, self.num_cpu_blocks, "cpu")
        if self.swap_stream is None:
            self.cpu_cache[:, :, cpu_ids] = self.device_cache[:, :, device_ids]
            return
        self.in_flight.reap()
        compute = torch.cuda.current_stream(self.device)
        self.swap_stream.wait_stream(compute)  # the step that wrote the blocks comes first
        with torch.cuda.stream(self.swap_stream):
            blocks = self.device_cache[:, :, device_ids.to(self.device)]  # [L, 2, n, ...]
            gathered = torch.cuda.Event()
            gathered.record()
            staging = torch.empty(blocks.shape, dtype=self.dtype, pin_memory=True)
            staging.copy_(blocks, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()
        compute.wait_event(gathered)  # from here the compute stream may overwrite the blocks

        def finish() -> None:
            self.cpu_cache[:, :, cpu_ids] = staging

        self.in_flight.add(InFlightCopy(copied, staging, finish))

    def swap_in(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy CPU block -> device block for each (cpu, device) pair."""
        if not pairs:
            return
        cpu_ids, device_ids = self._indices(pairs, self.num_cpu_blocks, self.num_blocks, "cpu")
        if self.swap_stream is None:
            self.device_cache[:, :, device_ids] = self.cpu_cache[:, :, cpu_ids]
            return
        self.in_flight.reap(wait=True)  # swap-outs still staged land in the CPU cache first
        shape = (self.num_layers, 2, len(cpu_ids), *self.cpu_cache.shape[3:])
        staging = torch.empty(shape, dtype=self.dtype, pin_memory=True)
        torch.index_select(self.cpu_cache, 2, cpu_ids, out=staging)
        compute = torch.cuda.current_stream(self.device)
        self.swap_stream.wait_stream(compute)  # work queued before may still read the blocks
        with torch.cuda.stream(self.swap_stream):
            blocks = staging.to(self.device, non_blocking=True)
            self.device_cache[:, :, device_ids.to(self.device)] = blocks
            copied = torch.cuda.Event()
            copied.record()
        compute.wait_event(copied)  # the model reads the blocks only once they are there
        self.in_flight.add(InFlightCopy(copied, staging))

    def synchronize(self) -> None:
        """Wait for every swap in flight and complete it (the CPU cache holds every swap-out)."""
        self.in_flight.reap(wait=True)

    @staticmethod
    def _indices(pairs: Sequence[tuple[int, int]], num_src: int, num_dst: int,
                 device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.tensor(pairs, dtype=torch.int64).reshape(-1, 2)
        src, dst = ids[:, 0], ids[:, 1]
        if len(ids) and (src.min() < 0 or src.max() >= num_src
                         or dst.min() < 0 or dst.max() >= num_dst):
            raise ValueError(f"block ids out of range (source < {num_src}, "
                             f"destination < {num_dst}): {list(pairs)[:8]}")
        return src.to(device), dst.to(device)


@dataclass(slots=True)
class InFlightCopy:
    """A swap issued on the swap stream, complete once ``event`` has completed. ``staging``
    (pinned host memory the copy reads or writes) is held until then; ``finish`` runs then
    (a swap-out's scatter of the staged blocks into the CPU cache)."""

    event: Any  # torch.cuda.Event: query(), synchronize()
    staging: torch.Tensor
    finish: Callable[[], None] | None = None


class InFlightCopies:
    """Swaps in flight, in issue order. Invariant: they are completed (``finish`` run,
    staging released) in that order, so of two swap-outs to one CPU block the later wins."""

    def __init__(self) -> None:
        self._copies: list[InFlightCopy] = []

    def __len__(self) -> int:
        return len(self._copies)

    def add(self, copy: InFlightCopy) -> None:
        self._copies.append(copy)

    def reap(self, wait: bool = False) -> None:
        """Complete the copies whose events have completed, up to the first that has not;
        with ``wait``, wait for each and complete them all."""
        while self._copies:
            copy = self._copies[0]
            if wait:
                copy.event.synchronize()
            elif not copy.event.query():
                return
            if copy.finish is not None:
                copy.finish()
            self._copies.pop(0)


def kv_memory_model(hf_config: Any, dtype: torch.dtype, kv_format: KVFormat | None = None,
                    tp_size: int = 1) -> KVMemoryModel:
    """The KV memory model of a loaded config, the cache stored in ``dtype`` (or in the
    8-bit ``kv_format``); one rank's heads under tensor parallelism."""
    if kv_format is not None:
        dtype = kv_format.storage
    num_heads, num_kv_heads = heads_per_rank(hf_config.num_attention_heads,
                                             hf_config.num_key_value_heads, tp_size)
    return KVMemoryModel(
        name=str(getattr(hf_config, "model_type", "model")),
        num_layers=hf_config.num_hidden_layers,
        num_attention_heads=num_heads,
        num_kv_heads=num_kv_heads, head_dim=head_dim_of(hf_config),
        dtype=str(dtype).removeprefix("torch."))


def _allocate_zeroed(shape: tuple[int, ...], dtype: torch.dtype,
                     device: torch.device) -> torch.Tensor:
    """A zero-filled cache. On Linux CPU memory: an anonymous private mapping, whose pages
    read as zeros and are committed on their first write (when a step first stores into a
    block), advised to 2 MiB pages.

    Decode attention streams the blocks of every sequence each step; with 4 KiB pages every
    4 KiB costs a TLB miss (measured 20-30% lower read bandwidth on this project's CPU), so
    the advice comes before any page is touched. Zero-filling the whole cache up front, as
    ``torch.zeros`` does, took 2.8 s of SmolLM2's 11.6 s start-up on a 2-core EPYC for a cache
    of 10% of the RAM, most of which a light workload never writes (docs/BENCHMARKS.md,
    "Start-up"); the engine checks at start that the cache fits in the available RAM
    (engine_setup), since its pages are committed only as they fill.
    """
    numel = math.prod(shape)
    if device.type != "cpu" or not sys.platform.startswith("linux") or numel == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    # anonymous and private (a shared one would be shmem, which takes no transparent huge
    # pages): zero pages until written
    buffer = mmap.mmap(-1, numel * dtype.itemsize, flags=mmap.MAP_PRIVATE)
    try:
        buffer.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError):
        pass  # only an optimisation
    return torch.frombuffer(buffer, dtype=dtype).view(shape)
