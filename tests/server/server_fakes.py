"""A stand-in for LLMEngine with the same interface and no model: each step appends one token
(prompt's last token + 1, + 2, ...) to every running request. It lets the async engine and the
HTTP layer be tested for ordering, aborts and errors without the cost of a forward pass.

Each request "holds" one KV block per 4 tokens out of ``num_blocks``, so tests can check that
aborts and finishes give every block back.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from pagellm.core.stats import EngineStats
from pagellm.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pagellm.sampling_params import SamplingParams

BLOCK_SIZE = 4


@dataclass
class _Req:
    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    outputs: list[list[int]] = field(default_factory=list)
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.time()))


class FakeEngine:
    def __init__(self, tokenizer, max_model_len: int = 64, num_blocks: int = 256,
                 step_delay: float = 0.0, fail_on_step: int | None = None,
                 unfittable_prompt: str | None = None, faulty_prompt: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.num_blocks = num_blocks
        self.step_delay = step_delay
        self.fail_on_step = fail_on_step
        self.unfittable_prompt = unfittable_prompt  # finished with an error, like a prompt
        # that can never fit in the KV cache
        self.faulty_prompt = faulty_prompt  # finished with an engine fault, like a failed step
        self.requests: dict[str, _Req] = {}
        self.num_steps = 0
        self.generated = 0
        self.finished = 0
        self.thread_ids: set[int] = set()  # threads that called into the engine
        self.step_sizes: list[int] = []

    def _touch(self) -> None:
        self.thread_ids.add(threading.get_ident())

    def shutdown(self) -> None:
        """LLMEngine.shutdown: no workers to stop here."""

    def add_request(self, request_id, prompt, params=None, priority=0, arrival_time=None,
                    cache_salt=None, lora_request=None) -> None:
        self._touch()
        if lora_request is not None:  # as the real engine without enable_lora
            raise ValueError("the engine was started without enable_lora=True")
        params = params or SamplingParams()
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text, ids = (prompt, self.tokenizer.encode(prompt)) if isinstance(prompt, str) else (
            prompt.get("prompt"), list(prompt["prompt_token_ids"]))
        if not ids:
            raise ValueError("the prompt is empty: it must hold at least one token")
        if len(ids) + (params.max_tokens or 1) > self.max_model_len:
            raise ValueError(f"prompt + max_tokens exceeds max_model_len={self.max_model_len}")
        req = _Req(request_id, text, ids, params)
        req.outputs = [[] for _ in range(params.n)]
        self.requests[request_id] = req

    def step(self) -> list[RequestOutput]:
        self._touch()
        self.num_steps += 1
        if self.fail_on_step is not None and self.num_steps >= self.fail_on_step:
            raise RuntimeError("simulated engine failure")
        if self.step_delay:
            time.sleep(self.step_delay)
        self.step_sizes.append(len(self.requests))
        now = time.time()
        outputs = []
        for req in list(self.requests.values()):
            if req.prompt is not None and req.prompt == self.unfittable_prompt:
                del self.requests[req.request_id]
                output = self._output(req, "abort")
                output.error = f"request {req.request_id!r} cannot fit in the KV cache"
                outputs.append(output)
                continue
            if req.prompt is not None and req.prompt == self.faulty_prompt:
                del self.requests[req.request_id]
                output = self._output(req, "abort")
                output.error = "the engine step failed: RuntimeError('simulated fault')"
                output.error_internal = True
                outputs.append(output)
                continue
            for index, tokens in enumerate(req.outputs):
                tokens.append((req.prompt_ids[-1] + len(tokens) + 1 + index) % 500 + 3)
                self.generated += 1
            req.metrics.first_token_time = req.metrics.first_token_time or now
            req.metrics.last_token_time = now
            done = len(req.outputs[0]) >= (req.params.max_tokens or 16)
            if done:
                req.metrics.finished_time = now
                del self.requests[req.request_id]
                self.finished += 1
            outputs.append(self._output(req, "length" if done else None))
        return outputs

    def abort_request(self, request_ids) -> list[RequestOutput]:
        self._touch()
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        outputs = []
        for rid in ids:
            req = self.requests.pop(rid, None)
            if req is not None:
                outputs.append(self._output(req, "abort"))
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def _output(self, req: _Req, finish_reason: str | None) -> RequestOutput:
        completions = [CompletionOutput(i, self.tokenizer.decode(tokens), list(tokens), None,
                                        None, finish_reason)
                       for i, tokens in enumerate(req.outputs)]
        return RequestOutput(req.request_id, req.prompt, req.prompt_ids, None, completions,
                             finish_reason is not None, metrics=req.metrics)

    def blocks_used(self) -> int:
        return sum(-(-(len(r.prompt_ids) + len(r.outputs[0])) // BLOCK_SIZE)
                   for r in self.requests.values())

    def get_stats(self) -> EngineStats:
        used = self.blocks_used()
        return EngineStats(
            num_running=len(self.requests), num_waiting=0, num_swapped=0,
            num_requests_running=len(self.requests), num_requests_waiting=0,
            num_requests_swapped=0, num_preemptions=0,
            num_swap_outs=0, num_swap_ins=0, num_steps=self.num_steps, prompt_tokens_total=0,
            generation_tokens_total=self.generated, num_requests_finished=self.finished,
            num_blocks=self.num_blocks, num_free_blocks=self.num_blocks - used,
            num_cached_blocks=0, kv_usage=used / self.num_blocks, kv_waste_ratio=0.0,
            slots_allocated=used * BLOCK_SIZE, slots_filled=0, prefix_cache_queries=0,
            prefix_cache_hits=0, prefix_hit_rate=0.0, num_cpu_blocks=0, num_free_cpu_blocks=0,
            external_fragmentation=0.0,
            seq_block_counts={f"{r}#0": 1 for r in self.requests})
