"""Compiled weight-only int4 / int8 matmuls for the CPU (quant_matmul.c), and their layouts.

Why our own: torch's CPU kernels for weight-only int4/int8 (``_weight_int4pack_mm_for_cpu``,
``_weight_int8pack_mm``) run scalar code for float32 activations and, on CPUs without
AVX-512, read bfloat16-activation weights at a few GB/s (measured in docs/BENCHMARKS.md);
batch-1 decode is that read. These widen each weight in registers once per tile of rows (1-4,
or 8 in AVX2 builds), with AVX2 + FMA inner loops where the build has them and plain C
elsewhere. From ``GEMM_ROWS`` rows on (prefill), a product dequantizes a cache-sized slice of
the weight to float32 at a time and hands it to torch's float32 GEMM, which then beats
widening per tile. With int8 activations on AVX512-VNNI builds, int4 weights are packed in
panels of 16 output columns (quant_panels.py) for a kernel that sums 16 columns' integer
products side by side in one register; symmetric int8 weights too. On AVX512-BF16 builds,
products of many bfloat16 rows (``DOT_ROWS`` / ``LOOP_DOT_ROWS`` on) multiply the codes,
exact in bfloat16, by the rows with ``vdpbf16ps`` instead. The torch side (pack_int4's
layout, the int8 activations' rounding, the sliced float32 GEMM) is quant_torch.py.

Both compute the float32 sums of ``x * w`` with ``w`` dequantized exactly as the layers'
``dequantized()`` reference (quantized_linear.py), rounded once to x's dtype. The library is
built and loaded by pagellm.native, its arguments and build are quant_library.py; without
it (``available()`` False) the layers run torch's kernels.
"""
from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch

from pagellm import native
from pagellm.model.layers import quant_library
from pagellm.model.layers.quant_library import (DOT_KINDS, PANEL_KINDS, PARAMS_DTYPES, WHAT,
                                                KernelArgs, QuantLibrary, kernel_name,
                                                rounded_rows, set_rows, workspace_floats)
from pagellm.model.layers.quant_panels import PANEL, pack_int8_panels
# the torch side, also named from here (quant_matmul.pack_int4, ...)
from pagellm.model.layers.quant_torch import (ACTIVATION_BLOCK, pack_int4, quantize_activations,
                                              slice_rows, sliced_float32_gemm, unpack_int4)

# from here on: dequantized slices + float32 GEMM. On an AVX2 EPYC the row kernels were
# faster up to 31 rows for bfloat16, int4 and int8 weights with one and two threads, and the
# GEMM from 32 rows with one thread (36-48 with two; benchmarks/quantization.py crossover,
# docs/BENCHMARKS.md)
GEMM_ROWS = 32
# int8 activations: the integer kernel below this many rows; from there the float loops, which
# widen each code once for a tile of 8 rows, were as fast on the AVX2 EPYC (at 8 rows: 34.7 ms
# against 37.9 for SmolLM2's 120 projections; at 4 rows the integer kernel 18.5 against 19.5)
INTEGER_ROWS = 8
# bfloat16 activations from this many rows on: the AVX512-BF16 products (int4_dot_gemm and
# its kin) where the build has them, for the layers that run torch's kernels otherwise. On a
# Zen 4 EPYC, SmolLM2's 1536 x 576 and 576 x 1536 projections with two threads: 8 rows
# 0.16 ms against torch's int4 kernel's 0.11, 16 rows 0.17 against 0.21, and from 64 rows
# about half torch's time; its int4 decode at 16 and 24 sequences 1.2-1.3x the tokens/s of
# torch's kernel (docs/BENCHMARKS.md)
DOT_ROWS = 16
# and from this many where the compiled loops run otherwise (group-wise int8 on AVX-512
# CPUs): the same CPU, SmolLM2's shapes in groups of 32, the loops' time over the dot
# products' 0.6-1.15x at 8 rows, 0.87-1.5x at 9, 1.02-1.5x at 10, 1.1-1.75x at 12 (two
# threads; with one 0.83-1.3x, 1.0-1.5x, 1.05-1.65x, 1.2-1.95x)
LOOP_DOT_ROWS = 10
# Below 10 rows the AVX512-BF16 build has a few-rows kernel (dot_few: K % 32 == 0, groups of
# 16, 32, a multiple of 64 or K; blocks of 16 from 10 rows), with which the products run from
# these counts instead. On a Zen 4 EPYC it took 0.94x torch's int4 time at 8 rows, 0.5-0.85x
# torch's per-row int8 time from 4, and 0.85-0.95x the compiled loops' at 4 (two threads; they
# win at 1 row). On an Intel Xeon with AMX it was slower than both at every count (1.1-1.5x
# torch's, 1.05-1.7x the loops'), so there the routes of before stay (docs/BENCHMARKS.md).
FEW_ROWS_PAY = native.cpu_vendor() == "AuthenticAMD"
FEW_DOT_ROWS = 8 if FEW_ROWS_PAY else DOT_ROWS
FEW_LOOP_DOT_ROWS = 4 if FEW_ROWS_PAY else LOOP_DOT_ROWS
# the int4 panels have no GEMM path (their kernel was faster at 16-1024 rows, see
# int4_panel_a8_matmul); a product of more rows runs in calls of this many
PANEL_CHUNK_ROWS = 256


