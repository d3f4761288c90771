"""Compiled elementwise layer ops for the CPU (cpu_ops.c): RMSNorm fused with the residual add,
rotary embedding in place, and (bfloat16) SiLU-and-multiply, bit-identical to the torch ops
they replace.

They accelerate, never decide: ``available(x, op)`` is False off the CPU, for other dtypes,
without a C compiler (see pagellm.native), and for any op that is not bit-identical to its
torch op on this CPU with this torch build (checked when the library loads: torch's float32
sum order and its vectorised SiLU depend on the ISA its kernels run); the layers then run
their torch ops.
"""
from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import torch
import torch.nn.functional as F

from pagellm import native

logger = logging.getLogger("pagellm")

_SOURCE = Path(__file__).with_name("cpu_ops.c")
WHAT = "CPU layer ops"  # its name in native.status()
# no -ffast-math family flag and no FMA contraction: every rounding must be torch's
_FLAGS = ["-O3", "-fopenmp", "-fPIC", "-shared", "-ffp-contract=off"]
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


class _Library(native.KernelLibrary):
    """cpu_ops.c, built on first use, and which of its ops reproduce the torch ops here.

    ``lanes`` is torch's float32 sum vector width (0: unknown, and then RMSNorm stays off).
    Each op is compared with the torch op it replaces when the library loads, on this CPU,
    with this torch build, for each dtype: how torch rounds (its vectorised SiLU, its sum
    order) depends on the ISA its kernels were dispatched for, so an op is used only where it
    is bit-identical here. ``enabled`` holds the (op, dtype) pairs that passed.
    """

    def __init__(self, level: str | None = None) -> None:
        super().__init__(level)
        self.lanes = 0
        self.enabled: set[tuple[str, torch.dtype]] = set()

    def build(self) -> ctypes.CDLL | None:
        what = WHAT + (f" [{self.level}]" if self.level else "")
        library = native.build_and_load(_SOURCE, _FLAGS, what, self.level)
        if library is None:
            return None
        _declare(library)
        self.library = library  # the checks below call the ops through load()
        self.lanes = _torch_sum_lanes(library)
        self.enabled = _verified_ops(self.lanes)
        return library if self.enabled else None


_LIBRARY = _Library()
_OPS = ("rms_norm", "rotary", "silu_and_mul")


def _declare(library: ctypes.CDLL) -> None:
    for suffix in _SUFFIX.values():
        getattr(library, "rms_norm_" + suffix).argtypes = [ctypes.POINTER(_RMSArgs)]
        getattr(library, "rotary_" + suffix).argtypes = [ctypes.POINTER(_RopeArgs)]
    library.row_sum_f32.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
    library.row_sum_f32.restype = ctypes.c_float
    library.silu_and_mul_bf16.argtypes = [ctypes.POINTER(_SiluArgs)]
    library.silu_table_init()


def available(x: torch.Tensor, op: str) -> bool:
    """Whether ``op`` (one of _OPS) runs compiled for x: on the CPU, in a dtype where it was
    verified bit-identical to the torch op at load."""
    if not _LIBRARY.tried:
        _LIBRARY.load()  # ``enabled`` stays empty where the library did not load
    return x.is_cpu and (op, x.dtype) in _LIBRARY.enabled  # for every norm of a step: cheap


def enabled_ops() -> list[str]:
    """``op/dtype`` of every compiled op in use, e.g. ``rms_norm/bfloat16`` (loads the
    library)."""
    _LIBRARY.load()
    return sorted(f"{op}/{str(dtype).removeprefix('torch.')}" for op, dtype in _LIBRARY.enabled)


def _verified_ops(lanes: int) -> set[tuple[str, torch.dtype]]:
    """The (op, dtype) pairs whose output equals the torch op's bit for bit on probe data
    (every finite bfloat16 gate for SiLU)."""
    from pagellm.model.layers.norm import RMSNorm
    from pagellm.model.layers.rotary import RotaryEmbedding

    gen = torch.Generator().manual_seed(0)
    checks = {"rotary": lambda dtype: _rotary_matches(RotaryEmbedding.apply, dtype, gen)}
    if lanes:  # without torch's sum order RMSNorm cannot match
        checks["rms_norm"] = lambda dtype: _rms_matches(RMSNorm, dtype, gen)
    passed = {(op, dtype) for op, check in checks.items() for dtype in _SUFFIX
              if check(dtype)}
    if _silu_matches():
        passed.add(("silu_and_mul", torch.bfloat16))
    for op in _OPS:
        for dtype in ((torch.bfloat16,) if op == "silu_and_mul" else _SUFFIX):
            if (op, dtype) not in passed:
                logger.info("compiled %s for %s differs from the torch op on this CPU "
                            "(or torch build): the torch op runs", op, dtype)
    return passed


