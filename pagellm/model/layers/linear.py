"""Linear layers whose parameters carry a ``weight_loader``.

A checkpoint names the projections separately (``q_proj``, ``k_proj``, ``v_proj``; ``gate_proj``,
``up_proj``); we run them as one matmul each (``qkv_proj``, ``gate_up_proj``) because one larger
GEMM is faster than three small ones. Each fused parameter knows where every checkpoint shard
goes (``weight_loader(param, tensor, shard_id)``), so the model loader needs no per-model table
of names: it maps ``q_proj`` -> (``qkv_proj``, "q") and calls the loader.

On the CPU, once the weights are loaded, ``pack_linear_weights`` re-lays every weight out in
oneDNN's blocked format once (torch's own bfloat16 matmul runs the same oneDNN kernel but
reorders the weight on every call; its float32 matmul goes to MKL): 1.05-2x faster in bfloat16
with the same output bits, 1.1-3.7x in float32, by number of rows (docs/BENCHMARKS.md, "Packed
weights").
"""
from __future__ import annotations

import logging
from collections.abc import Collection

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger("pagellm")
_PACKABLE_DTYPES = (torch.float32, torch.bfloat16)


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor) -> None:
    """Copy a checkpoint tensor into a parameter of the same shape (dtype converted)."""
    if param.shape != loaded.shape:
        raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit a "
                         f"parameter of shape {tuple(param.shape)}")
    param.data.copy_(loaded)


class Linear(nn.Module):
    """y = x @ W^T (+ b). W: [out_features, in_features], as in checkpoints."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)
        self.packed_weight: torch.Tensor | None = None  # oneDNN layout, set by pack()

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: str | int | None = None) -> None:
        default_weight_loader(param, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, in_features] -> [num_tokens, out_features]
        if self.packed_weight is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none",
                                                      [None], "")
        return F.linear(x, self.weight, self.bias)

    def pack(self, keep_weight: bool = False) -> bool:
        """Re-lay the loaded weight out for oneDNN's CPU GEMM; False where that is unavailable.

        Without ``keep_weight`` the plain weight is released (replaced by an empty tensor of
        the same dtype): the packed copy replaces it, so memory does not double. Keep it when
        another module reads the same tensor (an lm_head tied to the embedding). Weights can
        no longer be loaded into a packed layer.
        """
        weight = self.weight
        if (weight.device.type != "cpu" or weight.dtype not in _PACKABLE_DTYPES
                or not torch.backends.mkldnn.is_available()):
            return False
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        except (RuntimeError, AttributeError) as exc:  # e.g. no bfloat16 support in oneDNN
            logger.debug("linear weights stay unpacked: %s", exc)
            return False
        self.packed_weight = packed
        if not keep_weight:
            weight.data = torch.empty(0, dtype=weight.dtype)
        return True

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}"
                + (", packed" if self.packed_weight is not None else ""))


def pack_linear_weights(model: nn.Module, shared: Collection[int] = ()) -> int:
    """Pack every Linear of a loaded CPU model (see Linear.pack); returns how many were.

    ``shared``: ids of weight tensors that other modules also read (tied embeddings), which
    are packed but kept.
    """
    return sum(module.pack(keep_weight=id(module.weight) in shared)
               for module in model.modules() if isinstance(module, Linear))


class MergedLinear(Linear):
    """Several projections of the same input stacked along the output dimension.

    ``shard_id`` is the index of the projection (0 = gate, 1 = up for the MLP); its rows are
    ``output_sizes[shard_id]`` long, starting after the rows of the shards before it.
    """

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False) -> None:
        self.output_sizes = list(output_sizes)
        self.shard_ids: tuple[str | int, ...] = tuple(range(len(output_sizes)))
        super().__init__(in_features, sum(output_sizes), bias)

    def shard_range(self, shard_id: str | int) -> tuple[int, int]:
        index = int(shard_id)
        return sum(self.output_sizes[:index]), self.output_sizes[index]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: str | int | None = None) -> None:
        if shard_id is None:  # a checkpoint that already stores the fused tensor
            default_weight_loader(param, loaded)
            return
        offset, size = self.shard_range(shard_id)
        default_weight_loader(param.data.narrow(0, offset, size), loaded)


class QKVLinear(MergedLinear):
    """The q, k and v projections as one matmul; shard ids are "q", "k" and "v".

    Output layout: [q (num_heads * head_dim) | k (num_kv_heads * head_dim) | v (same)].
    """

    _SHARDS = {"q": 0, "k": 1, "v": 2}

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False) -> None:
        self.head_dim, self.num_heads, self.num_kv_heads = head_dim, num_heads, num_kv_heads
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        super().__init__(hidden_size, [q_size, kv_size, kv_size], bias)
        self.shard_ids = tuple(self._SHARDS)

    def shard_range(self, shard_id: str | int) -> tuple[int, int]:
        if shard_id not in self._SHARDS:
            raise ValueError(f"QKVLinear shard_id must be 'q', 'k' or 'v', got {shard_id!r}")
        return super().shard_range(self._SHARDS[shard_id])