_LIBRARY = QuantLibrary()


def available() -> bool:
    """True when the compiled kernels are built and loaded (building them on the first call)."""
    return _LIBRARY.load() is not None


def preferred() -> bool:
    """Whether the layers run these kernels rather than torch's: where they are built, except
    on CPUs with AVX-512. There torch's int4/int8 kernels have AVX-512 loops and were measured
    at least as fast (docs/BENCHMARKS.md), and these have none; group-wise int8, which torch
    has no kernel for, runs here wherever they are built."""
    return _LIBRARY.load() is not None and not _LIBRARY.features & 2


def has_vnni_loops() -> bool:
    """Whether the loaded build has the AVX512-VNNI loops of the int8-activation products
    (int8 weights take int8 activations only there by default: use_int8_activations)."""
    return _LIBRARY.load() is not None and bool(_LIBRARY.features & 4)


def has_dot_products() -> bool:
    """Whether the loaded build has the AVX512-BF16 products of bfloat16 rows with int4 / int8
    codes (int4_dot_gemm and its kin), which products of LOOP_DOT_ROWS or DOT_ROWS rows and
    more run (QuantizedMatmul.runs_dot)."""
    return _LIBRARY.load() is not None and bool(_LIBRARY.features & 8)


def describe() -> str:
    """One line for humans: which kernels the quantized projections run."""
    library = _LIBRARY.load()
    if library is None:
        return f"torch's weight-only kernels (compiled ones {native.status()[WHAT]})"
    vnni = "; int8 activations by AVX512-VNNI" if _LIBRARY.features & 4 else ""
    if _LIBRARY.features & 8:
        vnni += (f"; bfloat16 rows by AVX512-BF16 from {DOT_ROWS} rows "
                 f"({min(DOT_ROWS, LOOP_DOT_ROWS)} for the compiled loops' products; "
                 + (f"{FEW_DOT_ROWS} and {FEW_LOOP_DOT_ROWS} for weights the few-rows "
                    f"kernel takes)" if FEW_ROWS_PAY else "the few-rows kernel off: not an "
                    "AMD CPU)"))
    if not preferred():
        return ("torch's weight-only kernels (AVX-512 CPU); compiled ones for group-wise "
                f"int8{vnni}")
    loops = "AVX2+FMA" if _LIBRARY.features & 1 else "plain C"
    return f"compiled, {native.status()[WHAT]}; {loops} loops{vnni}"


