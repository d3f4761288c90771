"""A GGUF file's quantized blocks as pagellm's quantized formats, exactly: the codes, scales and
zeros of Q4_0 / Q4_1 / Q4_K blocks as int4 groups of 32 (``int4_codes``), and of every quantized
type as int8 groups of 32 or 16 (``int8_codes``), in the layouts of
model/layers/quantized_linear.py. numpy over the file's memory-mapped bytes (gguf_loader
hands the tensors in); ggml's block layouts are described beside each type.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

# GGUF 4-bit blocks that are int4 groups of 32 as they are (quantized_linear.py), by bytes
# per block: Q4_0 = fp16 d, 16 bytes of nibbles (d * (q - 8)); Q4_1 = fp16 d, fp16 m, nibbles
# (d * q + m); Q4_K = a super-block of 256: fp16 d, fp16 dmin, 12 bytes of 6-bit scales and
# mins of its 8 sub-blocks of 32, 128 bytes of nibbles (d * sc_j * q - dmin * m_j).
INT4_BLOCK_TYPES = {"Q4_0": 18, "Q4_1": 20, "Q4_K": 144}


def int4_codes(tensor: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Q4_0 / Q4_1 / Q4_K tensor's codes [out, in] (0..15), scales and zeros [out, in / 32]
    float32, in int4pack's convention (q - 8) * scale + zero: the file's values exactly."""
    block_bytes = INT4_BLOCK_TYPES[tensor.tensor_type.name]
    rows = np.asarray(tensor.data).reshape(int(tensor.shape[1]), -1, block_bytes)
    if block_bytes == 144:
        codes, scale, zero = _q4_k_groups(rows)
    else:
        scale = _float16(rows, 0)  # [out, blocks]
        zero = np.zeros_like(scale) if block_bytes == 18 else _float16(rows, 2) + 8 * scale
        nibbles = rows[..., block_bytes - 16:]  # [out, blocks, 16]: j low, j + 16 high
        codes = np.concatenate([nibbles & 15, nibbles >> 4], axis=-1)  # [out, blocks, 32]
    return (torch.from_numpy(codes.reshape(rows.shape[0], -1).astype(np.uint8)),
            torch.from_numpy(scale.reshape(rows.shape[0], -1)),
            torch.from_numpy(zero.reshape(rows.shape[0], -1)))


# GGUF blocks as int8 groups (codes times one scale per group, plus a zero for the types
# with a min), by bytes per block. Groups of 32: Q8_0 = fp16 d, 32 int8 codes (d * q); Q5_0 =
# fp16 d, 4 bytes of high bits, 16 bytes of nibbles (d * (q5 - 16)); Q5_1 = fp16 d, fp16 m,
# the same high bits and nibbles (d * q5 + m); Q4_0 and Q4_1 (d * (q - 8), d * q + m); Q4_K
# and Q5_K = super-blocks of 256 with 8 sub-blocks of 32 (d * sc_j * q - dmin * m_j; Q5_K
# adds 32 bytes of fifth bits). Groups of 16: Q6_K = a super-block of 256: 128 bytes of low
# nibbles, 64 of high 2-bit pairs, 16 int8 scales of its sub-blocks of 16, fp16 d
# (d * sc_j * (q6 - 32)); Q3_K = a super-block of 256: 32 bytes of high bits, 64 of 2-bit
# pairs, 12 bytes of the 6-bit scales of its 16 sub-blocks of 16, fp16 d
# (d * (sc_j - 32) * (q3 - 4)); Q2_K = 16 bytes of 4-bit (scale, min) pairs of its 16
# sub-blocks, 64 of 2-bit codes, fp16 d, dmin (d * sc_j * q2 - dmin * m_j).
INT8_BLOCK_TYPES = {"Q8_0": 34, "Q5_0": 22, "Q6_K": 210, "Q3_K": 110, "Q4_0": 18,
                    "Q4_1": 20, "Q4_K": 144, "Q5_1": 24, "Q5_K": 176, "Q2_K": 84}


