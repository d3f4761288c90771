"""The torch side of quant_matmul.c's products: pack_int4's row layout of int4 codes and its
inverse, the rounding of activations to int8 codes that the int8-activation kernels see, and
the float32 GEMM on cache-sized slices of a weight that the compiled products hand many rows
to. Plain torch, no kernels."""
from __future__ import annotations

from collections.abc import Callable

import torch

_SLICE_FLOATS = 1 << 18  # ~1 MB of dequantized float32 weight per GEMM call


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """codes [N, K] in [0, 15] -> [N, K / 2] uint8: in each run of 32 columns, byte j holds
    column j (low nibble) and column j + 16 (high nibble)."""
    out_features, in_features = codes.shape
    runs = codes.to(torch.uint8).view(out_features, in_features // 32, 2, 16)
    return (runs[:, :, 0] | (runs[:, :, 1] << 4)).reshape(out_features, in_features // 2)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of pack_int4: [N, K / 2] uint8 -> codes [N, K] uint8."""
    out_features = packed.shape[0]
    runs = packed.view(out_features, -1, 1, 16)
    return torch.cat([runs & 0x0F, runs >> 4], 2).reshape(out_features, -1)


ACTIVATION_BLOCK = 32  # columns per int8 activation scale


def quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] (K a multiple of 32) rounded as the int8-activation products see it, in
    float32: per row and block of 32 columns, codes q = x * (127 / amax) clamped to
    [-127, 127] and rounded to nearest even, times the scale amax / 127 (all float32
    operations, as quant_matmul.c's quantize_activations; a block of zeros stays zero)."""
    in_features = x.shape[-1]
    if in_features % ACTIVATION_BLOCK:
        raise ValueError(f"int8 activations: in_features={in_features} must be a multiple of "
                         f"{ACTIVATION_BLOCK}")
    blocks = x.float().reshape(-1, in_features // ACTIVATION_BLOCK, ACTIVATION_BLOCK)
    amax = blocks.abs().amax(-1, keepdim=True)
    # a division as C's 127.0f / amax (``127 / amax`` multiplies by the reciprocal)
    inverse = torch.where(amax > 0, torch.full_like(amax, 127) / amax, 0.0)
    codes = (blocks * inverse).clamp(-127, 127).round()
    return (codes * (amax / 127)).view(x.shape)


def sliced_float32_gemm(rows: torch.Tensor, out_features: int,
                        weight_rows: Callable[[int, int], torch.Tensor],
                        bias: torch.Tensor | None) -> torch.Tensor:
    """rows [M, K] @ W^T (+ bias) in float32, rounded once to rows' dtype, with W [N, K]
    produced ~1 MB of float32 at a time by ``weight_rows(start, count)`` ([count, K] float32):
    each slice is read back from the cache by the GEMM, not from memory (a whole-weight
    conversion cost more than the matmul for a 32000-row lm_head)."""
    in_features = rows.shape[-1]
    chunk = slice_rows(in_features)
    xt = rows.reshape(-1, in_features).float().t()  # [K, M]
    out = torch.empty(out_features, xt.shape[1])  # transposed: each slice's rows contiguous
    for start in range(0, out_features, chunk):
        count = min(chunk, out_features - start)
        torch.mm(weight_rows(start, count), xt, out=out[start:start + count])
    if bias is not None:
        out += bias.float()[:, None]
    return out.t().to(rows.dtype)


def slice_rows(in_features: int) -> int:
    """Rows of W per float32 slice of sliced_float32_gemm."""
    return max(16, _SLICE_FLOATS // in_features)