def dequantized_panel_rows(codes: torch.Tensor, scale: torch.Tensor, group_size: int,
               index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """quant_library.dequantized_panel_rows by the loaded library (a bfloat16 or float32
    ``dtype``); None where the library is not built or for another dtype."""
    library = _LIBRARY.load()
    if library is None or dtype not in (torch.bfloat16, torch.float32):
        return None
    return quant_library.dequantized_panel_rows(library, codes, scale, group_size, index,
                                                dtype)


class QuantizedMatmul:
    """x [..., K] -> x @ W^T for one quantized weight: its codes and parameters, and the
    kernel arguments that do not change from call to call, prepared once (a projection runs
    every step, and a ctypes call with its arguments rebuilt costs as much as a small
    product). The tensors must stay where they are (CPU, never replaced) while it is used,
    and calls do not overlap (one model step at a time, as the engine runs them: the
    arguments and the module's workspace are shared).

    ``kind``: "int4" (codes from pack_int4, params [N, K / group_size, 2]), "int8" (codes
    [N, K] int8, params [N] or [N, K / group_size]), "int8_zero" (codes [N, K] int8, params
    [N, K / group_size, 2]: w = q * scale + zero) or "bf16" (codes: a bfloat16 weight [N, K]
    as it is, K % 8 == 0; params ignored) or "int4_panels" / "int8_panels" (codes and
    params from quant_panels' pack_int4_panels / pack_int8_panels, ``out_features`` N given;
    int8 activations only: no float loops and no GEMM path, any number of rows runs the
    kernel, PANEL_CHUNK_ROWS at a time). ``bias`` [N], added in float32 before the one
    rounding to x's dtype.

    ``int8_activations`` (settable; it applies where takes_int8_activations: int4, and int8
    without zeros in groups of a multiple of 32): multiply x rounded by quantize_activations
    instead of x: with integer dot products below INTEGER_ROWS rows (int4_a8_matmul,
    int8_a8_matmul), from there the float loops (and from GEMM_ROWS the float32 GEMM) on the
    rounded rows; symmetric int8 on AVX512-VNNI builds through its "int8_panels" copy at
    every row count (panel_matmul)."""

    int8_activations = False
    _panel_matmul = None  # panel_matmul()
    _few = None  # runs_dot: whether the few-rows AVX512-BF16 kernel takes this weight

    def __init__(self, kind: str, codes: torch.Tensor, params: torch.Tensor,
                 group_size: int, bias: torch.Tensor | None = None,
                 out_features: int | None = None) -> None:
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.kind, self.codes, self.params = kind, codes, params  # keep them alive
        if kind in PANEL_KINDS:
            if out_features is None or not 0 <= codes.shape[0] * PANEL - out_features < PANEL:
                raise ValueError(f"{kind.replace('_', ' ')}: out_features={out_features} for "
                                 f"{codes.shape[0]} panels of {PANEL}")
            self.out_features, self.in_features = out_features, codes.shape[1] * 32
        else:
            self.out_features, self.in_features = codes.shape[0], codes.shape[1] * (
                2 if kind == "int4" else 1)
        params_dtype = PARAMS_DTYPES.get(params.dtype)
        if params_dtype is None:
            raise ValueError(f"quantized matmul: parameters in "
                             f"{str(params.dtype).removeprefix('torch.')}; float32, bfloat16 "
                             f"or float16")
        # int8_activations' integer products: int4, and symmetric int8 in whole blocks of 32
        self.takes_int8_activations = kind == "int4" or kind in PANEL_KINDS or (
            kind == "int8" and group_size % 32 == 0 and self.in_features % 32 == 0)
        self.args = KernelArgs(0, codes.data_ptr(), params.data_ptr(), 0, 0, 0,
                               self.out_features, self.in_features, group_size, 0, 1, 0,
                               params_dtype, None)
        self.pointer = ctypes.byref(self.args)

    def integer(self) -> bool:
        """Whether x is rounded to int8 codes for the product (always for the panels)."""
        return self.kind in PANEL_KINDS or (self.int8_activations
                                             and self.takes_int8_activations)

    def __call__(self, x: torch.Tensor, add_bias: bool = True) -> torch.Tensor:
        """``add_bias=False``: without the bias given at construction."""
        library = _LIBRARY.load()
        in_features = self.in_features
        if x.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"quantized matmul: activations must be float32 or bfloat16, got "
                             f"{str(x.dtype).removeprefix('torch.')}")
        rows = x if x.dim() == 2 else x.reshape(-1, in_features)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        num_rows = rows.shape[0]
        integer = self.integer()
        args = self.args
        bias = self.bias if add_bias else None
        if self.kind in PANEL_KINDS:
            out = self._panel_rows(library, rows, bias)
            return out if x.dim() == 2 else out.view(*x.shape[:-1], self.out_features)
        panels = self.panel_matmul() if integer else None
        if panels is not None:
            return panels(x, add_bias)
        if self.runs_dot(num_rows, rows.dtype):
            out = torch.empty(num_rows, self.out_features, dtype=rows.dtype)
            self._dot_call(library, rows, out, bias)()
            return out if x.dim() == 2 else out.view(*x.shape[:-1], self.out_features)
        if integer and num_rows >= INTEGER_ROWS:
            # the float loops (or the GEMM) on the rounded rows
            rows, integer = rounded_rows(library, args, rows), False
        set_rows(args, rows)
        args.bias = None if bias is None else bias.data_ptr()
        if num_rows >= GEMM_ROWS:
            out = _gemm(library, self.kind, args, rows, self.codes, bias)
        else:
            out = torch.empty(num_rows, self.out_features, dtype=rows.dtype)
            args.out = out.data_ptr()
            args.workspace = _LIBRARY.scratch(workspace_floats(num_rows, in_features)
                                              ).data_ptr()
            getattr(library, kernel_name(self.kind, integer))(self.pointer)
        out = out.to(x.dtype)  # rounded rows: float32, rounded once here
        return out if x.dim() == 2 else out.view(*x.shape[:-1], self.out_features)

    def runs_dot(self, rows: int, dtype: torch.dtype, instead_of_torch: bool = False) -> bool:
        """Whether a product of ``rows`` rows of ``dtype`` runs the AVX512-BF16 kernel:
        bfloat16 rows, at least LOOP_DOT_ROWS of them (DOT_ROWS ``instead_of_torch``: for a
        layer that runs torch's kernel otherwise; this product's own calls run it from
        whichever is lower), where the build has it (int4, int8 and int8_zero codes, without
        int8 activations; groups of an even size: it multiplies pairs). Where its few-rows
        kernel takes the weight (dot_few), from FEW_LOOP_DOT_ROWS rows (FEW_DOT_ROWS
        ``instead_of_torch``)."""
        if not (dtype == torch.bfloat16 and self.kind in DOT_KINDS and not self.integer()
                and self.args.group_size % 2 == 0 and has_dot_products()):
            return False
        if self.takes_few_rows() and rows < DOT_ROWS:
            return rows >= (FEW_DOT_ROWS if instead_of_torch else FEW_LOOP_DOT_ROWS)
        return rows >= (DOT_ROWS if instead_of_torch else min(DOT_ROWS, LOOP_DOT_ROWS))

    def takes_few_rows(self) -> bool:
        """Whether the AVX512-BF16 build's few-rows kernel takes this weight's products of
        fewer than 10 rows, and so runs_dot from FEW_LOOP_DOT_ROWS / FEW_DOT_ROWS (dot_few:
        K % 32 == 0, groups of 16, 32, a multiple of 64 or K). Caller checks
        has_dot_products()."""
        if self._few is None:
            args = KernelArgs.from_buffer_copy(self.args)
            args.rows = 1
            self._few = bool(_LIBRARY.load().dot_few(ctypes.byref(args)))
        return self._few

    def dot_workspace_floats(self, rows: int) -> int:
        """The workspace the AVX512-BF16 product of ``rows`` rows needs with the current
        thread count, in floats (the rows repacked ~512 KB at a time, their group sums, each
        thread's dequantized columns; it grows with rows up to that bound). Caller checks
        has_dot_products()."""
        args = KernelArgs.from_buffer_copy(self.args)
        args.rows, args.num_threads = rows, torch.get_num_threads()
        return _LIBRARY.load().dot_gemm_workspace(ctypes.byref(args), DOT_KINDS[self.kind])

    def _dot_call(self, library: ctypes.CDLL, rows: torch.Tensor, out: torch.Tensor,
                  bias: torch.Tensor | None, workspace: torch.Tensor | None = None
                  ) -> Callable[[], None]:
        """The AVX512-BF16 product of rows [M, K] (bfloat16, unit column stride) into out
        [M, N] (bfloat16) as a call, in ``workspace`` (at least dot_workspace_floats(M)
        floats; None: the module's shared one, for a call run at once)."""
        args = KernelArgs.from_buffer_copy(self.args)
        set_rows(args, rows)
        args.out, args.bias = out.data_ptr(), None if bias is None else bias.data_ptr()
        floats = library.dot_gemm_workspace(ctypes.byref(args), DOT_KINDS[self.kind])
        if workspace is None:
            workspace = _LIBRARY.scratch(floats)
        elif workspace.numel() < floats:
            raise ValueError(f"prepared: a workspace of {workspace.numel()} floats; the "
                             f"product of {args.rows} rows needs {floats}")
        args.workspace = workspace.data_ptr()
        return native.PreparedCall(getattr(library, f"{self.kind}_dot_gemm"), args)

    def panel_matmul(self) -> QuantizedMatmul | None:
        """Where the build has the AVX512-VNNI loops, symmetric int8 codes in whole blocks of
        32 take int8 activations in panels: their "int8_panels" copy (pack_int8_panels, made
        on first use and kept beside the row-layout codes; Int8Weight moves its codes into
        panels of its own instead), which every product with int8_activations then runs (no
        float loops, no GEMM path: 2-5x faster than those at 4-256 rows for SmolLM2's
        vocabulary projection on an AMX Xeon). None elsewhere."""
        if self._panel_matmul is None and (self.kind == "int8" and self.takes_int8_activations
                                           and has_vnni_loops()):
            self._panel_matmul = QuantizedMatmul(
                "int8_panels", *pack_int8_panels(self.codes, self.params),
                self.args.group_size, self.bias, out_features=self.out_features)
        return self._panel_matmul

    def _panel_rows(self, library: ctypes.CDLL, rows: torch.Tensor,
                    bias: torch.Tensor | None) -> torch.Tensor:
        """The panels' product, PANEL_CHUNK_ROWS rows per call (bounding the workspace)."""
        out = torch.empty(rows.shape[0], self.out_features, dtype=rows.dtype)
        args, kernel = self.args, getattr(library, kernel_name(self.kind, True))
        args.bias = None if bias is None else bias.data_ptr()
        for start in range(0, rows.shape[0], PANEL_CHUNK_ROWS):
            chunk = rows[start:start + PANEL_CHUNK_ROWS]
            set_rows(args, chunk)
            args.out = out[start:start + PANEL_CHUNK_ROWS].data_ptr()
            args.workspace = _LIBRARY.scratch(workspace_floats(chunk.shape[0],
                                                               self.in_features)).data_ptr()
            kernel(self.pointer)
        return out

    def prepared(self, x: torch.Tensor, out: torch.Tensor, workspace: torch.Tensor
                 ) -> Callable[[], None]:
        """This product of x [rows, K] (unit column stride, fewer than GEMM_ROWS rows, or
        any number the AVX512-BF16 product runs: runs_dot) into ``out`` [rows, N] (x's
        dtype) as a prepared call: the kernels __call__ would run for x, with ``workspace``
        (at least workspace_floats(rows, K) floats; dot_workspace_floats(rows) for the
        AVX512-BF16 product) and without the bias. The call keeps the tensors' pointers
        only: the caller holds x, out and workspace while it uses the call.
        Caller checks available()."""
        rows = x.shape[0]
        library = _LIBRARY.load()
        integer = self.integer()
        if self.runs_dot(rows, x.dtype):
            return self._dot_call(library, x, out, None, workspace)
        if rows >= GEMM_ROWS:
            raise ValueError(f"prepared: {rows} rows take the GEMM path")
        panels = self.panel_matmul() if integer else None
        if panels is not None:
            return panels.prepared(x, out, workspace)
        args = KernelArgs.from_buffer_copy(self.args)
        set_rows(args, x)
        args.out, args.workspace, args.bias = out.data_ptr(), workspace.data_ptr(), None
        if not integer or rows < INTEGER_ROWS or self.kind in PANEL_KINDS:
            return native.PreparedCall(getattr(library, kernel_name(self.kind, integer)), args)
        # as __call__ from INTEGER_ROWS rows: the rows rounded in float32, the float loops
        # into float32, rounded once to x's dtype
        rounded = torch.empty(rows, self.in_features)
        out32 = torch.empty(rows, self.out_features)
        rounding = native.PreparedCall(library.round_activations, args)
        matmul_args = KernelArgs.from_buffer_copy(args)
        matmul_args.x, matmul_args.x_stride, matmul_args.x_bf16 = (rounded.data_ptr(),
                                                                   self.in_features, 0)
        matmul_args.out = out32.data_ptr()
        matmul = native.PreparedCall(getattr(library, f"{self.kind}_matmul"), matmul_args)

        def call() -> None:  # holds rounded and out32, which the kernels write through pointers
            rounding.function(rounding.pointer, rounded.data_ptr())
            matmul()
            out.copy_(out32)

        return call


