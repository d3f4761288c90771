"""quant_matmul.c as ctypes sees it: the one argument structure every kernel takes, the
library's build with its feature bits, and the helpers that fill the arguments.
QuantizedMatmul (quant_matmul.py) chooses the kernel a product runs; this module only knows
how to call one.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from pagellm import native

SOURCE = Path(__file__).with_name("quant_matmul.c")
WHAT = "CPU quantized matmul"  # its name in native.status()
_FLAGS = ["-O3", "-fopenmp", "-fPIC", "-shared", "-fno-math-errno", "-fno-trapping-math"]
# the AVX512-BF16 products' kind codes (dot_gemm_workspace)
DOT_KINDS = {"int4": 0, "int8": 1, "int8_zero": 2}
PANEL_KINDS = ("int4_panels", "int8_panels")
# the kernel's params_dtype codes
PARAMS_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_PRODUCTS = ("int4_matmul", "int8_matmul", "int8_zero_matmul", "bf16_matmul",
             "int4_a8_matmul", "int8_a8_matmul",
             "int4_panel_a8_matmul", "int8_panel_a8_matmul",  # AVX512-VNNI builds
             "int4_dot_gemm", "int8_dot_gemm", "int8_zero_dot_gemm")  # AVX512-BF16 builds


class KernelArgs(ctypes.Structure):
    """The arguments of every product in quant_matmul.c (its struct of the same fields)."""

    _fields_ = ([(name, ctypes.c_void_p) for name in
                 ("x", "codes", "params", "out", "workspace")]
                + [(name, ctypes.c_int64) for name in
                   ("rows", "out_features", "in_features", "group_size", "x_stride",
                    "num_threads")]
                + [("x_bf16", ctypes.c_int32), ("params_dtype", ctypes.c_int32),
                   ("bias", ctypes.c_void_p)])


def _declare(function, *argtypes, restype=None) -> None:
    function.argtypes, function.restype = [ctypes.POINTER(KernelArgs), *argtypes], restype


class QuantLibrary(native.KernelLibrary):
    """quant_matmul.c loaded (None after a failed build), its features (bit 0: AVX2 loops,
    bit 1: an AVX-512 build, bit 2: the int8 activations' AVX512-VNNI loop, bit 3: the
    AVX512-BF16 products) and a grow-only float32 workspace."""

    features = 0

    def build(self) -> ctypes.CDLL | None:
        what = WHAT + (f" [{self.level}]" if self.level else "")
        library = native.build_and_load(SOURCE, _FLAGS, what, self.level)
        if library is None:
            return None
        for name in _PRODUCTS:
            if hasattr(library, name):  # the build's instruction set decides
                _declare(getattr(library, name))
        _declare(library.round_activations, ctypes.c_void_p)
        if hasattr(library, "dot_gemm_workspace"):
            _declare(library.dot_gemm_workspace, ctypes.c_int64, restype=ctypes.c_int64)
            _declare(library.dot_few, restype=ctypes.c_int)
        for name in ("int4_dequantize", "int8_dequantize", "int8_zero_dequantize"):
            _declare(getattr(library, name), ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p)
        _declare(library.int8_panel_dequantize_rows, ctypes.c_void_p, ctypes.c_int64,
                 ctypes.c_void_p, ctypes.c_int32, restype=ctypes.c_int64)
        self.features = library.quant_matmul_features()
        return library


def workspace_floats(rows: int, in_features: int) -> int:
    """The workspace a product of ``rows`` rows needs, in floats: the widened bfloat16 rows
    and two floats per group of each row (groups of 16 at the smallest; int8 activations: a
    scale per 32 columns, the group sums and a byte per column)."""
    return rows * (in_features + in_features // 8)


def set_rows(args: KernelArgs, rows: torch.Tensor) -> None:
    """x [rows, K] (unit column stride) on a kernel's args: its pointer, row count, row
    stride and dtype, and the thread count."""
    args.x, args.rows, args.x_stride = rows.data_ptr(), rows.shape[0], rows.stride(0)
    args.x_bf16, args.num_threads = rows.dtype == torch.bfloat16, torch.get_num_threads()


def kernel_name(kind: str, integer: bool) -> str:
    """The product's C function by kind: {kind}_a8_matmul for int8 activations
    ({int4,int8}_panel_a8_matmul for the panels, which have no other)."""
    if kind in PANEL_KINDS:
        return f"{kind.removesuffix('_panels')}_panel_a8_matmul"
    return f"{kind}_a8_matmul" if integer else f"{kind}_matmul"


def rounded_rows(library: ctypes.CDLL, args: KernelArgs, rows: torch.Tensor) -> torch.Tensor:
    """rows [M, K] (unit column stride) as quantize_activations rounds them, float32, by the
    compiled round_activations (one pass; the torch ops take ~10 passes)."""
    out = torch.empty(rows.shape, dtype=torch.float32)
    set_rows(args, rows)
    library.round_activations(ctypes.byref(args), out.data_ptr())
    return out


def dequantized_panel_rows(library: ctypes.CDLL, codes: torch.Tensor, scale: torch.Tensor,
                    group_size: int, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``index`` [T] of symmetric int8 codes in pack_int8_panels' layout ``codes``
    [P, K / 32, 512] times ``scale`` ([N] or [N, K / group_size], the rows' layout): [T, K]
    in ``dtype`` (bfloat16 or float32), by the compiled int8_panel_dequantize_rows in one
    call, bit for bit the torch ops of Int8Weight.rows. An id outside [0, N) raises IndexError."""
    in_features = codes.shape[1] * 32
    index, scale = index.to(torch.int64).contiguous(), scale.contiguous()
    out = torch.empty(index.numel(), in_features, dtype=dtype)
    args = KernelArgs(0, codes.data_ptr(), scale.data_ptr(), 0, 0, 0, scale.shape[0],
                      in_features, group_size, 0, torch.get_num_threads(), 0,
                      PARAMS_DTYPES[scale.dtype], None)
    bad = library.int8_panel_dequantize_rows(ctypes.byref(args), index.data_ptr(),
                                             index.numel(), out.data_ptr(),
                                             dtype == torch.bfloat16)
    if bad:
        raise IndexError(f"embedding lookup: {bad} ids outside [0, {scale.shape[0]})")
    return out
