"""The CUDA path on a GPU: the Triton kernels compiled (not interpreted), decode steps replayed
from CUDA graphs, and swaps on the side stream. Every test here is marked gpu and skips
without CUDA; benchmarks/gpu_check.py runs this file in a process without TRITON_INTERPRET.

Nothing at module level imports triton_backend: this module is collected beside
test_triton_attention.py, which needs the kernels defined under the interpreter.
"""
from __future__ import annotations

import pytest
import torch
from attention_steps import MIXED_BATCH, make_step

from pagellm.attention import AttentionMetadata
from pagellm.attention.torch_backend import reference_paged_attention

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}


@pytest.fixture(scope="module")
def triton_backend():
    import os

    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1: the kernels would be interpreted, not compiled")
    pytest.importorskip("triton")
    from pagellm.attention import triton_backend

    if triton_backend.INTERPRETED:
        pytest.skip("triton_backend was imported under TRITON_INTERPRET=1 in this process")
    return triton_backend


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("sliding_window", [None, 10])
@pytest.mark.parametrize("block_size", [1, 16])
def test_compiled_kernels_match_the_reference(triton_backend, dtype, sliding_window,
                                              block_size):
    q, k, v, k_cache, v_cache, _, tables, seq_lens = make_step(
        MIXED_BATCH, block_size, dtype, num_heads=32, num_kv_heads=8, head_dim=128)
    q, k, v, k_cache, v_cache = (t.cuda() for t in (q, k, v, k_cache, v_cache))
    query_lens = [n for _, n in MIXED_BATCH]
    metadata = AttentionMetadata.build(query_lens, seq_lens, tables, block_size, "cuda")
    scale = 128 ** -0.5
    out = triton_backend.paged_attention(q, k, v, k_cache, v_cache, metadata, scale,
                                         sliding_window)
    expected = reference_paged_attention(q.cpu(), k_cache.cpu(), v_cache.cpu(), query_lens,
                                         seq_lens, tables, scale, sliding_window)
    assert out.dtype == dtype
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.cpu().float(), expected.float(), atol=tol, rtol=tol)


def _generate(path, enforce_eager: bool, prompts: list[list[int]], kv_cache_dtype="auto"):
    from pagellm import LLM, SamplingParams

    llm = LLM(model=str(path), device="cuda", dtype="float32", max_num_seqs=8,
              max_model_len=256, num_gpu_blocks_override=64, enforce_eager=enforce_eager,
              kv_cache_dtype=kv_cache_dtype)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    graphs = llm.llm_engine.runner.decode_graphs
    return [o.outputs[0].token_ids for o in outputs], graphs


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "fp8"])
def test_cuda_graph_decodes_give_the_eager_tokens(triton_backend, tmp_path, kv_cache_dtype):
    """Over an 8-bit cache too (the quantizing store kernel inside the graph)."""
    from pagellm.bench.random_model import build_random_model

    path = build_random_model(tmp_path / "tiny")
    prompts = [[(7 * i + j) % 500 + 3 for j in range(5 + 9 * i)] for i in range(5)]
    eager, no_graphs = _generate(path, True, prompts, kv_cache_dtype)
    replayed, graphs = _generate(path, False, prompts, kv_cache_dtype)
    assert no_graphs is None and sorted(graphs.graphs) == [1, 2, 4, 8]
    assert replayed == eager  # 5 sequences decode padded to 8, then fewer as they finish


def test_swaps_on_the_side_stream_are_ordered_with_the_compute_stream():
    from helpers import tiny_config

    from pagellm.worker.cache_engine import CacheEngine

    config = tiny_config("LlamaForCausalLM", num_hidden_layers=2)
    cache = CacheEngine(config, 64, 8, 16, torch.float32, "cuda")
    assert cache.swap_stream is not None and cache.cpu_cache.is_pinned()
    big = torch.randn(4096, 4096, device="cuda")
    for _ in range(3):
        big = big @ big / 64  # keep the compute stream busy so that races would show
    cache.device_cache[:, :, 5] = 5.0  # queued behind the matmuls
    cache.swap_out([(5, 2)])
    cache.device_cache[:, :, 5] = -1.0  # the block's next owner writes it at once
    cache.swap_in([(2, 9)])
    copied = cache.device_cache[:, :, 9].clone()  # the compute stream reads the swapped-in block
    cache.synchronize()
    torch.cuda.synchronize()
    assert bool((cache.cpu_cache[:, :, 2] == 5.0).all())
    assert bool((copied == 5.0).all()) and bool((cache.device_cache[:, :, 5] == -1.0).all())
    assert len(cache.in_flight) == 0
