"""Triton paged-attention kernels against the torch path on a CUDA GPU (prints JSON).

    .venv/bin/python benchmarks/triton_attention.py                     # bfloat16
    .venv/bin/python benchmarks/triton_attention.py --dtype float16 --contexts 512,4096

Needs a CUDA GPU and triton; without them it exits with a message (status 2).

Workload (seed 0): one attention layer of the ~125M "small" Llama (12 query heads over 4 KV
heads, head_dim 64), block size 16, block tables of shuffled physical blocks (as after
allocator churn), caches filled with random values.
- decode: batches of 1..256 sequences, each computing 1 token after ``context - 1`` cached;
- prefill: whole 512-token prompts (1 and 8 of them), and a 512-token chunk after 1,536
  cached tokens (chunked prefill / prefix hit).

Each case times one ``paged_attention`` call (K/V slot write plus attention, as a layer runs
it) of each backend with ``triton.testing.do_bench`` (median, L2 flushed between runs), and
reports for decodes the K/V bytes read per second, and the largest difference between the two
backends' outputs as a check that they computed the same thing.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from pagellm.attention import AttentionMetadata
from pagellm.attention import torch_backend

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 12, 4, 64  # the small Llama
BLOCK_SIZE = 16


def make_case(query_lens: list[int], seq_lens: list[int], dtype: torch.dtype,
              device: str, seed: int = 0) -> tuple:
    """(query, key, value, k_cache, v_cache, metadata) for one step of these sequences."""
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-n // BLOCK_SIZE) for n in seq_lens]
    num_blocks = sum(needed) + 16
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables, start = [], 0
    for n in needed:
        tables.append(order[start:start + n])
        start += n
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, generator=gen).to(device, dtype)
    v_cache = torch.randn(shape, generator=gen).to(device, dtype)
    num_tokens = sum(query_lens)
    query = torch.randn(num_tokens, NUM_HEADS, HEAD_DIM, generator=gen).to(device, dtype)
    key = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(device, dtype)
    value = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(device, dtype)
    metadata = AttentionMetadata.build(query_lens, seq_lens, tables, BLOCK_SIZE, device=device)
    return query, key, value, k_cache, v_cache, metadata


def bench_case(name: str, query_lens: list[int], seq_lens: list[int], dtype: torch.dtype,
               triton_attention, do_bench, device: str = "cuda") -> dict:
    query, key, value, k_cache, v_cache, metadata = make_case(query_lens, seq_lens, dtype, device)
    scale = HEAD_DIM ** -0.5
    times, outputs = {}, {}
    for backend, attend in (("triton", triton_attention),
                            ("torch", torch_backend.paged_attention)):
        def call(attend=attend):
            return attend(query, key, value, k_cache, v_cache, metadata, scale)

        outputs[backend] = call().float()
        times[backend] = do_bench(call, warmup=25, rep=100, return_mode="median")
    # A decode reads each cached K/V element once: its bytes per second say how close the
    # kernel is to the memory bandwidth. (A prefill rereads K/V per query block.)
    kv_bytes = 2 * sum(seq_lens) * NUM_KV_HEADS * HEAD_DIM * k_cache.element_size()
    is_decode = all(n == 1 for n in query_lens)
    return {"case": name, "num_seqs": len(seq_lens), "query_tokens": sum(query_lens),
            "context": max(seq_lens), "triton_ms": round(times["triton"], 4),
            "torch_ms": round(times["torch"], 4),
            "speedup": round(times["torch"] / times["triton"], 2),
            "triton_kv_read_gb_per_s":
                round(kv_bytes / times["triton"] / 1e6, 1) if is_decode else None,
            "max_abs_diff": float((outputs["triton"] - outputs["torch"]).abs().max())}


def cases(batch_sizes: list[int], contexts: list[int]) -> list[tuple[str, list[int], list[int]]]:
    """(name, query_lens, seq_lens) of every case, prefills first as the metadata wants."""
    decodes = [("decode", [1] * b, [c] * b) for c in contexts for b in batch_sizes]
    prefills = [("prefill", [512], [512]), ("prefill", [512] * 8, [512] * 8),
                ("chunk after 1536 cached", [512], [2048])]
    return decodes + prefills


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--batch-sizes", default="1,8,32,64,128,256")
    parser.add_argument("--contexts", default="512,2048")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        _fail("needs a CUDA GPU, and torch.cuda.is_available() is False on this machine "
              "(benchmarks/model_runner.py measures the CPU path)")
    try:
        import triton
        from triton.testing import do_bench

        from pagellm.attention.triton_backend import paged_attention as triton_attention
    except ImportError as error:
        _fail(f"needs triton ({error})")
    dtype = getattr(torch, args.dtype)
    results = [bench_case(name, query_lens, seq_lens, dtype, triton_attention, do_bench)
               for name, query_lens, seq_lens in cases(
                   [int(b) for b in args.batch_sizes.split(",")],
                   [int(c) for c in args.contexts.split(",")])]
    print(json.dumps({"model": "small Llama attention layer", "num_heads": NUM_HEADS,
                      "num_kv_heads": NUM_KV_HEADS, "head_dim": HEAD_DIM,
                      "block_size": BLOCK_SIZE, "dtype": args.dtype,
                      "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                      "triton": triton.__version__, "results": results},
                     indent=1))


def _fail(reason: str) -> None:
    print(f"benchmarks/triton_attention.py: {reason}", file=sys.stderr)
    raise SystemExit(2)


if __name__ == "__main__":
    main()
