"""The batched LoRA update of one linear layer, for a step whose tokens use different adapters.

Every adapter resident on the device sits in a slot of stacked weights:
``lora_a`` [max_loras, S * R, in_features] and ``lora_b`` [max_loras, S * R, out_features],
S the layer's shards (3 for a fused q/k/v, 2 for gate/up, else 1), R = ``max_lora_rank``. Shard
s of slot l occupies rows ``s * R .. s * R + rank`` of both (zeros beyond the adapter's rank), and
its B rows are non-zero only in that shard's columns of the fused output, so one expand covers
every shard. Each token t has a slot ``token_slots[t]`` (-1: no adapter), and gets

    y[t] += (x[t] @ lora_a[slot]^T) @ lora_b[slot]          (scaling folded into lora_b)

Two implementations, compared by the tests:

- ``lora_torch``, the reference and the CPU path: no loop and no gather of weights. One matmul
  against the first ``K`` slots at once ([T, K * S * R]), a one-hot mask keeps each token's own
  slot, and one matmul expands. Its cost grows with ``K``, the highest slot the step uses + 1
  (the slot cache hands out the lowest free slots first).
- ``lora_triton`` (``triton_ops.py``), for GPUs: each program reads its token's slot and only
  that adapter's rows (a gathered matrix-vector product, punica's BGMV), so the cost does not
  grow with the number of slots.
"""
from __future__ import annotations

import torch


def lora_torch(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
               slot_mask: torch.Tensor) -> torch.Tensor:
    """Add the update to ``y`` [T, out] in place and return it. ``x`` [T, in];
    ``slot_mask`` [T, K] one-hot rows in x's dtype (all zero for a token without adapter)."""
    num_tokens, num_slots = slot_mask.shape
    rows = lora_a.shape[1]  # S * R
    a = lora_a[:num_slots].reshape(num_slots * rows, -1)  # [K * S * R, in], a view
    b = lora_b[:num_slots].reshape(num_slots * rows, -1)  # [K * S * R, out], a view
    shrunk = (x @ a.t()).view(num_tokens, num_slots, rows)  # [T, K, S * R]
    shrunk = (shrunk * slot_mask.unsqueeze(-1)).view(num_tokens, num_slots * rows)
    return y.addmm_(shrunk, b)


def lora_reference(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor,
                   lora_b: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
    """The definition, one token at a time, in float64 (tests only): a new tensor."""
    out = y.double().clone()
    for t, slot in enumerate(token_slots.tolist()):
        if slot >= 0:
            out[t] += (x[t].double() @ lora_a[slot].double().t()) @ lora_b[slot].double()
    return out


def slot_mask(token_slots: torch.Tensor, num_slots: int, dtype: torch.dtype) -> torch.Tensor:
    """One-hot [T, num_slots] of ``token_slots`` [T] (-1 rows stay zero)."""
    slots = torch.arange(num_slots, device=token_slots.device)
    return (token_slots.unsqueeze(1) == slots).to(dtype)
