"""The adapter caches of a worker: adapters on the device (``max_loras`` slots, LRU) and
adapters loaded in CPU memory (``max_cpu_loras``, LRU), read from disk on demand.

A step's adapters must all be in slots at once; the scheduler guarantees there are at most
``max_loras`` of them (``SchedulerConfig.max_loras``). An adapter not resident takes the
lowest free slot, else the slot of the least recently used adapter that this step does not
use (an eviction, counted). Its weights come from the CPU cache, else from its folder again
(a load, counted): ``max_cpu_loras`` bounds the host memory the adapters take, not the number
of adapters a server may serve.
"""
from __future__ import annotations

import heapq
import logging
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import asdict, dataclass

import torch
from torch import nn

from pagellm.lora.adapter import LoRAModel, load_peft_adapter
from pagellm.lora.layers import WRAPPED, LoRALinear, LoRAStepState, wrap_lora_layers
from pagellm.lora.request import LoRARequest

logger = logging.getLogger("pagellm")


@dataclass(slots=True)
class LoRAStats:
    num_registered: int = 0  # adapters known to the engine (LoRARequests seen, not removed)
    num_resident: int = 0  # adapters in device slots
    num_cpu_cached: int = 0
    num_loads: int = 0  # adapter folders read from disk
    num_slot_loads: int = 0  # adapters copied into a device slot
    num_slot_evictions: int = 0  # adapters pushed out of a slot for another one
    num_cpu_evictions: int = 0


class LoRAManager:
    """Invariants: ``slots`` maps each resident adapter id to a distinct slot in
    ``[0, max_loras)``, least recently used first; ``free_slots`` (a heap) holds the others;
    a registered id always names the same (name, path)."""

    def __init__(self, model: nn.Module, max_loras: int, max_lora_rank: int,
                 max_cpu_loras: int, use_triton: bool = False) -> None:
        self.max_loras, self.max_lora_rank, self.max_cpu_loras = (max_loras, max_lora_rank,
                                                                  max_cpu_loras)
        self.state = LoRAStepState(use_triton)
        self.layers: dict[str, LoRALinear] = wrap_lora_layers(model, max_loras, max_lora_rank,
                                                              self.state)
        self.registered: dict[int, LoRARequest] = {}
        self.cpu_cache: OrderedDict[int, LoRAModel] = OrderedDict()
        self.slots: OrderedDict[int, int] = OrderedDict()
        self.free_slots = list(range(max_loras))
        self.stats = LoRAStats()
        # checkpoint module name (model.layers.0.self_attn.q_proj) -> (layer, shard index)
        self._targets: dict[str, tuple[LoRALinear, int]] = {}
        for layer_name, layer in self.layers.items():
            parent, fused = layer_name.rsplit(".", 1)
            for shard, name in enumerate(WRAPPED[fused]):
                self._targets[f"{parent}.{name}"] = (layer, shard)

    # ---------------------------------------------------------------- registry
    def add_lora(self, request: LoRARequest) -> None:
        """Register an adapter and load it into the CPU cache (checks its files, its rank, its
        targets and their shapes against the model). ValueError when it cannot be served."""
        known = self.registered.get(request.lora_int_id)
        if known is not None and (known.lora_name, known.lora_path) != (request.lora_name,
                                                                      request.lora_path):
            raise ValueError(
                f"lora_int_id={request.lora_int_id} already names adapter "
                f"{known.lora_name!r} ({known.lora_path}); got {request.lora_name!r} "
                f"({request.lora_path}): use another id, or remove the first adapter")
        if known is None:
            self._cpu_model(request)  # raises before registering
            self.registered[request.lora_int_id] = request

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter (its slot frees at once); False when it was not registered."""
        if self.registered.pop(lora_int_id, None) is None:
            return False
        self.cpu_cache.pop(lora_int_id, None)
        slot = self.slots.pop(lora_int_id, None)
        if slot is not None:
            heapq.heappush(self.free_slots, slot)
        return True

    def list_loras(self) -> list[LoRARequest]:
        return list(self.registered.values())

    # ---------------------------------------------------------------- per step
    def activate(self, requests: Iterable[LoRARequest]) -> dict[int, int]:
        """Make every adapter of the step resident; returns lora_int_id -> slot."""
        wanted = {r.lora_int_id: r for r in requests}
        if len(wanted) > self.max_loras:
            raise ValueError(f"a step uses {len(wanted)} adapters, above max_loras="
                             f"{self.max_loras}")
        for lora_id, request in wanted.items():
            if lora_id in self.slots:
                self.slots.move_to_end(lora_id)
                continue
            self._load_into_slot(request, self._take_slot(wanted))
        return {lora_id: self.slots[lora_id] for lora_id in wanted}

    def _take_slot(self, keep: dict[int, LoRARequest]) -> int:
        if self.free_slots:
            return heapq.heappop(self.free_slots)
        victim = next(lora_id for lora_id in self.slots if lora_id not in keep)
        self.stats.num_slot_evictions += 1
        slot = self.slots.pop(victim)
        logger.debug("LoRA adapter %d leaves slot %d", victim, slot)
        return slot

    def _load_into_slot(self, request: LoRARequest, slot: int) -> None:
        # checked when its request was added; a request queued before its adapter was
        # removed still runs with it (read from its folder again if need be)
        adapter = self._cpu_model(request)
        pairs: dict[LoRALinear, list] = {layer: [None] * len(layer.shards)
                                         for layer in self.layers.values()}
        for module, pair in adapter.pairs.items():
            layer, shard = self._targets[module]
            pairs[layer][shard] = pair
        with torch.no_grad():
            for layer, layer_pairs in pairs.items():
                layer.set_slot(slot, layer_pairs)
        self.slots[request.lora_int_id] = slot
        self.stats.num_slot_loads += 1

    def _cpu_model(self, request: LoRARequest) -> LoRAModel:
        lora_id = request.lora_int_id
        adapter = self.cpu_cache.get(lora_id)
        if adapter is not None:
            self.cpu_cache.move_to_end(lora_id)
            return adapter
        adapter = load_peft_adapter(request.lora_path, lora_id, self.max_lora_rank)
        self._check_targets(adapter, request)
        self.stats.num_loads += 1
        self.cpu_cache[lora_id] = adapter
        while len(self.cpu_cache) > self.max_cpu_loras:
            self.cpu_cache.popitem(last=False)
            self.stats.num_cpu_evictions += 1
        return adapter

    def _check_targets(self, adapter: LoRAModel, request: LoRARequest) -> None:
        for module, pair in adapter.pairs.items():
            target = self._targets.get(module)
            if target is None:
                raise ValueError(f"LoRA adapter {request.lora_name!r}: module {module!r} is not "
                                 "a projection of this model")
            layer, shard = target
            size = layer.shards[shard][1]
            if pair.lora_a.shape[1] != layer.base.in_features or pair.lora_b.shape[0] != size:
                raise ValueError(
                    f"LoRA adapter {request.lora_name!r}: {module} has A "
                    f"{tuple(pair.lora_a.shape)} and B {tuple(pair.lora_b.shape)}, the model's "
                    f"projection is {layer.base.in_features} -> {size}")

    def get_stats(self) -> dict[str, int]:
        stats = self.stats
        stats.num_registered, stats.num_resident = len(self.registered), len(self.slots)
        stats.num_cpu_cached = len(self.cpu_cache)
        return asdict(stats)
