"""A tiny seeded random-weight Llama, built once per session, for the benchmark smoke tests."""
from __future__ import annotations

from pathlib import Path

import pytest

from pagellm.bench.random_model import TINY_LLAMA, build_random_model

# Short contexts keep the contiguous baseline's max-length reservations small.
BENCH_TINY = {**TINY_LLAMA, "max_position_embeddings": 256}


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return build_random_model(tmp_path_factory.mktemp("bench") / "tiny", seed=0, **BENCH_TINY)


@pytest.fixture(autouse=True)
def one_torch_thread():
    """One thread: on a busy shared machine, several spinning OpenMP threads per process slow
    every process down far more than they help (these tests measure nothing)."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
