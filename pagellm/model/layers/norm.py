"""RMSNorm, computed exactly as transformers computes it (float32 statistics), optionally fused
with the residual add before it (as vLLM's fused_add_rms_norm)."""
from __future__ import annotations

import torch
from torch import nn

from pagellm.model.layers import cpu_ops


class RMSNorm(nn.Module):
    """y = weight * (x / sqrt(mean(x^2) + eps)), statistics in float32.

    The normalised activations are cast back to the input dtype *before* the weight multiply, as
    in transformers: doing it the other way round changes bfloat16 rounding and greedy tokens.

    ``forward(x, residual)`` first adds the residual stream (``h = residual + x``, rounded to
    the dtype as transformers' ``residual + hidden_states``) and returns ``(norm(h), h)``; on
    the CPU a compiled kernel (cpu_ops.c) does add and norm in one pass per row, bit for bit
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
            out = cpu_ops.rms_norm(x, residual, self.weight, self.eps)
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
        return (x.is_contiguous() and self.weight.dtype == x.dtype and x.numel() > 0
                and (residual is None or (residual.shape == x.shape
                                          and residual.dtype == x.dtype
                                          and residual.is_contiguous()))
                and cpu_ops.available(x, "rms_norm"))

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
