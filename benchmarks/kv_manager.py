"""Bookkeeping cost of the KV cache managers: no model, no tensors, only the Python the
scheduler runs every step. Fixed seeds; prints one JSON object.

Workload (defaults): 256 running sequences whose prompts are uniform in 1,900..2,100 tokens
(seed 0), block size 16. For each manager configuration:

- admit: lookup_prefix + allocate_slots of a whole prompt, per sequence (distinct prompts, so no
  prefix hits: with caching on this includes hashing every full block).
- decode_step: one step of the engine, allocate_slots(seq, tokens, 1) for all 256 sequences, a
  new block whenever a sequence crosses a block boundary (about 1 step in 16 per sequence).
  Measured over --decode-steps consecutive steps.
- block_tables: get_block_table for all sequences (what the model runner reads each step).
- get_stats, fork + free of one child, swap_out + swap_in of one sequence.
- free: per sequence.

    python benchmarks/kv_manager.py [--num-seqs 256] [--decode-steps 256]
"""
from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable

from pagellm.kv import ContiguousKVCacheManager, KVCacheManager, cdiv


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def summary_ms(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "mean_ms": round(statistics.fmean(ordered) * 1e3, 4),
        "median_ms": round(ordered[len(ordered) // 2] * 1e3, 4),
        "p99_ms": round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1e3, 4),
    }


def make_workload(num_seqs: int, prompt_min: int, prompt_max: int, decode_steps: int,
                  seed: int) -> list[list[int]]:
    """Each sequence's prompt followed by the tokens it will decode (drawn up front, so that
    timing covers the manager only)."""
    rng = random.Random(seed)
    seqs = []
    for _ in range(num_seqs):
        prompt_len = rng.randint(prompt_min, prompt_max)
        seqs.append([rng.randrange(32000) for _ in range(prompt_len + decode_steps)])
    return seqs


def bench_manager(mgr, seqs: list[list[int]], prompt_lens: list[int], decode_steps: int) -> dict:
    result: dict = {}
    admit = []
    for seq_id, (tokens, prompt_len) in enumerate(zip(seqs, prompt_lens)):
        prompt = tokens[:prompt_len]

        def admit_one() -> None:
            match = mgr.lookup_prefix(prompt)
            assert mgr.allocate_slots(seq_id, prompt, prompt_len - match.num_tokens,
                                      prefix=match) is not None

        admit.append(timed(admit_one))
    result["admit_per_seq"] = summary_ms(admit)

    steps = []
    num_seqs = len(seqs)
    allocate = mgr.allocate_slots
    for _ in range(decode_steps):
        start = time.perf_counter()
        for seq_id in range(num_seqs):
            if allocate(seq_id, seqs[seq_id], 1) is None:
                raise RuntimeError("benchmark pool too small")
        steps.append(time.perf_counter() - start)
    result["decode_step"] = summary_ms(steps)
    result["decode_step"]["per_seq_us"] = round(statistics.fmean(steps) / num_seqs * 1e6, 3)

    tables = [timed(lambda: [mgr.get_block_table(s) for s in range(num_seqs)]) for _ in range(20)]
    result["block_tables_all_seqs"] = summary_ms(tables)
    result["get_stats"] = summary_ms([timed(mgr.get_stats) for _ in range(20)])

    def fork_and_free() -> None:
        mgr.fork(0, "child")
        mgr.free("child")

    result["fork_and_free"] = summary_ms([timed(fork_and_free) for _ in range(20)])
    if mgr.num_cpu_blocks:
        swaps = []
        for seq_id in range(20):
            swaps.append(timed(lambda: (mgr.swap_out([seq_id]), mgr.swap_in([seq_id]))))
        result["swap_out_and_in"] = summary_ms(swaps)
    mgr.check_invariants()
    assert all(mgr.num_tokens(s) == prompt_lens[s] + decode_steps for s in range(num_seqs))
    result["free_per_seq"] = summary_ms([timed(lambda s=s: mgr.free(s)) for s in range(num_seqs)])
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--prompt-min", type=int, default=1900)
    parser.add_argument("--prompt-max", type=int, default=2100)
    parser.add_argument("--decode-steps", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    seqs = make_workload(args.num_seqs, args.prompt_min, args.prompt_max, args.decode_steps,
                         args.seed)
    prompt_lens = [len(s) - args.decode_steps for s in seqs]
    max_len = args.prompt_max + args.decode_steps
    blocks_per_seq = cdiv(max_len, args.block_size)
    num_blocks = args.num_seqs * (blocks_per_seq + 1) + 64
    swap_blocks = 4 * blocks_per_seq
    configs = {
        "paged": lambda: KVCacheManager(num_blocks, args.block_size, swap_blocks),
        "paged_prefix_caching": lambda: KVCacheManager(num_blocks, args.block_size, swap_blocks,
                                                       enable_prefix_caching=True),
        "contiguous": lambda: ContiguousKVCacheManager(num_blocks, args.block_size, max_len,
                                                       swap_blocks),
    }
    results = {name: bench_manager(factory(), seqs, prompt_lens, args.decode_steps)
               for name, factory in configs.items()}
    print(json.dumps({
        "workload": {**vars(args), "num_blocks": num_blocks, "num_cpu_blocks": swap_blocks},
        "python": sys.version.split()[0], "machine": platform.machine(),
        "results": results,
    }, indent=2))


if __name__ == "__main__":
    main()