def _rms_matches(norm_class: type, dtype: torch.dtype, gen: torch.Generator) -> bool:
    for n in (17, 64, 576, 896, 4096):
        layer = norm_class(n, eps=1e-5).to(dtype)
        with torch.no_grad():
            layer.weight.copy_(torch.rand(n, generator=gen) * 0.4 + 0.8)
        x = (torch.randn(5, n, generator=gen) * 3).to(dtype)
        residual = (torch.randn(5, n, generator=gen) * 30).to(dtype)
        stream = residual.clone()
        if not (torch.equal(rms_norm(x, None, layer.weight, layer.eps), layer._norm(x))
                and torch.equal(rms_norm(x, stream, layer.weight, layer.eps),
                                layer._norm(residual + x))
                and torch.equal(stream, residual + x)):
            return False
    return True


def _rotary_matches(reference, dtype: torch.dtype, gen: torch.Generator) -> bool:
    tokens, heads, head_dim = 7, 3, 64
    angles = torch.rand(tokens, head_dim, generator=gen) * 100
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    x = (torch.randn(tokens, heads, head_dim, generator=gen) * 3).to(dtype)
    expected = reference(x, cos[:, None], sin[:, None])
    return torch.equal(rotary_(x.clone(), cos, sin), expected)


def _silu_matches() -> bool:
    every = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    gate = every[torch.isfinite(every.float())]  # 65,280 values
    gate_up = torch.cat([gate.view(255, 256), torch.ones(255, 256, dtype=torch.bfloat16)], 1)
    return torch.equal(silu_and_mul(gate_up), F.silu(gate_up[:, :256]))


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
    out = torch.empty_like(x)
    # float32: h and its squares, per thread
    scratch = _LIBRARY.scratch(2 * x.shape[-1] * torch.get_num_threads())
    prepared_rms_norm(x, residual, weight, eps, out, scratch)()
    return out


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [tokens, heads, head_dim] in place (heads and head_dim contiguous, any token
    stride) by cos, sin [tokens, head_dim] (contiguous, x's dtype). Caller checks
    available(x)."""
    tokens, _, head_dim = x.shape
    if not (cos.dtype == sin.dtype == x.dtype and cos.shape == sin.shape == (tokens, head_dim)
            and cos.is_contiguous() and sin.is_contiguous()):
        raise ValueError(f"rotary_: cos and sin must be contiguous [{tokens}, {head_dim}] of "
                         f"{x.dtype}, got {tuple(cos.shape)} {cos.dtype}")
    prepared_rotary(x, cos, sin)()
    return x


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [rows, 2 * n] (bfloat16, rows of contiguous elements) -> silu(gate) * up
    [rows, n], rounded as F.silu(gate) * up. Caller checks available(gate_up) and the dtype."""
    out = torch.empty(gate_up.shape[0], gate_up.shape[1] // 2, dtype=gate_up.dtype)
    prepared_silu_and_mul(gate_up, out)()
    return out


def prepared_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                      eps: float, out: torch.Tensor, scratch: torch.Tensor
                      ) -> native.PreparedCall:
    """rms_norm(x, residual, weight, eps) into ``out`` as a prepared call, for buffers that
    stay where they are (``scratch``: 2 * n * threads floats). Caller checks
    available(x, "rms_norm")."""
    n = x.shape[-1]
    args = _RMSArgs(x.data_ptr(), None if residual is None else residual.data_ptr(),
                    weight.data_ptr(), out.data_ptr(), scratch.data_ptr(), x.numel() // n, n,
                    _LIBRARY.lanes, torch.get_num_threads(), eps)
    return native.PreparedCall(getattr(_LIBRARY.library, "rms_norm_" + _SUFFIX[x.dtype]), args)


def prepared_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                    ) -> native.PreparedCall:
    """rotary_(x, cos, sin) as a prepared call, for x, cos and sin that stay where they are
    (cos, sin: contiguous [tokens, head_dim]). Caller checks available(x, "rotary")."""
    tokens, heads, head_dim = x.shape
    args = _RopeArgs(x.data_ptr(), cos.data_ptr(), sin.data_ptr(), tokens, heads, head_dim,
                     x.stride(0), torch.get_num_threads())
    return native.PreparedCall(getattr(_LIBRARY.library, "rotary_" + _SUFFIX[x.dtype]), args)


def prepared_silu_and_mul(gate_up: torch.Tensor, out: torch.Tensor) -> native.PreparedCall:
    """silu_and_mul(gate_up) into ``out`` as a prepared call (bfloat16)."""
    args = _SiluArgs(gate_up.data_ptr(), out.data_ptr(), gate_up.shape[0],
                     gate_up.shape[1] // 2, gate_up.stride(0), torch.get_num_threads())
    return native.PreparedCall(_LIBRARY.library.silu_and_mul_bf16, args)
