"""LoRA-aware linear layers: the base layer's output plus each token's own adapter update.

``LoRALinear`` wraps a loaded (possibly packed) ``Linear`` and keeps the base layer's forward
untouched: the adapter update is added to its output. Which token uses which slot is per-step
data, held by one ``LoRAStepState`` that every wrapped layer of the model shares; the model
runner sets it before each forward (the model code never sees the scheduler).
"""
from __future__ import annotations

import torch
from torch import nn

from pagellm.lora.adapter import LoRAPair
from pagellm.lora.ops import LoRABatch, lora_torch
from pagellm.model.layers.linear import Linear, MergedLinear

# the decoder's projections an adapter may target, as (fused module, checkpoint names)
WRAPPED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
           "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


class LoRAStepState:
    """The step's tokens by adapter slot (``LoRABatch``), shared by all LoRA layers of a
    model; None when no token of the step has an adapter (the layers skip the update)."""

    def __init__(self, use_triton: bool = False) -> None:
        self.batch: LoRABatch | None = None
        self.use_triton = use_triton  # the Triton kernels (GPU) instead of lora_torch


class LoRALinear(nn.Module):
    """``base(x)`` plus the update of each token's adapter (ops.py).

    Invariant: slot l's rows of ``lora_a`` / ``lora_b`` hold the adapter last loaded into
    slot l, zero where the adapter has no pair for a shard or a lower rank than
    ``max_lora_rank``.
    """

    def __init__(self, base: Linear, max_loras: int, max_lora_rank: int,
                 state: LoRAStepState) -> None:
        super().__init__()
        self.base = base
        self.state = state
        self.rank = max_lora_rank
        if isinstance(base, MergedLinear):
            self.shards = [base.shard_range(s) for s in base.shard_ids]  # (offset, size)
        else:
            self.shards = [(0, base.out_features)]
        rows = len(self.shards) * max_lora_rank
        weight = base.packed_weight if base.packed_weight is not None else base.weight
        kwargs = dict(dtype=weight.dtype, device=weight.device)
        self.register_buffer("lora_a", torch.zeros(max_loras, rows, base.in_features, **kwargs),
                             persistent=False)
        self.register_buffer("lora_b", torch.zeros(max_loras, rows, base.out_features,
                                                   **kwargs), persistent=False)

    def set_slot(self, slot: int, pairs: list[LoRAPair | None]) -> None:
        """Load one adapter's pairs (one per shard, None: not adapted) into ``slot``."""
        if len(pairs) != len(self.shards):
            raise ValueError(f"{len(self.shards)} shards, got {len(pairs)} pairs")
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        for i, ((offset, size), pair) in enumerate(zip(self.shards, pairs)):
            if pair is None:
                continue
            if pair.lora_a.shape[1] != self.base.in_features or pair.lora_b.shape[0] != size:
                raise ValueError(
                    f"LoRA pair of shapes A {tuple(pair.lora_a.shape)}, B "
                    f"{tuple(pair.lora_b.shape)} does not fit a projection of "
                    f"{self.base.in_features} -> {size}")
            row = i * self.rank
            self.lora_a[slot, row:row + pair.rank].copy_(pair.lora_a)
            self.lora_b[slot, row:row + pair.rank, offset:offset + size].copy_(pair.lora_b.t())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)  # [T, out_features]
        batch = self.state.batch
        if batch is None:
            return y
        if self.state.use_triton:
            from pagellm.lora.triton_ops import lora_triton
            return lora_triton(y, x, self.lora_a, self.lora_b, batch.token_slots)
        return lora_torch(y, x, self.lora_a, self.lora_b, batch)


def wrap_lora_layers(model: nn.Module, max_loras: int, max_lora_rank: int,
                     state: LoRAStepState) -> dict[str, LoRALinear]:
    """Replace the decoder's projections by LoRA layers; returns them by module name
    (``model.layers.0.self_attn.qkv_proj``)."""
    wrapped: dict[str, LoRALinear] = {}
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if child_name in WRAPPED and isinstance(child, Linear):
                layer = LoRALinear(child, max_loras, max_lora_rank, state)
                setattr(module, child_name, layer)
                wrapped[f"{name}.{child_name}" if name else child_name] = layer
    return wrapped
