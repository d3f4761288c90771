"""The paged model path against transformers on the same weights (float32 unless stated).

Every test runs a batch of prompts of mixed lengths (1 to 300 tokens) together through
ModelRunner + KVCacheManager and demands transformers' prompt logits (1e-4) and its greedy
tokens, exactly, under every way of laying the KV cache out: block sizes, chunked prefill,
prefix-cache hits, sequences ending at block boundaries.
"""
from __future__ import annotations

import pytest
from conftest import MAX_NEW_TOKENS, VARIANTS
from helpers import random_prompts
from paged_greedy import PagedGreedy, run_greedy


def assert_greedy_matches(result, reference, prompts) -> None:
    for i, prompt in enumerate(prompts):
        expected, _ = reference.greedy(prompt)
        assert result.tokens[i] == expected, f"prompt {i} (length {len(prompt)})"


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prompt_logits_and_greedy_tokens_match_transformers(model_zoo, prompts, variant):
    path, reference = model_zoo(variant)
    result = run_greedy(path, prompts, MAX_NEW_TOKENS, record_prompt_logits=True)
    for i, prompt in enumerate(prompts):
        expected = reference.prompt_logits(prompt)
        assert result.prompt_logits[i].shape == expected.shape
        err = (result.prompt_logits[i] - expected).abs().max().item()
        assert err < 1e-4, f"prompt {i} (length {len(prompt)}): max abs error {err:.2e}"
    assert_greedy_matches(result, reference, prompts)
    # The test only means something if the tokens vary (see DESIGN: test models).
    assert min(len(set(tokens)) for tokens in result.tokens) >= 8


@pytest.mark.parametrize("block_size", [1, 8, 16, 32])
@pytest.mark.parametrize("variant", ["llama", "qwen3"])
def test_block_size_does_not_change_tokens(model_zoo, prompts, variant, block_size):
    path, reference = model_zoo(variant)
    result = run_greedy(path, prompts, MAX_NEW_TOKENS, block_size=block_size,
                        num_blocks=2048 // block_size * 4)
    assert_greedy_matches(result, reference, prompts)


@pytest.mark.parametrize("variant", ["llama", "mistral-sliding", "qwen2-tied"])
def test_chunked_prefill_of_7_tokens(model_zoo, prompts, variant):
    path, reference = model_zoo(variant)
    result = run_greedy(path, prompts, MAX_NEW_TOKENS, chunk_size=7, record_prompt_logits=True)
    assert result.num_steps >= 300 // 7
    for i, prompt in enumerate(prompts):
        err = (result.prompt_logits[i] - reference.prompt_logits(prompt)).abs().max().item()
        assert err < 1e-4, f"prompt {i}: max abs error {err:.2e}"
    assert_greedy_matches(result, reference, prompts)


@pytest.mark.parametrize("variant", ["llama", "qwen3"])
def test_shared_prefix_served_from_cached_blocks(model_zoo, variant):
    path, reference = model_zoo(variant)
    shared = random_prompts([70], seed=7)[0]
    first = random_prompts([90], seed=8, prefix=shared)
    later = random_prompts([71, 100, 140], seed=9, prefix=shared) + [shared[:64]]
    engine = PagedGreedy(path, block_size=16, prefix_caching=True)
    warm = engine.generate(first, MAX_NEW_TOKENS)
    assert warm.prefix_hits == [0]
    result = engine.generate(later, MAX_NEW_TOKENS, chunk_size=13)
    # 4 full blocks (64 tokens) of the shared 70-token prefix are cached; a prompt that is
    # exactly 64 cached tokens still recomputes its last block (3 blocks hit).
    assert result.prefix_hits == [64, 64, 64, 48]
    assert_greedy_matches(warm, reference, first)
    assert_greedy_matches(result, reference, later)


@pytest.mark.parametrize("block_size", [8, 16])
def test_sequences_ending_at_block_boundaries(model_zoo, block_size):
    """Prompts of exactly k blocks, one token short and one over; generation then crosses
    block boundaries at different steps for each sequence."""
    path, reference = model_zoo("llama")
    lengths = [block_size, 2 * block_size - 1, 2 * block_size, 2 * block_size + 1,
               4 * block_size]
    prompts = random_prompts(lengths, seed=11)
    result = run_greedy(path, prompts, MAX_NEW_TOKENS, block_size=block_size)
    assert_greedy_matches(result, reference, prompts)
    # A prompt that fills its blocks exactly: also as the only sequence, chunked at the
    # block size, so every chunk ends at a boundary.
    single = run_greedy(path, prompts[2:3], MAX_NEW_TOKENS, block_size=block_size,
                        chunk_size=block_size)
    assert_greedy_matches(single, reference, prompts[2:3])


@pytest.mark.parametrize("variant", ["llama", "mistral-sliding", "qwen3"])
def test_pure_torch_decode_path_matches_transformers(model_zoo, prompts, variant,
                                                     monkeypatch):
    """The same tokens where the compiled CPU kernel is unavailable (no compiler, float16,
    other devices): decodes then gather the context and run scaled_dot_product_attention."""
    from pagellm.attention import cpu_kernel

    monkeypatch.setattr(cpu_kernel, "supports", lambda query: False)
    path, reference = model_zoo(variant)
    assert_greedy_matches(run_greedy(path, prompts, MAX_NEW_TOKENS), reference, prompts)
