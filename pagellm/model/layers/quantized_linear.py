"""Weight-only quantized linear layers on the CPU, through torch's own kernels.

- ``int8``: one scale per output channel, ``W[n, k] = q[n, k] * scale[n]`` with q in
  [-127, 127] (symmetric, scale = amax / 127); ``torch.ops.aten._weight_int8pack_mm``.
- ``int4``: groups of ``group_size`` input columns, asymmetric, in torch's int4pack
  convention ``W[n, k] = (q[n, k] - 8) * scale[n, g] + zero[n, g]`` (g = k // group_size,
  q in [0, 15]); ``torch.ops.aten._convert_weight_to_int4pack_for_cpu`` packs q once,
  ``_weight_int4pack_mm_for_cpu`` multiplies.

Both read a quarter (int4) or half (int8) of bfloat16's weight bytes per token, the lever on
bandwidth-bound batch-1 decode. Activations stay in the model dtype (bfloat16 or float32);
scales and zeros are stored in it too (the kernels' contract), so ``dequantized()`` — the
reference the tests compare against — is computed from the scales as stored.

GGUF blocks map onto int4 without a detour where the layouts match: Q4_0 (``d * (q - 8)``)
and Q4_1 (``d * q + m``) over 32 columns, and each sub-block of 32 of a Q4_K super-block
(``d * sc * q - dmin * m``), are int4 with group 32, scale d (d * sc) and zero 0, m + 8d
(8 d sc - dmin m) (gguf_loader.int4_codes). Everything else is quantized while loading from
the checkpoint's values in float32 (``int8_quantize`` / ``int4_quantize`` per checkpoint
tensor, model/quantize_on_load.py), never from a copy already rounded to bfloat16;
``quantize_linear_weights`` quantizes what is left from the loaded weight.
"""
from __future__ import annotations

import torch
from torch import nn

QUANTIZATION_METHODS = ("int8", "int4")


