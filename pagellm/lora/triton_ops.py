"""Triton kernels of the batched LoRA update (see ops.py for the layout and the math).

Two launches per layer, as punica's BGMV: ``shrink`` computes each token's
``x[t] @ lora_a[slot]^T`` ([T, S * R], float32), ``expand`` adds ``shrunk[t] @ lora_b[slot]`` to
the layer output. A program handles one token and one tile of output columns and reads only
its token's adapter, so a step with many adapters costs what a step with one does. Tokens
without adapter (slot -1) return at once. Tested against ``ops.lora_torch`` under
``TRITON_INTERPRET=1`` on the CPU.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# Whether the kernels below run under Triton's interpreter (numpy, on CPU tensors): read when
# they are defined, as Triton does.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, out_ptr, slots_ptr, in_features, rows,
                   stride_xt, stride_al, stride_ar, stride_ot,
                   BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slots_ptr + token)
    if slot < 0:
        return
    r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for k0 in range(0, in_features, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + token * stride_xt + k, mask=k < in_features, other=0.0)
        a = tl.load(a_ptr + slot * stride_al + r[:, None] * stride_ar + k[None, :],
                    mask=(r[:, None] < rows) & (k[None, :] < in_features), other=0.0)
        acc += tl.sum(a.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    tl.store(out_ptr + token * stride_ot + r, acc, mask=r < rows)


@triton.jit
def _expand_kernel(shrunk_ptr, b_ptr, y_ptr, slots_ptr, rows, out_features,
                   stride_st, stride_bl, stride_br, stride_yt,
                   BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slots_ptr + token)
    if slot < 0:
        return
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for r0 in range(0, rows, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        s = tl.load(shrunk_ptr + token * stride_st + r, mask=r < rows, other=0.0)
        b = tl.load(b_ptr + slot * stride_bl + r[:, None] * stride_br + n[None, :],
                    mask=(r[:, None] < rows) & (n[None, :] < out_features), other=0.0)
        acc += tl.sum(b.to(tl.float32) * s[:, None], axis=0)
    y_ptrs = y_ptr + token * stride_yt + n
    y = tl.load(y_ptrs, mask=n < out_features, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + acc).to(y.dtype), mask=n < out_features)


def lora_triton(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                token_slots: torch.Tensor, block_r: int = 16, block_k: int = 64,
                block_n: int = 64) -> torch.Tensor:
    """``lora_torch`` with ``token_slots`` [T] int (-1: none) instead of a mask; y in place."""
    num_tokens, in_features = x.shape
    rows, out_features = lora_a.shape[1], lora_b.shape[2]
    if num_tokens == 0:
        return y
    x = x.contiguous()
    if y.stride(1) != 1:
        raise ValueError("lora_triton writes rows of y: its last dimension must be contiguous")
    shrunk = torch.zeros(num_tokens, rows, dtype=torch.float32, device=x.device)
    slots = token_slots.to(torch.int32).contiguous()
    _shrink_kernel[(num_tokens, triton.cdiv(rows, block_r))](
        x, lora_a, shrunk, slots, in_features, rows, x.stride(0), lora_a.stride(0),
        lora_a.stride(1), shrunk.stride(0), BLOCK_R=block_r, BLOCK_K=block_k)
    _expand_kernel[(num_tokens, triton.cdiv(out_features, block_n))](
        shrunk, lora_b, y, slots, rows, out_features, shrunk.stride(0), lora_b.stride(0),
        lora_b.stride(1), y.stride(0), BLOCK_R=block_r, BLOCK_N=block_n)
    return y
