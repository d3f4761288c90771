"""End-to-end: LLM.generate against transformers, and under memory pressure."""
from __future__ import annotations

import pytest

from pagellm import LLM, SamplingParams

from engine_helpers import ARCH_OVERRIDES, hf_greedy, make_prompts

GREEDY = dict(temperature=0.0, ignore_eos=True)


def _tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.mark.parametrize("arch", list(ARCH_OVERRIDES))
def test_greedy_matches_transformers(model_factory, arch):
    model_dir = model_factory(arch)
    prompts = make_prompts(5, [1, 37, 120, 16, 250], seed=3)
    llm = LLM(str(model_dir), block_size=16, kv_cache_memory_bytes=8 << 20, swap_space=0.01)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(max_tokens=24, **GREEDY), use_tqdm=False)
    expected = hf_greedy(model_dir, prompts, 24)
    assert _tokens(outputs) == expected
    assert all(len(set(t)) > 5 for t in expected), "the test model should not collapse"
    assert [o.request_id for o in outputs] == sorted((o.request_id for o in outputs), key=int)


def _pressure_run(model_dir, prompts, max_tokens, **engine_kwargs):
    llm = LLM(str(model_dir), block_size=4, max_model_len=96, swap_space=0.002,
              max_num_seqs=64, **engine_kwargs)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(max_tokens=max_tokens, **GREEDY), use_tqdm=False)
    return _tokens(outputs), llm.llm_engine


@pytest.mark.parametrize("prefix_caching", [False, True])
@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_memory_pressure_keeps_greedy_outputs(llama_dir, mode, prefix_caching):
    prompts = make_prompts(10, [22, 35, 9, 41, 28], seed=5, shared_prefix=12)
    max_tokens = 40
    roomy, _ = _pressure_run(llama_dir, prompts, max_tokens, num_gpu_blocks_override=1024,
                             enable_prefix_caching=prefix_caching)
    demand_blocks = sum(-(-(len(p) + max_tokens) // 4) for p in prompts)
    num_blocks = 26  # one max_model_len sequence (24 blocks) plus two
    assert demand_blocks >= 5 * num_blocks
    tight, engine = _pressure_run(llama_dir, prompts, max_tokens,
                                  num_gpu_blocks_override=num_blocks, preemption_mode=mode,
                                  enable_prefix_caching=prefix_caching)
    assert tight == roomy
    stats = engine.get_stats()
    assert stats.num_preemptions > 0
    if mode == "swap":
        assert stats.num_swap_outs > 0 and stats.num_swap_ins == stats.num_swap_outs
    else:
        assert stats.num_swap_outs == 0
    assert stats.num_free_blocks == stats.num_blocks
    assert stats.num_free_cpu_blocks == stats.num_cpu_blocks
    engine.kv.check_invariants()


def test_chunked_prefill_and_block_sizes_keep_outputs(llama_dir):
    prompts = make_prompts(4, [70, 5, 33, 129], seed=9)
    params = SamplingParams(max_tokens=16, **GREEDY)
    reference = None
    for block_size, budget in [(16, 8192), (1, 8192), (8, 13), (32, 40)]:
        llm = LLM(str(llama_dir), block_size=block_size, max_num_batched_tokens=budget,
                  num_gpu_blocks_override=4096 // block_size, max_model_len=512)
        tokens = _tokens(llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                      use_tqdm=False))
        reference = reference or tokens
        assert tokens == reference, (block_size, budget)


def test_generate_accepts_strings_and_per_prompt_params(llama_dir):
    llm = LLM(str(llama_dir), num_gpu_blocks_override=256, max_model_len=256)
    outs = llm.generate(["Explain how PagedAttention works", "大模型 🙂"],
                        [SamplingParams(max_tokens=3, **GREEDY),
                         SamplingParams(max_tokens=5, **GREEDY)], use_tqdm=True)
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 5]
    assert outs[0].prompt == "Explain how PagedAttention works"
    assert outs[0].outputs[0].finish_reason == "length"
    assert outs[0].metrics.first_token_time >= outs[0].metrics.arrival_time
    chat = llm.chat([{"role": "user", "content": "hello"}], SamplingParams(max_tokens=4),
                    use_tqdm=False)
    assert len(chat[0].outputs[0].token_ids) == 4


def test_chat_joins_text_parts_and_names_other_parts(llama_dir):
    """Content parts as OpenAI sends them: text parts joined by newlines (as vLLM joins them
    for a string-content template); any other part is a ValueError naming it (the template
    would fail on the list, or render it as Python)."""
    llm = LLM(str(llama_dir), num_gpu_blocks_override=64, max_model_len=256)
    params = SamplingParams(max_tokens=3, **GREEDY)
    parts = [{"role": "system", "content": "be brief"},
             {"role": "user", "content": [{"type": "text", "text": "hello"},
                                          {"type": "text", "text": "there"}]}]
    joined = [parts[0], {"role": "user", "content": "hello\nthere"}]
    a, b = (llm.chat(m, params, use_tqdm=False)[0] for m in (parts, joined))
    assert a.prompt_token_ids == b.prompt_token_ids
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    image = {"type": "image_url", "image_url": {"url": "http://x/cat.png"}}
    with pytest.raises(ValueError, match=r"messages\[1\]\.content\[1\] is type 'image_url': "
                                         "the model takes text only"):
        llm.chat([parts[0], {"role": "user", "content": [parts[1]["content"][0], image]}],
                 params, use_tqdm=False)
    with pytest.raises(ValueError, match=r"messages\[0\]\.content\[0\]\.text must be a string"):
        llm.chat([{"role": "user", "content": [{"type": "text", "text": 5}]}], params,
                 use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_bad_arguments_raise_clear_errors(llama_dir):
    with pytest.raises(ValueError, match="block_size"):
        LLM(str(llama_dir), block_size=0)
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not divide"):
        LLM(str(llama_dir), tensor_parallel_size=3)
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(str(llama_dir), num_gpu_blocks_override=2, block_size=16, max_model_len=512)
    with pytest.raises(TypeError, match="unknown engine arguments"):
        LLM(str(llama_dir), no_such_knob=1)
