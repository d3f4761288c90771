"""Paged attention in Triton: the GPU path, with the torch backend's semantics.

Caches are ``[num_blocks, block_size, num_kv_heads, head_dim]`` per layer; the K/V of token
``i`` of the step go to ``slot_mapping[i] = block * block_size + offset`` (``-1``: not written).
One call handles a whole step, as ``torch_backend.paged_attention`` does: write the step's K/V
into their slots, then attend every query over its sequence's context read back through the
block table (tokens cached by earlier chunks or prefix hits and this step's tokens alike).

The K/V stores are in triton_store.py (``_write_kv_kernel``, and the 8-bit caches' quantizing
store). Two attention kernels:

- ``_prefill_kernel``: the prefill group (whole prompts, prompt chunks, prompts after a prefix
  hit), one program per (sequence, block of BLOCK_M queries, query head), FlashAttention-style:
  it streams the keys the block can see in tiles of BLOCK_N, with an online softmax.
- ``_decode_kernel``: one program per (decoding sequence, KV head). The query heads sharing
  that KV head (grouped-query attention) are the rows of one tile, so each K/V element of the
  context is read from memory once per sequence, not once per query head.

Both attention kernels share ``_attend_tile``. A key tile is a run of BLOCK_N consecutive
positions; each position's physical slot is looked up in the block table, so any block size
(1, 4, 16, not a power of two) uses the same tiles. Scores, the softmax statistics and the
output accumulate in float32 whatever the cache dtype; float32 inputs use IEEE (not TF32) dot
products so that they match the float32 torch path. The kernels take strides, so the query may
be a view into a fused QKV projection.

``reference_paged_attention`` in torch_backend.py is the plain definition these kernels are
tested against (tests/model/test_triton_attention.py, on CPU tensors under TRITON_INTERPRET=1).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagellm.attention.kv_quant import QuantizedKVCache
from pagellm.attention.kv_quant import scales as kv_scales
from pagellm.attention.kv_quant import values as kv_values
from pagellm.attention.metadata import AttentionMetadata
from pagellm.attention.triton_store import (_unit_last_stride, write_to_kv_cache,
                                            write_to_kv_cache_quantized)


@dataclass(frozen=True, slots=True)
class LaunchConfig:
    """Tile sizes and warps per program. tl.dot needs every tile dimension >= 16."""

    prefill_block_m: int  # queries per prefill program
    prefill_block_n: int  # keys per tile in the prefill kernel
    prefill_warps: int
    decode_block_n: int  # keys per tile in the decode kernel
    decode_warps: int


def launch_config(dtype: torch.dtype, head_dim: int) -> LaunchConfig:
    """Tiles that compile for sm_90 without register spills (checked with ptxas for head_dim
    64, 128 and 256). float32 tiles are smaller: IEEE float32 dot products run on the FMA
    units, and every element takes twice the registers of a 16-bit one."""
    if dtype == torch.float32:
        if head_dim <= 128:
            return LaunchConfig(64, 32, 8, 32, 4)
        return LaunchConfig(32, 16, 8, 32, 8)
    if head_dim <= 64:
        return LaunchConfig(64, 64, 4, 64, 4)
    if head_dim <= 128:
        return LaunchConfig(64, 64, 8, 64, 4)
    return LaunchConfig(32, 32, 8, 32, 8)


# Whether @triton.jit below builds interpreted kernels (TRITON_INTERPRET=1 when this module
# is imported): those run on CPU tensors, compiled ones only on the GPU.
INTERPRETED = bool(triton.knobs.runtime.interpret)


@triton.jit
def _dot(a, b, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr):
    """a @ b accumulated in float32. UPCAST_DOT is set only under the interpreter for
    bfloat16, whose dot (triton 3.9) multiplies the raw bf16 bit patterns as integers; the
    values are already rounded to bfloat16, so float32 products give what tensor cores give."""
    if UPCAST_DOT:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision=DOT_PRECISION)


@triton.jit
def _attend_tile(query, acc, m_i, l_i, query_pos, key_start, seq_len, scale_log2, window,
                 block_table_ptr, k_cache_ptr, v_cache_ptr, kv_head,
                 stride_cache_b, stride_cache_s, stride_cache_h, block_size, head_dim,
                 k_scale_ptr, v_scale_ptr, lut_ptr, stride_scale_b, stride_scale_s,
                 stride_scale_h,
                 BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, USE_WINDOW: tl.constexpr,
                 DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
                 QUANT: tl.constexpr):
    """Fold keys [key_start, key_start + BLOCK_N) into the running softmax of M query rows.

    query [M, BLOCK_D], acc [M, BLOCK_D] float32, m_i / l_i [M] float32 running max and sum
    (in log2 units: scores are scaled by scale * log2(e), so exp2 gives the softmax),
    query_pos [M] absolute positions of the rows. With QUANT (an 8-bit cache, kv_quant.py:
    1 = int8, 2 = a byte -> float32 table at lut_ptr, for fp8) the tile's bytes are decoded
    here, and each key's and value's row scale (k_scale_ptr / v_scale_ptr, bfloat16) folds
    into its score and its softmax weight: the query is float32 then, and so are the dots.
    """
    keys = key_start + tl.arange(0, BLOCK_N)  # [BLOCK_N] positions in the sequence
    dims = tl.arange(0, BLOCK_D)
    in_seq = keys < seq_len
    blocks = tl.load(block_table_ptr + keys // block_size, mask=in_seq, other=0)  # int64
    kv_offset = (blocks * stride_cache_b + (keys % block_size) * stride_cache_s
                 + kv_head * stride_cache_h)  # [BLOCK_N]
    kv_mask = in_seq[:, None] & (dims[None, :] < head_dim)  # [BLOCK_N, BLOCK_D]
    if QUANT:
        scale_offset = (blocks * stride_scale_b + (keys % block_size) * stride_scale_s
                        + kv_head * stride_scale_h)  # [BLOCK_N]
        key = _decode_bytes(tl.load(k_cache_ptr + kv_offset[:, None] + dims[None, :],
                                    mask=kv_mask, other=0), lut_ptr, QUANT)
        k_scale = tl.load(k_scale_ptr + scale_offset, mask=in_seq, other=0.0).to(tl.float32)
        scores = _dot(query, tl.trans(key), DOT_PRECISION, UPCAST_DOT) * k_scale[None, :]
    else:
        key = tl.load(k_cache_ptr + kv_offset[:, None] + dims[None, :], mask=kv_mask,
                      other=0.0)
        scores = _dot(query, tl.trans(key), DOT_PRECISION, UPCAST_DOT)  # [M, BLOCK_N] float32
    scores *= scale_log2  # after the dot, in float32: no rounding of a scaled bf16 query

    # Causal over absolute positions; as every row's position is < seq_len, this also masks
    # the tile's keys past the end of the sequence.
    visible = keys[None, :] <= query_pos[:, None]
    if USE_WINDOW:
        visible &= keys[None, :] > query_pos[:, None] - window
    scores = tl.where(visible, scores, float("-inf"))
    # The values of keys no row sees (before the window, past every row's position) are not
    # read: their weight is 0, but 0 x NaN is NaN.
    seen = tl.max(visible.to(tl.int32), 0) > 0  # [BLOCK_N]
    value_mask = kv_mask & seen[:, None]

    m_new = tl.maximum(m_i, tl.max(scores, 1))  # [M]
    # A row that has seen no visible key yet keeps m = -inf; subtracting 0 instead keeps
    # exp2(-inf - -inf) = NaN out of its (still empty) sums.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(scores - m_safe[:, None])  # [M, BLOCK_N]
    alpha = tl.exp2(m_i - m_safe)  # [M] rescales what was accumulated under the old max
    l_i = l_i * alpha + tl.sum(p, 1)
    if QUANT:
        value = _decode_bytes(tl.load(v_cache_ptr + kv_offset[:, None] + dims[None, :],
                                      mask=value_mask, other=0), lut_ptr, QUANT)
        v_scale = tl.load(v_scale_ptr + scale_offset, mask=in_seq & seen,
                          other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + _dot(p * v_scale[None, :], value, DOT_PRECISION,
                                          UPCAST_DOT)
    else:
        value = tl.load(v_cache_ptr + kv_offset[:, None] + dims[None, :], mask=value_mask,
                        other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(value.dtype), value, DOT_PRECISION, UPCAST_DOT)
    return acc, m_new, l_i


@triton.jit
def _decode_bytes(raw, lut_ptr, QUANT: tl.constexpr):
    """8-bit cache values -> float32: int8 converts (QUANT 1), other formats read the
    byte's value from the 256-entry table (QUANT 2)."""
    if QUANT == 1:
        return raw.to(tl.float32)
    return tl.load(lut_ptr + (raw.to(tl.int32) & 255))


