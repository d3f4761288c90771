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
