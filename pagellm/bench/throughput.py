"""Offline throughput of the engine on a seeded workload (``pagellm bench throughput``).

Every request is queued at t = 0 and the engine steps until all are done. After every step the
engine's statistics are sampled into a timeline (KV slots reserved and filled, running and
waiting sequences), from which come the time-averaged KV waste ratio and the peak and mean
concurrency. Outputs are greedy with ``ignore_eos``, so every request generates exactly its
stated number of tokens; the run checks that the tokens it counts, the tokens the engine counts
and the tokens the workload asked for agree.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagellm import native
from pagellm.bench.timeline import RunResult, Timeline
from pagellm.bench.workloads import BenchRequest

# Built-in seeded random-weight models, by name (see pagellm.bench.random_model).
BUILTIN_MODELS = ("tiny", "small", "narrow")


def default_cache_dir() -> Path:
    return native.cache_dir()


def resolve_model(name: str, cache_dir: str | Path | None = None) -> str:
    """``tiny`` / ``small`` / ``narrow``: the seeded random-weight Llama configs, built once in
    the cache folder; anything else is a model folder or hub id, returned as is."""
    if name not in BUILTIN_MODELS:
        return name
    from pagellm.bench.random_model import (NARROW_LLAMA, SMALL_LLAMA, TINY_LLAMA,
                                            cached_demo_model)

    config = {"tiny": TINY_LLAMA, "small": SMALL_LLAMA, "narrow": NARROW_LLAMA}[name]
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    return str(cached_demo_model(cache, f"bench-{name}-llama", **config))


def set_threads(num_threads: int | None = None) -> int:
    """Use every core for torch and keep the tokenizer's thread pool from competing."""
    import torch

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    num_threads = num_threads or os.cpu_count() or 1
    torch.set_num_threads(num_threads)
    return num_threads


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on, including how busy the machine was."""
    import platform

    import torch
    import transformers

    return {"cpu": native.cpu_model(), "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(),
            "load_average_1min": round(os.getloadavg()[0], 2)}


@dataclass(slots=True)
class EngineOptions:
    """The engine arguments a benchmark varies; the rest keep EngineArgs' defaults."""

    model: str
    kv_allocator: str = "paged"
    dtype: str = "bfloat16"
    block_size: int = 16
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    kv_cache_memory_bytes: int | None = None
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    swap_space: float = 4.0
    preemption_mode: str | None = None
    watermark: float = 0.01
    seed: int = 0
    enforce_eager: bool = False
    kv_cache_dtype: str = "auto"
    quantization: str | None = None
    quantization_group_size: int | None = None
    int8_activations: bool = False

    def engine_args(self):
        from pagellm.config import EngineArgs

        return EngineArgs(
            model=self.model, kv_allocator=self.kv_allocator, dtype=self.dtype,
            block_size=self.block_size, max_model_len=self.max_model_len,
            max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
            kv_cache_memory_bytes=self.kv_cache_memory_bytes,
            num_gpu_blocks_override=self.num_gpu_blocks_override,
            enable_prefix_caching=self.enable_prefix_caching, swap_space=self.swap_space,
            preemption_mode=self.preemption_mode, watermark=self.watermark, seed=self.seed,
            enforce_eager=self.enforce_eager, kv_cache_dtype=self.kv_cache_dtype,
            quantization=self.quantization, quantization_group_size=self.quantization_group_size,
            int8_activations=self.int8_activations)


def build_engine(options: EngineOptions):
    from pagellm.core.engine import LLMEngine

    return LLMEngine.from_engine_args(options.engine_args())


def warm_up(engine, vocab_size: int) -> None:
    """One short request through every stage, so one-time costs stay out of the timing."""
    from pagellm.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    engine.add_request("warmup", {"prompt_token_ids": [i % vocab_size for i in range(3, 35)]},
                       params)
    while engine.has_unfinished_requests():
        engine.step()


