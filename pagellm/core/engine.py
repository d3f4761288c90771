"""LLMEngine: requests in, one scheduled and executed batch per ``step()``, outputs out.

The engine glues the layers together and owns no state of its own beyond the request table:
the scheduler owns sequences and the KV cache manager (what runs, forks, stops, frees), the
worker computes what the plan asks (logits, samples, logprobs), the output processor turns
tokens into text and outputs. A step is: schedule, execute, update from the output, make
outputs (vLLM v1's shape).

Failures are attributed as narrowly as the engine can tell (nothing a client sends may stop
the engine for the others):

- a request that could never run (bad values, a prompt too long, a min_tokens that bans every
  token) is refused by ``add_request`` with a ValueError;
- a runner output that is wrong for one sequence (a sampled id outside ``[0, vocab_size)``)
  fails that sequence's request only: its output carries the error, its blocks are freed;
- an exception raised while the worker executes a step cannot be pinned on one request (a
  partly applied step, its swaps, copies and generator draws, cannot be replayed to find out):
  the step's requests fail with the error and the engine goes on serving the others;
- ``MAX_CONSECUTIVE_FAILED_STEPS`` failing steps in a row are the engine's own failure (the
  device, the model), not a request's: ``step()`` raises ``EngineDeadError`` and the server
  reports itself unhealthy.
"""
from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterable
from typing import Any

from pagellm.config import EngineArgs
from pagellm.core.output_processor import OutputProcessor
from pagellm.core.plan import ModelRunnerOutput, SchedulerOutput
from pagellm.core.request import Request
from pagellm.core.scheduler import StepUpdate
from pagellm.core.kv_view import build_kv_view
from pagellm.core.stats import EngineStats, StatsTracker
from pagellm.lora.request import LoRARequest
from pagellm.outputs import RequestMetrics, RequestOutput
from pagellm.sampling_params import SamplingParams

logger = logging.getLogger("pagellm")

PromptType = str | list[int] | dict[str, Any]

# Steps that fail in a row before the engine is declared dead; one success resets the count.
MAX_CONSECUTIVE_FAILED_STEPS = 3


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class EngineDeadError(RuntimeError):
    """The engine itself failed (several steps in a row): no request can be served."""


def check_prompt_length(num_tokens: int, max_model_len: int) -> None:
    """ValueError unless a prompt of ``num_tokens`` leaves room for one generated token."""
    if num_tokens >= max_model_len:
        raise ValueError(f"the prompt has {num_tokens} tokens, but max_model_len is "
                         f"{max_model_len}: it must leave room for at least one generated token")


