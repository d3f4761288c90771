"""KV memory model, capacity planning and size parsing (the kv-calc figures)."""
from __future__ import annotations

import json

import pytest

from pagellm.kv import PRESETS, KVMemoryModel, format_bytes, parse_size
from pagellm.kv.memory import dtype_bytes

MiB, GiB = 1024**2, 1024**3


def test_llama_2_70b_grouped_query_figures():
    model = KVMemoryModel.from_preset("llama-2-70b", "float16")
    assert (model.num_layers, model.num_attention_heads, model.num_kv_heads, model.head_dim) == \
        (80, 64, 8, 128)
    assert model.bytes_per_token == 327_680 == 0.3125 * MiB
    assert model.bytes_per_token_if_mha == 2_621_440 == 2.5 * MiB
    assert model.bytes_for(32, 2048) == 21_474_836_480 == 20 * GiB
    assert 32 * 2048 * model.bytes_per_token_if_mha == 160 * GiB


@pytest.mark.parametrize("preset, dtype, layers, kv_heads, head_dim, per_token", [
    ("llama-2-7b", "float16", 32, 32, 128, 524_288),
    ("llama-2-70b", "float16", 80, 8, 128, 327_680),
    ("llama-3-8b", "bfloat16", 32, 8, 128, 131_072),
    ("mistral-7b", "bfloat16", 32, 8, 128, 131_072),
    ("qwen2-7b", "bfloat16", 28, 4, 128, 57_344),
])
def test_presets(preset, dtype, layers, kv_heads, head_dim, per_token):
    model = KVMemoryModel.from_preset(preset)  # dtype "auto": as published
    assert model.dtype == dtype
    assert (model.num_layers, model.num_kv_heads, model.head_dim) == (layers, kv_heads, head_dim)
    assert model.bytes_per_token == per_token
    assert KVMemoryModel.from_preset(preset, "float32").bytes_per_token == 2 * per_token


def test_config_parsing_defaults_and_explicit_head_dim(tmp_path):
    mha = {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64}
    model = KVMemoryModel.from_hf_config(mha)
    assert (model.num_kv_heads, model.head_dim, model.dtype) == (4, 16, "float16")
    assert not model.is_grouped_query
    explicit = {**mha, "num_key_value_heads": 2, "head_dim": 32, "torch_dtype": "bfloat16"}
    model = KVMemoryModel.from_hf_config(explicit)
    assert (model.num_kv_heads, model.head_dim, model.dtype) == (2, 32, "bfloat16")
    assert model.bytes_per_token == 2 * 2 * 2 * 32 * 2

    (tmp_path / "config.json").write_text(json.dumps(explicit))
    assert KVMemoryModel.from_model_dir(tmp_path, "fp32").bytes_per_token == 2 * 2 * 2 * 32 * 4
    assert KVMemoryModel.from_config_file(tmp_path / "config.json") == \
        KVMemoryModel.from_model_dir(tmp_path)
    nested = {"text_config": explicit, "torch_dtype": "float32"}
    assert KVMemoryModel.from_hf_config(nested).dtype == "float32"


def test_config_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        KVMemoryModel.from_model_dir(tmp_path)
    with pytest.raises(FileNotFoundError):
        KVMemoryModel.from_config_file(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="num_hidden_layers"):
        KVMemoryModel.from_hf_config({"num_attention_heads": 4})
    with pytest.raises(ValueError, match="multiple"):
        KVMemoryModel.from_hf_config({"num_hidden_layers": 1, "num_attention_heads": 6,
                                      "num_key_value_heads": 4, "hidden_size": 48})
    with pytest.raises(ValueError, match="unknown preset"):
        KVMemoryModel.from_preset("gpt-5")
    with pytest.raises(ValueError, match="unknown KV cache dtype"):
        KVMemoryModel.from_preset("llama-2-7b", "float12")


def test_dtypes():
    assert [dtype_bytes(d) for d in ("float32", "fp16", "bf16", "torch.bfloat16", "fp8")] == \
        [4, 2, 2, 2, 1]


def test_capacity():
    model = KVMemoryModel.from_preset("llama-2-70b", "float16")
    cap = model.capacity(40 * GiB, block_size=16, seq_len=2048)
    assert cap.bytes_per_block == 5 * MiB
    assert (cap.num_blocks, cap.num_tokens, cap.blocks_per_seq, cap.max_concurrency) == \
        (8192, 131_072, 128, 64)
    odd = model.capacity(40 * GiB, block_size=16, seq_len=2049)  # one token more: one block more
    assert (odd.blocks_per_seq, odd.max_concurrency) == (129, 63)
    assert model.capacity(5 * MiB - 1).num_blocks == 0  # a partial block holds nothing
    assert model.capacity(GiB).seq_len == 4096  # defaults to the model's context length


@pytest.mark.parametrize("text, size", [
    ("40GiB", 40 * GiB), ("40 GiB", 40 * GiB), ("1.5GiB", 3 * GiB // 2), ("40G", 40 * GiB),
    ("512MiB", 512 * MiB), ("512MB", 512 * 10**6), ("2tb", 2 * 10**12), ("1024", 1024),
    ("8KiB", 8192), ("100B", 100), (4096, 4096),
])
def test_parse_size(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "GiB", "40 GiBs", "-1GiB", "0", "1e3", "forty"])
def test_parse_size_errors(text):
    with pytest.raises(ValueError, match="size"):
        parse_size(text)


def test_format_bytes():
    assert format_bytes(327_680) == "320 KiB"
    assert format_bytes(327_680, "MiB") == "0.3125 MiB"
    assert format_bytes(2.5 * MiB) == "2.5 MiB"
    assert format_bytes(160 * GiB) == "160 GiB"
    assert format_bytes(1023) == "1,023 bytes"
    assert set(PRESETS) >= {"llama-2-7b", "llama-2-70b", "llama-3-8b", "mistral-7b", "qwen2-7b"}
