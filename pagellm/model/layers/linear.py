"""Linear layers whose parameters carry a ``weight_loader``.

A checkpoint names the projections separately (``q_proj``, ``k_proj``, ``v_proj``; ``gate_proj``,
``up_proj``); we run them as one matmul each (``qkv_proj``, ``gate_up_proj``) because one larger
GEMM is faster than three small ones. Each fused parameter knows where every checkpoint shard
goes (``weight_loader(param, tensor, shard_id)``), so the model loader needs no per-model table
of names: it maps ``q_proj`` -> (``qkv_proj``, "q") and calls the loader.

On the CPU, once the weights are loaded, ``pack_linear_weights`` re-lays every weight out in
oneDNN's blocked format once (torch's own bfloat16 matmul runs the same oneDNN kernel but
reorders the weight on every call; its float32 matmul goes to MKL): 1.05-2x faster in bfloat16
(the same output bits on the AVX-512 CPUs measured; oneDNN may pick other kernels, and another
summation order, on other CPUs), 1.1-3.7x in float32, by number of rows (docs/BENCHMARKS.md,
"Packed weights"). Where oneDNN has no bfloat16 path (CPUs without AVX-512 or AVX-NE-CONVERT),
bfloat16 layers stay unpacked: below quant_matmul.GEMM_ROWS rows they run the compiled
bfloat16 kernel (quant_matmul.c, the weight widened in registers), from there in float32
(without the compiler: 4 rows or more in float32, fewer on F.linear) (Linear.pack).
"""
from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Collection

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.distributed.parallel_state import current_group
from pagellm.model.layers import quant_matmul

logger = logging.getLogger("pagellm")
_PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
# bfloat16 without oneDNN's bfloat16 path: from this many rows float32 matmuls are faster
# (AVX2 EPYC, the small model's projections: 19.5 against 24.9 ms at 4 rows, 16.3 against
# 13.2 at 2)
_UPCAST_ROWS = 4


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor) -> None:
    """Copy a checkpoint tensor into a parameter of the same shape (dtype converted).
    ``loaded`` may also be a safetensors slice (read here, whole)."""
    loaded = as_tensor(loaded)
    if param.shape != loaded.shape:
        raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit a "
                         f"parameter of shape {tuple(param.shape)}")
    param.data.copy_(loaded)


def as_tensor(loaded) -> torch.Tensor:
    """A checkpoint tensor, or a lazy safetensors slice read in full."""
    return loaded if isinstance(loaded, torch.Tensor) else loaded[:]


