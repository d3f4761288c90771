"""The engine with an 8-bit KV cache under memory pressure (swap, recompute, prefix caching,
forks with n > 1) against the same engine reading a dequantized copy.

The comparison engine keeps a float32 cache, but every K/V it stores is first rounded through
the same 8-bit format (Attention.reference_kv_format), so it reads exactly the values the 8-bit
engine dequantizes (q x bfloat16 scale is exact in float32) through the unquantized attention
paths and with no scales to move. Whatever differs is the 8-bit engine's own doing: a scale
lost or stale after a swap, a copy-on-write or a prefix hit, a wrong row decoded in a kernel
would change its tokens. Both engines run the same schedule, so the preemptions happen at the
same steps.
"""
from __future__ import annotations

import pytest
from engine_helpers import make_prompts

from pagellm import LLM, SamplingParams
from pagellm.attention import Attention
from pagellm.attention.kv_quant import kv_format

PRESSURE = dict(block_size=4, num_gpu_blocks_override=40, max_model_len=128, max_num_seqs=6,
                enable_prefix_caching=True, dtype="float32")


def run(llama_dir, kv_cache_dtype, reference, preemption_mode):
    llm = LLM(str(llama_dir), kv_cache_dtype="auto" if reference else kv_cache_dtype,
              preemption_mode=preemption_mode, swap_space=0.01, **PRESSURE)
    if reference:
        modules = [m for m in llm.llm_engine.runner.model.modules() if isinstance(m, Attention)]
        assert modules
        for module in modules:
            module.reference_kv_format = kv_format(kv_cache_dtype)
    prompts = [{"prompt_token_ids": p}
               for p in make_prompts(6, [9, 14, 5, 22], seed=21, shared_prefix=12)]
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    forked = SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=16, ignore_eos=True)
    outputs = llm.generate(prompts, [greedy] * 4 + [forked] * 2, use_tqdm=False)
    stats = llm.llm_engine.get_stats()
    assert stats.num_preemptions > 0, "the cache was meant to be too small"
    assert stats.prefix_cache_hits > 0
    assert stats.num_free_blocks == stats.num_blocks
    if preemption_mode == "swap":
        assert stats.num_swap_outs > 0
    return [[list(c.token_ids) for c in o.outputs] for o in outputs], stats


@pytest.mark.parametrize("kv_cache_dtype, preemption_mode",
                         [("int8", "swap"), ("fp8", "recompute"), ("fp8_e5m2", "swap")])
def test_8bit_cache_matches_engine_reading_a_dequantized_copy(llama_dir, kv_cache_dtype,
                                                              preemption_mode):
    quantized, stats = run(llama_dir, kv_cache_dtype, False, preemption_mode)
    expected, _ = run(llama_dir, kv_cache_dtype, True, preemption_mode)
    assert quantized == expected
    assert stats.kv_cache_dtype == kv_cache_dtype


def test_8bit_cache_bytes_and_errors(llama_dir):
    """Sizing counts one byte per element plus a 2-byte scale per token and KV head; an
    unknown kv_cache_dtype names the supported ones."""
    plain = LLM(str(llama_dir), kv_cache_memory_bytes=1 << 20, max_model_len=64,
                dtype="bfloat16")
    int8 = LLM(str(llama_dir), kv_cache_memory_bytes=1 << 20, max_model_len=64,
               dtype="bfloat16", kv_cache_dtype="int8")
    config = plain.llm_engine.hf_config
    head_dim = config.hidden_size // config.num_attention_heads
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads
    assert plain.llm_engine.get_stats().kv_bytes_per_block == 16 * per_token * head_dim * 2
    assert int8.llm_engine.get_stats().kv_bytes_per_block == 16 * per_token * (head_dim + 2)
    assert int8.llm_engine.num_gpu_blocks == (1 << 20) // (16 * per_token * (head_dim + 2))
    assert int8.llm_engine.cache_engine.device_cache.nbytes == (
        int8.llm_engine.num_gpu_blocks * 16 * per_token * (head_dim + 2))
    with pytest.raises(ValueError, match="kv_cache_dtype='int4'.*'int8', 'fp8'"):
        LLM(str(llama_dir), kv_cache_dtype="int4")


def test_stats_endpoint_reports_the_kv_cache_dtype_block_bytes_and_weights(llama_dir):
    import asyncio

    import httpx

    from pagellm.core.async_engine import AsyncLLMEngine
    from pagellm.entrypoints.openai.api_server import build_app
    from pagellm.metrics import EngineMetrics

    llm = LLM(str(llama_dir), kv_cache_dtype="fp8", num_gpu_blocks_override=16, max_model_len=64,
              quantization="int8")

    async def main():
        metrics = EngineMetrics("m")
        app = build_app(AsyncLLMEngine(llm.llm_engine, on_step=metrics.observe_step), ["m"],
                        metrics)
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
                return (await c.get("/stats")).json()

    stats = asyncio.run(asyncio.wait_for(main(), 30))
    config = llm.llm_engine.hf_config
    head_dim = config.hidden_size // config.num_attention_heads
    assert (stats["kv_cache_dtype"], stats["quantization"]) == ("fp8", "int8")
    assert stats["kv_bytes_per_block"] == 16 * 2 * config.num_hidden_layers * (
        config.num_key_value_heads * (head_dim + 2))
