"""Where an engine step's time goes: model forward against everything else.

At each batch size N the benchmark admits N requests with distinct random prompts of
``prompt_len`` tokens, runs their prefills, then times ``decode_steps`` steps in which exactly N
sequences decode one token each. The engine's stages are timed by wrapping the methods the
engine calls on its own objects (instance attributes, so nothing else is affected):

- ``model_forward``: the model's forward pass (by the model, the CPU decode plan or a captured
  CUDA graph) and the vocabulary projection of the sampled rows;
- ``prepare_inputs``: packing token ids, positions, slot mapping and block tables into tensors;
- ``schedule``: the scheduler's step plan, including ``kv_allocate`` (the KV cache manager's
  slot allocation, reported separately as a part of it);
- ``sample``: the sampler over the logits rows;
- ``output_processing``: the scheduler's update from the runner's output (appending tokens,
  stop checks, freeing) and the output processor (incremental detokenisation, outputs);
- ``other``: what is left of the step (cache ops, logits slicing, stats, outputs).

``overhead_fraction`` = (step - model_forward) / step: the target is under 5% at 256 sequences.
"""
from __future__ import annotations

import functools
import random
import time
from collections import defaultdict
from dataclasses import asdict, dataclass
from typing import Any, Callable

# Extra output tokens per request for the decode steps taken while the batch is admitted.
PREFILL_SLACK = 48
STAGES = ("model_forward", "prepare_inputs", "schedule", "kv_allocate", "sample",
          "output_processing")


@dataclass(slots=True)
class StepBenchConfig:
    model: str
    dtype: str = "bfloat16"
    batch_sizes: tuple[int, ...] = (1, 32, 128, 256)
    prompt_len: int = 128
    decode_steps: int = 16
    block_size: int = 16
    seed: int = 0
    # every request's sampling: greedy by default; temperature > 0 samples at random (with
    # top_p), each request seeded
    temperature: float = 0.0
    top_p: float = 1.0


