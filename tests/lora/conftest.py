"""Fixtures of the LoRA tests: a tiny random Llama and three PEFT adapters of different ranks,
targets and scalings, built once per session, and transformers + peft references."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import hf_greedy, load_hf_model, make_tiny_model

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


@pytest.fixture(autouse=True, scope="package")
def one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def lora_zoo(tmp_path_factory) -> tuple[Path, dict[str, Path]]:
    """(base model folder, adapter name -> adapter folder)."""
    root = tmp_path_factory.mktemp("lora")
    base = make_tiny_model(root, "LlamaForCausalLM", seed=3)
    adapters = {name: make_peft_adapter(base, root / name, seed=10 + lora_id, **config)
                for name, (lora_id, config) in ADAPTERS.items()}
    return base, adapters


@pytest.fixture(scope="session")
def greedy_reference(lora_zoo):
    """reference(adapter name or None, prompt, n) -> transformers + peft greedy tokens."""
    base, adapters = lora_zoo
    models: dict = {}
    cache: dict = {}

    def get(name: str | None, prompt: list[int], max_new_tokens: int) -> list[int]:
        key = (name, tuple(prompt), max_new_tokens)
        if key not in cache:
            if name not in models:
                models[name] = peft_reference(base, None if name is None else adapters[name])
            cache[key] = hf_greedy(models[name], prompt, max_new_tokens)
        return cache[key]

    return get
