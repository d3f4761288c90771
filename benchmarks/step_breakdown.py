"""Where an engine run's time goes: steps with prompt tokens against decode-only steps (JSON).

    .venv/bin/python benchmarks/step_breakdown.py --allocator paged
    .venv/bin/python benchmarks/step_breakdown.py --allocator contiguous --num-prompts 128

The run is the memory experiment's (`pagellm bench memory`): the "small" Llama in bfloat16,
the default budget of 8 max-length reservations, the seeded `random` workload (prompts
32-512 tokens, outputs 16-256), all requests queued at t = 0. A timer around every
`ModelRunner.execute` call sorts the model's time into steps holding prompt tokens (whole
prompts or chunks, with or without decodes beside them) and decode-only steps; the rest of
the wall time is the engine outside the model (scheduling, sampling, outputs). Paging can only
speed up the decode-only part (more sequences per step); prompt tokens cost the same in both
allocators, which bounds the throughput ratio between them.
"""
from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict

from pagellm.bench.memory_experiment import (MemoryExperimentConfig, _engine_options,
                                             resolve_budget)
from pagellm.bench.throughput import build_engine, resolve_model, run_engine, set_threads, warm_up
from pagellm.bench.workloads import WorkloadSpec, build_workload
from pagellm.worker.model_runner import ModelRunner


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--allocator", choices=["paged", "contiguous"], default="paged")
    parser.add_argument("--model", default="small")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    set_threads(args.threads)
    config = MemoryExperimentConfig(model=resolve_model(args.model), dtype=args.dtype)
    engine = build_engine(_engine_options(config, resolve_budget(config), args.allocator, 16))
    vocab_size = engine.hf_config.vocab_size
    workload = build_workload(WorkloadSpec(num_prompts=args.num_prompts), vocab_size)
    warm_up(engine, vocab_size)

    spent: dict[str, float] = defaultdict(float)
    tokens: dict[str, int] = defaultdict(int)
    steps: dict[str, int] = defaultdict(int)
    execute = ModelRunner.execute

    def timed(runner, batch):
        start = time.perf_counter()
        out = execute(runner, batch)
        prompt = sum(s.num_new_tokens for s in batch if s.num_new_tokens > 1)
        kind = "with_prompt_tokens" if prompt else "decode_only"
        spent[kind] += time.perf_counter() - start
        steps[kind] += 1
        tokens[kind + "_prompt_tokens"] += prompt
        tokens[kind + "_decode_tokens"] += sum(1 for s in batch if s.num_new_tokens == 1)
        return out

    ModelRunner.execute = timed
    try:
        result = run_engine(engine, workload.requests, system=args.allocator).summary()
    finally:
        ModelRunner.execute = execute
    model_s = sum(spent.values())
    print(json.dumps({
        "allocator": args.allocator, "dtype": args.dtype, "threads": args.threads,
        "elapsed_s": result["elapsed_s"], "output_tokens_per_s": result["output_tokens_per_s"],
        "outside_model_s": round(result["elapsed_s"] - model_s, 2),
        "steps": dict(steps), "model_s": {k: round(v, 2) for k, v in spent.items()},
        "tokens": dict(tokens),
        "decode_only_tokens_per_s": round(tokens["decode_only_decode_tokens"]
                                          / max(spent["decode_only"], 1e-9), 1),
    }, indent=1))


if __name__ == "__main__":
    main()
