"""HuggingFace transformers baselines on the same weights and the same KV memory budget.

- ``run_hf_static``: ``model.generate`` with static batching, the way transformers is used for
  offline batches. Requests are taken in arrival order into the largest batch whose padded KV
  fits the budget: a batch of B requests holds B x (longest prompt + longest output) slots at its
  last step, because every row is left-padded to the longest prompt and decodes until the
  longest output is done. Rows finish together, so a short request keeps its row (and computes
  tokens nobody asked for) until the batch ends. Those extra tokens are counted in
  ``generated_tokens`` but not in the useful ``output_tokens``.
- ``run_hf_continuous``: transformers' own continuous batching with its paged cache
  (``model.continuous_batching_context_manager``), given the same number of KV blocks of the
  same block size (``page_size``) and the same ``max_num_seqs``; prefix sharing is off so that
  its block counts measure the workload alone.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from pagellm.bench.timeline import RunResult, Timeline
from pagellm.bench.workloads import BenchRequest

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_hf_model(path: str | Path, dtype: str = "bfloat16"):
    from transformers import AutoModelForCausalLM

    from pagellm.model.gguf_config import is_gguf_file

    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r} is not one of {', '.join(_DTYPES)}")
    if is_gguf_file(path):  # transformers dequantizes GGUF files itself (needs accelerate)
        path = Path(path)
        return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                    dtype=_DTYPES[dtype]).eval()
    return AutoModelForCausalLM.from_pretrained(path, dtype=_DTYPES[dtype]).eval()


def static_batches(requests: list[BenchRequest], kv_slots_budget: int,
                   max_batch_size: int | None = None) -> list[list[int]]:
    """Indices of each batch: arrival order, each batch as large as the padded KV allows."""
    batches: list[list[int]] = []
    batch: list[int] = []
    longest_prompt = longest_output = 0
    for i, request in enumerate(requests):
        if request.prompt_len + request.output_len > kv_slots_budget:
            raise ValueError(f"request {i} needs {request.prompt_len + request.output_len} KV "
                             f"slots, more than the budget of {kv_slots_budget}")
        prompt = max(longest_prompt, request.prompt_len)
        output = max(longest_output, request.output_len)
        full = max_batch_size is not None and len(batch) == max_batch_size
        if batch and (full or (len(batch) + 1) * (prompt + output) > kv_slots_budget):
            batches.append(batch)
            batch, prompt, output = [], request.prompt_len, request.output_len
        batch.append(i)
        longest_prompt, longest_output = prompt, output
    if batch:
        batches.append(batch)
    return batches


class _StepRecorder:
    """A stopping criterion that never stops: it samples the padded batch after every step."""

    def __init__(self, timeline: Timeline, start: float, prompt_lens: list[int],
                 output_lens: list[int], padded_prompt_len: int, waiting: int) -> None:
        self.timeline, self.start = timeline, start
        self.prompt_lens, self.output_lens = prompt_lens, output_lens
        self.padded_prompt_len = padded_prompt_len
        self.waiting = waiting
        self.steps = 0
        self.first_token_s: float | None = None  # since the run's start

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        self.steps += 1
        if self.first_token_s is None:
            self.first_token_s = time.perf_counter() - self.start
        self.record(self.steps)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    def record(self, num_generated: int) -> None:
        rows = len(self.prompt_lens)
        filled = sum(p + min(num_generated, o) for p, o in zip(self.prompt_lens, self.output_lens))
        self.timeline.add(time.perf_counter() - self.start, rows, self.waiting,
                          rows * (self.padded_prompt_len + num_generated), filled)


def run_hf_static(model, requests: list[BenchRequest], kv_slots_budget: int,
                  max_batch_size: int | None = None, pad_token_id: int = 0) -> RunResult:
    """Greedy ``generate`` over padded static batches; EOS is ignored (every row runs to the
    batch's longest output)."""
    from transformers import GenerationConfig, StoppingCriteriaList

    batches = static_batches(requests, kv_slots_budget, max_batch_size)
    timeline = Timeline()
    generated = 0
    done = 0
    ttft: list[float] = []
    start = time.perf_counter()
    for batch in batches:
        chunk = [requests[i] for i in batch]
        longest_prompt = max(r.prompt_len for r in chunk)
        longest_output = max(r.output_len for r in chunk)
        input_ids, attention_mask = (t.to(model.device) for t in
                                     _left_pad(chunk, longest_prompt, pad_token_id))
        recorder = _StepRecorder(timeline, start, [r.prompt_len for r in chunk],
                                 [r.output_len for r in chunk], longest_prompt,
                                 len(requests) - done - len(chunk))
        recorder.record(0)
        config = GenerationConfig(max_new_tokens=longest_output, do_sample=False,
                                  eos_token_id=None, pad_token_id=pad_token_id)
        with torch.inference_mode():
            out = model.generate(input_ids=input_ids, attention_mask=attention_mask,
                                 generation_config=config,
                                 stopping_criteria=StoppingCriteriaList([recorder]))
        new_tokens = out.shape[1] - longest_prompt
        if new_tokens != longest_output:
            raise RuntimeError(f"generate stopped after {new_tokens} of {longest_output} tokens")
        generated += len(chunk) * new_tokens
        done += len(chunk)
        ttft += [recorder.first_token_s] * len(chunk)
    elapsed = time.perf_counter() - start
    timeline.add(elapsed, 0, 0, 0, 0)
    return RunResult(
        system="hf", num_requests=len(requests),
        prompt_tokens=sum(r.prompt_len for r in requests),
        output_tokens=sum(r.output_len for r in requests), generated_tokens=generated,
        elapsed_s=elapsed, kv_slots_budget=kv_slots_budget, timeline=timeline, ttft_s=ttft,
        extra={"num_batches": len(batches),
               "batch_sizes": [len(b) for b in batches]})


def _left_pad(chunk: list[BenchRequest], length: int, pad_token_id: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    input_ids = torch.full((len(chunk), length), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(chunk), length), dtype=torch.long)
    for row, request in enumerate(chunk):
        input_ids[row, length - request.prompt_len:] = torch.tensor(request.prompt_token_ids)
        attention_mask[row, length - request.prompt_len:] = 1
    return input_ids, attention_mask


def run_hf_continuous(model, requests: list[BenchRequest], num_blocks: int, block_size: int,
                      max_num_seqs: int, max_batch_tokens: int,
                      poll_interval: float = 0.02) -> RunResult:
    """transformers' continuous batching with ``num_blocks`` paged KV blocks of ``block_size``
    tokens. It runs in its own thread; this thread samples its KV blocks and active requests."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    cb_config = ContinuousBatchingConfig(
        page_size=block_size, num_blocks=num_blocks, max_batch_tokens=max_batch_tokens,
        max_requests_per_batch=max_num_seqs, allow_block_sharing=False,
        use_async_batching=False, use_cuda_graph=False)
    gen_config = GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=0,
                                  max_new_tokens=max(r.output_len for r in requests))
    timeline = Timeline()
    results = {}
    # Its logger complains on every start that psutil (GPU memory accounting) is missing.
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)
    with model.continuous_batching_context_manager(
            generation_config=gen_config, continuous_batching_config=cb_config,
            warmup=False) as manager:
        start = time.perf_counter()
        for i, request in enumerate(requests):
            manager.add_request(request.prompt_token_ids, request_id=f"req_{i}",
                                max_new_tokens=request.output_len, eos_token_id=-1,
                                record_timestamps=True)
        last_sample = -poll_interval
        while len(results) < len(requests):
            result = manager.get_result(timeout=poll_interval)
            if result is not None and result.is_finished():
                if result.error:
                    raise RuntimeError(f"transformers failed {result.request_id}: {result.error}")
                results[result.request_id] = result
            elif result is None and not manager.is_running():
                raise RuntimeError("transformers' continuous batching thread stopped")
            now = time.perf_counter() - start
            if now - last_sample >= poll_interval:
                _sample_continuous(manager, timeline, now, block_size)
                last_sample = now
        elapsed = time.perf_counter() - start
    timeline.add(elapsed, 0, 0, 0, 0)
    generated = sum(len(r.generated_tokens) for r in results.values())
    return RunResult(
        system="hf_continuous", num_requests=len(requests),
        prompt_tokens=sum(r.prompt_len for r in requests),
        output_tokens=generated, generated_tokens=generated, elapsed_s=elapsed,
        kv_slots_budget=num_blocks * block_size, timeline=timeline,
        ttft_s=[r.timestamps[0] - start for r in results.values() if r.timestamps],
        extra={"requested_output_tokens": sum(r.output_len for r in requests)})


def _sample_continuous(manager, timeline: Timeline, now: float, block_size: int) -> None:
    """Read the manager's state from this thread; dicts may change under us, so retry."""
    processor = getattr(manager, "batch_processor", None)
    if processor is None:
        return
    for _ in range(5):
        try:
            active = list(processor.scheduler.active_requests.values())
            waiting = len(processor.scheduler.waiting_requests)
            tables = processor.cache.cache_allocators["full_attention"].block_table
            reserved = sum(len(tables.get(s.request_id, ())) for s in active) * block_size
            filled = sum(s.position_offset for s in active)
        except RuntimeError:  # dictionary changed size during iteration
            continue
        timeline.add(now, len(active), waiting, reserved, min(filled, reserved))
        return
