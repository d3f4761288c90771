"""LLMEngine: requests in, one scheduled and executed batch per ``step()``, outputs out.

The engine glues the layers together and owns no policy of its own: the scheduler decides what
runs, the KV cache manager where its K/V lives, the model runner computes logits and the sampler
picks tokens. What is left here is the per-request bookkeeping: appending tokens, forking
``n > 1`` samples after the prompt, stop conditions, incremental detokenisation and outputs.
"""
from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterable
from typing import Any

import torch

from pagellm.config import EngineArgs
from pagellm.core.engine_setup import EngineComponents, build_components
from pagellm.core.output_processor import OutputProcessor
from pagellm.core.request import Request, Sequence, SequenceStatus
from pagellm.core.scheduler import SchedulerOutput
from pagellm.core.stats import EngineStats, StatsTracker
from pagellm.outputs import RequestMetrics, RequestOutput
from pagellm.sampling_params import SamplingParams
from pagellm.worker.model_runner import ScheduledSeq
from pagellm.worker.sampler import SamplerOutput, SamplingMetadata

logger = logging.getLogger("pagellm")

PromptType = str | list[int] | dict[str, Any]


class LLMEngine:
    """Continuous-batching engine. Not thread-safe: one caller drives ``step()``."""

    def __init__(self, args: EngineArgs) -> None:
        c: EngineComponents = build_components(args)
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
        self.output_processor = OutputProcessor(self.tokenizer, self.hf_config,
                                                self.max_model_len, c.eos_token_ids)
        self.requests: dict[str, Request] = {}
        self._seq_counter = itertools.count()
        self.stats = StatsTracker()

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
                    cache_salt: str | None = None) -> None:
        """Queue a request. Raises ValueError for anything that could never run.

        Fields of ``params`` the caller did not set take the model's recommended values
        (``default_sampling``, from generation_config.json)."""
        params = (params or SamplingParams()).with_defaults(self.default_sampling)
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text, token_ids = self.tokenize_prompt(prompt)
        self._validate_prompt(token_ids)
        self._validate_params(params)
        max_tokens = self._resolve_max_tokens(len(token_ids), params)
        request = Request(request_id, text, token_ids, params, max_tokens, priority=priority,
                          arrival_time=arrival_time or time.time(), seq_no=next(self._seq_counter),
                          extra_keys=(cache_salt,) if cache_salt else ())
        request.metrics = RequestMetrics(arrival_time=request.arrival_time)
        if params.prompt_logprobs is not None:
            request.prompt_logprobs = [None]
        seq = Sequence(f"{request_id}#0", 0, request, list(token_ids), self._generator(params, 0))
        seq.detokenizer = self.output_processor.new_detokenizer(seq)
        request.seqs.append(seq)
        self.requests[request_id] = request
        self.scheduler.add(seq)

    def _validate_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("the prompt is empty: it must hold at least one token")
        vocab = self.hf_config.vocab_size
        bad = next((t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad!r} is out of range [0, {vocab})")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(token_ids)} tokens, but max_model_len is "
                f"{self.max_model_len}: it must leave room for at least one generated token")

    def _validate_params(self, params: SamplingParams) -> None:
        limit = self.args.max_num_seqs
        if params.n > limit:
            raise ValueError(f"n={params.n} exceeds max_num_seqs={limit}")
        vocab = self.hf_config.vocab_size
        bad = next((t for t in params.stop_token_ids or () if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"stop_token_ids holds {bad}, out of range [0, {vocab})")

    def _resolve_max_tokens(self, num_prompt: int, params: SamplingParams) -> int:
        room = self.max_model_len - num_prompt
        if params.max_tokens is None:
            return room
        if params.max_tokens > room:
            raise ValueError(
                f"prompt ({num_prompt} tokens) + max_tokens ({params.max_tokens}) = "
                f"{num_prompt + params.max_tokens} exceeds max_model_len={self.max_model_len}")
        return params.max_tokens

    def _generator(self, params: SamplingParams, index: int) -> torch.Generator | None:
        if params.seed is None:
            return None
        seed = params.seed if index == 0 else (params.seed * 1_000_003 + index) % (1 << 63)
        return torch.Generator(device=self.device).manual_seed(seed)

    def abort_request(self, request_ids: str | Iterable[str]) -> list[RequestOutput]:
        """Abort requests (unknown ids are ignored); their blocks are freed at once."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        outputs = []
        for rid in request_ids:
            request = self.requests.pop(rid, None)
            if request is None:
                continue
            for seq in request.seqs:
                if not seq.status.is_finished:
                    self.scheduler.remove(seq)
                    seq.status = SequenceStatus.FINISHED_ABORTED
            request.metrics.finished_time = time.time()
            outputs.append(self.output_processor.build_request_output(request))
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
        self.stats.record_schedule(plan)
        if plan.is_empty:
            return self._fail_unschedulable()
        self._apply_cache_ops(plan)
        batch = [self._scheduled_seq(item.seq, item.num_new_tokens) for item in plan.scheduled]
        logits = self.runner.execute(batch)
        touched = self._consume_logits(plan, batch, logits)
        return self._finish_step(touched)

    def _apply_cache_ops(self, plan: SchedulerOutput) -> None:
        if plan.blocks_to_swap_out:
            self.cache_engine.swap_out(plan.blocks_to_swap_out)
        if plan.blocks_to_swap_in:
            self.cache_engine.swap_in(plan.blocks_to_swap_in)
        if plan.blocks_to_copy:
            self.cache_engine.copy_blocks(plan.blocks_to_copy)

    def _scheduled_seq(self, seq: Sequence, num_new: int) -> ScheduledSeq:
        start = seq.num_computed_tokens - num_new
        request = seq.request
        need_prompt = (request.prompt_logprobs is not None
                       and len(request.prompt_logprobs) < request.num_prompt_tokens
                       and start < request.num_prompt_tokens)
        return ScheduledSeq(seq.token_ids, start, num_new, self.kv.get_block_table(seq.seq_id),
                            need_logits=seq.num_computed_tokens == seq.num_tokens,
                            need_prompt_logits=need_prompt)

    def _consume_logits(self, plan: SchedulerOutput, batch: list[ScheduledSeq],
                        logits: torch.Tensor) -> set[Request]:
        """Split the logits rows: prompt logprobs, then one sampling row per sampling seq."""
        sample_rows: list[int] = []
        sample_seqs: list[Sequence] = []
        row = 0
        for item, sched in zip(plan.scheduled, batch):
            seq = item.seq
            if sched.need_prompt_logits:
                self._record_prompt_logprobs(seq, sched, logits[row:row + sched.num_new_tokens])
                row += sched.num_new_tokens
                if sched.need_logits:
                    sample_rows.append(row - 1)
                    sample_seqs.append(seq)
            elif sched.need_logits:
                sample_rows.append(row)
                sample_seqs.append(seq)
                row += 1
        touched: set[Request] = set()
        if sample_seqs:
            rows, seqs = self._expand_forks(sample_rows, sample_seqs)
            # Rows 0..n-1 in order (plain decode batches) need no gathered copy of the logits.
            picked = logits[:len(rows)] if rows == list(range(len(rows))) else logits[rows]
            sampled = self._sample(picked, seqs)
            self._append_tokens(seqs, sampled)
            touched.update(seq.request for seq in seqs)
        return touched

    def _expand_forks(self, rows: list[int], seqs: list[Sequence]
                      ) -> tuple[list[int], list[Sequence]]:
        """A request with n > 1 that finished its prompt samples n tokens from one logits row:
        its prompt sequence is forked into n sequences sharing the prompt's blocks."""
        out_rows, out_seqs = [], []
        for row, seq in zip(rows, seqs):
            request = seq.request
            out_rows.append(row)
            out_seqs.append(seq)
            if request.params.n > 1 and not request.forked:
                request.forked = True
                for index in range(1, request.params.n):
                    child = self._fork(seq, index)
                    out_rows.append(row)
                    out_seqs.append(child)
        return out_rows, out_seqs

    def _fork(self, parent: Sequence, index: int) -> Sequence:
        request = parent.request
        child = Sequence(f"{request.request_id}#{index}", index, request, list(parent.token_ids),
                         self._generator(request.params, index))
        child.num_computed_tokens = parent.num_computed_tokens
        child.detokenizer = self.output_processor.new_detokenizer(child)
        request.seqs.append(child)
        copies = self.kv.fork(parent.seq_id, child.seq_id)
        if copies is None:
            # The contiguous baseline found no free reservation for the child: it waits and
            # recomputes its tokens when admitted, like a sequence preempted by recompute.
            child.num_computed_tokens = 0
            self.scheduler.add(child)
            return child
        if copies:  # the contiguous baseline copies the parent's blocks instead of sharing
            self.cache_engine.copy_blocks(copies)
        self.scheduler.add_running(child)
        return child

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> SamplerOutput:
        meta = SamplingMetadata(
            params=[s.request.params for s in seqs],
            prompt_token_ids=[s.request.prompt_token_ids for s in seqs],
            output_token_ids=[s.output_token_ids for s in seqs],
            generators=[s.generator for s in seqs])
        return self.sampler(logits, meta)

    def _record_prompt_logprobs(self, seq: Sequence, sched: ScheduledSeq,
                                logits: torch.Tensor) -> None:
        """Row i predicts token start + i + 1; only prompt tokens are recorded."""
        request = seq.request
        k = request.params.prompt_logprobs
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        start = sched.num_computed_tokens
        for i in range(logprobs.shape[0]):
            pos = start + i + 1
            if pos >= request.num_prompt_tokens or pos < len(request.prompt_logprobs):
                continue
            request.prompt_logprobs.append(
                self.output_processor.logprob_dict(logprobs[i], request.prompt_token_ids[pos], k))

    def _append_tokens(self, seqs: list[Sequence], sampled: SamplerOutput) -> None:
        now = time.time()
        for i, seq in enumerate(seqs):
            token = sampled.token_ids[i]
            seq.token_ids.append(token)
            if seq.logprobs is not None:
                seq.cumulative_logprob += sampled.logprobs[i]
                seq.logprobs.append(self.output_processor.token_logprobs(sampled, i))
            self.stats.record_token(seq, now)
            self.output_processor.update(seq)
            if seq.status.is_finished:
                self.output_processor.finish(seq)
                self.scheduler.remove(seq)

    def _finish_step(self, touched: set[Request]) -> list[RequestOutput]:
        outputs = []
        now = time.time()
        for request in sorted(touched, key=lambda r: r.seq_no):
            if request.is_finished:
                request.metrics.finished_time = now
                self.requests.pop(request.request_id, None)
                self.stats.record_finished(request)
            outputs.append(self.output_processor.build_request_output(request))
        return outputs

    def _fail_unschedulable(self) -> list[RequestOutput]:
        """Nothing could be scheduled. With nothing running or swapped, the head of the waiting
        queue can never fit (it needs more blocks than exist): finish it with an error rather
        than retry it for ever."""
        sched = self.scheduler
        head = sched.next_waiting()
        if sched.running or sched.swapped or head is None:
            return []
        request = head.request
        request.error = (f"request {request.request_id!r} cannot fit in the KV cache "
                         f"({self.num_gpu_blocks} blocks of {self.args.block_size} tokens)")
        logger.warning(request.error)
        return self.abort_request(request.request_id)

    def get_stats(self) -> EngineStats:
        return self.stats.snapshot(self.scheduler, self.kv)
