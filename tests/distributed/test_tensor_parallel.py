"""Tensor parallelism over two worker ranks on the CPU (gloo): the same greedy tokens as one
rank, logprobs within 1e-4 (the all-reduces sum in another order), for every way a model is
split (replicated KV heads, biases, tied embeddings, q/k norm, an uneven vocabulary), under
memory pressure (swap and recompute), with prefix caching and with n > 1."""
from __future__ import annotations

import pytest
from helpers import random_prompts
from tp_engines import (LOGPROB_TOLERANCE, MAX_TOKENS, assert_same_outputs, greedy,
                        prompts)

from pagellm import SamplingParams

# The Llama engine's KV cache is too small for its batches: 20 blocks of 16 tokens for four
# sequences growing to ~150 tokens, so sequences are preempted and come back.
PRESSURE = dict(num_gpu_blocks_override=20, block_size=16, max_num_seqs=4)
LLAMA = dict(preemption_mode="swap", **PRESSURE)


def check_greedy(engines, model: str, **kwargs) -> None:
    params = greedy(logprobs=5)
    expected = engines.get(model).generate(prompts(), params, use_tqdm=False)
    actual = engines.get(model, tp=2, **kwargs).generate(prompts(), params, use_tqdm=False)
    assert_same_outputs(expected, actual)
    # the tokens vary: a broken shard would change them
    assert len(set(expected[-1].outputs[0].token_ids)) > MAX_TOKENS // 3


def test_llama_greedy_tokens_and_logprobs_match_one_rank(engines):
    check_greedy(engines, "llama", **LLAMA)


def pressure_batch() -> list[dict]:
    return [{"prompt_token_ids": p}
            for p in random_prompts([100, 90, 110, 70], vocab_size=512, seed=3)]


def check_pressure(engines, mode: str) -> None:
    params = greedy(max_tokens=40)
    expected = engines.get("llama").generate(pressure_batch(), params, use_tqdm=False)
    llm = engines.get("llama", tp=2, **{**LLAMA, "preemption_mode": mode})
    actual = llm.generate(pressure_batch(), params, use_tqdm=False)
    assert_same_outputs(expected, actual)
    stats = llm.llm_engine.get_stats()
    assert stats.num_preemptions > 0
    assert (stats.num_swap_outs > 0) == (mode == "swap")


def test_memory_pressure_with_swap_gives_the_same_tokens(engines):
    check_pressure(engines, "swap")


def test_prefix_caching_and_n_greater_than_one(engines):
    prefix = random_prompts([48], vocab_size=512, seed=5)[0]
    batch = [{"prompt_token_ids": p}
             for p in random_prompts([60, 70, 80], vocab_size=512, seed=6, prefix=prefix)]
    params = greedy()
    sampled = SamplingParams(n=3, temperature=0.9, seed=11, max_tokens=16, ignore_eos=True)
    single, parallel = engines.get("llama"), engines.get("llama", tp=2, **LLAMA)
    hits_before = parallel.llm_engine.get_stats().prefix_cache_hits
    for _ in range(2):  # the second round reads the prefix from the cache
        assert_same_outputs(single.generate(batch, params, use_tqdm=False),
                            parallel.generate(batch, params, use_tqdm=False))
    assert parallel.llm_engine.get_stats().prefix_cache_hits - hits_before >= 48
    expected = single.generate(batch[:2], sampled, use_tqdm=False)
    actual = parallel.generate(batch[:2], sampled, use_tqdm=False)
    assert_same_outputs(expected, actual)
    assert len({tuple(c.token_ids) for c in actual[0].outputs}) == 3


def test_a_plan_every_rank_refuses_fails_that_step_only(engines):
    from pagellm.core.plan import ScheduledSequence, SchedulerOutput

    llm = engines.get("llama", tp=2, **LLAMA)
    bad = SchedulerOutput([ScheduledSequence("bad", [5, 6, 7], 0, 3, [10**6], True,
                                             params=SamplingParams(), sample_ids=("bad",))])
    with pytest.raises(ValueError, match="outside the cache's 20 blocks"):
        llm.llm_engine.worker.execute_model(bad)  # the same error on both ranks
    assert llm.llm_engine.worker.dead is None
    expected = engines.get("llama").generate(prompts()[:2], greedy(), use_tqdm=False)
    assert_same_outputs(expected, llm.generate(prompts()[:2], greedy(), use_tqdm=False))


@pytest.mark.parametrize("model", ["qwen2", "qwen3"])
def test_greedy_tokens_and_logprobs_match_one_rank(engines, model):
    check_greedy(engines, model)


def test_prompt_logprobs_match_one_rank(engines):
    params = greedy(max_tokens=4, prompt_logprobs=3)
    expected = engines.get("qwen3").generate(prompts()[2:3], params, use_tqdm=False)[0]
    actual = engines.get("qwen3", tp=2).generate(prompts()[2:3], params, use_tqdm=False)[0]
    assert len(actual.prompt_logprobs) == len(expected.prompt_logprobs) == 40
    for exp_row, act_row in zip(expected.prompt_logprobs[1:], actual.prompt_logprobs[1:]):
        for token, value in exp_row.items():
            assert act_row[token].logprob == pytest.approx(value.logprob,
                                                           abs=LOGPROB_TOLERANCE)


def test_memory_pressure_with_recompute_gives_the_same_tokens(engines):
    check_pressure(engines, "recompute")


def test_structured_outputs_sample_on_the_driver(engines):
    """A JSON-schema request under tensor parallelism: the driver's grammar masks steer the
    sampling exactly as on one rank (sampled at temperature 1, seeded), and the text
    parses."""
    import json

    from pagellm.structured_outputs import StructuredOutputsParams

    schema = {"type": "object", "properties": {"n": {"type": "integer"},
                                               "ok": {"type": "boolean"}},
              "required": ["n", "ok"], "additionalProperties": False}
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=64,
                            structured_outputs=StructuredOutputsParams(json=schema))
    batch = [{"prompt_token_ids": p} for p in random_prompts([20, 30], vocab_size=512, seed=9)]
    expected = engines.get("llama").generate(batch, params, use_tqdm=False)
    actual = engines.get("llama", tp=2, **LLAMA).generate(batch, params, use_tqdm=False)
    for one, two in zip(expected, actual):
        assert one.outputs[0].token_ids == two.outputs[0].token_ids
        assert two.outputs[0].finish_reason == "stop"
        assert set(json.loads(two.outputs[0].text)) == {"n", "ok"}


def test_an_int8_kv_cache_splits_by_kv_heads_too(engines):
    """kv_cache_dtype='int8' under tensor parallelism: each rank stores its KV heads' 8-bit
    rows and scales; the greedy tokens are one rank's with the same 8-bit cache."""
    params = greedy(max_tokens=16)
    expected = engines.get("llama", kv_cache_dtype="int8").generate(prompts(), params,
                                                                    use_tqdm=False)
    llm = engines.get("llama", tp=2, kv_cache_dtype="int8", **LLAMA)
    assert_same_outputs(expected, llm.generate(prompts(), params, use_tqdm=False))
