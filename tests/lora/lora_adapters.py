"""The LoRA tests' adapters: three PEFT adapters of different ranks, targets and scalings,
and the transformers + peft reference model of one."""
from __future__ import annotations

from pathlib import Path

import torch
from helpers import load_hf_model

# name -> (lora_int_id, peft LoraConfig arguments)
ADAPTERS = {
    "all-r4": (1, dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj",
                                                          "o_proj", "gate_proj", "up_proj",
                                                          "down_proj"])),
    "qv-r8-rslora": (2, dict(r=8, lora_alpha=4, use_rslora=True,
                             target_modules=["q_proj", "v_proj"])),
    "mlp-r16-patterns": (3, dict(r=16, lora_alpha=32, target_modules=["o_proj", "gate_proj",
                                                                       "up_proj", "down_proj"],
                                 rank_pattern={"down_proj": 6},
                                 alpha_pattern={"gate_proj": 3})),
}
MAX_LORA_RANK = 16


def make_peft_adapter(base: Path, out: Path, seed: int, std: float = 0.15, **config) -> Path:
    """A PEFT adapter of the model in ``base`` with seeded random A and non-zero B (PEFT
    initialises B to zero, which would make the adapter a no-op)."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(load_hf_model(base), LoraConfig(task_type="CAUSAL_LM", **config))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * std)
    model.save_pretrained(out)
    return out


def peft_reference(base: Path, adapter: Path | None):
    """transformers with one adapter injected by peft (unmerged), or the plain base model."""
    model = load_hf_model(base)
    if adapter is None:
        return model
    from peft import PeftModel

    return PeftModel.from_pretrained(model, adapter).eval().base_model.model
