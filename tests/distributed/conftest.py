"""Fixtures for the tensor-parallel tests: tiny float32 models, and tensor-parallel engines
built once and shared by the tests that use the same settings (starting the worker
processes costs seconds).

One process holds one torch.distributed group at a time, so ``TensorParallelEngines`` keeps
at most one tensor-parallel engine alive: asking for other settings shuts the previous one
down first. Tests that share settings sit next to each other in their file.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import make_tiny_model
from tp_engines import MODELS, TensorParallelEngines


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


@pytest.fixture(scope="module")
def engines(tiny_models):
    """Closed at the end of each module: no worker process outlives the tests that use it."""
    manager = TensorParallelEngines(tiny_models)
    yield manager
    manager.close()
