"""RMSNorm, computed exactly as transformers computes it (float32 statistics), optionally fused
with the residual add before it (as vLLM's fused_add_rms_norm)."""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch
from torch import nn

from pagellm import native

_SOURCE = Path(__file__).with_name("rms_norm.c")
# no -ffast-math family flag and no FMA contraction: every rounding must be torch's
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-ffp-contract=off"]
_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}
_CANDIDATE_LANES = (8, 16, 4)  # floats per vector of torch's CPU sum (AVX2, AVX-512, NEON)


class _RMSArgs(ctypes.Structure):
    _fields_ = ([(name, ctypes.c_void_p) for name in
                 ("x", "residual", "weight", "out", "scratch")]
                + [(name, ctypes.c_int64) for name in ("rows", "n", "lanes", "num_threads")]
                + [("eps", ctypes.c_float)])


class _Library:
    """rms_norm.c, built on first use (None where it cannot be, see pagellm.native)."""

    def __init__(self) -> None:
        self.library: ctypes.CDLL | None = None
        self.tried = False
        self.lanes = 0

    def load(self) -> ctypes.CDLL | None:
        if not self.tried:
            self.tried = True
            library = native.build_and_load(_SOURCE, _FLAGS, "CPU RMSNorm kernel")
            if library is not None:
                for suffix in _SUFFIX.values():
                    getattr(library, "rms_norm_" + suffix).argtypes = [ctypes.POINTER(_RMSArgs)]
                library.row_sum_f32.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
                library.row_sum_f32.restype = ctypes.c_float
                self.lanes = _torch_sum_lanes(library)
                self.library = library if self.lanes else None
        return self.library


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


_LIBRARY = _Library()


class RMSNorm(nn.Module):
    """y = weight * (x / sqrt(mean(x^2) + eps)), statistics in float32.

    The normalised activations are cast back to the input dtype *before* the weight multiply, as
    in transformers: doing it the other way round changes bfloat16 rounding and greedy tokens.

    ``forward(x, residual)`` first adds the residual stream (``h = residual + x``, rounded to
    the dtype as transformers' ``residual + hidden_states``) and returns ``(norm(h), h)``; on
    the CPU a compiled kernel (rms_norm.c) does add and norm in one pass per row, bit for bit
    as the torch ops, and stores ``h`` into ``residual`` in place.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        # x, residual: [..., hidden_size]
        if self._fusable(x, residual):
            out = self._fused(x, residual)
            return out if residual is None else (out, residual)
        if residual is None:
            return self._norm(x)
        hidden = residual + x
        return self._norm(hidden), hidden

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        variance = x32.pow(2).mean(-1, keepdim=True)
        x32 = x32 * torch.rsqrt(variance + self.eps)
        return self.weight * x32.to(dtype)

    def _fusable(self, x: torch.Tensor, residual: torch.Tensor | None) -> bool:
        return (x.device.type == "cpu" and x.dtype in _SUFFIX and x.is_contiguous()
                and self.weight.dtype == x.dtype and x.numel() > 0
                and (residual is None or (residual.shape == x.shape
                                          and residual.dtype == x.dtype
                                          and residual.is_contiguous()))
                and _LIBRARY.load() is not None)

    def _fused(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        n = x.shape[-1]
        out = torch.empty_like(x)
        threads = torch.get_num_threads()
        scratch = torch.empty(2 * n * threads)  # float32: h and its squares, per thread
        args = _RMSArgs(x.data_ptr(), None if residual is None else residual.data_ptr(),
                        self.weight.data_ptr(), out.data_ptr(), scratch.data_ptr(),
                        x.numel() // n, n, _LIBRARY.lanes, threads, self.eps)
        getattr(_LIBRARY.library, "rms_norm_" + _SUFFIX[x.dtype])(ctypes.byref(args))
        return out

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