def int4_matmul(x: torch.Tensor, packed: torch.Tensor, scale_and_zero: torch.Tensor,
                group_size: int, int8_activations: bool = False) -> torch.Tensor:
    """x [..., K] @ W^T with W[n, k] = (q[n, k] - 8) * scale[n, g] + zero[n, g]: ``packed``
    from pack_int4, ``scale_and_zero`` [N, K / group_size, 2]; ``int8_activations``: x
    rounded by quantize_activations first."""
    matmul = QuantizedMatmul("int4", packed, scale_and_zero, group_size)
    matmul.int8_activations = int8_activations
    return matmul(x)


def int8_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                group_size: int, int8_activations: bool = False) -> torch.Tensor:
    """x [..., K] @ W^T with W[n, k] = q[n, k] * scale[n, g]: q [N, K] int8, scale
    [N, K / group_size] (or [N] with group_size K); ``int8_activations`` (group_size and K
    multiples of 32): x rounded by quantize_activations first."""
    matmul = QuantizedMatmul("int8", q, scale, group_size)
    if int8_activations and not matmul.takes_int8_activations:
        raise ValueError(f"int8 activations: group_size={group_size} and in_features="
                         f"{matmul.in_features} must be multiples of {ACTIVATION_BLOCK}")
    matmul.int8_activations = int8_activations
    return matmul(x)


def _gemm(library: ctypes.CDLL, kind: str, args: KernelArgs, rows: torch.Tensor,
          codes: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Many rows: float32 GEMMs on dequantized slices of W (sliced_float32_gemm)."""
    in_features = args.in_features
    if kind == "bf16":
        return sliced_float32_gemm(rows, args.out_features,
                                   lambda start, count: codes[start:start + count].float(), bias)
    workspace = _LIBRARY.scratch(slice_rows(in_features) * in_features)
    dequantize = getattr(library, f"{kind}_dequantize")

    def dequantized(start: int, count: int) -> torch.Tensor:
        # into the shared workspace through its pointer (it may be an inference tensor)
        dequantize(ctypes.byref(args), start, count, workspace.data_ptr())
        return workspace[:count * in_features].view(count, in_features)

    return sliced_float32_gemm(rows, args.out_features, dequantized, bias)