class StageTimers:
    """Accumulated seconds per stage since the last ``reset``."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def reset(self) -> None:
        self.seconds.clear()

    def wrap(self, owner: Any, method: str, stage: str) -> None:
        inner: Callable = getattr(owner, method)
        seconds = self.seconds

        @functools.wraps(inner)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                seconds[stage] += time.perf_counter() - start

        setattr(owner, method, timed)


def install_timers(engine) -> StageTimers:
    timers = StageTimers()
    model = engine.runner.model
    timers.wrap(model, "forward", "model_forward")
    timers.wrap(model, "compute_logits", "model_forward")
    # Decode-only steps may bypass model.forward: the CPU decode plan calls the layers'
    # kernels in a row, and on CUDA a captured graph is replayed. Both are the forward.
    for fast_path in (engine.runner.cpu_decode, engine.runner.decode_graphs):
        if fast_path is not None:
            timers.wrap(fast_path, "run", "model_forward")
    timers.wrap(engine.runner, "prepare_inputs", "prepare_inputs")
    timers.wrap(engine.scheduler, "schedule", "schedule")
    timers.wrap(engine.kv, "allocate_slots", "kv_allocate")
    timers.wrap(engine.worker, "sampler", "sample")
    timers.wrap(engine.scheduler, "update_from_output", "output_processing")
    timers.wrap(engine.output_processor, "process", "output_processing")
    return timers


def build_step_engine(config: StepBenchConfig):
    from pagellm.config import EngineArgs
    from pagellm.core.engine import LLMEngine

    largest = max(config.batch_sizes)
    max_len = config.prompt_len + config.decode_steps + PREFILL_SLACK + 8
    blocks_per_seq = -(-max_len // config.block_size)
    return LLMEngine.from_engine_args(EngineArgs(
        model=config.model, dtype=config.dtype, block_size=config.block_size,
        max_model_len=max_len, max_num_seqs=largest,
        max_num_batched_tokens=max(8192, config.prompt_len),
        # 10% on top: the scheduler keeps a watermark of free blocks when admitting requests.
        num_gpu_blocks_override=int(largest * blocks_per_seq * 1.1) + 16, swap_space=0,
        enable_prefix_caching=False, seed=config.seed))


def _add_requests(engine, num_seqs: int, config: StepBenchConfig, tag: str) -> None:
    from pagellm.sampling_params import RequestOutputKind, SamplingParams

    rng = random.Random(f"{config.seed}-{tag}")
    vocab = engine.hf_config.vocab_size
    # Sequences admitted first decode while later ones prefill (chunked prefill), so they
    # need room for those steps too: none may finish during the timed steps. DELTA outputs,
    # as the server streams them (a CUMULATIVE output copies every token list each step).
    for i in range(num_seqs):
        params = SamplingParams(temperature=config.temperature, top_p=config.top_p,
                                seed=i if config.temperature > 0 else None,
                                max_tokens=config.decode_steps + PREFILL_SLACK,
                                ignore_eos=True, output_kind=RequestOutputKind.DELTA)
        prompt = [rng.randrange(3, vocab) for _ in range(config.prompt_len)]
        engine.add_request(f"{tag}-{i}", {"prompt_token_ids": prompt}, params)


def _all_decoding(engine, num_seqs: int) -> bool:
    running = engine.scheduler.running
    return (len(running) == num_seqs and not engine.scheduler.waiting
            and all(seq.num_computed_tokens == seq.num_tokens - 1 for seq in running))


def measure_batch(engine, timers: StageTimers, num_seqs: int, config: StepBenchConfig
                  ) -> dict[str, Any]:
    """Prefill N sequences, then time pure decode steps with N running."""
    tag = f"n{num_seqs}"
    _add_requests(engine, num_seqs, config, tag)
    for _ in range(num_seqs * config.prompt_len + 8):  # enough for any admission order
        if _all_decoding(engine, num_seqs):
            break
        engine.step()
    else:
        raise RuntimeError(f"{num_seqs} sequences never all reached the decode phase")
    timers.reset()
    step_seconds = 0.0
    for _ in range(config.decode_steps):
        start = time.perf_counter()
        engine.step()
        step_seconds += time.perf_counter() - start
        if len(engine.scheduler.running) != num_seqs:
            raise RuntimeError(f"{len(engine.scheduler.running)} sequences running, "
                               f"wanted {num_seqs}")
    stages = {s: timers.seconds.get(s, 0.0) for s in STAGES}
    engine.abort_request([f"{tag}-{i}" for i in range(num_seqs)])
    return _row(num_seqs, config.decode_steps, step_seconds, stages)


def _row(num_seqs: int, steps: int, step_seconds: float, stages: dict[str, float]
         ) -> dict[str, Any]:
    accounted = sum(v for k, v in stages.items() if k != "kv_allocate")
    per_step_ms = {k: round(1000 * v / steps, 3) for k, v in stages.items()}
    per_step_ms["other"] = round(1000 * (step_seconds - accounted) / steps, 3)
    step_ms = 1000 * step_seconds / steps
    return {
        "num_seqs": num_seqs,
        "step_ms": round(step_ms, 3),
        "model_forward_ms": per_step_ms["model_forward"],
        "overhead_ms": round(step_ms - per_step_ms["model_forward"], 3),
        "overhead_fraction": round(1 - stages["model_forward"] / step_seconds, 4),
        "decode_tokens_per_s": round(num_seqs * steps / step_seconds, 1),
        "stages_ms": per_step_ms,
    }


def benchmark_engine_step(config: StepBenchConfig) -> dict[str, Any]:
    from pagellm.bench.throughput import machine_info

    engine = build_step_engine(config)
    timers = install_timers(engine)
    measure_batch(engine, timers, 1, StepBenchConfig(**{**asdict(config), "decode_steps": 2}))
    rows = [measure_batch(engine, timers, n, config) for n in config.batch_sizes]
    largest = rows[-1]
    return {
        "config": asdict(config),
        "machine": machine_info(),
        "context_len_max": config.prompt_len + config.decode_steps + PREFILL_SLACK,
        "results": rows,
        "target": {"num_seqs": largest["num_seqs"], "overhead_fraction_max": 0.05,
                   "met": largest["overhead_fraction"] < 0.05},
    }
