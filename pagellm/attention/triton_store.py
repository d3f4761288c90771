"""The Triton K/V stores of the GPU path (triton_backend.py): one program per token writes its
K and V (all KV heads) into its slot (``slot_mapping``, -1: padding, not written), nothing
sized by the step's contents, so that CUDA graphs capture them.

- ``_write_kv_kernel``: a cache of the model dtype, the rows copied as they are.
- ``_write_kv_quantized_kernel``: an 8-bit cache (kv_quant.py), each row quantized as
  ``kv_quant.quantize`` does, byte for byte (tests/model/test_triton_attention.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagellm.attention.kv_quant import QuantizedKVCache


@triton.jit
def _write_kv_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
                     stride_key_t, stride_key_h, stride_value_t, stride_value_h,
                     stride_cache_b, stride_cache_s, stride_cache_h,
                     block_size, num_kv_heads, head_dim,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token)  # int64
    if slot < 0:  # padding: not written
        return
    heads = tl.arange(0, BLOCK_H)[:, None]  # [BLOCK_H, 1]
    dims = tl.arange(0, BLOCK_D)[None, :]  # [1, BLOCK_D]
    mask = (heads < num_kv_heads) & (dims < head_dim)
    cache_offset = ((slot // block_size) * stride_cache_b + (slot % block_size) * stride_cache_s
                    + heads * stride_cache_h + dims)  # [BLOCK_H, BLOCK_D]
    key = tl.load(key_ptr + token * stride_key_t + heads * stride_key_h + dims, mask=mask)
    value = tl.load(value_ptr + token * stride_value_t + heads * stride_value_h + dims, mask=mask)
    tl.store(k_cache_ptr + cache_offset, key, mask=mask)
    tl.store(v_cache_ptr + cache_offset, value, mask=mask)


@triton.jit
def _quantized_rows(x, qmax, FORMAT: tl.constexpr):
    """x [BLOCK_H, BLOCK_D] float32 (zero past head_dim) -> (codes [BLOCK_H, BLOCK_D] int32 in
    0..255, the rows' bfloat16 scale bits [BLOCK_H] int32), as kv_quant.quantize: scale =
    bfloat16(amax / qmax) rounded to nearest even (1 for an all-zero row), codes = x / scale
    clamped to +-qmax and rounded to nearest even, int8 (FORMAT 0) as two's complement bytes,
    fp8 e4m3 (1) / e5m2 (2) with c10's bit operations (the CPU store's fp8_code); each fp8
    code's sign comes from x's own bits (a zero keeps its sign). A row with a NaN or an
    infinity: scale NaN (0x7FC0), codes 0."""
    # the divisions are IEEE (div_rn): Triton's ``/`` is not correctly rounded on NVIDIA GPUs
    bad = tl.max(tl.where(tl.abs(x) < float("inf"), 0, 1), axis=1) > 0  # NaN or infinite
    x = tl.where(bad[:, None], 0.0, x)  # such a row: the codes of zeros (0), scale NaN below
    amax = tl.max(tl.abs(x), axis=1)  # [BLOCK_H]
    ratio = tl.where(amax > 0, tl.div_rn(amax, tl.full(amax.shape, qmax, tl.float32)), 1.0)
    bits = ratio.to(tl.int32, bitcast=True)  # positive and finite: no sign, no NaN
    scale_bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    scale = (scale_bits << 16).to(tl.float32, bitcast=True)
    y = tl.div_rn(x, tl.broadcast_to(scale[:, None], x.shape))
    y = tl.minimum(tl.maximum(y, -qmax), qmax)
    if FORMAT == 0:
        # |y| <= 127: adding 1.5 * 2^23 leaves units in the last place, so the float adder
        # rounds to the nearest integer, ties to even; the subtraction is exact
        rounded = (y + 12582912.0) - 12582912.0
        codes = rounded.to(tl.int32) & 0xFF
    else:
        magnitude = y.to(tl.int32, bitcast=True) & 0x7FFFFFFF
        sign = (x.to(tl.int32, bitcast=True) >> 24) & 0x80
        if FORMAT == 1:  # e4m3: 3 mantissa bits, bias 7; subnormals below 2^-6
            denorm, denorm_bits = 16384.0, 141 << 23  # 2^14: its last place is 2^-9, the
            # subnormal step, so adding it rounds a subnormal to its code
            normal = magnitude >= (121 << 23)
            shifted = (magnitude + ((7 - 127) << 23) + ((1 << 19) - 1)
                       + ((magnitude >> 20) & 1)) >> 20
            overflow = tl.full(magnitude.shape, 0x7F, tl.int32)
            too_big = magnitude >= (1087 << 20)
        else:  # e5m2: 2 mantissa bits, bias 15; subnormals below 2^-14
            denorm, denorm_bits = 128.0, 134 << 23  # 2^7: last place 2^-16
            normal = magnitude >= (113 << 23)
            shifted = (magnitude + ((15 - 127) << 23) + ((1 << 20) - 1)
                       + ((magnitude >> 21) & 1)) >> 21
            overflow = tl.where(magnitude > 0x7F800000, 0x7F, 0x7C)
            too_big = magnitude >= (143 << 23)
        tiny = ((magnitude.to(tl.float32, bitcast=True) + denorm).to(tl.int32, bitcast=True)
                - denorm_bits)
        codes = tl.where(too_big, overflow, tl.where(normal, shifted, tiny)) | sign
    return codes, tl.where(bad, 0x7FC0, scale_bits)


@triton.jit
def _store_quantized_rows(src_ptr, cache_ptr, row, dims, mask, head_mask, head_dim, qmax,
                          FORMAT: tl.constexpr):
    """Rows at ``src_ptr`` [BLOCK_H, BLOCK_D] (one token's K or V) quantized into the cache
    rows at ``row``: head_dim codes, then the scale's two bytes (little-endian bfloat16)."""
    x = tl.load(src_ptr, mask=mask, other=0.0).to(tl.float32)
    codes, scale_bits = _quantized_rows(x, qmax, FORMAT)
    tl.store(cache_ptr + row + dims, codes.to(tl.uint8), mask=mask)
    tl.store(cache_ptr + row + head_dim, (scale_bits & 0xFF).to(tl.uint8)[:, None],
             mask=head_mask)
    tl.store(cache_ptr + row + head_dim + 1, (scale_bits >> 8).to(tl.uint8)[:, None],
             mask=head_mask)


@triton.jit
def _write_kv_quantized_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
                               stride_key_t, stride_key_h, stride_value_t, stride_value_h,
                               stride_cache_b, stride_cache_s, stride_cache_h,
                               block_size, num_kv_heads, head_dim, qmax,
                               FORMAT: tl.constexpr, BLOCK_H: tl.constexpr,
                               BLOCK_D: tl.constexpr):
    """One token: its K and V rows quantized (_quantized_rows) into the uint8 caches' rows
    at its slot."""
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token)  # int64
    if slot < 0:  # padding: not written
        return
    heads = tl.arange(0, BLOCK_H)[:, None]  # [BLOCK_H, 1]
    dims = tl.arange(0, BLOCK_D)[None, :]  # [1, BLOCK_D]
    head_mask = heads < num_kv_heads
    mask = head_mask & (dims < head_dim)
    row = ((slot // block_size) * stride_cache_b + (slot % block_size) * stride_cache_s
           + heads * stride_cache_h)  # [BLOCK_H, 1]
    _store_quantized_rows(key_ptr + token * stride_key_t + heads * stride_key_h + dims,
                          k_cache_ptr, row, dims, mask, head_mask, head_dim, qmax, FORMAT)
    _store_quantized_rows(value_ptr + token * stride_value_t + heads * stride_value_h + dims,
                          v_cache_ptr, row, dims, mask, head_mask, head_dim, qmax, FORMAT)


def write_to_kv_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store key/value [num_tokens, num_kv_heads, head_dim] at ``slot_mapping`` (-1: skip)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    key, value = _unit_last_stride(key), _unit_last_stride(value)
    _write_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        k_cache.shape[1], num_kv_heads, head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim))


def write_to_kv_cache_quantized(key: torch.Tensor, value: torch.Tensor,
                                cache: QuantizedKVCache, slot_mapping: torch.Tensor) -> None:
    """Quantize key/value [num_tokens, num_kv_heads, head_dim] into the 8-bit cache at
    ``slot_mapping`` (-1: skip): kv_quant.quantize's bytes, one program per token, nothing
    sized by the step's contents (CUDA graphs can capture it)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    key, value = _unit_last_stride(key), _unit_last_stride(value)
    k_cache = cache.key
    _write_kv_quantized_kernel[(num_tokens,)](
        key, value, k_cache, cache.value, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        k_cache.shape[1], num_kv_heads, head_dim, cache.format.qmax,
        FORMAT=_STORE_FORMATS[cache.format.name],
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim))


_STORE_FORMATS = {"int8": 0, "fp8_e4m3": 1, "fp8_e5m2": 2}


def _unit_last_stride(tensor: torch.Tensor) -> torch.Tensor:
    """The kernels address the head dimension as contiguous; copy only when it is not."""
    return tensor if tensor.stride(-1) == 1 else tensor.contiguous()