def int8_codes(tensor: Any) -> tuple[torch.Tensor, ...]:
    """A quantized tensor's codes [out, in] int8, scales [out, in / group] float32 (the file's
    fp16 values, times the K types' sub-block scales) and, for the types with a min (Q4_1,
    Q4_K, Q5_1, Q5_K, Q2_K), zeros [out, in / group] float32: W = q * scale (+ zero), the
    file's values exactly (gguf's own float32 arithmetic, d * q + m or d * q - dmin * m).
    Groups of 32, or 16 for Q6_K, Q3_K and Q2_K."""
    name = tensor.tensor_type.name
    rows = np.asarray(tensor.data).reshape(int(tensor.shape[1]), -1, INT8_BLOCK_TYPES[name])
    zero = None
    if name == "Q8_0":
        codes, scale = rows[..., 2:].copy().view(np.int8), _float16(rows, 0)
    elif name in ("Q5_0", "Q5_1"):
        codes = _q5_codes(rows, 2 if name == "Q5_0" else 4)
        scale = _float16(rows, 0)
        if name == "Q5_0":
            codes = codes - 16
        else:
            zero = _float16(rows, 2)
    elif name == "Q6_K":
        codes, scale = _q6_k_groups(rows)
    elif name == "Q3_K":
        codes, scale = _q3_k_groups(rows)
    elif name == "Q2_K":
        codes, scale, zero = _q2_k_groups(rows)
    elif name in ("Q4_0", "Q4_1"):
        nibbles = rows[..., -16:]  # [out, blocks, 16]: j low, j + 16 high
        codes = np.concatenate([nibbles & 15, nibbles >> 4], axis=-1).astype(np.int16)
        scale = _float16(rows, 0)
        if name == "Q4_0":
            codes = codes - 8
        else:
            zero = _float16(rows, 2)
    else:  # Q4_K, Q5_K
        codes, scale, zero = _k_groups_with_min(rows, name == "Q5_K")
    parts = (codes.astype(np.int8), scale) + (() if zero is None else (zero,))
    return tuple(torch.from_numpy(np.ascontiguousarray(p).reshape(rows.shape[0], -1))
                 for p in parts)


def _q5_codes(rows: np.ndarray, offset: int) -> np.ndarray:
    """rows [out, blocks, bytes] of Q5_0 (offset 2) or Q5_1 (offset 4) -> codes q5 [out,
    blocks, 32] in [0, 31] int16: weight j < 16 is the low nibble of byte j of the quants
    (high nibble: j + 16), with bit j of the 32-bit little-endian high-bit word at ``offset``
    as its fifth bit."""
    high = rows[..., offset:offset + 4].copy().view("<u4")  # [out, blocks, 1]
    quants = rows[..., offset + 4:offset + 20]
    low = np.concatenate([quants & 15, quants >> 4], axis=-1).astype(np.int16)
    fifth = (high >> np.arange(32, dtype=np.uint32)) & 1  # [out, blocks, 32]
    return low | (fifth.astype(np.int16) << 4)