def narrow_loaded(loaded, dim: int, start: int, size: int):
    """Rows (dim 0) or columns (dim 1) ``start .. start + size`` of a checkpoint tensor. On a
    lazy safetensors slice (tensor parallelism) only those bytes are read from the file."""
    if isinstance(loaded, torch.Tensor):
        return loaded.narrow(dim, start, size)
    index = (slice(start, start + size),) if dim == 0 else (slice(None), slice(start, start + size))
    return loaded[index]


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
        self.pack_failure: str | None = None  # why pack() could not, when it tried
        # bfloat16 where oneDNN has no bfloat16 path (pack()): matmuls of 4+ rows in float32,
        # and, where it is built, fewer than quant_matmul.GEMM_ROWS in the compiled kernel
        self.upcast = False
        self.bf16_kernel: quant_matmul.QuantizedMatmul | None = None
        # int8/int4 weight-only (quantized_linear.py), set after loading; replaces the weight
        self.quantized: nn.Module | None = None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: str | int | None = None) -> None:
        default_weight_loader(param, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, in_features] -> [num_tokens, out_features]
        if self.quantized is not None:
            out = self.quantized(x)
            return out if self.bias is None else out + self.bias
        return self.matmul(x, self.bias)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x @ W^T + bias through the path chosen at load: packed, float32 (upcast) or plain."""
        if self.packed_weight is not None:
            return _packed_linear(x, self.packed_weight, bias)
        if self.upcast:
            rows = x.numel() // self.in_features
            if self.bf16_kernel is not None and rows < quant_matmul.GEMM_ROWS:
                return self._kernel_linear(x, bias)
            if rows >= _UPCAST_ROWS:
                return self._float32_linear(x, bias)
        return F.linear(x, self.weight, bias)

    def _kernel_linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The compiled bfloat16 kernel: the weight widened in registers, float32 sums (with
        the layer's bias) rounded once; another bias is added after."""
        if bias is None or bias is self.bias:
            return self.bf16_kernel(x, add_bias=bias is not None)
        return self.bf16_kernel(x, add_bias=False) + bias

    def _float32_linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """F.linear of the bfloat16 values in float32, rounded once (as bfloat16 matmuls
        round), the weight converted a cache-sized slice at a time."""
        out = quant_matmul.sliced_float32_gemm(
            x.reshape(-1, self.in_features), self.out_features,
            lambda start, count: self.weight[start:start + count].float(), bias)
        return out.reshape(*x.shape[:-1], self.out_features)

    def pack(self, keep_weight: bool = False) -> bool:
        """Re-lay the loaded weight out for oneDNN's CPU GEMM; False where that is unavailable.

        The packed path rests on torch's private mkldnn ops, so it is taken only after a probe
        call on this layer ran and agreed with F.linear (within the dtype's rounding): another
        torch build, a missing op or a CPU oneDNN cannot serve leaves the layer on F.linear,
        with one log line (pack_linear_weights). Without ``keep_weight`` the plain weight is released (replaced by
        an empty tensor of the same dtype): the packed copy replaces it, so memory does not
        double. Keep it when another module reads the same tensor (an lm_head tied to the
        embedding). Weights can no longer be loaded into a packed layer.
        """
        weight = self.weight
        if (weight.device.type != "cpu" or weight.dtype not in _PACKABLE_DTYPES
                or not torch.backends.mkldnn.is_available()):
            return False
        if weight.dtype == torch.bfloat16 and not onednn_has_bfloat16():
            # torch's bfloat16 matmul then takes a path that costs each row a pass over the
            # weight (5x the float32 route's time at 64 rows on an AVX2 EPYC); converting the
            # weight to float32 per call and rounding the float32 sums once is the same
            # arithmetic (_float32_linear), and so is widening it in registers (the compiled
            # kernel, for the rows of a decode step)
            self.upcast = True
            if quant_matmul.available() and self.in_features % 8 == 0:
                self.bf16_kernel = quant_matmul.QuantizedMatmul(
                    "bf16", weight.detach(), weight.detach(), self.in_features, self.bias)
            self.pack_failure = ("oneDNN has no bfloat16 path on this CPU (it needs AVX-512BW/"
                                 "VL/DQ or AVX-NE-CONVERT): bfloat16 projections of "
                                 + (f"fewer than {quant_matmul.GEMM_ROWS} rows run in the "
                                    "compiled bfloat16 kernel, more in float32"
                                    if self.bf16_kernel is not None else
                                    f"{_UPCAST_ROWS} or more rows run in float32"))
            return False
        try:
            packed = _reorder_weight(weight.detach())
            _check_packed(packed, weight, self.bias)
        except Exception as exc:  # any failure of a private op: stay on the public one
            first_line = str(exc).splitlines()[0] if str(exc) else ""
            self.pack_failure = f"{type(exc).__name__}: {first_line}"
            logger.debug("%s stays unpacked: %s", self.extra_repr(), self.pack_failure)
            return False
        self.packed_weight = packed
        if not keep_weight:
            weight.data = torch.empty(0, dtype=weight.dtype)
        return True

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}"
                + (", packed" if self.packed_weight is not None else "")
                + (f", {type(self.quantized).__name__}" if self.quantized is not None else ""))


def onednn_has_bfloat16() -> bool:
    """Whether oneDNN has a bfloat16 matmul on this CPU (AVX-512BW/VL/DQ or AVX-NE-CONVERT)."""
    return torch.ops.mkldnn._is_mkldnn_bf16_supported()


