"""Loading a PEFT LoRA adapter folder into per-module low-rank pairs, checked against the
base model.

A PEFT checkpoint names each trained pair after the module it adapts
(``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``, A: [r, in] and
``...lora_B.weight``, B: [out, r]); the update of that module is
``y += scaling * (x @ A^T) @ B^T`` with ``scaling = lora_alpha / r`` (``lora_alpha / sqrt(r)``
with rsLoRA). The scaling is folded into B here, once, so that a step multiplies only.

Supported: the attention and MLP projections (q/k/v/o, gate/up/down) of the decoder, with
per-module ranks and alphas (``rank_pattern``, ``alpha_pattern``). Everything else an adapter
may carry (embeddings, lm_head, ``modules_to_save`` copies, DoRA magnitudes, LoRA biases) would
change the model in ways the batched layers do not apply, so it is refused with an error
naming it, never silently dropped.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
SUPPORTED_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<kind>[AB])"
                  r"(?:\.[^.]+)?\.weight$")


@dataclass(slots=True)
class LoRAPair:
    """One adapted module: ``lora_a`` [rank, in_features], ``lora_b`` [out_features, rank]
    with the scaling already multiplied in (float32, on the CPU)."""

    lora_a: torch.Tensor
    lora_b: torch.Tensor

    @property
    def rank(self) -> int:
        return self.lora_a.shape[0]


@dataclass(slots=True)
class LoRAModel:
    """A loaded adapter: ``pairs`` maps a checkpoint module name (``model.layers.0.self_attn.
    q_proj``) to its pair."""

    lora_int_id: int
    pairs: dict[str, LoRAPair]

    @property
    def rank(self) -> int:
        return max(pair.rank for pair in self.pairs.values())


def load_peft_adapter(path: str | Path, lora_int_id: int, max_lora_rank: int) -> LoRAModel:
    """Read and check an adapter folder; ValueError naming what is missing or unsupported."""
    folder = Path(path)
    config_path, weights_path = folder / CONFIG_FILE, folder / WEIGHTS_FILE
    if not config_path.is_file():
        raise ValueError(f"LoRA adapter {str(path)!r}: no {CONFIG_FILE} (a PEFT adapter folder "
                         f"holds {CONFIG_FILE} and {WEIGHTS_FILE})")
    if not weights_path.is_file():
        raise ValueError(f"LoRA adapter {str(path)!r}: no {WEIGHTS_FILE} (only safetensors "
                         "adapters are loaded)")
    config = json.loads(config_path.read_text())
    check_adapter_config(config, str(path))
    from safetensors.torch import load_file

    tensors = load_file(str(weights_path))
    pairs = _pairs(tensors, str(path))
    scaled = {}
    for module, (a, b) in pairs.items():
        rank = a.shape[0]
        if b.shape[1] != rank:
            raise ValueError(f"LoRA adapter {str(path)!r}: {module} has lora_A of rank {rank} "
                             f"but lora_B of shape {tuple(b.shape)}")
        if rank > max_lora_rank:
            raise ValueError(f"LoRA adapter {str(path)!r}: {module} has rank {rank}, above "
                             f"max_lora_rank={max_lora_rank}")
        scale = _scaling(config, module, rank)
        scaled[module] = LoRAPair(a.float().contiguous(), (b.float() * scale).contiguous())
    return LoRAModel(lora_int_id, scaled)


def check_adapter_config(config: dict[str, Any], where: str) -> None:
    """Refuse what the batched layers cannot apply."""
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise ValueError(f"LoRA adapter {where!r}: peft_type={peft_type!r} is not supported "
                         "(only 'LORA')")
    if config.get("use_dora"):
        raise ValueError(f"LoRA adapter {where!r}: use_dora=True (DoRA) is not supported")
    if config.get("modules_to_save"):
        raise ValueError(f"LoRA adapter {where!r}: modules_to_save="
                         f"{config['modules_to_save']!r} is not supported (only LoRA pairs on "
                         f"{', '.join(SUPPORTED_TARGETS)})")
    if config.get("bias", "none") != "none" or config.get("lora_bias"):
        raise ValueError(f"LoRA adapter {where!r}: trained biases (bias="
                         f"{config.get('bias')!r}, lora_bias={config.get('lora_bias')!r}) are "
                         "not supported")
    targets = config.get("target_modules")
    if isinstance(targets, list):
        unsupported = sorted(set(targets) - set(SUPPORTED_TARGETS))
        if unsupported:
            raise ValueError(f"LoRA adapter {where!r}: target_modules {unsupported} not "
                             f"supported (supported: {', '.join(SUPPORTED_TARGETS)})")
    if config.get("fan_in_fan_out"):
        raise ValueError(f"LoRA adapter {where!r}: fan_in_fan_out=True (Conv1D layers) is "
                         "not supported")


def _pairs(tensors: dict[str, torch.Tensor], where: str
           ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    found: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None:
            raise ValueError(f"LoRA adapter {where!r}: tensor {key!r} is not a LoRA pair "
                             f"weight (supported targets: {', '.join(SUPPORTED_TARGETS)})")
        module = match["module"]
        target = module.rsplit(".", 1)[-1]
        if target not in SUPPORTED_TARGETS or ".layers." not in f".{module}":
            raise ValueError(f"LoRA adapter {where!r}: target module {module!r} is not "
                             f"supported (supported: {', '.join(SUPPORTED_TARGETS)} of the "
                             "decoder layers)")
        found.setdefault(module, {})[match["kind"]] = tensor
    if not found:
        raise ValueError(f"LoRA adapter {where!r}: {WEIGHTS_FILE} holds no LoRA weights")
    for module, pair in found.items():
        if set(pair) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {where!r}: {module} has lora_{''.join(pair)} "
                             "without its other half")
    return {module: (pair["A"], pair["B"]) for module, pair in found.items()}


def _pattern_value(patterns: dict[str, Any], module: str) -> Any:
    """PEFT's rule: a pattern key matches a module name it ends (whole dotted parts)."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return None


def _scaling(config: dict[str, Any], module: str, rank: int) -> float:
    alpha = _pattern_value(config.get("alpha_pattern"), module)
    if alpha is None:
        alpha = config.get("lora_alpha", 8)
    if config.get("use_rslora"):
        return alpha / math.sqrt(rank)
    return alpha / rank
