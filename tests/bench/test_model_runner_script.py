"""benchmarks/model_runner.py: the step and attention timings cover an 8-bit KV cache
(--kv-cache-dtype) as they do the model dtype's."""
from __future__ import annotations

from pathlib import Path

import pytest

import pagellm.attention.layer as attention_layer
from pagellm.attention import quantized_backend

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_an_8bit_cache_is_timed_like_the_model_dtype_s(kv_cache_dtype, monkeypatch):
    """Each decode row names its KV dtype, and the attention timer sees the backend that
    reads the cache (the 8-bit one's too: some time in it), put back afterwards."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import model_runner as bench

    backends = attention_layer.paged_attention, quantized_backend.paged_attention
    (row,) = bench.run("bfloat16", [2], 32, 0, 1, True, kv_cache_dtype=kv_cache_dtype)
    assert (row["kv_cache_dtype"], row["kind"], row["num_seqs"]) == (kv_cache_dtype, "decode", 2)
    assert row["attention_ms"] > 0 and row["step_ms"] > 0
    assert (attention_layer.paged_attention, quantized_backend.paged_attention) == backends
