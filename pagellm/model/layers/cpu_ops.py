"""Compiled elementwise layer ops for the CPU (cpu_ops.c): RMSNorm fused with the residual add,
rotary embedding in place, and (bfloat16) SiLU-and-multiply, bit-identical to the torch ops
they replace.

They accelerate, never decide: ``available(x)`` is False off the CPU, for other dtypes, without
a C compiler (see pagellm.native), and where torch's float32 sum order cannot be reproduced;
the layers then run their torch ops.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from pagellm import native

_SOURCE = Path(__file__).with_name("cpu_ops.c")
# no -ffast-math family flag and no FMA contraction: every rounding must be torch's
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-ffp-contract=off"]
_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}
_CANDIDATE_LANES = (8, 16, 4)  # floats per vector of torch's CPU sum (AVX2, AVX-512, NEON)


class _RMSArgs(ctypes.Structure):
    _fields_ = ([(name, ctypes.c_void_p) for name in
                 ("x", "residual", "weight", "out", "scratch")]
                + [(name, ctypes.c_int64) for name in ("rows", "n", "lanes", "num_threads")]
                + [("eps", ctypes.c_float)])


class _RopeArgs(ctypes.Structure):
    _fields_ = ([(name, ctypes.c_void_p) for name in ("x", "cos", "sin")]
                + [(name, ctypes.c_int64) for name in
                   ("tokens", "heads", "head_dim", "token_stride", "num_threads")])


class _SiluArgs(ctypes.Structure):
    _fields_ = ([(name, ctypes.c_void_p) for name in ("gate_up", "out")]
                + [(name, ctypes.c_int64) for name in ("rows", "n", "row_stride", "num_threads")])


class _Library:
    """cpu_ops.c, built on first use; ``lanes`` is torch's sum vector width (0: unknown)."""

    def __init__(self) -> None:
        self.library: ctypes.CDLL | None = None
        self.tried = False
        self.lanes = 0

    def load(self) -> ctypes.CDLL | None:
        if not self.tried:
            self.tried = True
            library = native.build_and_load(_SOURCE, _FLAGS, "CPU layer ops")
            if library is not None:
                for suffix in _SUFFIX.values():
                    getattr(library, "rms_norm_" + suffix).argtypes = [ctypes.POINTER(_RMSArgs)]
                    getattr(library, "rotary_" + suffix).argtypes = [ctypes.POINTER(_RopeArgs)]
                library.row_sum_f32.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
                library.row_sum_f32.restype = ctypes.c_float
                library.silu_and_mul_bf16.argtypes = [ctypes.POINTER(_SiluArgs)]
                library.silu_table_init()
                self.lanes = _torch_sum_lanes(library)
                self.library = library if self.lanes else None
        return self.library


_LIBRARY = _Library()


def available(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype in _SUFFIX and _LIBRARY.load() is not None


def _torch_sum_lanes(library: ctypes.CDLL) -> int:
    """The vector width with which row_sum_f32 adds exactly as torch.sum does (0: none).

    Probe rows of many lengths (with and without a tail, short and cascading) and magnitudes:
    a wrong width or order differs from torch in the last bit on most of them."""
    gen = torch.Generator().manual_seed(0)
    rows = [torch.randn(n, generator=gen) * 10.0 ** float(torch.randint(-3, 4, (1,),
                                                                         generator=gen))
            for n in (7, 64, 100, 768, 896, 1000, 4096, 5120) for _ in range(4)]
    for lanes in _CANDIDATE_LANES:
        if all(library.row_sum_f32(row.data_ptr(), row.numel(), lanes)
               == row.view(1, -1).sum(-1).item() for row in rows):
            return lanes
    return 0


def rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
             eps: float) -> torch.Tensor:
    """RMSNorm of the rows of x [..., n] (contiguous), after adding ``residual`` (same shape,
    contiguous; then updated in place to residual + x). Caller checks available(x)."""
    n = x.shape[-1]
    out = torch.empty_like(x)
    threads = torch.get_num_threads()
    scratch = torch.empty(2 * n * threads)  # float32: h and its squares, per thread
    args = _RMSArgs(x.data_ptr(), None if residual is None else residual.data_ptr(),
                    weight.data_ptr(), out.data_ptr(), scratch.data_ptr(), x.numel() // n, n,
                    _LIBRARY.lanes, threads, eps)
    getattr(_LIBRARY.library, "rms_norm_" + _SUFFIX[x.dtype])(ctypes.byref(args))
    return out


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [tokens, heads, head_dim] in place (heads and head_dim contiguous, any token
    stride) by cos, sin [tokens, head_dim] (contiguous, x's dtype). Caller checks
    available(x)."""
    tokens, heads, head_dim = x.shape
    if not (cos.dtype == sin.dtype == x.dtype and cos.shape == sin.shape == (tokens, head_dim)
            and cos.is_contiguous() and sin.is_contiguous()):
        raise ValueError(f"rotary_: cos and sin must be contiguous [{tokens}, {head_dim}] of "
                         f"{x.dtype}, got {tuple(cos.shape)} {cos.dtype}")
    args = _RopeArgs(x.data_ptr(), cos.data_ptr(), sin.data_ptr(), tokens, heads, head_dim,
                     x.stride(0), torch.get_num_threads())
    getattr(_LIBRARY.library, "rotary_" + _SUFFIX[x.dtype])(ctypes.byref(args))
    return x


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [rows, 2 * n] (bfloat16, rows of contiguous elements) -> silu(gate) * up
    [rows, n], rounded as F.silu(gate) * up. Caller checks available(gate_up) and the dtype."""
    rows, n = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, n, dtype=gate_up.dtype)
    args = _SiluArgs(gate_up.data_ptr(), out.data_ptr(), rows, n, gate_up.stride(0),
                     torch.get_num_threads())
    _LIBRARY.library.silu_and_mul_bf16(ctypes.byref(args))
    return out
