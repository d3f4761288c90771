"""Fixtures of the LoRA tests: a tiny random Llama and three PEFT adapters of different ranks,
targets and scalings, built once per session, and transformers + peft references."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import hf_greedy, make_tiny_model
from lora_adapters import ADAPTERS, make_peft_adapter, peft_reference


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
