"""Weight-only quantized linear layers on the CPU.

- ``int8``: ``W[n, k] = q[n, k] * scale[n]`` with q in [-127, 127] (symmetric, scale =
  amax / 127), one scale per output channel; or one per group of ``group_size`` input
  columns (``scale[n, g]``, g = k // group_size), as GGUF's Q8_0 blocks are; or, for GGUF
  blocks with a min (Q4_1, Q4_K, Q5_1, Q5_K, Q2_K), ``q[n, k] * scale[n, g] + zero[n, g]``.
- ``int4``: groups of ``group_size`` input columns, asymmetric,
  ``W[n, k] = (q[n, k] - 8) * scale[n, g] + zero[n, g]`` with q in [0, 15].

Both read a quarter (int4) or half (int8) of bfloat16's weight bytes per token, the lever on
bandwidth-bound batch-1 decode. Activations stay in the model dtype (bfloat16 or float32);
scales and zeros are stored in it too, so ``dequantized()`` — the reference the tests compare
against — is computed from the scales as stored.

The products run in pagellm's compiled kernels (quant_matmul.py: float32 sums of the
dequantized weights, AVX2 where the CPU has it), whose layout the codes are packed in at
construction, where quant_matmul.preferred(); and, on builds with AVX512-BF16, the products
of quant_matmul.DOT_ROWS bfloat16 rows and more (LOOP_DOT_ROWS where the compiled loops run
otherwise; prefill, large batches), which sum exact bfloat16 products of the codes in
float32. Elsewhere (no C compiler; CPUs with AVX-512)
they run torch's weight-only kernels (``_weight_int8pack_mm``;
``_weight_int4pack_mm_for_cpu`` on codes packed by ``_convert_weight_to_int4pack_for_cpu``,
which needs out_features % 16 == 0); group-wise int8, which torch has no kernel for, and
int4 with int8 activations (torch's kernel would take the rounded rows in float32, its slow
path) run compiled wherever they are built, else as torch computes them.

GGUF blocks map onto these without a detour where the layouts match: Q8_0 (``d * q`` over 32
columns) is int8 with group 32, and every other GGUF type is int8 with its block's codes,
scale and (where it has one) min (gguf_codes.int8_codes); Q4_0 (``d * (q - 8)``) and Q4_1 (``d * q + m``) over 32
columns, and each sub-block of 32 of a Q4_K super-block (``d * sc * q - dmin * m``), are int4
with group 32, scale d (d * sc) and zero 0, m + 8d (8 d sc - dmin m)
(gguf_codes.int4_codes). Everything else is quantized while loading from the checkpoint's
values in float32 (``int8_quantize`` / ``int4_quantize`` per checkpoint tensor,
model/quantize_on_load.py), never from a copy already rounded to bfloat16;
model/quantized_model.py quantizes what is left from the loaded weight, and holds the
model-level choices (methods, group size, int8 activations).
"""
from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.model.layers import quant_matmul, quant_panels



