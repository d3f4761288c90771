"""The real SmolLM2-135M-Instruct GGUF file (9 query heads, 3 KV heads) over three ranks:
each rank dequantizes its shard of the file, and the chat answer is the single rank's."""
from __future__ import annotations

import pytest
from gguf_models import smollm2_gguf

from pagellm import LLM, SamplingParams

pytestmark = pytest.mark.slow  # three processes load a 135M model: about a minute on 2 cores

QUESTIONS = ["What is the capital of France?", "Why is the sky blue?"]


def test_three_ranks_answer_like_one():
    path = str(smollm2_gguf())
    params = SamplingParams(temperature=0, max_tokens=24)
    kwargs = dict(dtype="float32", max_model_len=512, swap_space=0.05,
                  kv_cache_memory_bytes=32 << 20)
    messages = [[{"role": "user", "content": q}] for q in QUESTIONS]
    single = LLM(path, **kwargs)
    expected = [o.outputs[0].token_ids for o in single.chat(messages, params, use_tqdm=False)]
    del single
    parallel = LLM(path, tensor_parallel_size=3, **kwargs)
    try:
        actual = [o.outputs[0].token_ids for o in parallel.chat(messages, params,
                                                                 use_tqdm=False)]
    finally:
        parallel.shutdown()
    assert actual == expected