def run_engine(engine, requests: list[BenchRequest], system: str = "paged",
               recorder=None) -> RunResult:
    """Queue every request at once, step until done, sample the engine after every step;
    ``recorder`` (bench/kv_report.py: ViewRecorder) also records KV views, for --html."""
    from pagellm.sampling_params import SamplingParams

    before = engine.get_stats()
    timeline = Timeline()
    finished: dict[str, Any] = {}
    start, start_wall = time.perf_counter(), time.time()  # request metrics use time.time()
    for i, request in enumerate(requests):
        params = SamplingParams(temperature=0.0, max_tokens=request.output_len, ignore_eos=True)
        engine.add_request(str(i), {"prompt_token_ids": request.prompt_token_ids}, params)
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
        stats = engine.get_stats()
        now = time.perf_counter() - start
        timeline.add(now, stats.num_running, stats.num_waiting + stats.num_swapped,
                     stats.slots_allocated, stats.slots_filled)
        if recorder is not None:
            recorder.record(engine, now, stats)
    elapsed = time.perf_counter() - start
    after = engine.get_stats()
    result = _engine_result(system, engine, requests, finished, timeline, elapsed, before, after)
    result.ttft_s = [o.metrics.first_token_time - start_wall for o in finished.values()
                     if o.metrics is not None and o.metrics.first_token_time is not None]
    return result


def _engine_result(system: str, engine, requests: list[BenchRequest], finished: dict[str, Any],
                   timeline: Timeline, elapsed: float, before, after) -> RunResult:
    outputs = [finished.get(str(i)) for i in range(len(requests))]
    counted = sum(len(c.token_ids) for o in outputs if o is not None for c in o.outputs)
    failed = sum(1 for o in outputs
                 if o is None or any(c.finish_reason == "abort" for c in o.outputs))
    kv_slots = engine.num_gpu_blocks * engine.args.block_size
    return RunResult(
        system=system, num_requests=len(requests),
        prompt_tokens=sum(r.prompt_len for r in requests), output_tokens=counted,
        generated_tokens=after.generation_tokens_total - before.generation_tokens_total,
        elapsed_s=elapsed, kv_slots_budget=kv_slots, timeline=timeline,
        num_preemptions=after.num_preemptions - before.num_preemptions,
        num_swaps=after.num_swap_outs - before.num_swap_outs,
        prefix_hit_rate=_prefix_hit_rate(before, after),
        extra={"requested_output_tokens": sum(r.output_len for r in requests),
               "failed_requests": failed, "num_steps": after.num_steps - before.num_steps,
               "kv_allocator": engine.args.kv_allocator, "block_size": engine.args.block_size,
               "num_gpu_blocks": engine.num_gpu_blocks, "max_num_seqs": engine.args.max_num_seqs})


def _prefix_hit_rate(before, after) -> float:
    queries = after.prefix_cache_queries - before.prefix_cache_queries
    hits = after.prefix_cache_hits - before.prefix_cache_hits
    return hits / queries if queries else 0.0


def accounting_errors(result: dict[str, Any]) -> list[str]:
    """What is inconsistent in a run summary (empty when the books balance)."""
    errors = []
    if result["output_tokens"] != result.get("requested_output_tokens", result["output_tokens"]):
        errors.append(f"{result['system']}: {result['output_tokens']} output tokens counted, "
                      f"{result['requested_output_tokens']} requested")
    if result["system"] != "hf" and result["generated_tokens"] != result["output_tokens"]:
        errors.append(f"{result['system']}: the engine counted {result['generated_tokens']} "
                      f"generated tokens, the outputs hold {result['output_tokens']}")
    if not 0.0 <= result["kv_waste_ratio"] <= 1.0:
        errors.append(f"{result['system']}: waste ratio {result['kv_waste_ratio']} not in [0, 1]")
    limit = result.get("max_num_seqs")
    if limit is not None and result["peak_concurrency"] > limit:
        errors.append(f"{result['system']}: {result['peak_concurrency']} concurrent sequences, "
                      f"above max_num_seqs={limit}")
    return errors


def benchmark_throughput(options: EngineOptions, requests: list[BenchRequest],
                         warmup: bool = True) -> dict[str, Any]:
    """Build the engine, warm it up, run the workload; return the JSON summary with timeline."""
    engine = build_engine(options)
    if warmup:
        warm_up(engine, engine.hf_config.vocab_size)
    result = run_engine(engine, requests, system=options.kv_allocator).to_dict()
    result["accounting_errors"] = accounting_errors(result)
    result["machine"] = machine_info()
    result["engine"] = {"model": options.model, "dtype": options.dtype,
                        "kv_cache_dtype": options.kv_cache_dtype,
                        "quantization": options.quantization,
                        "quantization_group_size": options.quantization_group_size,
                        "int8_activations": options.int8_activations,
                        "max_model_len": engine.max_model_len,
                        "num_cpu_blocks": engine.num_cpu_blocks}
    return result
