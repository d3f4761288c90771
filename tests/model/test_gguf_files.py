"""GGUF loading on tiny files written with gguf.GGUFWriter: every supported tensor type
dequantizes to what ``gguf`` itself reads from the bytes, the q/k row order is undone, the
metadata becomes the right config, and bad files fail with errors naming what is wrong."""
from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("gguf")

from gguf_models import TINY_GGUF, llama_cpp_permute, llama_cpp_unpermute, write_tiny_gguf
from helpers import hf_greedy, make_tokenizer

from pagellm.model.gguf_loader import SUPPORTED_TENSOR_TYPES, unpermute_qk
from pagellm.model.loader import load_config, load_model, resolve_model_path


def _fused_expected(expected: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """The engine's parameter names: q/k/v and gate/up fused (see packed_modules_mapping)."""
    out: dict[str, torch.Tensor] = {}
    for name, value in expected.items():
        prefix, _, leaf = name.rpartition(".")
        if prefix.endswith(("k_proj", "v_proj", "up_proj")):
            continue
        if prefix.endswith("q_proj"):
            base = prefix[:-len("q_proj")]
            parts = [expected[f"{base}{p}.{leaf}"] for p in ("q_proj", "k_proj", "v_proj")]
            out[f"{base}qkv_proj.{leaf}"] = torch.from_numpy(np.concatenate(parts))
        elif prefix.endswith("gate_proj"):
            base = prefix[:-len("gate_proj")]
            parts = [expected[f"{base}{p}.{leaf}"] for p in ("gate_proj", "up_proj")]
            out[f"{base}gate_up_proj.{leaf}"] = torch.from_numpy(np.concatenate(parts))
        else:
            out[name] = torch.from_numpy(np.ascontiguousarray(value))
    return out


@pytest.mark.parametrize("type_name", SUPPORTED_TENSOR_TYPES)
def test_each_tensor_type_loads_as_gguf_dequantizes_it(tmp_path, type_name):
    path, expected = write_tiny_gguf(tmp_path, type_name)
    model, config = load_model(path, dtype=torch.float32, pack_weights=False)
    params = dict(model.named_parameters())
    for name, value in _fused_expected(expected).items():
        assert torch.equal(params[name], value.float()), name
    assert set(params) == set(_fused_expected(expected))
    assert config.architectures == ["LlamaForCausalLM"]


def test_unpermute_inverts_llama_cpp_order():
    weight = np.arange(8 * 2 * 3, dtype=np.float32).reshape(16, 3)
    stored = llama_cpp_permute(weight, 2)
    assert not np.array_equal(stored, weight)
    assert np.array_equal(unpermute_qk(torch.from_numpy(stored), 2).numpy(), weight)
    assert np.array_equal(llama_cpp_unpermute(stored, 2), weight)
    bias = np.arange(16, dtype=np.float32)
    assert np.array_equal(unpermute_qk(torch.from_numpy(llama_cpp_permute(bias, 4)), 4).numpy(),
                          bias)


def test_metadata_becomes_the_config(tmp_path):
    path, _ = write_tiny_gguf(tmp_path, "Q8_0")
    config = load_config(path)
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "vocab_size", "max_position_embeddings"):
        assert getattr(config, key) == TINY_GGUF[key], key
    assert config.head_dim == 64
    assert config.rope_parameters["rope_theta"] == TINY_GGUF["rope_theta"]
    assert config.tie_word_embeddings is False
    assert (config.bos_token_id, config.eos_token_id) == (0, 1)
    assert resolve_model_path(str(path)) == path


def _llama3_rope_divisors(head_dim: int, theta: float, factor: float) -> np.ndarray:
    """What llama.cpp's converter writes as rope_freqs for Llama 3.1's rope scaling."""
    divisors = []
    for freq in 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim):
        wavelen = 2 * np.pi / freq
        if wavelen < 8192 / 4:
            divisors.append(1.0)
        elif wavelen > 8192 / 1:
            divisors.append(factor)
        else:
            smooth = (8192 / wavelen - 1) / (4 - 1)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(divisors, dtype=np.float32)


def test_baked_llama3_rope_scaling_is_recovered(tmp_path):
    divisors = _llama3_rope_divisors(64, 500000.0, 32.0)
    path, _ = write_tiny_gguf(tmp_path, "F16", rope_theta=500000.0,
                              max_position_embeddings=131072, rope_freqs=divisors)
    rope = load_config(path).rope_parameters
    assert rope["rope_type"] == "llama3" and rope["factor"] == 32.0
    assert rope["original_max_position_embeddings"] == 8192
    load_model(path, pack_weights=False)  # the rope_freqs tensor is no weight of the model
    bad, _ = write_tiny_gguf(tmp_path, "F16", name="bad.gguf", rope_freqs=divisors[::-1])
    with pytest.raises(ValueError, match="rope_freqs"):
        load_config(bad)


def test_tiny_gguf_matches_transformers_on_the_same_file(tmp_path):
    """The whole path (config, q/k order, tokenizer override) against transformers' GGUF
    loader: same greedy tokens in float32."""
    from transformers import AutoModelForCausalLM

    from pagellm import LLM, SamplingParams

    path, _ = write_tiny_gguf(tmp_path, "Q8_0", hidden_size=128, intermediate_size=256,
                              num_attention_heads=4, num_key_value_heads=2)
    tokenizer_dir = tmp_path / "tokenizer"
    make_tokenizer(512).save_pretrained(tokenizer_dir)
    llm = LLM(str(path), tokenizer=str(tokenizer_dir), dtype="float32",
              num_gpu_blocks_override=64, max_model_len=256, swap_space=0.01)
    prompts = [[0, 5, 77, 300, 12, 9, 41], [0, 400, 3] * 7]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
                           use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name,
                                              dtype=torch.float32).eval()
    expected = [hf_greedy(hf, p, 16) for p in prompts]
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected
    assert len(set(expected[0])) > 3, "the test model should not collapse"


def test_unsupported_type_and_architecture_are_named(tmp_path):
    import gguf

    path, _ = write_tiny_gguf(tmp_path, "F32")
    reader_types = [t for t in gguf.GGMLQuantizationType if t.name not in SUPPORTED_TENSOR_TYPES]
    assert reader_types  # e.g. IQ2_XXS
    bad = tmp_path / "iq.gguf"
    writer = gguf.GGUFWriter(str(bad), "llama")
    writer.add_block_count(1)
    writer.add_embedding_length(256)
    writer.add_head_count(4)
    writer.add_tensor("token_embd.weight", np.zeros((4, 256 // 256 * 66), dtype=np.uint8),
                      raw_dtype=gguf.GGMLQuantizationType.IQ2_XXS)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"IQ2_XXS.*supported types: F32, F16"):
        load_model(bad, pack_weights=False)

    other = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(other), "gpt2")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"'gpt2' is not supported.*llama, qwen2, qwen3"):
        load_config(other)


def test_missing_or_wrong_files_are_clear(tmp_path):
    from pagellm.model.loader import ModelNotFoundError

    with pytest.raises(ModelNotFoundError, match="does not exist"):
        resolve_model_path(str(tmp_path / "nothing.gguf"))
    text = tmp_path / "weights.bin"
    text.write_bytes(b"x")
    with pytest.raises(ModelNotFoundError, match="not a GGUF file"):
        resolve_model_path(str(text))