def _k_groups_with_min(rows: np.ndarray, five_bits: bool
                       ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """rows [out, super-blocks, 144 or 176] of Q4_K or Q5_K -> codes [out, sb, 8, 32] (0-15
    or 0-31), scale d * sc_j and zero -dmin * m_j [out, sb, 8] float32. Sub-blocks 2i and
    2i + 1 are the low and the high nibbles of the i-th 32 bytes of quants; Q5_K's fifth bit
    of weight l of sub-block j is bit j of high-bit byte l (bytes 16-47, quants from 48)."""
    sc, m = _k_scales_mins(rows[..., 4:16])
    scale = _float16(rows, 0)[..., None] * sc.astype(np.float32)
    zero = -(_float16(rows, 2)[..., None] * m.astype(np.float32))
    start = 48 if five_bits else 16
    quants = rows[..., start:start + 128].reshape(*rows.shape[:2], 4, 1, 32)
    codes = ((quants >> np.array([0, 4], dtype=np.uint8)[:, None]) & 15).astype(np.int16)
    codes = codes.reshape(*rows.shape[:2], 8, 32)
    if five_bits:
        high = rows[..., 16:48].reshape(*rows.shape[:2], 1, 32)
        codes |= ((high >> np.arange(8, dtype=np.uint8)[:, None]) & 1).astype(np.int16) << 4
    return codes, scale, zero


def _q2_k_groups(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """rows [out, super-blocks, 84] of Q2_K -> codes q2 [out, sb, 16, 16] in [0, 3], scale
    d * sc_j and zero -dmin * m_j [out, sb, 16] float32. Sub-block j's byte j of the first 16
    holds sc_j (low nibble) and m_j; weight l of sub-block 8 n + 2 s + h has bits 2s, 2s + 1
    of quant byte 32 n + 16 h + l."""
    packed = rows[..., 0:16]
    quants = rows[..., 16:80].reshape(*rows.shape[:2], 2, 1, 2, 16)  # [.., n, s, h, l]
    shift = (2 * np.arange(4, dtype=np.uint8))[:, None, None]
    codes = ((quants >> shift) & 3).astype(np.int16).reshape(*rows.shape[:2], 16, 16)
    scale = _float16(rows, 80)[..., None] * (packed & 15).astype(np.float32)
    zero = -(_float16(rows, 82)[..., None] * (packed >> 4).astype(np.float32))
    return codes, scale, zero


def _q6_k_groups(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """rows [out, super-blocks, 210] of Q6_K -> codes q6 - 32 [out, sb, 256] int8 and scales
    [out, sb, 16] float32 (d * sc_j). ggml's layout: each half of 128 weights takes 64 bytes
    of low nibbles (ql) and 32 of high bit pairs (qh); weight l + 32 i (l < 32, i < 4) of a
    half has ql[l + 32 (i % 2)]'s low (i < 2) or high (i >= 2) nibble and bits 2i, 2i + 1
    of qh[l]; sub-block j covers weights 16 j .. 16 j + 15."""
    ql = rows[..., 0:128].reshape(*rows.shape[:2], 2, 2, 32)  # [out, sb, half, i % 2, l]
    qh = rows[..., 128:192].reshape(*rows.shape[:2], 2, 1, 32)  # [out, sb, half, 1, l]
    low = np.stack([ql & 15, ql >> 4], axis=3)  # [out, sb, half, i // 2, i % 2, l]
    low = low.reshape(*rows.shape[:2], 2, 4, 32)  # i = 2 (i // 2) + i % 2
    high = (qh >> (2 * np.arange(4, dtype=np.uint8))[:, None]) & 3  # [out, sb, half, i, l]
    codes = (low | (high << 4)).astype(np.int16) - 32
    sc = rows[..., 192:208].copy().view(np.int8).astype(np.float32)  # [out, sb, 16]
    return codes.astype(np.int8), _float16(rows, 208)[..., None] * sc


def _q4_k_groups(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """rows [out, super-blocks, 144] of Q4_K -> codes [out, sb, 8, 32] uint8, scale and zero
    [out, sb, 8] float32 in int4's convention: (q - 8) * scale + zero = d sc q - dmin m."""
    codes, scale, negative_min = _k_groups_with_min(rows, five_bits=False)
    return codes.astype(np.uint8), scale, 8 * scale + negative_min


def _k_scales_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 6-bit scales and mins [out, sb, 8] of Q4_K / Q5_K's 12 packed bytes [out, sb, 12]
    (ggml's get_scale_min_k4): bytes 0-3 hold the low 6 bits of the scales of sub-blocks 0-3,
    bytes 4-7 those of their mins; sub-block j >= 4 takes its scale's low 4 bits from byte
    j + 4's low nibble (its min's from the high nibble) and the top 2 bits from the top bits
    of byte j - 4 (its min's: byte j)."""
    low, high, mixed = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = np.concatenate([low & 63, (mixed & 15) | ((low >> 6) << 4)], axis=-1)
    m = np.concatenate([high & 63, (mixed >> 4) | ((high >> 6) << 4)], axis=-1)
    return sc, m


def _q3_k_groups(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """rows [out, super-blocks, 110] of Q3_K -> codes q3 - 4 [out, sb, 256] int8 and scales
    [out, sb, 16] float32 (d * (sc_j - 32)). ggml's layout: weight 16 h + l (h < 2, l < 16) of
    the 32 that shift j (< 4) of half n (< 2) covers, sub-block 8 n + 2 j + h, has bits 2j, 2j
    + 1 of quant byte 32 n + 16 h + l and, as its third bit, bit 4 n + j of high-bit byte
    16 h + l. Scale j takes its low 4 bits from byte j % 8's low (j < 8) or high nibble and
    its top 2 bits from bits 2 (j // 4) and 2 (j // 4) + 1 of byte 8 + j % 4."""
    hmask = rows[..., 0:32].reshape(*rows.shape[:2], 1, 1, 2, 16)  # [.., n, j, h, l]
    quants = rows[..., 32:96].reshape(*rows.shape[:2], 2, 1, 2, 16)
    packed = rows[..., 96:108]
    j = np.arange(4, dtype=np.uint8)[:, None, None]
    n = np.arange(2, dtype=np.uint8)[:, None, None, None]
    low = (quants >> (2 * j)) & 3  # [out, sb, n, j, h, l]
    high = (hmask >> (4 * n + j)) & 1
    codes = low.astype(np.int16) - 4 * (1 - high.astype(np.int16))
    k = np.arange(16)
    nibble = np.where(k < 8, packed[..., k % 8] & 15, packed[..., k % 8] >> 4)
    top = (packed[..., 8 + k % 4] >> (2 * (k // 4)).astype(np.uint8)) & 3
    sc = (nibble | (top << 4)).astype(np.float32) - 32  # [out, sb, 16]
    return codes.astype(np.int8), _float16(rows, 108)[..., None] * sc


def _float16(rows: np.ndarray, offset: int) -> np.ndarray:
    """The fp16 at byte ``offset`` of every block, as float32 [out, blocks]."""
    return rows[..., offset:offset + 2].copy().view(np.float16)[..., 0].astype(np.float32)
