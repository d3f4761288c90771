"""Shared by the tensor-parallel tests: the tiny models, the engine settings, the cache of
engines (``TensorParallelEngines``) and the comparison of two engines' outputs."""
from __future__ import annotations

from typing import Any

import pytest
from helpers import random_prompts

from pagellm import LLM, SamplingParams

# name -> (architecture, config overrides): each covers a different way of splitting
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    # one KV head for two ranks (replicated); biases on every projection (row-parallel ones
    # add theirs once, after the all-reduce)
    "llama": ("LlamaForCausalLM", {"num_key_value_heads": 1, "attention_bias": True,
                                   "mlp_bias": True}),
    # q/k/v biases, tied embeddings (the LM head shares the embedding's vocabulary shard)
    "qwen2": ("Qwen2ForCausalLM", {}),
    # per-head q/k norm; a vocabulary that does not split evenly (509 = 255 + 254 rows)
    "qwen3": ("Qwen3ForCausalLM", {"vocab_size": 509}),
}
BASE_KWARGS = dict(dtype="float32", max_model_len=256, swap_space=0.05, seed=0,
                   kv_cache_memory_bytes=8 << 20)


class TensorParallelEngines:
    """``get(model, tp, **kwargs)`` -> an LLM, cached by its settings; at most one with
    tensor_parallel_size > 1 alive at a time."""

    def __init__(self, tiny_models) -> None:
        self.tiny_models = tiny_models
        self.single: dict[tuple, LLM] = {}
        self.parallel_key: tuple | None = None
        self.parallel: LLM | None = None

    def get(self, model: str, tp: int = 1, **kwargs: Any) -> LLM:
        key = (model, tp, tuple(sorted(kwargs.items())))
        settings = {**BASE_KWARGS, **kwargs, "tensor_parallel_size": tp}
        if tp == 1:
            if key not in self.single:
                self.single[key] = LLM(str(self.tiny_models(model)), **settings)
            return self.single[key]
        if key != self.parallel_key:
            self.close()
            self.parallel = LLM(str(self.tiny_models(model)), **settings)
            self.parallel_key = key
        return self.parallel

    def close(self) -> None:
        if self.parallel is not None:
            self.parallel.shutdown()
        self.parallel, self.parallel_key = None, None


MAX_TOKENS = 24
LOGPROB_TOLERANCE = 1e-4


def prompts(vocab_size: int = 509, seed: int = 1) -> list[dict]:
    return [{"prompt_token_ids": p}
            for p in random_prompts([1, 9, 40, 130], vocab_size=vocab_size, seed=seed)]


def greedy(max_tokens: int = MAX_TOKENS, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def assert_same_outputs(expected, actual) -> None:
    """Same tokens, and the chosen tokens' logprobs (and the top-5) within tolerance."""
    assert len(expected) == len(actual)
    for exp, act in zip(expected, actual):
        assert [c.token_ids for c in act.outputs] == [c.token_ids for c in exp.outputs]
        for exp_c, act_c in zip(exp.outputs, act.outputs):
            if exp_c.logprobs is None:
                continue
            for token, exp_top, act_top in zip(exp_c.token_ids, exp_c.logprobs, act_c.logprobs):
                assert act_top[token].logprob == pytest.approx(exp_top[token].logprob,
                                                               abs=LOGPROB_TOLERANCE)
                for other, value in exp_top.items():
                    if other in act_top:
                        assert act_top[other].logprob == pytest.approx(
                            value.logprob, abs=LOGPROB_TOLERANCE)