def _reorder_weight(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight, None)


def _packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
                   ) -> torch.Tensor:
    return _linear_pointwise()(x, packed, bias, "none", [None], "")


@functools.cache
def _linear_pointwise() -> Callable[..., torch.Tensor]:
    """The op's compiled entry point. ``torch.ops.mkldnn._linear_pointwise(...)`` resolves its
    overload in Python on every call: about 7 us of a 1-row bfloat16 projection's 15-20, 49
    times in a 12-layer decode step. The packed path already rests on this private op (and
    on a probe call per layer, _check_packed), so taking its builtin adds no new dependency."""
    overload = torch.ops.mkldnn._linear_pointwise.default
    return getattr(overload, "_op", overload)


def _check_packed(packed: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """Raise unless the packed call runs and is about as accurate as F.linear on a probe
    input: its error against a float64 matmul at most 4x F.linear's (oneDNN may add in
    another order than torch's matmul), or 4 x (float32's last place x sqrt(in_features), how
    rounding grows over a float32 sum, plus the output dtype's last place) at the output's
    scale, whichever is larger. A wrong layout or a missing op is off by the output's scale."""
    gen = torch.Generator().manual_seed(0)
    probe = torch.randn(3, weight.shape[1], generator=gen).to(weight.dtype)
    got, expected = _packed_linear(probe, packed, bias), F.linear(probe, weight, bias)
    if got.shape != expected.shape or got.dtype != expected.dtype:
        raise RuntimeError(f"packed output {tuple(got.shape)} {got.dtype} differs from "
                           f"F.linear's {tuple(expected.shape)} {expected.dtype}")
    exact = F.linear(probe.double(), weight.double(), None if bias is None else bias.double())
    error, torch_error = ((out.double() - exact).abs().max().item() for out in (got, expected))
    # float32 sums: rounding grows with sqrt(terms); then the output's rounding to its dtype
    units = (torch.finfo(torch.float32).eps * weight.shape[1] ** 0.5
             + torch.finfo(weight.dtype).eps)
    bound = max(4 * torch_error, 4 * units * exact.abs().max().item())
    if not error <= bound:
        raise RuntimeError(f"packed output is off by {error:.3g} (bound {bound:.3g})")


def pack_linear_weights(model: nn.Module, shared: Collection[int] = ()) -> int:
    """Pack every Linear of a loaded CPU model (see Linear.pack); returns how many were, and
    logs one warning when some packing failed.

    ``shared``: ids of weight tensors that other modules also read (tied embeddings), which
    are packed but kept.
    """
    linears = [module for module in model.modules()
               if isinstance(module, Linear) and module.quantized is None]
    packed = sum(module.pack(keep_weight=id(module.weight) in shared) for module in linears)
    upcast = [module for module in linears if module.upcast]
    if upcast:  # expected on such CPUs, and handled: said, not warned
        logger.info("%d of %d linear layers stay unpacked: %s", len(upcast), len(linears),
                    upcast[0].pack_failure)
    failures = [module.pack_failure for module in linears
                if module.pack_failure and not module.upcast]
    if failures:
        logger.warning("%d of %d linear layers stay unpacked (F.linear runs): %s",
                       len(failures), len(linears), failures[0])
    return packed


class MergedLinear(Linear):
    """Several projections of the same input stacked along the output dimension.

    ``shard_id`` is the index of the projection (0 = gate, 1 = up for the MLP); its rows are
    ``output_sizes[shard_id]`` long, starting after the rows of the shards before it.

    Column-parallel under tensor parallelism (the group current when it is built): each rank
    holds rows ``rank * size .. (rank + 1) * size`` of every projection (``output_sizes`` are
    the rank's sizes), so its output is the rank's slice of each, with no communication.
    """

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False) -> None:
        self.tp = current_group()
        for size in output_sizes:
            if size % self.tp.world_size:
                raise ValueError(f"tensor_parallel_size={self.tp.world_size} does not divide "
                                 f"a projection of {size} rows")
        self.output_sizes = [size // self.tp.world_size for size in output_sizes]
        self.shard_ids: tuple[str | int, ...] = tuple(range(len(output_sizes)))
        super().__init__(in_features, sum(self.output_sizes), bias)

    def shard_range(self, shard_id: str | int) -> tuple[int, int]:
        index = int(shard_id)
        return sum(self.output_sizes[:index]), self.output_sizes[index]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: str | int | None = None) -> None:
        if shard_id is None:  # a checkpoint that already stores the fused tensor
            default_weight_loader(param, loaded)
            return
        offset, size = self.shard_range(shard_id)
        if self.tp.world_size > 1:
            loaded = narrow_loaded(loaded, 0, self.source_row(shard_id), size)
        default_weight_loader(param.data.narrow(0, offset, size), loaded)

    def source_row(self, shard_id: str | int) -> int:
        """The first checkpoint row of this rank's part of projection ``shard_id``."""
        return self.tp.rank * self.shard_range(shard_id)[1]


