"""The benchmarks size their KV budget from a GGUF file's metadata as from a config.json."""
from __future__ import annotations

import pytest

pytest.importorskip("gguf")

from gguf_models import TINY_GGUF, write_tiny_gguf

from pagellm.bench.memory_experiment import MemoryExperimentConfig, resolve_budget


def test_memory_budget_reads_a_gguf_file(tmp_path):
    path, _ = write_tiny_gguf(tmp_path, "Q8_0")
    budget = resolve_budget(MemoryExperimentConfig(model=str(path), dtype="bfloat16"))
    head_dim = TINY_GGUF["hidden_size"] // TINY_GGUF["num_attention_heads"]
    per_token = (2 * TINY_GGUF["num_hidden_layers"] * TINY_GGUF["num_key_value_heads"]
                 * head_dim * 2)
    assert budget.bytes_per_token == per_token
    assert budget.max_model_len == TINY_GGUF["max_position_embeddings"]
