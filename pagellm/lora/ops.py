"""The batched LoRA update of one linear layer, for a step whose tokens use different adapters.

Every adapter resident on the device sits in a slot of stacked weights:
``lora_a`` [max_loras, S * R, in_features] and ``lora_b`` [max_loras, S * R, out_features],
S the layer's shards (3 for a fused q/k/v, 2 for gate/up, else 1), R = ``max_lora_rank``. Shard
s of slot l occupies rows ``s * R .. s * R + rank`` of both (zeros beyond the adapter's rank), and
its B rows are non-zero only in that shard's columns of the fused output, so one expand covers
every shard. Each token t has a slot ``token_slots[t]`` (-1: no adapter), and gets

    y[t] += (x[t] @ lora_a[slot]^T) @ lora_b[slot]          (scaling folded into lora_b)

Two implementations, compared by the tests with the one-token-at-a-time definition
(``lora_reference``):

- ``lora_torch``, the CPU path: a segmented matmul as two batched matmuls. The step's tokens
  are grouped by slot once per step (``LoRABatch``, [n slots used, longest group]); each layer
  gathers its input rows into that layout, multiplies each group by its own slot's A then B
  (``torch.bmm``), and adds the rows back (``index_add_``). No Python loop over requests or
  slots; the work is that of the tokens' own adapters (plus the padding of uneven groups).
  A step with a single adapter skips the grouping: two plain matmuls over all tokens, the rows
  of tokens without adapter zeroed in between.
- ``lora_triton`` (``triton_ops.py``), for GPUs: each program reads its token's slot and only
  that adapter's rows (a gathered matrix-vector product, punica's BGMV).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class LoRABatch:
    """A step's tokens grouped by adapter slot (built once per step, read by every layer).

    ``token_slots`` [T] int32 (-1: no adapter), the tokens in the runner's packed order (what
    the Triton kernels read);
    ``slots`` [n] int64: the slots the step uses, ascending (``slot_list`` on the host);
    ``has_adapter`` [T, 1] bool. With several slots: ``token_index`` [n, L] int64, row i lists
    the tokens of ``slots[i]``, padded with token 0, and ``valid`` [n, L, 1] bool, False on the
    padding (its rows are zeroed before the matmuls, so they add exact zeros).
    """

    token_slots: torch.Tensor
    slots: torch.Tensor
    slot_list: list[int]
    has_adapter: torch.Tensor
    token_index: torch.Tensor | None = None
    valid: torch.Tensor | None = None

    @classmethod
    def build(cls, token_slots: list[int], device: torch.device | str) -> LoRABatch | None:
        """From the per-token slots; None when no token has an adapter."""
        groups: dict[int, list[int]] = {}
        for token, slot in enumerate(token_slots):
            if slot >= 0:
                groups.setdefault(slot, []).append(token)
        if not groups:
            return None
        slots = sorted(groups)
        token_slots_t = torch.tensor(token_slots, dtype=torch.int32).to(device)
        batch = cls(token_slots_t, torch.tensor(slots, dtype=torch.int64).to(device), slots,
                    (token_slots_t >= 0).unsqueeze(-1))
        if len(slots) > 1:
            longest = max(map(len, groups.values()))
            index = [groups[s] + [0] * (longest - len(groups[s])) for s in slots]
            valid = [[True] * len(groups[s]) + [False] * (longest - len(groups[s]))
                     for s in slots]
            batch.token_index = torch.tensor(index, dtype=torch.int64).to(device)
            batch.valid = torch.tensor(valid).unsqueeze(-1).to(device)
        return batch


def lora_torch(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
               batch: LoRABatch) -> torch.Tensor:
    """Add the update to ``y`` [T, out] in place and return it. ``x`` [T, in]."""
    if len(batch.slot_list) == 1:
        slot = batch.slot_list[0]
        shrunk = (x @ lora_a[slot].t()) * batch.has_adapter  # [T, S * R]
        return y.addmm_(shrunk, lora_b[slot])
    a = lora_a.index_select(0, batch.slots)  # [n, S * R, in]
    b = lora_b.index_select(0, batch.slots)  # [n, S * R, out]
    grouped = x[batch.token_index] * batch.valid  # [n, L, in]
    update = torch.bmm(torch.bmm(grouped, a.transpose(1, 2)), b)  # [n, L, out]
    return y.index_add_(0, batch.token_index.view(-1), update.view(-1, y.shape[1]))


def lora_reference(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor,
                   lora_b: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
    """The definition, one token at a time, in float64 (tests only): a new tensor."""
    out = y.double().clone()
    for t, slot in enumerate(token_slots.tolist()):
        if slot >= 0:
            out[t] += (x[t].double() @ lora_a[slot].double().t()) @ lora_b[slot].double()
    return out