class Int8Weight(nn.Module):
    """q [N, K] int8 and per-channel scale [N] in the activation dtype."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("q", q.contiguous())
        self.register_buffer("scale", scale.contiguous())

    @classmethod
    def quantize(cls, weight: torch.Tensor, dtype: torch.dtype | None = None) -> Int8Weight:
        """``dtype``: the activation dtype the scales are stored in (default: the weight's)."""
        return cls(*int8_quantize(weight, dtype or weight.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x, self.q, self.scale.to(x.dtype))

    def dequantized(self) -> torch.Tensor:
        return self.q.float() * self.scale.float()[:, None]

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.scale.nbytes


class Int4Weight(nn.Module):
    """q packed by _convert_weight_to_int4pack_for_cpu ([N, K / 2] uint8), and
    scale_and_zero [K / group_size, N, 2] in the activation dtype."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                 group_size: int, dtype: torch.dtype) -> None:
        """q [N, K] integers in [0, 15]; scale, zero [N, K / group_size]."""
        super().__init__()
        out_features, in_features = q.shape
        _check_group(in_features, group_size, out_features)
        self.group_size = group_size
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            q.to(torch.int32).contiguous(), 1))
        self.register_buffer("scale_and_zero", torch.stack([scale, zero], -1).transpose(0, 1)
                             .contiguous().to(dtype))  # [K / g, N, 2]
        self._q = None  # unpacked codes, kept only for dequantized() in tests

    @classmethod
    def quantize(cls, weight: torch.Tensor, group_size: int,
                 dtype: torch.dtype | None = None) -> Int4Weight:
        """``dtype``: the activation dtype the scales and zeros are stored in (default: the
        weight's)."""
        dtype = dtype or weight.dtype
        _check_group(weight.shape[1], group_size, weight.shape[0])
        return cls.from_codes(*int4_quantize(weight, group_size, dtype), group_size, dtype)

    @classmethod
    def from_codes(cls, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                   group_size: int, dtype: torch.dtype) -> Int4Weight:
        layer = cls(q, scale, zero, group_size, dtype)
        layer._q = q.to(torch.uint8)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            x, self.packed, self.group_size, self.scale_and_zero.to(x.dtype))

    def dequantized(self) -> torch.Tensor:
        """[N, K] float32 from the codes and the stored (rounded) scales and zeros."""
        out_features, in_features = self._q.shape
        sz = self.scale_and_zero.float().transpose(0, 1)  # [N, K / g, 2]
        q = self._q.float().view(out_features, -1, self.group_size)
        return ((q - 8) * sz[..., :1] + sz[..., 1:]).view(out_features, in_features)

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scale_and_zero.nbytes


def int8_quantize(weight: torch.Tensor, dtype: torch.dtype
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] (any float dtype, read in float32) -> q [N, K] int8, scale [N] in
    ``dtype``; q is computed with the scale as stored. Rows are independent: the rows of a
    stacked weight quantize as each part alone."""
    w = weight.float()
    amax = w.abs().amax(1)
    scale = torch.where(amax > 0, amax / 127, 1.0).to(dtype)
    q = (w / scale.float()[:, None]).round().clamp(-127, 127).to(torch.int8)
    return q, scale


def int4_quantize(weight: torch.Tensor, group_size: int, dtype: torch.dtype
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [N, K] (read in float32) -> codes [N, K] uint8 in [0, 15], scale and zero
    [N, K / group_size] float32 holding values of ``dtype`` (the codes are computed with
    them as stored). Rows are independent, as for int8."""
    out_features, in_features = weight.shape
    _check_group(in_features, group_size)
    groups = weight.float().view(out_features, in_features // group_size, group_size)
    low, high = groups.amin(-1), groups.amax(-1)
    scale = torch.where(high > low, (high - low) / 15, 1.0).to(dtype).float()
    zero = (low + 8 * scale).to(dtype).float()  # (q - 8) * scale + zero
    q = ((groups - zero[..., None]) / scale[..., None] + 8).round().clamp(0, 15)
    return q.view(out_features, in_features).to(torch.uint8), scale, zero


def _check_group(in_features: int, group_size: int, out_features: int | None = None) -> None:
    if group_size not in (32, 64, 128, 256) or in_features % group_size:
        raise ValueError(f"int4 quantization: group_size={group_size} must be one of 32, 64, "
                         f"128, 256 and divide in_features={in_features}")
    if out_features is not None and out_features % 16:
        raise ValueError(f"int4 quantization: out_features={out_features} must be a multiple "
                         "of 16 (torch's int4 packing); use quantization='int8'")


def check_supported(method: str | None, device: torch.device, dtype: torch.dtype) -> None:
    """Raise ValueError for a combination the quantized kernels cannot run."""
    if method is None:
        return
    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization={method!r} is not supported; supported: "
                         f"{', '.join(QUANTIZATION_METHODS)} (or None)")
    if device.type != "cpu":
        raise ValueError(f"quantization={method!r} runs on the CPU only (torch's int8/int4 "
                         f"weight-only kernels); device={device.type!r}: use device='cpu' "
                         "or quantization=None")
    if dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"quantization={method!r} needs dtype bfloat16 or float32, got "
                         f"{str(dtype).removeprefix('torch.')}")


def quantize_linear(module: nn.Module, method: str, group_size: int) -> nn.Module:
    """The quantized weight of a loaded Linear (its ``weight`` [N, K])."""
    weight = module.weight.detach()
    if method == "int8":
        return Int8Weight.quantize(weight)
    return Int4Weight.quantize(weight, group_size)


def quantize_linear_weights(model: nn.Module, method: str, group_size: int,
                            shared: set[int] | frozenset[int] = frozenset()) -> int:
    """Quantize every Linear of a loaded model whose weight is not already quantized (GGUF
    blocks mapped directly); returns how many were. The plain weight is released, except
    where another module reads it (``shared``: a tied embedding)."""
    from pagellm.model.layers.linear import Linear

    count = 0
    for module in model.modules():
        if not isinstance(module, Linear) or module.quantized is not None:
            continue
        module.quantized = quantize_linear(module, method, group_size)
        if id(module.weight) not in shared:
            module.weight.data = torch.empty(0, dtype=module.weight.dtype)
        count += 1
    return count
