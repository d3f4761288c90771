"""Decode attention alone: the compiled CPU kernel against the pure-torch path (prints JSON).

    .venv/bin/python benchmarks/decode_attention.py                     # bfloat16, 64 x 512
    .venv/bin/python benchmarks/decode_attention.py --dtype float32 --num-seqs 128
    .venv/bin/python benchmarks/decode_attention.py --hot               # K/V in cache: compute
    .venv/bin/python benchmarks/decode_attention.py --num-blocks 4160   # a half-used pool

Workload (seed 0): the attention of the ~125M "small" Llama (12 query heads over 4 KV heads,
head_dim 64), block size 16, ``--num-seqs`` decodes at ``--context`` tokens each, for 12
layers with a K/V cache of their own each, allocated as the engine allocates its cache (so
every step reads the whole context from memory, as a model step does), block tables made of shuffled physical blocks. Reports the median time
of the 12 layers' decode attention (the step's K/V already in the cache), the K/V bytes read
and the rate, and the largest difference from the pure-torch path. ``--hot`` makes every table
point into the same 32 blocks, so K/V stay in the CPU caches: what the kernel costs when memory
is not the limit. ``--num-blocks`` sizes the pool the tables draw from (default: the batch's
blocks + 8, a full pool); a larger pool leaves gaps between the blocks a step reads.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from pagellm.attention import AttentionMetadata, cpu_kernel
from pagellm.attention.torch_backend import _decode, decode_attention
from pagellm.worker.cache_engine import _allocate_zeroed

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, NUM_LAYERS, BLOCK_SIZE = 12, 4, 64, 12, 16
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def measure(num_seqs: int, context: int, dtype: torch.dtype, hot: bool, iters: int,
            num_blocks: int = 0) -> dict:
    gen = torch.Generator().manual_seed(0)
    per_seq = -(-context // BLOCK_SIZE)
    num_blocks = max(num_blocks, num_seqs * per_seq + 8)
    if hot:
        tables = [[(i * 7 + j) % 32 for j in range(per_seq)] for i in range(num_seqs)]
    else:
        tables = torch.randperm(num_blocks, generator=gen)[:num_seqs * per_seq].view(
            num_seqs, per_seq).tolist()
    decode = AttentionMetadata.build([1] * num_seqs, [context] * num_seqs, tables,
                                     BLOCK_SIZE).decode
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)

    def cache() -> torch.Tensor:  # allocated as the engine's cache is (2 MiB pages on Linux)
        return _allocate_zeroed(shape, dtype, torch.device("cpu")).copy_(
            torch.randn(shape, generator=gen))

    caches = [(cache(), cache()) for _ in range(NUM_LAYERS)]
    query = torch.randn(num_seqs, NUM_HEADS, HEAD_DIM, generator=gen).to(dtype)
    scale = HEAD_DIM ** -0.5
    out = _decode(query, *caches[0], decode, scale, None)
    reference = decode_attention(query, *caches[0], decode, scale)
    times = []
    for _ in range(iters + 1):  # the first pass warms up
        start = time.perf_counter()
        for k_cache, v_cache in caches:
            _decode(query, k_cache, v_cache, decode, scale, None)
        times.append(time.perf_counter() - start)
    ms = statistics.median(times[1:]) * 1e3
    kv_bytes = 2 * NUM_LAYERS * num_seqs * context * NUM_KV_HEADS * HEAD_DIM * query.element_size()
    return {"num_seqs": num_seqs, "context": context, "hot": hot, "num_blocks": num_blocks,
            "ms_12_layers": round(ms, 2),
            "kv_bytes": kv_bytes, "gb_per_s": round(kv_bytes / ms / 1e6, 1),
            "max_diff_vs_torch_path": float((out.float() - reference.float()).abs().max())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--num-seqs", type=int, default=64)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--iters", type=int, default=7)
    parser.add_argument("--hot", action="store_true", help="K/V kept in the CPU caches")
    parser.add_argument("--num-blocks", type=int, default=0,
                        help="blocks in the pool (default: the batch's + 8)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not cpu_kernel.supports(torch.empty(0, dtype=DTYPES[args.dtype])):
        raise SystemExit("the compiled CPU decode kernel is not available here")
    result = measure(args.num_seqs, args.context, DTYPES[args.dtype], args.hot, args.iters,
                     args.num_blocks)
    print(json.dumps({"dtype": args.dtype, "threads": args.threads, "cpu": platform.machine(),
                      "vector_inner_loops": cpu_kernel.vector_paths(), **result}, indent=1))


if __name__ == "__main__":
    main()
