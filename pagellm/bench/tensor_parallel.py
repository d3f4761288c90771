"""Tensor parallelism's step time, throughput and communication time, per rank count.

For each tensor_parallel_size and batch size N the benchmark admits N requests with distinct
seeded random prompts of ``prompt_len`` tokens, runs their prefills, then times
``decode_steps`` steps in which the N sequences decode one token each (greedy, EOS ignored).
It reports the mean step time, output tokens per second, and the time the driver (rank 0)
spent inside collectives per step (``comm_ms_per_step``: the all-reduces after each
row-parallel layer and the embedding, and the logits gather; wall time, so it includes waiting
for the slower rank), with their count per step.

On one CPU host the ranks are processes sharing the machine's cores: at ``threads`` torch
threads per rank, TP=2 uses twice the cores of TP=1 at the same ``threads``, and the step
also pays the collectives and the plan's trip to the workers.
"""
from __future__ import annotations

import random
import time
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(slots=True)
class TensorParallelBenchConfig:
    model: str
    dtype: str = "bfloat16"
    tensor_parallel_sizes: tuple[int, ...] = (1, 2)
    batch_sizes: tuple[int, ...] = (1, 16)
    prompt_len: int = 128
    decode_steps: int = 16
    threads: int = 1
    backend: str = "mp"
    seed: int = 0


def run_tensor_parallel_bench(config: TensorParallelBenchConfig) -> dict[str, Any]:
    import torch

    from pagellm import LLM

    torch.set_num_threads(config.threads)
    results = []
    max_model_len = config.prompt_len + config.decode_steps + 64
    for tp in config.tensor_parallel_sizes:
        llm = LLM(config.model, dtype=config.dtype, tensor_parallel_size=tp,
                  distributed_executor_backend=config.backend, max_model_len=max_model_len,
                  max_num_seqs=max(config.batch_sizes), swap_space=0.05,
                  kv_cache_memory_bytes=256 << 20, enable_prefix_caching=False,
                  seed=config.seed)
        try:
            for batch_size in config.batch_sizes:
                results.append({"tensor_parallel_size": tp, "batch_size": batch_size,
                                **_measure(llm, config, batch_size)})
        finally:
            llm.shutdown()
    return {"config": asdict(config), "results": results}


def _measure(llm: Any, config: TensorParallelBenchConfig, batch_size: int) -> dict[str, Any]:
    from pagellm import SamplingParams

    engine = llm.llm_engine
    vocab = engine.hf_config.vocab_size
    rng = random.Random(config.seed + batch_size)
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=config.decode_steps + 8)
    for i in range(batch_size):
        prompt = [rng.randrange(3, vocab) for _ in range(config.prompt_len)]
        engine.add_request(f"tp-bench-{batch_size}-{i}", prompt, params)
    while any(seq.num_computed_tokens < len(seq.request.prompt_token_ids)
              for seq in engine.scheduler.seqs.values()):
        engine.step()  # prefills (and the first decodes of early sequences)
    group = getattr(engine.worker, "tp_group", None)
    comm_before = group.comm_seconds if group else 0.0
    calls_before = group.num_collectives if group else 0
    start = time.perf_counter()
    for _ in range(config.decode_steps):
        engine.step()
    elapsed = time.perf_counter() - start
    comm = (group.comm_seconds - comm_before) if group else 0.0
    calls = (group.num_collectives - calls_before) if group else 0
    engine.abort_all()
    steps = config.decode_steps
    return {"step_ms": round(elapsed / steps * 1e3, 3),
            "output_tokens_per_s": round(batch_size * steps / elapsed, 1),
            "comm_ms_per_step": round(comm / steps * 1e3, 3),
            "comm_fraction": round(comm / elapsed, 3),
            "collectives_per_step": calls // steps}
