"""Quantize a model's projections from the checkpoint's own values while its weights load.

Each projection is quantized from the checkpoint tensor as read, in float32 (a GGUF tensor
dequantized to float32, a safetensors tensor in its stored dtype upcast), never from the copy
loaded into the model: with ``dtype=bfloat16`` that copy is already rounded, and quantizing it
would round each weight twice (a bfloat16 round trip). Where a GGUF file's blocks *are* the
target format (Q4_0 / Q4_1 / Q4_K as int4 groups of 32, gguf_codes.int4_codes; every
quantized type as int8 groups of 32 or 16 with float32 scales, and zeros for the types with
a min, gguf_codes.int8_codes) the loader hands their codes in instead (``add``), and nothing
is re-quantized. A fused int8 projection whose shards come in different groups takes the
smallest, the other shards' scales (and zeros) repeated; if one shard has zeros, the others
take zeros of 0.

Both formats keep rows independent (int8: one scale per output row; int4: groups run along
the input), so every checkpoint tensor — one shard of a fused projection such as q_proj of
qkv_proj — is quantized alone, and the shards' parts stacked along the output equal the
fused weight quantized whole. A projection is installed (``Linear.quantized`` set, its plain
weight released) as soon as its last shard has been copied in, so the memory held beyond the
model in its dtype is one float32 tensor and the parts of the projections still incomplete.
A projection whose checkpoint names do not match (none in the supported families) is left to
finish_weights, which quantizes it from its loaded weight.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from pagellm.model.layers.linear import Linear, as_tensor
from pagellm.model.layers.quantized_linear import (Int4Weight, Int8Weight, int4_quantize,
                                                    int8_quantize)

# int8: (q [N, K] int8, scale [N] in the model dtype), or from GGUF blocks (q, scale
# [N, K / group] float32) and, for the types with a min, zero [N, K / group] float32;
# int4: (codes [N, K] uint8, scale, zero [N, K / group] float32)
Parts = tuple[torch.Tensor, ...]


class QuantizingLoad:
    """The quantized parts of a model's projections, collected from the checkpoint tensors
    streaming to ``load_weights``.

    Invariants: ``parts`` holds only checkpoint names of projections not yet installed; a
    projection is installed once, from parts of every one of its checkpoint tensors, in its
    shards' order. The vocabulary projection is int8 whatever the method (finish_weights);
    when tied, it is quantized from the embedding's tensor and its weight is kept.

    ``method="gguf"``: each projection's format is ``choose(checkpoint names, is the
    vocabulary projection)``, "int4" (groups of 32), "int8" or None (left plain), from the
    file's tensor types (gguf_loader.gguf_method).
    """

    def __init__(self, model: Any, method: str, group_size: int,
                 choose: Callable[[list[str], bool], str | None] | None = None) -> None:
        if method == "gguf" and choose is None:
            raise ValueError("quantization='gguf' needs the file's tensor types")
        self.method, self.group_size = method, 32 if method == "gguf" else group_size
        self.dtype = model.lm_head.weight.dtype
        self.parts: dict[str, Parts] = {}
        # projection module -> its checkpoint tensors, in its output's order
        self._sources: dict[Linear, list[str]] = {}
        self._module_of: dict[str, Linear] = {}  # checkpoint name -> projection
        self._methods: dict[Linear, str | None] = {}  # projection -> its format
        self._shared = {id(model.lm_head.weight)} if model.tie_word_embeddings else set()
        for module, names in _projection_sources(model).items():
            self._sources[module] = names
            self._module_of.update((n, module) for n in names)
            lm_head = module is model.lm_head
            self._methods[module] = (choose(names, lm_head) if choose is not None
                                     else "int8" if lm_head else method)

    def method_of(self, name: str) -> str | None:
        """"int8" / "int4" for a checkpoint tensor that a projection is quantized from; None
        for any other tensor."""
        module = self._module_of.get(name)
        return None if module is None else self._methods[module]

    def add(self, name: str, parts: Parts) -> None:
        """Parts taken from the file as they are (int4: codes, scale, zero float32; int8: codes,
        scale [N, K / group] float32 and, for blocks with a min, zero)."""
        self.parts[name] = parts

    def stream(self, weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """The same (name, tensor) pairs, each projection tensor quantized on its way; a
        projection is installed after ``load_weights`` has copied its last tensor."""
        for name, tensor in weights:
            method = self.method_of(name)
            if method is not None and name not in self.parts:
                values = as_tensor(tensor).float()  # [N, K]: the checkpoint's values
                self.parts[name] = (int8_quantize(values, self.dtype) if method == "int8"
                                    else int4_quantize(values, self.group_size, self.dtype))
                del values
            yield name, tensor
            if method is not None:
                self._install_if_complete(self._module_of[name])

    def _install_if_complete(self, module: Linear) -> None:
        names = self._sources[module]
        if not all(n in self.parts for n in names):
            return
        parts = [self.parts.pop(n) for n in names]
        int8 = self.method_of(names[0]) == "int8"
        if int8:
            parts = _int8_shards(parts)
        stacked = [torch.cat(p) for p in zip(*parts)]
        if stacked[0].shape != module.weight.shape:
            raise ValueError(f"checkpoint tensors {names} stack to "
                             f"{tuple(stacked[0].shape)}, not the projection's "
                             f"{tuple(module.weight.shape)}")
        if int8:
            q, scale, *zero = _float16_if_exact(stacked)
            module.quantized = Int8Weight(q, scale, q.shape[1] // scale.shape[1]
                                          if scale.dim() == 2 else None, *zero)
        else:
            module.quantized = Int4Weight(*stacked, self.group_size, self.dtype)
        if id(module.weight) not in self._shared:
            module.weight.data = torch.empty(0, dtype=module.weight.dtype)


def _int8_shards(parts: list[Parts]) -> list[Parts]:
    """The int8 parts of a projection's shards in one form that stacks: all per output
    channel, or all in the smallest group among them with float32 scales; with zeros for
    every shard where one has them (0 for the others)."""
    groups = {_group(*p[:2]) for p in parts}
    if len(groups) > 1:  # GGUF blocks beside other blocks or re-quantized shards
        parts = [_per_group(p, min(g for g in groups if g)) for p in parts]
    if any(len(p) == 3 for p in parts):
        parts = [p if len(p) == 3 else (*p, torch.zeros_like(p[1], dtype=torch.float32))
                 for p in parts]
    return parts


def _float16_if_exact(parts: Parts) -> Parts:
    """Group-wise float32 scales (and zeros) in float16 where every one of them is exactly a
    float16, as a GGUF file's Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 block scales and mins are:
    half the parameter bytes, the same weights. K-quant products (d * sc) mostly are not."""
    q, *params = parts
    if params[0].dim() != 2 or params[0].dtype != torch.float32:
        return parts
    halves = [p.half() for p in params]
    if all(torch.equal(h.float(), p) for h, p in zip(halves, params)):
        return q, *halves
    return parts


def _group(q: torch.Tensor, scale: torch.Tensor) -> int | None:
    """The group size of int8 parts; None: per output channel."""
    return q.shape[1] // scale.shape[1] if scale.dim() == 2 else None


def _per_group(parts: Parts, group: int) -> Parts:
    """int8 parts (q, scale[, zero]) with float32 scales (and zeros) per ``group`` (which
    divides their own group): each repeated, which dequantizes to the same values."""
    q, *params = parts
    repeats = (_group(q, params[0]) or q.shape[1]) // group
    return q, *(p.float().reshape(q.shape[0], -1).repeat_interleave(repeats, dim=1)
                for p in params)


def _projection_sources(model: Any) -> dict[Linear, list[str]]:
    """Every Linear -> the checkpoint tensors of its weight: its own name, or those of its
    shards (packed_modules_mapping) for a fused one; the tied lm_head -> the embedding."""
    inverse: dict[str, dict[str | int, str]] = {}
    for checkpoint, (fused, shard) in model.packed_modules_mapping.items():
        inverse.setdefault(fused, {})[shard] = checkpoint
    sources = {}
    for name, module in model.named_modules():
        if not isinstance(module, Linear):
            continue
        prefix, _, leaf = name.rpartition(".")
        shards = getattr(module, "shard_ids", None)
        if module is model.lm_head and model.tie_word_embeddings:
            sources[module] = ["model.embed_tokens.weight"]
        elif shards is None:
            sources[module] = [f"{name}.weight"]
        elif all(s in inverse.get(leaf, {}) for s in shards):
            sources[module] = [f"{prefix}.{inverse[leaf][s]}.weight" for s in shards]
    return sources
