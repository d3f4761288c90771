"""The attention layer the models call: heads in, heads out, K/V through the paged cache."""
from __future__ import annotations

import functools
import os
from collections.abc import Callable

import torch
from torch import nn

from pagellm.attention import quantized_backend
from pagellm.attention.kv_quant import KVFormat, QuantizedKVCache, fake_quantize
from pagellm.attention.metadata import AttentionMetadata
from pagellm.attention.torch_backend import paged_attention

# (key, value), each [num_blocks, block_size, KVH, D]; or an 8-bit cache (kv_quant.py)
KVCache = tuple[torch.Tensor, torch.Tensor] | QuantizedKVCache
BACKENDS = ("auto", "torch", "triton")


def select_backend(query: torch.Tensor) -> Callable[..., torch.Tensor]:
    """The ``paged_attention`` to run: Triton kernels for CUDA tensors when triton imports,
    else the torch path. ``PAGELLM_ATTENTION_BACKEND=torch`` or ``=triton`` forces one
    (``triton`` on CPU tensors runs under ``TRITON_INTERPRET=1``, as the tests do)."""
    choice = os.environ.get("PAGELLM_ATTENTION_BACKEND", "auto")
    if choice not in BACKENDS:
        raise ValueError(f"PAGELLM_ATTENTION_BACKEND={choice!r}; expected one of {BACKENDS}")
    if choice == "torch" or (choice == "auto" and not query.is_cuda):
        return paged_attention
    triton_attention = _triton_paged_attention()
    if triton_attention is not None:
        return triton_attention
    if choice == "triton":
        raise RuntimeError("PAGELLM_ATTENTION_BACKEND=triton, but triton cannot be imported")
    return paged_attention


def runs_triton(device: torch.device | str) -> bool:
    """Whether attention on ``device`` runs the Triton kernels: the backend CUDA graphs need
    (the torch path skips padding slots through a host-built index, a data-dependent shape)."""
    triton_attention = _triton_paged_attention()
    probe = torch.empty(0, device=device)
    return triton_attention is not None and select_backend(probe) is triton_attention


@functools.cache
def _triton_paged_attention() -> Callable[..., torch.Tensor] | None:
    try:
        from pagellm.attention import triton_backend
    except ImportError:
        return None
    return triton_backend.paged_attention


def _triton_paged_attention_quantized() -> Callable[..., torch.Tensor]:
    from pagellm.attention import triton_backend
    return triton_backend.paged_attention_quantized


class Attention(nn.Module):
    """Scaled dot-product attention of a step's queries over their sequences' cached context.

    Model code passes rotated q/k and v of the step's tokens plus this layer's cache; where
    the context lives (which blocks, which sequence a token belongs to) comes from the
    per-step AttentionMetadata, so the model never sees the scheduler.
    """

    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float,
                 sliding_window: int | None = None) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads={num_heads} is not a multiple of "
                             f"num_key_value_heads={num_kv_heads}")
        self.num_heads, self.head_dim, self.num_kv_heads = num_heads, head_dim, num_kv_heads
        self.scale, self.sliding_window = scale, sliding_window
        # For comparisons only: store the step's K/V rounded through this 8-bit format into a
        # cache of the model dtype (what an 8-bit cache's reader sees, read by the unquantized
        # paths): the engine that tests and quality checks hold the 8-bit cache against.
        self.reference_kv_format: KVFormat | None = None

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: KVCache, metadata: AttentionMetadata) -> torch.Tensor:
        """query [T, H, D], key/value [T, KVH, D] -> [T, H, D]."""
        attend = select_backend(query)
        if self.reference_kv_format is not None:
            key = fake_quantize(key, self.reference_kv_format)
            value = fake_quantize(value, self.reference_kv_format)
        if isinstance(kv_cache, QuantizedKVCache):
            attend = (quantized_backend.paged_attention if attend is paged_attention
                      else _triton_paged_attention_quantized())
            return attend(query, key, value, kv_cache, metadata, self.scale,
                          self.sliding_window)
        k_cache, v_cache = kv_cache
        return attend(query, key, value, k_cache, v_cache, metadata, self.scale,
                      self.sliding_window)

    def extra_repr(self) -> str:
        return (f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, sliding_window={self.sliding_window}")
