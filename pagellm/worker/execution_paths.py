"""Which code runs a model's steps on this machine, in words: the attention backend, the
matmuls, the fused layer ops, and the CPU's instruction sets that decide between them.

The fast CPU paths are chosen at load time and fall back silently-but-logged to the torch
ops (no compiler, a failed build, an op that is not bit-identical here, a private torch op
that misbehaves); this is how a user, the demo and the test report see which were taken.
"""
from __future__ import annotations

import os
import platform

import torch
from torch import nn

from pagellm import native
from pagellm.attention import cpu_kernel
from pagellm.model.layers import Linear, cpu_ops, quant_matmul
from pagellm.model.layers.linear import onednn_has_bfloat16

_NOTABLE_CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile",
                      "asimd", "sve", "bf16")


def cpu_summary() -> str:
    """The CPU model and the instruction sets that matter here, e.g. ``AMD EPYC (x86_64;
    avx2 avx512f avx512_bf16)``."""
    model = native.cpu_model() or platform.machine()
    flags = [flag for flag in _NOTABLE_CPU_FLAGS if flag in native.cpu_flags()]
    return f"{model} ({platform.machine()}; {' '.join(flags) or 'no notable vector flags'})"


def describe_paths(model: nn.Module | None = None, device: str = "cpu") -> dict[str, str]:
    """name -> the path it takes. With ``model``, the matmul line counts its packed
    projections; without, it says what loading would do."""
    if torch.device(device).type != "cpu":
        backend = os.environ.get("PAGELLM_ATTENTION_BACKEND", "auto")
        return {"device": str(device), "attention": f"{backend} (Triton kernels on CUDA)",
                "matmul": "torch F.linear (cuBLAS)"}
    ops = cpu_ops.enabled_ops()
    return {
        "cpu": cpu_summary(),
        "decode attention": cpu_kernel.describe(),
        "prefill attention": "torch scaled_dot_product_attention, one call per sequence",
        "matmul": _matmul_path(model),
        "quantized matmul": quant_matmul.describe(),
        "layer ops": (f"compiled: {', '.join(ops)}" if ops else
                      f"torch ops ({native.status().get(cpu_ops.WHAT, 'no op verified')})"),
    }


def _matmul_path(model: nn.Module | None) -> str:
    if not torch.backends.mkldnn.is_available():
        return "torch F.linear (torch built without oneDNN)"
    if model is None:
        if not onednn_has_bfloat16():
            small = (f"the compiled bfloat16 kernel below {quant_matmul.GEMM_ROWS} rows"
                     if quant_matmul.available() else "F.linear below 4 rows")
            return ("oneDNN with packed weights (checked per layer at load) for float32; "
                    f"bfloat16 on {small}, in float32 from there (this CPU lacks oneDNN's "
                    "bfloat16 path)")
        return "oneDNN with packed weights (checked per layer at load)"
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    quantized = sum(m.quantized is not None for m in linears)
    if quantized:
        integer = sum(getattr(m.quantized, "int8_activations", False) for m in linears)
        return (f"weight-only int8/int4 for {quantized} of {len(linears)} projections"
                + (f" (int8 activations for {integer} of them)" if integer else ""))
    packed = sum(m.packed_weight is not None for m in linears)
    if packed == len(linears):
        return f"oneDNN with packed weights (all {packed} projections)"
    failure = next((m.pack_failure for m in linears if m.pack_failure), "packing off")
    return f"oneDNN packed {packed} of {len(linears)} projections, F.linear the rest ({failure})"
