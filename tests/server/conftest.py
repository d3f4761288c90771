"""Fixtures for the server tests: a tokenizer for the fake-engine tests, and a tiny seeded
random-weight model for the tests that start a real ``pagellm serve``."""
from __future__ import annotations

import pytest

from pagellm.bench.random_model import build_tokenizer


@pytest.fixture(scope="session")
def tokenizer():
    return build_tokenizer(512, seed=0)
