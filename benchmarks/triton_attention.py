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
from dataclasses import dataclass

import torch

from pagellm.attention import AttentionMetadata
from pagellm.attention import torch_backend


@dataclass(frozen=True, slots=True)
class AttentionShape:
    """One attention layer's heads and the cache's block size."""

    num_heads: int = 12  # the small Llama
    num_kv_heads: int = 4
    head_dim: int = 64
    block_size: int = 16


SMALL = AttentionShape()


def make_case(query_lens: list[int], seq_lens: list[int], dtype: torch.dtype,
              device: str, seed: int = 0, shape: AttentionShape = SMALL) -> tuple:
    """(query, key, value, k_cache, v_cache, metadata) for one step of these sequences. The
    values are drawn on ``device`` (seeded): caches of tens of GiB are drawn in milliseconds."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.Generator(device=device).manual_seed(seed)
    block_size = shape.block_size
    needed = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(needed) + 16
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables, start = [], 0
    for n in needed:
        tables.append(order[start:start + n])
        start += n

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(size, generator=values, device=device, dtype=dtype)

    k_cache = randn(num_blocks, block_size, shape.num_kv_heads, shape.head_dim)
    v_cache = randn(num_blocks, block_size, shape.num_kv_heads, shape.head_dim)
    num_tokens = sum(query_lens)
    query = randn(num_tokens, shape.num_heads, shape.head_dim)
    key = randn(num_tokens, shape.num_kv_heads, shape.head_dim)
    value = randn(num_tokens, shape.num_kv_heads, shape.head_dim)
    metadata = AttentionMetadata.build(query_lens, seq_lens, tables, block_size, device=device)
    return query, key, value, k_cache, v_cache, metadata


def bench_case(name: str, query_lens: list[int], seq_lens: list[int], dtype: torch.dtype,
               triton_attention, do_bench, device: str = "cuda", shape: AttentionShape = SMALL,
               with_torch: bool = True) -> dict:
    """Time one step of each backend; ``with_torch=False`` skips the torch path (its gathered
    copy of the K/V may not fit beside the cache)."""
    query, key, value, k_cache, v_cache, metadata = make_case(query_lens, seq_lens, dtype,
                                                              device, shape=shape)
    scale = shape.head_dim ** -0.5
    backends = [("triton", triton_attention)]
    if with_torch:
        backends.append(("torch", torch_backend.paged_attention))
    times, outputs = {}, {}
    for backend, attend in backends:
        def call(attend=attend):
            return attend(query, key, value, k_cache, v_cache, metadata, scale)

        outputs[backend] = call().float()
        times[backend] = do_bench(call, warmup=25, rep=100, return_mode="median")
    # A decode reads each cached K/V element once: its bytes per second say how close the
    # kernel is to the memory bandwidth. (A prefill rereads K/V per query block.)
    kv_bytes = 2 * sum(seq_lens) * shape.num_kv_heads * shape.head_dim * k_cache.element_size()
    is_decode = all(n == 1 for n in query_lens)
    torch_ms = times.get("torch")
    return {"case": name, "num_seqs": len(seq_lens), "query_tokens": sum(query_lens),
            "context": max(seq_lens), "kv_bytes": kv_bytes,
            "triton_ms": round(times["triton"], 4),
            "torch_ms": None if torch_ms is None else round(torch_ms, 4),
            "speedup": None if torch_ms is None else round(torch_ms / times["triton"], 2),
            "triton_kv_read_gb_per_s":
                round(kv_bytes / times["triton"] / 1e6, 1) if is_decode else None,
            "torch_kv_read_gb_per_s":
                round(kv_bytes / torch_ms / 1e6, 1) if is_decode and torch_ms else None,
            "max_abs_diff": (float((outputs["triton"] - outputs["torch"]).abs().max())
                             if with_torch else None)}


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
    print(json.dumps({"model": "small Llama attention layer", "num_heads": SMALL.num_heads,
                      "num_kv_heads": SMALL.num_kv_heads, "head_dim": SMALL.head_dim,
                      "block_size": SMALL.block_size, "dtype": args.dtype,
                      "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                      "triton": triton.__version__, "results": results},
                     indent=1))


def _fail(reason: str) -> None:
    print(f"benchmarks/triton_attention.py: {reason}", file=sys.stderr)
    raise SystemExit(2)


if __name__ == "__main__":
    main()