class QKVLinear(MergedLinear):
    """The q, k and v projections as one matmul; shard ids are "q", "k" and "v".

    Output layout: [q (num_heads * head_dim) | k (num_kv_heads * head_dim) | v (same)].

    Under tensor parallelism the heads are split: ``num_heads`` and ``num_kv_heads`` are the
    rank's (query heads ``rank * num_heads ..``); with fewer KV heads than ranks each rank
    holds one KV head, replicated on ``world_size / total KV heads`` ranks, the one its query
    heads attend to.
    """

    _SHARDS = {"q": 0, "k": 1, "v": 2}

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False) -> None:
        tp = current_group()
        self.head_dim = head_dim
        self.num_heads, self.num_kv_heads = heads_per_rank(num_heads, num_kv_heads,
                                                           tp.world_size)
        # the rank's first KV head of the checkpoint's num_kv_heads
        replicas = max(tp.world_size // num_kv_heads, 1)
        self.first_kv_head = tp.rank // replicas * self.num_kv_heads
        q_size, kv_size = num_heads * head_dim, self.num_kv_heads * head_dim
        # MergedLinear divides every size by world_size: give it the totals of the shards
        super().__init__(hidden_size, [q_size, kv_size * tp.world_size,
                                       kv_size * tp.world_size], bias)
        self.shard_ids = tuple(self._SHARDS)

    def source_row(self, shard_id: str | int) -> int:
        if shard_id == "q":
            return super().source_row(shard_id)
        return self.first_kv_head * self.head_dim

    def shard_range(self, shard_id: str | int) -> tuple[int, int]:
        if shard_id not in self._SHARDS:
            raise ValueError(f"QKVLinear shard_id must be 'q', 'k' or 'v', got {shard_id!r}")
        return super().shard_range(self._SHARDS[shard_id])


def heads_per_rank(num_heads: int, num_kv_heads: int, world_size: int) -> tuple[int, int]:
    """(query heads, KV heads) of one rank; KV heads are replicated when there are fewer of
    them than ranks. Raises ValueError naming the numbers when the heads do not split."""
    if num_heads % world_size:
        raise ValueError(f"tensor_parallel_size={world_size} does not divide the model's "
                         f"num_attention_heads={num_heads}")
    if num_kv_heads >= world_size:
        if num_kv_heads % world_size:
            raise ValueError(f"tensor_parallel_size={world_size} does not divide the model's "
                             f"num_key_value_heads={num_kv_heads}")
        return num_heads // world_size, num_kv_heads // world_size
    if world_size % num_kv_heads:
        raise ValueError(f"tensor_parallel_size={world_size} is not a multiple of the model's "
                         f"num_key_value_heads={num_kv_heads} (fewer KV heads than ranks are "
                         "replicated, which needs a whole number of ranks per KV head)")
    return num_heads // world_size, 1
