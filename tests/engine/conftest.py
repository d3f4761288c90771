"""Shared fixtures: tiny seeded random-weight models, built once per session."""
from __future__ import annotations

from pathlib import Path

import pytest
from engine_helpers import ARCH_OVERRIDES

from pagellm.bench.random_model import build_random_model


@pytest.fixture(scope="session")
def model_factory(tmp_path_factory):
    built: dict[str, Path] = {}

    def get(arch: str = "LlamaForCausalLM") -> Path:
        if arch not in built:
            out = tmp_path_factory.mktemp(arch)
            built[arch] = build_random_model(out / "model", arch, seed=1, **ARCH_OVERRIDES[arch])
        return built[arch]

    return get


@pytest.fixture(scope="session")
def llama_dir(model_factory) -> Path:
    return model_factory("LlamaForCausalLM")
