"""Rotary position embedding (RoPE), with the rope scalings of Llama checkpoints.

Frequencies follow transformers bit for bit: ``inv_freq`` in float32, angles
``position * inv_freq`` in float32, cos/sin cast to the activation dtype, and the
"rotate half" (GPT-NeoX) pairing of dimensions i and i + head_dim / 2. Matching the rounding
matters: in bfloat16 a different order of operations flips greedy tokens.
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from pagellm.model.layers import cpu_ops

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_parameters(hf_config: Any) -> dict[str, Any]:
    """The rope settings of a config, whichever transformers version wrote it.

    transformers 5 keeps them in ``rope_parameters`` (with ``rope_theta`` inside); older
    versions use ``rope_scaling`` plus a top-level ``rope_theta``.
    """
    params = dict(getattr(hf_config, "rope_parameters", None)
                  or getattr(hf_config, "rope_scaling", None) or {})
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    return params


def compute_inv_freq(head_dim: int, params: dict[str, Any],
                     max_position_embeddings: int) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2], float32, with the configured scaling applied."""
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope type {rope_type!r} is not supported; supported: "
                         f"{', '.join(SUPPORTED_ROPE_TYPES)}")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial_rotary_factor != 1.0 is not supported")
    base = float(params["rope_theta"])
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (base ** exponents)
    if rope_type == "linear":
        inv_freq = inv_freq / params["factor"]
    elif rope_type == "llama3":
        inv_freq = _llama3_scaling(inv_freq, params, max_position_embeddings)
    return inv_freq


def _llama3_scaling(inv_freq: torch.Tensor, params: dict[str, Any],
                    max_position_embeddings: int) -> torch.Tensor:
    """Llama 3.1: keep high frequencies, divide low ones by ``factor``, interpolate between."""
    factor = params["factor"]
    low_freq_factor, high_freq_factor = params["low_freq_factor"], params["high_freq_factor"]
    old_context_len = params.get("original_max_position_embeddings", max_position_embeddings)
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RotaryEmbedding(nn.Module):
    """cos/sin for a step's positions, computed once per forward and shared by all layers."""

    def __init__(self, head_dim: int, hf_config: Any) -> None:
        super().__init__()
        self.head_dim = head_dim
        inv_freq = compute_inv_freq(head_dim, rope_parameters(hf_config),
                                    hf_config.max_position_embeddings)
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # [head_dim // 2], float32

    def forward(self, positions: torch.Tensor,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [num_tokens] -> cos, sin [num_tokens, 1, head_dim] (broadcast over heads)."""
        freqs = positions[:, None].float() * self.inv_freq.float()  # [num_tokens, head_dim // 2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [num_tokens, num_heads, head_dim] rotated by its token's angle (a new tensor)."""
        return x * cos + rotate_half(x) * sin

    @staticmethod
    def rotates_in_place(x: torch.Tensor) -> bool:
        """Whether apply_ can rotate x (a view into the qkv projection) in place on the CPU."""
        return (x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]
                and x.shape[2] % 2 == 0 and cpu_ops.available(x, "rotary"))

    @staticmethod
    def apply_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``apply`` in place, one pass (cpu_ops.c), the same bits; needs rotates_in_place(x)."""
        return cpu_ops.rotary_(x, cos[:, 0].contiguous(), sin[:, 0].contiguous())
