"""The panel layouts of quant_matmul.c's panel kernels (AVX512-VNNI builds, int8 activations):
a weight's output columns in panels of 16, each block of 32 inputs of a panel stored so that
one ``vpdpbusd`` adds 4 code products into each of the 16 columns' 32-bit lanes.
``pack_int4_panels`` (int4_panel_a8_matmul) and ``pack_int8_panels`` (int8_panel_a8_matmul),
and their inverses. Plain torch, no kernels."""
from __future__ import annotations

import functools

import torch

PANEL = 16  # output columns per panel of pack_int4_panels


def pack_int4_panels(codes: torch.Tensor, scale_and_zero: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """codes [N, K] in [0, 15] and scale_and_zero [N, K / group_size, 2] in the panel layout
    of int4_panel_a8_matmul (quant_matmul.c): codes [P, K / 32, 256] uint8 with P =
    ceil(N / 16), where for panel p, block b, chunk c = 0..3 and column j, byte 64 c + 4 j + i
    holds column 16 p + j's code at k = 32 b + 4 c + i (low nibble) and at 32 b + 16 + 4 c + i
    (high nibble); params [P, K / group_size, 2, 16] (each group's 16 scales, then its 16
    zeros). The last panel's missing columns are zero codes and parameters."""
    out_features, in_features = codes.shape
    panels = -(-out_features // PANEL)
    pad = panels * PANEL - out_features
    q = torch.nn.functional.pad(codes.to(torch.uint8), (0, 0, 0, pad))
    # [P, j, b, half, c, i] -> [P, b, c, j, i, half]
    q = q.view(panels, PANEL, in_features // 32, 2, 4, 4).permute(0, 2, 4, 1, 5, 3)
    packed = (q[..., 0] | (q[..., 1] << 4)).reshape(panels, in_features // 32, 256)
    groups = scale_and_zero.shape[1]
    params = torch.nn.functional.pad(scale_and_zero, (0, 0, 0, 0, 0, pad))
    params = params.view(panels, PANEL, groups, 2).permute(0, 2, 3, 1)
    return packed.contiguous(), params.contiguous()


def unpack_int4_panels(packed: torch.Tensor, params: torch.Tensor, out_features: int
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of pack_int4_panels: codes [N, K] uint8, scale_and_zero [N, K / g, 2]."""
    panels, blocks = packed.shape[:2]
    q = packed.view(panels, blocks, 4, PANEL, 4, 1)
    q = torch.cat([q & 0x0F, q >> 4], -1)  # [P, b, c, j, i, half]
    q = q.permute(0, 3, 1, 5, 2, 4).reshape(panels * PANEL, blocks * 32)
    scale_and_zero = params.permute(0, 3, 1, 2).reshape(panels * PANEL, params.shape[1], 2)
    return q[:out_features].contiguous(), scale_and_zero[:out_features].contiguous()


def pack_int8_panels(codes: torch.Tensor, scale: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 codes [N, K] and their scales ([N] or [N, K / group_size]) in the panel
    layout of int8_panel_a8_matmul (quant_matmul.c): codes [P, K / 32, 512] uint8 with P =
    ceil(N / 16), where for panel p, block b, chunk c = 0..7 and column j, byte 64 c + 4 j + i
    holds column 16 p + j's code at k = 32 b + 4 c + i plus 128; scales [P, groups, 16]. The
    last panel's missing columns are zero codes and scales."""
    out_features, in_features = codes.shape
    panels = -(-out_features // PANEL)
    pad = panels * PANEL - out_features
    q = torch.nn.functional.pad(codes.to(torch.int16) + 128, (0, 0, 0, pad), value=128)
    # [P, j, b, c, i] -> [P, b, c, j, i]
    q = q.view(panels, PANEL, in_features // 32, 8, 4).permute(0, 2, 3, 1, 4)
    packed = q.to(torch.uint8).reshape(panels, in_features // 32, 512)
    scales = scale.reshape(out_features, -1)
    scales = torch.nn.functional.pad(scales, (0, 0, 0, pad))
    scales = scales.view(panels, PANEL, scales.shape[1]).permute(0, 2, 1)
    return packed.contiguous(), scales.contiguous()


def unpack_int8_panels(packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """The codes of pack_int8_panels' layout back in rows: [N, K] int8."""
    panels, blocks = packed.shape[:2]
    q = packed.view(panels, blocks, 8, PANEL, 4).permute(0, 3, 1, 2, 4)
    q = q.reshape(panels * PANEL, blocks * 32)[:out_features]
    return (q.to(torch.int16) - 128).to(torch.int8)


def int8_panel_rows(packed: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Rows ``index`` [T] of the codes in pack_int8_panels' layout: [T, K] int8, read in
    place (a tied embedding's lookups)."""
    blocks = packed.shape[1]
    # column n's first code: panel n // 16 at n % 16 * 4, = 4 n + (n // 16) (panel bytes - 64)
    first = torch.add(index * 4, index >> 4, alpha=blocks * 512 - 4 * PANEL)
    codes = packed.view(-1).take(first[:, None] + _row_offsets(blocks))
    return torch.bitwise_xor(codes, 128).view(torch.int8)  # code + 128 -> code


@functools.lru_cache(maxsize=8)
def _row_offsets(blocks: int) -> torch.Tensor:
    """[K]: where input k of a panel's column 0 sits in the panel (pack_int8_panels)."""
    k = torch.arange(blocks * 32)
    return k // 32 * 512 + k % 32 // 4 * 64 + k % 4
