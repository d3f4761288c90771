"""A loaded model's quantized projections: the methods and their checks, the default int4
group size, quantizing what the load left unquantized, and int8 activations across layers.
The layers themselves are model/layers/quantized_linear.py's."""
from __future__ import annotations

import torch
from torch import nn

from pagellm import config
from pagellm.model.layers import quant_matmul
from pagellm.model.layers.linear import Linear
from pagellm.model.layers.quantized_linear import Int4Weight, Int8Weight

# the engine's choices (pagellm/config.py), None aside
QUANTIZATION_METHODS = tuple(m for m in config.QUANTIZATION_METHODS if m is not None)


def default_group_size(model: nn.Module, from_gguf: bool) -> int:
    """The int4 group size when quantization_group_size is unset: 32 for a GGUF file (the
    groups of its Q4_0 / Q4_1 / Q4_K blocks, which int4 then takes as they are), else 128, or
    the largest of 64 and 32 that divides the input width of every projection (SmolLM2's 576
    takes 64)."""
    if from_gguf:
        return 32
    widths = sorted({m.in_features for m in model.modules() if isinstance(m, Linear)})
    for group_size in (128, 64, 32):
        if all(width % group_size == 0 for width in widths):
            return group_size
    raise ValueError(f"int4 quantization needs projections whose input widths are multiples "
                     f"of 32; this model's are {widths}: use quantization='int8'")


def check_supported(method: str | None, device: torch.device, dtype: torch.dtype) -> None:
    """Raise ValueError for a combination the quantized kernels cannot run."""
    if method is None:
        return
    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization={method!r} is not supported; supported: "
                         f"{', '.join(QUANTIZATION_METHODS)} (or None)")
    if device.type != "cpu":
        raise ValueError(f"quantization={method!r} runs on the CPU only (its int8/int4 "
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


def use_int8_activations(model: nn.Module) -> int:
    """Set int8_activations on every int4 layer of a loaded model, and, where the build has
    the AVX512-VNNI loops (elsewhere the int8 products with int8 activations are plain C and
    were not measured against the float loops), on every int8 one that takes them
    (symmetric, one scale per row or groups of a multiple of 32: quantization="int8"'s
    layers, a GGUF's Q8_0 ones, the per-row vocabulary projection of quantization="int4");
    returns how many. A model with none of those here is refused (ValueError) rather than
    left as it was."""
    vnni = quant_matmul.has_vnni_loops()
    layers = [m for m in model.modules() if isinstance(m, Int4Weight)
              or (vnni and isinstance(m, Int8Weight) and m.takes_int8_activations)]
    if not layers:
        int8 = sum(isinstance(m, Int8Weight) and m.takes_int8_activations
                   for m in model.modules())
        raise ValueError(
            "int8_activations=True: no layer of this model takes int8 activations here: int4 "
            f"layers take them on every build, symmetric int8 layers ({int8} in this model) "
            "only where the build has the AVX512-VNNI loops (the quantized matmuls here: "
            f"{quant_matmul.describe()})")
    for layer in layers:
        layer.int8_activations = True
    return len(layers)


def quantize_linear_weights(model: nn.Module, method: str, group_size: int,
                            shared: set[int] | frozenset[int] = frozenset()) -> int:
    """Quantize every Linear of a loaded model whose weight is not already quantized (GGUF
    blocks mapped directly); returns how many were. The plain weight is released, except
    where another module reads it (``shared``: a tied embedding)."""
    count = 0
    for module in model.modules():
        if not isinstance(module, Linear) or module.quantized is not None:
            continue
        module.quantized = quantize_linear(module, method, group_size)
        if id(module.weight) not in shared:
            module.weight.data = torch.empty(0, dtype=module.weight.dtype)
        count += 1
    return count