class LLMEngine:
    """Continuous-batching engine. Not thread-safe: one caller drives ``step()``."""

    def __init__(self, args: EngineArgs) -> None:
        # the model side (torch) is built here, so that importing pagellm.core needs no torch
        from pagellm.worker.engine_setup import build_components

        c = build_components(args)
        self.args = args
        self.device = c.device
        self.hf_config = c.hf_config
        self.tokenizer = c.tokenizer
        self.max_model_len = c.max_model_len
        self.kv = c.kv
        self.cache_engine = c.cache_engine
        self.runner = c.runner
        self.sampler = c.sampler
        self.scheduler = c.scheduler
        self.num_gpu_blocks = c.num_gpu_blocks
        self.num_cpu_blocks = c.num_cpu_blocks
        self.default_sampling = c.default_sampling
        self.worker = c.worker
        self.grammar_compiler = c.grammar_compiler
        self.output_processor = OutputProcessor(self.tokenizer)
        self.requests: dict[str, Request] = {}
        self._seq_counter = itertools.count()
        self.stats = StatsTracker()
        self.num_consecutive_failed_steps = 0

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        return cls(args)

    # ------------------------------------------------------------------ requests
    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self.tokenize_prompt(prompt["prompt"])
            raise ValueError("prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, (list, tuple)):
            return None, list(prompt)
        raise ValueError(f"prompt of type {type(prompt).__name__} is not supported: pass a str, "
                         "a list of token ids or {'prompt_token_ids': [...]}")

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
                    priority: int = 0, arrival_time: float | None = None,
                    cache_salt: str | None = None,
                    lora_request: LoRARequest | None = None) -> None:
        """Queue a request. Raises ValueError for anything that could never run.

        Fields of ``params`` the caller did not set take the model's recommended values
        (``default_sampling``, from generation_config.json). ``lora_request``: run it with that
        adapter (loaded and checked now; its KV blocks are cached apart from other adapters')."""
        params = (params or SamplingParams()).with_defaults(self.default_sampling)
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text, token_ids = self.tokenize_prompt(prompt)
        self._validate_prompt(token_ids)
        self._validate_params(params)
        params = self._resolve_bad_words(params)
        max_tokens = self._resolve_max_tokens(len(token_ids), params)
        extra_keys = (cache_salt,) if cache_salt else ()
        if lora_request is not None:
            self.add_lora(lora_request)
            extra_keys = (lora_request.cache_key, *extra_keys)
        request = Request(request_id, text, token_ids, params, max_tokens, priority=priority,
                          arrival_time=arrival_time or time.time(), seq_no=next(self._seq_counter),
                          extra_keys=extra_keys, lora_request=lora_request)
        request.metrics = RequestMetrics(arrival_time=request.arrival_time)
        if params.prompt_logprobs is not None:
            request.prompt_logprobs = [None]
        self.requests[request_id] = request
        self.scheduler.add_request(request)

    def _validate_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("the prompt is empty: it must hold at least one token")
        vocab = self.hf_config.vocab_size
        bad = next((t for t in token_ids if not _is_int(t) or not 0 <= t < vocab), None)
        if bad is not None:
            if not _is_int(bad):
                raise ValueError(f"prompt token ids must be Python ints, got {bad!r} "
                                 f"({type(bad).__name__})")
            raise ValueError(f"prompt token id {bad!r} is out of range [0, {vocab})")
        check_prompt_length(len(token_ids), self.max_model_len)

    def _validate_params(self, params: SamplingParams) -> None:
        limit = self.args.max_num_seqs
        if params.n > limit:
            raise ValueError(f"n={params.n} exceeds max_num_seqs={limit}")
        vocab = self.hf_config.vocab_size
        bad = next((t for t in params.stop_token_ids or () if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"stop_token_ids holds {bad}, out of range [0, {vocab})")
        if params.min_tokens > 0:
            banned = set(params.stop_token_ids or ())
            if not params.ignore_eos:
                banned.update(self.scheduler.eos_token_ids)
            if len(banned) >= vocab:
                raise ValueError(
                    f"min_tokens={params.min_tokens} bans every one of the {vocab} tokens of the "
                    "vocabulary (stop_token_ids and EOS): nothing could be sampled")
        for name in ("allowed_token_ids", "logit_bias"):
            bad = next((t for t in getattr(params, name) or () if t >= vocab), None)
            if bad is not None:
                raise ValueError(f"{name} holds token {bad}, out of range [0, {vocab})")
        if params.structured_outputs is not None:
            self.grammar_compiler.compile(params.structured_outputs)  # ValueError if invalid

    def _resolve_bad_words(self, params: SamplingParams) -> SamplingParams:
        """A copy of ``params`` with ``bad_words`` as token ids (vLLM's rule: each word as
        written and after a space, as the tokenizer splits it mid-sentence)."""
        if not params.bad_words:
            return params
        params = params.clone()
        words: list[list[int]] = []
        for word in params.bad_words:
            for text in (word, " " + word.lstrip()):
                ids = list(self.tokenizer.encode(text, add_special_tokens=False))
                if ids and ids not in words:
                    words.append(ids)
        params.bad_words_token_ids = words
        return params

    def _resolve_max_tokens(self, num_prompt: int, params: SamplingParams) -> int:
        room = self.max_model_len - num_prompt
        if params.max_tokens is None:
            return room
        if params.max_tokens > room:
            raise ValueError(
                f"prompt ({num_prompt} tokens) + max_tokens ({params.max_tokens}) = "
                f"{num_prompt + params.max_tokens} exceeds max_model_len={self.max_model_len}")
        return params.max_tokens

    # ------------------------------------------------------------------ adapters
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Register an adapter and load it (ValueError when LoRA is off or it cannot be
        served). True once registered, as vLLM."""
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got "
                             f"{type(lora_request).__name__}")
        if self.worker.lora_manager is None:
            raise ValueError(f"a request asks for LoRA adapter {lora_request.lora_name!r} but "
                             "the engine was started without enable_lora=True")
        self.worker.lora_manager.add_lora(lora_request)
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter; requests already queued with it still finish (it is loaded
        again from its folder if needed). False when it was not registered."""
        manager = self.worker.lora_manager
        return manager is not None and manager.remove_lora(lora_int_id)

    def list_loras(self) -> list[LoRARequest]:
        manager = self.worker.lora_manager
        return [] if manager is None else manager.list_loras()

    def abort_request(self, request_ids: str | Iterable[str]) -> list[RequestOutput]:
        """Abort requests (unknown ids are ignored); their blocks are freed at once. Returns
        their final outputs."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        outputs = []
        for rid in request_ids:
            request = self.requests.pop(rid, None)
            if request is None:
                continue
            self.scheduler.abort_request(request)
            request.metrics.finished_time = time.time()
            outputs.append(self.output_processor.make_output(request))
        return outputs

    def abort_all(self) -> list[RequestOutput]:
        """Abort every unfinished request (shutdown)."""
        return self.abort_request(list(self.requests))

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ------------------------------------------------------------------ step
    def step(self) -> list[RequestOutput]:
        """Schedule one batch, run it, and return outputs of the requests that progressed."""
        plan = self.scheduler.schedule()
        self.stats.record_schedule(plan, self.scheduler.seqs)
        if plan.is_empty:
            return self._fail_unschedulable(plan)
        try:
            runner_output = self.worker.execute_model(plan)
        except EngineDeadError as exc:  # e.g. a tensor-parallel worker died: no retry helps
            self._fail_requests(self._plan_request_ids(plan), f"the engine died: {exc}")
            raise
        except Exception as exc:  # noqa: BLE001 - attributed to the step's requests
            return self._fail_step(plan, exc)
        except BaseException as exc:  # interrupted: end the step's requests, then stop
            self._fail_requests(self._plan_request_ids(plan), f"the engine step failed: {exc!r}")
            raise
        self.num_consecutive_failed_steps = 0
        failed = self._check_runner_output(runner_output)
        update = self.scheduler.update_from_output(plan, runner_output)
        return failed + self._finish_step(update)

    def _plan_request_ids(self, plan: SchedulerOutput) -> list[str]:
        seqs = self.scheduler.seqs
        return list(dict.fromkeys(seqs[item.seq_id].request.request_id
                                  for item in plan.scheduled if item.seq_id in seqs))

    def _fail_requests(self, request_ids: Iterable[str], error: str) -> list[RequestOutput]:
        """End requests with ``error`` in their outputs, a fault of the engine's own
        (``error_internal``); their blocks are freed (and no K/V that was never written stays
        in the prefix cache)."""
        request_ids = [rid for rid in request_ids if rid in self.requests]
        for request_id in request_ids:
            self.requests[request_id].error = error
            self.requests[request_id].error_internal = True
        return self.abort_request(request_ids)

    def _fail_step(self, plan: SchedulerOutput, exc: Exception) -> list[RequestOutput]:
        """The worker raised: the step's requests fail, the engine goes on, unless steps keep
        failing (then the fault is the engine's own)."""
        self.num_consecutive_failed_steps += 1
        logger.error("engine step failed (%d in a row): %r", self.num_consecutive_failed_steps,
                     exc, exc_info=exc)
        outputs = self._fail_requests(self._plan_request_ids(plan),
                                      f"the engine step failed: {exc!r}")
        if self.num_consecutive_failed_steps >= MAX_CONSECUTIVE_FAILED_STEPS:
            raise EngineDeadError(f"{self.num_consecutive_failed_steps} engine steps failed in a "
                                  f"row, the last with {exc!r}") from exc
        return outputs

    def _check_runner_output(self, output: ModelRunnerOutput) -> list[RequestOutput]:
        """Fail the request of each sequence whose sampled ids are not token ids (they would
        break the next step's embedding lookup for the whole batch)."""
        vocab = self.hf_config.vocab_size
        bad: dict[str, str] = {}
        for seq_id, samples in output.sampled.items():
            for sample in samples:
                token = sample.token_id
                if isinstance(token, int) and 0 <= token < vocab:
                    continue
                seq = self.scheduler.seqs.get(seq_id)
                if seq is not None:
                    bad[seq.request.request_id] = (f"the model produced token id {token!r}, "
                                                   f"out of range [0, {vocab})")
        outputs = []
        for request_id, error in bad.items():
            logger.error("request %s failed: %s", request_id, error)
            outputs += self._fail_requests([request_id], error)
        return outputs

    def _finish_step(self, update: StepUpdate) -> list[RequestOutput]:
        now = time.time()
        for seq, _ in update.new_tokens:
            self.stats.record_token(seq, now)
        outputs = self.output_processor.process(update, self.scheduler)
        for request in update.requests.values():
            if request.is_finished and self.requests.pop(request.request_id, None):
                request.metrics.finished_time = now
                self.stats.record_finished(request)
        return outputs

    def _fail_unschedulable(self, plan: SchedulerOutput) -> list[RequestOutput]:
        """Nothing could be scheduled. With nothing running or swapped, the head of the waiting
        queue can never fit (it needs more blocks than exist): finish it with an error rather
        than retry it for ever."""
        self.worker.execute_model(plan)  # still apply the plan's cache operations, if any
        sched = self.scheduler
        head = sched.next_waiting()
        if sched.running or sched.swapped or head is None:
            return []
        request = head.request
        request.error = (f"request {request.request_id!r} cannot fit in the KV cache "
                         f"({self.num_gpu_blocks} blocks of {self.args.block_size} tokens)")
        logger.warning(request.error)
        return self.abort_request(request.request_id)

    def shutdown(self) -> None:
        """Stop the engine's worker processes or actors (tensor parallelism); a no-op on one
        device. The engine cannot step afterwards."""
        self.worker.shutdown()

    def get_stats(self) -> EngineStats:
        stats = self.stats.snapshot(self.scheduler, self.kv)
        if self.worker.lora_manager is not None:
            stats.lora = self.worker.lora_manager.get_stats()
        stats.kv_cache_dtype = self.args.kv_cache_dtype
        stats.kv_bytes_per_block = self.cache_engine.block_bytes
        stats.quantization = self.args.quantization
        return stats

    def get_kv_view(self, history: Iterable[dict[str, float]] = ()) -> dict[str, Any]:
        """The block map, its sequences and the statistics, taken together (core/kv_view.py)."""
        return build_kv_view(self.scheduler, self.kv, self.get_stats(), history)
