"""Loading: local folders, sharded safetensors, hub ids offline, dtypes, refused pickles,
unknown architectures, incomplete checkpoints, and the tokenizer."""
from __future__ import annotations

import json

import pytest
import torch
from helpers import load_hf_model, make_tiny_model, random_prompts, tiny_config
from safetensors.torch import load_file, save_file

from pagellm.model import (
    ModelNotFoundError,
    get_tokenizer,
    load_model,
    resolve_dtype,
    resolve_model_path,
)
from pagellm.model.registry import supported_architectures
from pagellm.worker.cache_engine import CacheEngine
from pagellm.worker.model_runner import ModelRunner, ScheduledSeq


def prompt_logits(path, prompt, **load_kwargs) -> torch.Tensor:
    """Logits of every prompt position: load_model, then one step over a fresh cache."""
    model, config = load_model(path, **load_kwargs)
    num_blocks = -(-len(prompt) // 16)
    runner = ModelRunner(model, CacheEngine(config, num_blocks, 0, 16, torch.float32, "cpu"),
                         "cpu")
    return runner.execute([ScheduledSeq(prompt, 0, len(prompt), list(range(num_blocks)),
                                        need_logits=True, need_prompt_logits=True)])


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("loader"), "LlamaForCausalLM", seed=5)


def test_sharded_safetensors_load_like_a_single_file(tmp_path, llama_path):
    sharded = make_tiny_model(tmp_path, "LlamaForCausalLM", seed=5, max_shard_size="60KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    prompt = random_prompts([25], seed=2)[0]
    torch.testing.assert_close(prompt_logits(sharded, prompt), prompt_logits(llama_path, prompt),
                               atol=0, rtol=0)
    expected = load_hf_model(llama_path)(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(prompt_logits(sharded, prompt), expected, atol=1e-4, rtol=0)


def test_bfloat16_load_keeps_rotary_frequencies_in_float32(llama_path):
    model, _ = load_model(llama_path, dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32
    assert torch.get_default_dtype() == torch.float32  # restored after construction


def test_unknown_architecture_lists_the_supported_ones(tmp_path, llama_path):
    config = json.loads((llama_path / "config.json").read_text())
    config["architectures"] = ["FancyNewForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").write_bytes((llama_path / "model.safetensors").read_bytes())
    with pytest.raises(ValueError, match="FancyNewForCausalLM") as error:
        load_model(tmp_path)
    for name in supported_architectures():
        assert name in str(error.value)
    assert set(supported_architectures()) == {"LlamaForCausalLM", "MistralForCausalLM",
                                              "Qwen2ForCausalLM", "Qwen3ForCausalLM"}


def test_pickled_bin_weights_are_refused_unless_allowed(tmp_path, llama_path):
    (tmp_path / "config.json").write_text((llama_path / "config.json").read_text())
    torch.save(load_file(llama_path / "model.safetensors"), tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match="pickled weights.*allow_pickle=True"):
        load_model(tmp_path)
    prompt = random_prompts([9], seed=3)[0]
    torch.testing.assert_close(prompt_logits(tmp_path, prompt, allow_pickle=True),
                               prompt_logits(llama_path, prompt), atol=0, rtol=0)


def test_incomplete_or_foreign_checkpoints_are_rejected(tmp_path, llama_path):
    (tmp_path / "config.json").write_text((llama_path / "config.json").read_text())
    tensors = load_file(llama_path / "model.safetensors")
    missing = dict(tensors)
    del missing["model.layers.1.self_attn.k_proj.weight"]
    save_file(missing, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="lacks tensors.*layers.1.self_attn.qkv_proj.weight"):
        load_model(tmp_path)
    save_file({**tensors, "model.layers.0.mystery.weight": torch.zeros(2)},
              tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="mystery.weight"):
        load_model(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(ModelNotFoundError, match="no weights"):
        load_model(tmp_path)


def test_missing_folders_and_offline_hub_ids_name_the_model(tmp_path, monkeypatch):
    from huggingface_hub import constants

    with pytest.raises(ModelNotFoundError, match="does not exist"):
        resolve_model_path(str(tmp_path / "nowhere"))
    with pytest.raises(ModelNotFoundError, match="has no config.json"):
        resolve_model_path(tmp_path)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    with pytest.raises(ModelNotFoundError,
                       match="could not fetch model 'acme/tiny-model'.*local folder"):
        resolve_model_path("acme/tiny-model")
    with pytest.raises(ModelNotFoundError, match="downloads are off"):
        resolve_model_path("acme/tiny-model", allow_download=False)


def test_resolve_dtype():
    config = tiny_config("LlamaForCausalLM")
    for config_dtype, cpu, cuda in [("bfloat16", torch.bfloat16, torch.bfloat16),
                                    ("float16", torch.bfloat16, torch.float16),
                                    ("float32", torch.float32, torch.float32),
                                    (None, torch.float32, torch.float32)]:
        config.dtype = config_dtype
        assert resolve_dtype("auto", config, "cpu") == cpu
        assert resolve_dtype("auto", config, "cuda") == cuda
    assert resolve_dtype("float16", config, "cpu") == torch.float16
    assert resolve_dtype(torch.bfloat16, config, "cpu") == torch.bfloat16
    with pytest.raises(ValueError, match="'fp8'.*float32"):
        resolve_dtype("fp8", config, "cpu")


def test_tokenizer_loads_with_its_chat_template(llama_path):
    tokenizer = get_tokenizer(llama_path)
    ids = tokenizer("Hello world").input_ids
    assert ids[0] == tokenizer.bos_token_id == 0 and tokenizer.eos_token_id == 1
    assert tokenizer.decode(ids, skip_special_tokens=True) == "Hello world"
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert chat == "<|user|>\nHi</s>\n<|assistant|>\n"
    assert len(tokenizer) == 512