@triton.jit
def _prefill_kernel(out_ptr, query_ptr, k_cache_ptr, v_cache_ptr,
                    k_scale_ptr, v_scale_ptr, lut_ptr, stride_scale_b, stride_scale_s,
                    stride_scale_h, block_tables_ptr,
                    seq_lens_ptr, query_start_loc_ptr, scale_log2, window,
                    stride_query_t, stride_query_h, stride_out_t, stride_out_h,
                    stride_cache_b, stride_cache_s, stride_cache_h, stride_table,
                    block_size, head_dim,
                    QUERIES_PER_KV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_D: tl.constexpr, USE_WINDOW: tl.constexpr,
                    DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
                    QUANT: tl.constexpr):
    seq = tl.program_id(0)
    query_block = tl.program_id(1)
    head = tl.program_id(2)
    query_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - query_start
    if query_block * BLOCK_M >= query_len:  # the grid is sized for the longest query
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - query_len  # tokens cached before this step

    rows = query_block * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] offsets in the query
    dims = tl.arange(0, BLOCK_D)
    row_mask = rows < query_len
    # Padding rows past the query take the last query's position, so that no row of the
    # tile is left without a visible key (0 / 0 in the normalisation); they are not stored.
    query_pos = context_len + tl.minimum(rows, query_len - 1)  # [BLOCK_M] absolute positions
    tokens = query_start + rows  # [BLOCK_M] rows of the packed batch
    io_mask = row_mask[:, None] & (dims[None, :] < head_dim)
    query = tl.load(query_ptr + tokens[:, None] * stride_query_t + head * stride_query_h
                    + dims[None, :], mask=io_mask, other=0.0)  # [BLOCK_M, BLOCK_D]
    if QUANT:
        query = query.to(tl.float32)

    # Keys this block can see: up to its last query's position (causal), and from the first
    # query's window start; tiles start on multiples of BLOCK_N.
    key_end = tl.minimum(seq_len, context_len + (query_block + 1) * BLOCK_M)
    key_begin = 0
    if USE_WINDOW:
        first_visible = tl.maximum(context_len + query_block * BLOCK_M - window + 1, 0)
        key_begin = (first_visible // BLOCK_N) * BLOCK_N
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    block_table_ptr = block_tables_ptr + seq * stride_table
    kv_head = head // QUERIES_PER_KV
    for key_start in range(key_begin, key_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(query, acc, m_i, l_i, query_pos, key_start, seq_len,
                                     scale_log2, window, block_table_ptr, k_cache_ptr,
                                     v_cache_ptr, kv_head, stride_cache_b, stride_cache_s,
                                     stride_cache_h, block_size, head_dim, k_scale_ptr,
                                     v_scale_ptr, lut_ptr, stride_scale_b, stride_scale_s,
                                     stride_scale_h, BLOCK_N, BLOCK_D, USE_WINDOW,
                                     DOT_PRECISION, UPCAST_DOT, QUANT)
    out = acc / l_i[:, None]
    tl.store(out_ptr + tokens[:, None] * stride_out_t + head * stride_out_h + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=io_mask)


@triton.jit
def _decode_kernel(out_ptr, query_ptr, k_cache_ptr, v_cache_ptr,
                   k_scale_ptr, v_scale_ptr, lut_ptr, stride_scale_b, stride_scale_s,
                   stride_scale_h, block_tables_ptr,
                   seq_lens_ptr, query_start_loc_ptr, first_seq, scale_log2, window,
                   stride_query_t, stride_query_h, stride_out_t, stride_out_h,
                   stride_cache_b, stride_cache_s, stride_cache_h, stride_table,
                   block_size, head_dim,
                   QUERIES_PER_KV: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_D: tl.constexpr, USE_WINDOW: tl.constexpr,
                   DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
                   QUANT: tl.constexpr):
    seq = first_seq + tl.program_id(0)
    kv_head = tl.program_id(1)
    token = tl.load(query_start_loc_ptr + seq)  # a decode has one query token
    seq_len = tl.load(seq_lens_ptr + seq)

    group = tl.arange(0, BLOCK_G)  # [BLOCK_G] query heads of this KV head, padded to >= 16
    dims = tl.arange(0, BLOCK_D)
    heads = kv_head * QUERIES_PER_KV + group
    io_mask = (group < QUERIES_PER_KV)[:, None] & (dims[None, :] < head_dim)
    query = tl.load(query_ptr + token * stride_query_t + heads[:, None] * stride_query_h
                    + dims[None, :], mask=io_mask, other=0.0)  # [BLOCK_G, BLOCK_D]
    if QUANT:
        query = query.to(tl.float32)
    query_pos = tl.zeros([BLOCK_G], dtype=tl.int64) + (seq_len - 1)

    key_begin = 0
    if USE_WINDOW:
        key_begin = (tl.maximum(seq_len - window, 0) // BLOCK_N) * BLOCK_N
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    block_table_ptr = block_tables_ptr + seq * stride_table
    for key_start in range(key_begin, seq_len, BLOCK_N):
        acc, m_i, l_i = _attend_tile(query, acc, m_i, l_i, query_pos, key_start, seq_len,
                                     scale_log2, window, block_table_ptr, k_cache_ptr,
                                     v_cache_ptr, kv_head, stride_cache_b, stride_cache_s,
                                     stride_cache_h, block_size, head_dim, k_scale_ptr,
                                     v_scale_ptr, lut_ptr, stride_scale_b, stride_scale_s,
                                     stride_scale_h, BLOCK_N, BLOCK_D, USE_WINDOW,
                                     DOT_PRECISION, UPCAST_DOT, QUANT)
    # Padding rows (group >= QUERIES_PER_KV) have a zero query, so l_i > 0 for them too.
    out = acc / l_i[:, None]
    tl.store(out_ptr + token * stride_out_t + heads[:, None] * stride_out_h + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=io_mask)


def prefill_attention(out: torch.Tensor, query: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, metadata: AttentionMetadata, scale: float,
                      sliding_window: int | None, config: LaunchConfig,
                      quant: QuantArgs | None = None) -> None:
    """Write into out[:num_prefill_tokens] the attention of the prefill group's queries."""
    num_heads, head_dim = query.shape[1:]
    num_kv_heads = k_cache.shape[2]
    num_query_blocks = triton.cdiv(metadata.prefill.max_query_len, config.prefill_block_m)
    grid = (metadata.num_prefills, num_query_blocks, num_heads)
    quant = quant or QuantArgs.none(k_cache)
    _prefill_kernel[grid](
        out, query, k_cache, v_cache, *quant.pointers(), metadata.block_tables, metadata.seq_lens,
        metadata.query_start_loc, scale * math.log2(math.e), sliding_window or 0,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), metadata.block_tables.stride(0),
        k_cache.shape[1], head_dim,
        QUERIES_PER_KV=num_heads // num_kv_heads, BLOCK_M=config.prefill_block_m,
        BLOCK_N=config.prefill_block_n, BLOCK_D=_block_d(head_dim),
        USE_WINDOW=sliding_window is not None,
        DOT_PRECISION=_dot_precision(torch.float32 if quant.mode else query.dtype),
        UPCAST_DOT=INTERPRETED and query.dtype == torch.bfloat16 and not quant.mode,
        QUANT=quant.mode, num_warps=config.prefill_warps)


def decode_attention(out: torch.Tensor, query: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, metadata: AttentionMetadata, scale: float,
                     sliding_window: int | None, config: LaunchConfig,
                     quant: QuantArgs | None = None) -> None:
    """Write into out[num_prefill_tokens:] the attention of the decode group's queries.

    CUDA graphs capture this launch (worker/cuda_graphs.py), so it must stay replayable with
    new per-step values: the grid is (decodes, KV heads), never sized by ``max_seq_len`` or
    any other value of the step's contents; each program reads its sequence's length and
    block table from device memory; no argument comes from a host sync. The Python ints
    passed (``num_prefills``, strides, shapes) are fixed for a captured batch size."""
    num_heads, head_dim = query.shape[1:]
    num_kv_heads = k_cache.shape[2]
    queries_per_kv = num_heads // num_kv_heads
    quant = quant or QuantArgs.none(k_cache)
    _decode_kernel[(metadata.num_decode_tokens, num_kv_heads)](
        out, query, k_cache, v_cache, *quant.pointers(), metadata.block_tables, metadata.seq_lens,
        metadata.query_start_loc, metadata.num_prefills, scale * math.log2(math.e),
        sliding_window or 0,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), metadata.block_tables.stride(0),
        k_cache.shape[1], head_dim,
        QUERIES_PER_KV=queries_per_kv, BLOCK_G=max(16, triton.next_power_of_2(queries_per_kv)),
        BLOCK_N=config.decode_block_n, BLOCK_D=_block_d(head_dim),
        USE_WINDOW=sliding_window is not None,
        DOT_PRECISION=_dot_precision(torch.float32 if quant.mode else query.dtype),
        UPCAST_DOT=INTERPRETED and query.dtype == torch.bfloat16 and not quant.mode,
        QUANT=quant.mode, num_warps=config.decode_warps)


def paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, metadata: AttentionMetadata,
                    scale: float, sliding_window: int | None = None) -> torch.Tensor:
    """One attention layer for a step.

    query [num_tokens, num_heads, D]; key, value [num_tokens, num_kv_heads, D] of the step's
    tokens (written to the cache here); returns [num_tokens, num_heads, D] in query's dtype.
    """
    _check_inputs(query, k_cache, v_cache)
    write_to_kv_cache(key, value, k_cache, v_cache, metadata.slot_mapping)
    query = _unit_last_stride(query)
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    config = launch_config(query.dtype, query.shape[2])
    if metadata.num_prefills:
        prefill_attention(out, query, k_cache, v_cache, metadata, scale, sliding_window, config)
    if metadata.num_decode_tokens:
        decode_attention(out, query, k_cache, v_cache, metadata, scale, sliding_window, config)
    return out


