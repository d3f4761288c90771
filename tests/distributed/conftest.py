"""Fixtures for the tensor-parallel tests: tiny float32 models, and tensor-parallel engines
built once and shared by the tests that use the same settings (starting the worker
processes costs seconds).

One process holds one torch.distributed group at a time, so ``TensorParallelEngines`` keeps
at most one tensor-parallel engine alive: asking for other settings shuts the previous one
down first. Tests that share settings sit next to each other in their file.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import make_tiny_model

from pagellm import LLM

# name -> (architecture, config overrides): each covers a different way of splitting
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    # one KV head for two ranks (replicated); biases on every projection (row-parallel ones
    # add theirs once, after the all-reduce)
    "llama": ("LlamaForCausalLM", {"num_key_value_heads": 1, "attention_bias": True,
                                   "mlp_bias": True}),
    # q/k/v biases, tied embeddings (the LM head shares the embedding's vocabulary shard)
    "qwen2": ("Qwen2ForCausalLM", {}),
    # per-head q/k norm; a vocabulary that does not split evenly (509 = 255 + 254 rows)
    "qwen3": ("Qwen3ForCausalLM", {"vocab_size": 509}),
}
BASE_KWARGS = dict(dtype="float32", max_model_len=256, swap_space=0.05, seed=0,
                   kv_cache_memory_bytes=8 << 20)


@pytest.fixture(autouse=True, scope="package")
def one_thread():
    """Every rank on one thread (the workers take the driver's count): two ranks on a
    2-core machine, no oversubscription."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    built: dict[str, Path] = {}
    root = tmp_path_factory.mktemp("tp_models")

    def get(name: str) -> Path:
        if name not in built:
            arch, overrides = MODELS[name]
            built[name] = make_tiny_model(root, arch, name=name, **overrides)
        return built[name]

    return get


class TensorParallelEngines:
    """``get(model, tp, **kwargs)`` -> an LLM, cached by its settings; at most one with
    tensor_parallel_size > 1 alive at a time."""

    def __init__(self, tiny_models) -> None:
        self.tiny_models = tiny_models
        self.single: dict[tuple, LLM] = {}
        self.parallel_key: tuple | None = None
        self.parallel: LLM | None = None

    def get(self, model: str, tp: int = 1, **kwargs: Any) -> LLM:
        key = (model, tp, tuple(sorted(kwargs.items())))
        settings = {**BASE_KWARGS, **kwargs, "tensor_parallel_size": tp}
        if tp == 1:
            if key not in self.single:
                self.single[key] = LLM(str(self.tiny_models(model)), **settings)
            return self.single[key]
        if key != self.parallel_key:
            self.close()
            self.parallel = LLM(str(self.tiny_models(model)), **settings)
            self.parallel_key = key
        return self.parallel

    def close(self) -> None:
        if self.parallel is not None:
            self.parallel.shutdown()
        self.parallel, self.parallel_key = None, None


@pytest.fixture(scope="session")
def engines(tiny_models):
    manager = TensorParallelEngines(tiny_models)
    yield manager
    manager.close()