class Int8Weight(nn.Module):
    """q [N, K] int8 and scale [N] (per output channel) or [N, K / group_size] (per group) in
    the activation dtype (GGUF groups: float32).

    ``zero`` [N, K / group_size] (group-wise only): W = q * scale + zero. The scales and zeros
    are then held together, [N, K / group_size, 2], the layout of the compiled "int8_zero"
    product; torch has no kernel for it (nor for symmetric groups), so without the compiled
    kernels forward multiplies the dequantized weight. ``params`` is the one buffer of
    either (what the kernel reads); ``scale`` and ``zero`` (None: symmetric) are read from
    it.

    With int8 activations on a build with the AVX512-VNNI loops, the codes are held in
    quant_panels.pack_int8_panels' layout instead (``panels``: ``panel_codes`` and
    ``panel_scales``, ``q`` then empty; codes() gives the rows), and back in rows when they
    are switched off: one copy of the codes either way."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor,
                 group_size: int | None = None, zero: torch.Tensor | None = None) -> None:
        super().__init__()
        out_features, in_features = q.shape
        self.group_size = group_size or in_features
        if in_features % self.group_size or self.group_size % 8:
            raise ValueError(f"int8 quantization: group_size={self.group_size} must be a "
                             f"multiple of 8 dividing in_features={in_features}")
        expected = (out_features,) if self.group_size == in_features else (
            out_features, in_features // self.group_size)
        if tuple(scale.shape) != expected:
            raise ValueError(f"int8 scales of shape {tuple(scale.shape)}, expected {expected}")
        if zero is not None and (scale.dim() != 2 or zero.shape != scale.shape):
            raise ValueError(f"int8 zeros of shape {tuple(zero.shape)}: zeros go with "
                             f"group-wise scales of the same shape, got scales of shape "
                             f"{tuple(scale.shape)}")
        self.out_features, self.in_features = out_features, in_features
        self.panels = False
        self.register_buffer("q", q.contiguous())
        self.register_buffer("params", (scale if zero is None else torch.stack(
            [scale, zero.to(scale.dtype)], -1)).contiguous())
        self.has_zeros = zero is not None
        # torch's kernel takes one scale per row; ours run group-wise scales wherever built
        self.compiled = self._compiled_by_default = quant_matmul.preferred() or (
            scale.dim() == 2 and quant_matmul.available())
        # the compiled product (QuantizedMatmul), which forward runs where ``compiled``
        self.kernel = quant_matmul.QuantizedMatmul("int8_zero" if self.has_zeros else "int8",
                                                    self.q, self.params, self.group_size)

    @property
    def int8_activations(self) -> bool:
        """Whether x is rounded by quant_matmul.quantize_activations before the product, as
        Int4Weight's (integer dot products of the codes, as llama.cpp's Q8_0 x Q8_0): only
        for symmetric codes in whole blocks of 32 (takes_int8_activations)."""
        return self.panels or self.kernel.int8_activations

    @int8_activations.setter
    def int8_activations(self, on: bool) -> None:
        if on and not self.takes_int8_activations:
            raise ValueError(f"int8_activations: int8 weights with zeros or groups of "
                             f"{self.group_size} columns (in_features "
                             f"{self.q.shape[1]}); symmetric groups of a multiple of 32 only")
        if on and not quant_matmul.available():
            raise ValueError("int8_activations: the compiled quantized matmul kernels are "
                             f"not built here ({quant_matmul.describe()})")
        self._use_panels(bool(on) and quant_matmul.has_vnni_loops())
        self.kernel.int8_activations = bool(on)
        # torch's kernel would take the rounded rows in float32: the compiled ones while on
        self.compiled = bool(on) or self._compiled_by_default

    def _use_panels(self, on: bool) -> None:
        """The codes into the panel layout (its kernel every product's), or back in rows."""
        if on == self.panels:
            return
        if on:
            codes, scales = quant_panels.pack_int8_panels(self.q, self.params)
            self.register_buffer("panel_codes", codes)
            self.register_buffer("panel_scales", scales)
            self.register_buffer("q", torch.empty(0, self.in_features, dtype=torch.int8))
            self.kernel = quant_matmul.QuantizedMatmul(
                "int8_panels", codes, scales, self.group_size, out_features=self.out_features)
        else:
            self.register_buffer("q", quant_panels.unpack_int8_panels(self.panel_codes,
                                                                      self.out_features))
            self.panel_codes = self.panel_scales = None
            self.kernel = quant_matmul.QuantizedMatmul("int8", self.q, self.params,
                                                        self.group_size)
        self.panels = on

    def codes(self) -> torch.Tensor:
        """[N, K] int8 (a copy out of the panels where ``panels``)."""
        if self.panels:
            return quant_panels.unpack_int8_panels(self.panel_codes, self.out_features)
        return self.q

    @property
    def takes_int8_activations(self) -> bool:
        """Whether int8_activations can be set (symmetric, groups a multiple of 32)."""
        return self.kernel.takes_int8_activations

    @property
    def scale(self) -> torch.Tensor:
        """[N] or [N, K / group_size]."""
        return self.params[..., 0] if self.has_zeros else self.params

    @property
    def zero(self) -> torch.Tensor | None:
        """[N, K / group_size], or None (symmetric codes)."""
        return self.params[..., 1] if self.has_zeros else None

    @classmethod
    def quantize(cls, weight: torch.Tensor, dtype: torch.dtype | None = None) -> Int8Weight:
        """``dtype``: the activation dtype the scales are stored in (default: the weight's)."""
        return cls(*int8_quantize(weight, dtype or weight.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.compiled or self.runs_dot(_rows_of(self, x), x.dtype):
            return self.kernel(x)
        if self.scale.dim() == 1:
            return torch._weight_int8pack_mm(x, self.q, self.scale.to(x.dtype))
        return F.linear(x.float(), self.dequantized()).to(x.dtype)

    def torch_product(self, x: torch.Tensor) -> Callable[[], torch.Tensor] | None:
        """forward(x) as one call of torch's kernel with its arguments bound, for a caller
        that runs it on the same tensor x every time (the CPU decode plan: none of forward's
        Python, ~6 us a projection); None where forward runs anything else (the compiled
        kernels, group-wise scales, scales of another dtype than x's)."""
        if (self.compiled or self.runs_dot(_rows_of(self, x), x.dtype) or self.scale.dim() != 1
                or self.scale.dtype != x.dtype):
            return None
        return functools.partial(torch._weight_int8pack_mm, x, self.q, self.scale)

    def runs_dot(self, rows: int, dtype: torch.dtype) -> bool:
        """Whether forward of ``rows`` rows of ``dtype`` runs the compiled AVX512-BF16 product
        (self.kernel) where torch's kernel (or the dequantized weight) runs otherwise
        (QuantizedMatmul.runs_dot; from LOOP_DOT_ROWS rows where the compiled loops run
        otherwise)."""
        return self.kernel.runs_dot(rows, dtype, instead_of_torch=not self.compiled)

    def rows(self, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``index`` [T] of dequantized() in ``dtype`` ([T, K]; one rounding, from
        float32): a tied embedding's lookups (VocabParallelEmbedding.share_codes); codes in
        panels by the compiled lookup (these ops in one call) where it takes ``dtype``."""
        if self.panels and (rows := quant_matmul.dequantized_panel_rows(
                self.panel_codes, self.scale, self.group_size, index, dtype)) is not None:
            return rows
        q = (quant_panels.int8_panel_rows(self.panel_codes, index) if self.panels
             else self.q.index_select(0, index))
        scale = self.scale.index_select(0, index).float().view(q.shape[0], -1, 1)
        weight = q.view(*scale.shape[:2], -1) * scale  # int8 x float32: float32
        if self.zero is not None:
            weight += self.zero.index_select(0, index).float()[..., None]
        return weight.view(q.shape).to(dtype)

    def dequantized(self) -> torch.Tensor:
        """[N, K] float32."""
        q = self.codes()
        scale = self.scale.float().view(q.shape[0], -1, 1)
        weight = q.float().view(*scale.shape[:2], -1) * scale
        if self.zero is not None:
            weight += self.zero.float()[..., None]
        return weight.view(q.shape)

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers())


class Int4Weight(nn.Module):
    """Codes packed for the kernel that runs them (``packed``) and scale_and_zero
    [N, K / group_size, 2] in the activation dtype.

    ``packed`` is quant_matmul.pack_int4's [N, K / 2] layout where the compiled kernels run,
    else torch's int4pack (with the parameters also held in its [K / group_size, N, 2]
    layout), and then the codes are also held in pack_int4's layout (``row_codes``), which the
    compiled AVX512-BF16 product reads for DOT_ROWS bfloat16 rows and more. With int8
    activations on a build with the AVX512-VNNI loops, both are in
    quant_panels.pack_int4_panels' layout instead (``panels``; scales_and_zeros() gives the
    [N, K / group_size, 2] view)."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                 group_size: int, dtype: torch.dtype) -> None:
        """q [N, K] integers in [0, 15]; scale, zero [N, K / group_size]."""
        super().__init__()
        out_features, in_features = q.shape
        _check_group(in_features, group_size)
        self.group_size = group_size
        self.register_buffer("scale_and_zero", torch.stack([scale, zero], -1).to(dtype)
                             .contiguous())  # [N, K / g, 2]
        self.compiled = quant_matmul.preferred()
        self._int8_activations = False
        self.panels = False
        if self.compiled:
            self._pack_compiled(q)
        else:
            if out_features % 16:
                raise ValueError(f"int4 quantization: out_features={out_features} must be a "
                                 "multiple of 16 for torch's int4 kernel (the compiled kernels "
                                 "are off); use quantization='int8'")
            self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                q.to(torch.int32).contiguous(), 1))
            self.register_buffer("torch_scale_and_zero",
                                 self.scale_and_zero.transpose(0, 1).contiguous())
            # the codes in rows too (half a byte a weight; torch's layout is its own): what
            # codes() reads and the AVX512-BF16 products run, from DOT_ROWS rows of bfloat16
            self.register_buffer("row_codes", quant_matmul.pack_int4(q))
            self.kernel = quant_matmul.QuantizedMatmul("int4", self.row_codes,
                                                        self.scale_and_zero, group_size)

    @classmethod
    def quantize(cls, weight: torch.Tensor, group_size: int,
                 dtype: torch.dtype | None = None) -> Int4Weight:
        """``dtype``: the activation dtype the scales and zeros are stored in (default: the
        weight's)."""
        dtype = dtype or weight.dtype
        _check_group(weight.shape[1], group_size)
        return cls(*int4_quantize(weight, group_size, dtype), group_size, dtype)

    @property
    def int8_activations(self) -> bool:
        """Whether x is rounded by quant_matmul.quantize_activations before the product
        (int8 codes per 32 columns, integer dot products in the compiled kernels)."""
        return self._int8_activations

    @int8_activations.setter
    def int8_activations(self, on: bool) -> None:
        self._int8_activations = bool(on)
        if on and not self.compiled and quant_matmul.available():
            # torch's kernel would take the rounded rows in float32, its slow path (SmolLM2:
            # ~3 tok/s against ~50 on the compiled integer kernel, AVX2 EPYC): the compiled
            # kernels run them wherever they are built, on CPUs with AVX-512 too
            self._pack_compiled(self.codes())
            del self.torch_scale_and_zero, self.row_codes
            self.compiled = True
        elif self.compiled and self.panels != self._wants_panels():
            self._pack_compiled(self.codes())  # into the layout of the kernel that runs it
        if self.compiled:
            self.kernel.int8_activations = self._int8_activations

    def _wants_panels(self) -> bool:
        """Whether the compiled codes go in the panel layout: int8 activations where the
        build has the AVX512-VNNI loops (int4_panel_a8_matmul, 1.7-3.5x faster than the
        row layout's integer loops on an AMX Xeon, docs/BENCHMARKS.md)."""
        return self._int8_activations and quant_matmul.has_vnni_loops()

    def _pack_compiled(self, q: torch.Tensor) -> None:
        """The codes (and parameters) in the compiled kernels' layout, pack_int4's or, where
        _wants_panels(), pack_int4_panels', and the compiled product (QuantizedMatmul) that
        forward runs."""
        scale_and_zero = self.scales_and_zeros()
        self.panels = self._wants_panels()
        if self.panels:
            packed, scale_and_zero = quant_panels.pack_int4_panels(q, scale_and_zero)
        else:
            packed = quant_matmul.pack_int4(q)
        self.register_buffer("packed", packed)
        self.register_buffer("scale_and_zero", scale_and_zero)
        self.kernel = quant_matmul.QuantizedMatmul(
            "int4_panels" if self.panels else "int4", self.packed, self.scale_and_zero,
            self.group_size, out_features=q.shape[0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.compiled or self.runs_dot(_rows_of(self, x), x.dtype):
            return self.kernel(x)
        if self._int8_activations:  # the rounded rows in float32: bfloat16 would round again
            return torch._weight_int4pack_mm_for_cpu(
                quant_matmul.quantize_activations(x), self.packed, self.group_size,
                self.torch_scale_and_zero.float()).to(x.dtype)
        return torch._weight_int4pack_mm_for_cpu(
            x, self.packed, self.group_size, self.torch_scale_and_zero.to(x.dtype))

    def torch_product(self, x: torch.Tensor) -> Callable[[], torch.Tensor] | None:
        """As Int8Weight.torch_product: forward(x) as one bound call of torch's kernel, or
        None where forward runs anything else (the compiled kernels, int8 activations,
        parameters of another dtype than x's)."""
        if (self.compiled or self._int8_activations or self.runs_dot(_rows_of(self, x), x.dtype)
                or self.torch_scale_and_zero.dtype != x.dtype):
            return None
        return functools.partial(torch._weight_int4pack_mm_for_cpu, x, self.packed,
                                 self.group_size, self.torch_scale_and_zero)

    def codes(self) -> torch.Tensor:
        """[N, K] uint8 in [0, 15]."""
        if self.panels:
            return quant_panels.unpack_int4_panels(self.packed, self.scale_and_zero,
                                                   self.kernel.out_features)[0]
        return quant_matmul.unpack_int4(self.packed if self.compiled else self.row_codes)

    def runs_dot(self, rows: int, dtype: torch.dtype) -> bool:
        """As Int8Weight.runs_dot (never with int8 activations: the kernel then runs its
        integer products)."""
        return self.kernel.runs_dot(rows, dtype, instead_of_torch=not self.compiled)

    def scales_and_zeros(self) -> torch.Tensor:
        """[N, K / group_size, 2] (scale, zero), as stored (the panels' parameters
        rearranged)."""
        if self.panels:
            return quant_panels.unpack_int4_panels(self.packed, self.scale_and_zero,
                                                   self.kernel.out_features)[1]
        return self.scale_and_zero

    def dequantized(self) -> torch.Tensor:
        """[N, K] float32 from the codes and the stored (rounded) scales and zeros."""
        q = self.codes().float()
        out_features, in_features = q.shape
        sz = self.scales_and_zeros().float()  # [N, K / g, 2]
        q = q.view(out_features, -1, self.group_size)
        return ((q - 8) * sz[..., :1] + sz[..., 1:]).view(out_features, in_features)

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers())


def _rows_of(layer: nn.Module, x: torch.Tensor) -> int:
    """The rows of x [..., K] a layer's product multiplies."""
    return x.numel() // layer.kernel.in_features


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


INT4_GROUP_SIZES = (32, 64, 128, 256)


def _check_group(in_features: int, group_size: int) -> None:
    if group_size not in INT4_GROUP_SIZES or in_features % group_size:
        dividing = [g for g in INT4_GROUP_SIZES if in_features % g == 0]
        fits = (f"; {', '.join(map(str, dividing))} would" if dividing else
                "; none of them does: use quantization='int8'")
        raise ValueError(f"int4 quantization: group_size={group_size} must be one of 32, 64, "
                         f"128, 256 and divide in_features={in_features}{fits} (or leave "
                         "quantization_group_size unset to choose one that does)")