def paged_attention_quantized(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                              cache: QuantizedKVCache, metadata: AttentionMetadata,
                              scale: float, sliding_window: int | None = None) -> torch.Tensor:
    """paged_attention over an 8-bit cache (kv_quant.py): the step's K/V are quantized and
    stored (write_to_kv_cache_quantized), then the kernels read the bytes and decode them per
    tile, in float32."""
    write_to_kv_cache_quantized(key, value, cache, metadata.slot_mapping)
    storage = torch.int8 if cache.format.storage == torch.int8 else torch.uint8
    k_values = kv_values(cache.key, cache.format).view(storage)
    v_values = kv_values(cache.value, cache.format).view(storage)
    _check_inputs(query, k_values, v_values)
    quant = QuantArgs(kv_scales(cache.key), kv_scales(cache.value),
                      cache.format.lut(query.device), 1 if storage == torch.int8 else 2)
    query = _unit_last_stride(query)
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    config = launch_config(torch.float32, query.shape[2])
    if metadata.num_prefills:
        prefill_attention(out, query, k_values, v_values, metadata, scale, sliding_window,
                          config, quant)
    if metadata.num_decode_tokens:
        decode_attention(out, query, k_values, v_values, metadata, scale, sliding_window,
                         config, quant)
    return out


@dataclass(frozen=True, slots=True)
class QuantArgs:
    """The kernels' 8-bit cache inputs: row scales [num_blocks, block_size, num_kv_heads]
    (strided bfloat16 views), the byte table, and QUANT (0: not quantized, 1: int8, 2: table)."""

    k_scale: torch.Tensor
    v_scale: torch.Tensor
    lut: torch.Tensor
    mode: int

    @staticmethod
    def none(cache: torch.Tensor) -> QuantArgs:
        return QuantArgs(cache, cache, cache, 0)

    def pointers(self) -> tuple:
        if not self.mode:
            return self.k_scale, self.v_scale, self.lut, 0, 0, 0
        return (self.k_scale, self.v_scale, self.lut, self.k_scale.stride(0),
                self.k_scale.stride(1), self.k_scale.stride(2))


def _check_inputs(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """The layouts the kernels assume; a mismatch here is a bug in the caller, not user input."""
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError(f"K/V caches need the same strides and contiguous heads, got "
                         f"{k_cache.stride()} and {v_cache.stride()}")
    if query.shape[1] % k_cache.shape[2]:
        raise ValueError(f"{query.shape[1]} query heads are not a multiple of "
                         f"{k_cache.shape[2]} KV heads")
    if not query.is_cuda and not INTERPRETED:
        raise RuntimeError("the Triton attention backend runs on CUDA tensors; on CPU tensors "
                           "only under TRITON_INTERPRET=1, set before this module is imported")


def _block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))  # tl.dot needs K >= 16


def _dot_precision(dtype: torch.dtype) -> str:
    """IEEE float32 products for float32 inputs (TF32 would round them to 10 mantissa bits);
    16-bit inputs run on the tensor cores as they are."""
    return "ieee" if dtype == torch.float32 else "tf32"
