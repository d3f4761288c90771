"""Driving the scheduler without a model: requests, fake runner outputs, a step loop."""
from __future__ import annotations

import itertools
import random

from pagellm.core.plan import ModelRunnerOutput, SampledToken, SchedulerOutput
from pagellm.core.request import Request
from pagellm.core.scheduler import Scheduler, SchedulerConfig, StepUpdate
from pagellm.kv import ContiguousKVCacheManager, KVCacheManager
from pagellm.sampling_params import SamplingParams

EOS = 2
_seq_no = itertools.count()


def make_scheduler(num_blocks: int = 64, block_size: int = 4, num_cpu_blocks: int = 0,
                   max_num_seqs: int = 8, budget: int = 64, max_model_len: int = 256,
                   policy: str = "fcfs", preemption_mode: str | None = None,
                   caching: bool = False, contiguous: bool = False,
                   chunked: bool = True) -> Scheduler:
    if contiguous:
        kv = ContiguousKVCacheManager(num_blocks, block_size, max_model_len,
                                      num_cpu_blocks=num_cpu_blocks)
    else:
        kv = KVCacheManager(num_blocks, block_size, num_cpu_blocks=num_cpu_blocks,
                            enable_prefix_caching=caching)
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                             max_model_len=max_model_len, enable_chunked_prefill=chunked,
                             preemption_mode=preemption_mode, policy=policy)
    return Scheduler(config, kv, frozenset({EOS}))


def make_request(request_id: str, prompt_len: int = 8, max_tokens: int = 4, n: int = 1,
                 priority: int = 0, arrival_time: float = 0.0, prompt: list[int] | None = None,
                 **params) -> Request:
    prompt = prompt if prompt is not None else [10 + (i % 50) for i in range(prompt_len)]
    sampling = SamplingParams(n=n, max_tokens=max_tokens, temperature=0.0, **params)
    return Request(request_id, None, list(prompt), sampling, max_tokens, priority=priority,
                   arrival_time=arrival_time, seq_no=next(_seq_no))


def fake_output(plan: SchedulerOutput, token: int | None = None,
                rng: random.Random | None = None) -> ModelRunnerOutput:
    """What a runner would return: a sample per sample id (``token``, else random non-EOS
    ids from ``rng``, else 7)."""
    out = ModelRunnerOutput()
    for item in plan.scheduled:
        if item.need_logits:
            out.sampled[item.seq_id] = [
                SampledToken(token if token is not None
                             else (rng.randrange(3, 100) if rng else 7))
                for _ in item.sample_ids]
    return out


def step(scheduler: Scheduler, token: int | None = None
         ) -> tuple[SchedulerOutput, StepUpdate]:
    plan = scheduler.schedule()
    return plan, scheduler.update_from_output(plan, fake_output(plan, token))


def run_to_completion(scheduler: Scheduler, max_steps: int = 1000) -> list[SchedulerOutput]:
    plans = []
    while scheduler.num_unfinished() and len(plans) < max_steps:
        plans.append(step(scheduler)[0])
    assert not scheduler.num_unfinished(), "requests still unfinished"
    return plans
