"""Engine statistics: counters kept as the engine runs, and snapshots for users and metrics."""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagellm.core.request import Request, Sequence
    from pagellm.core.scheduler import Scheduler, SchedulerOutput


@dataclass(slots=True)
class EngineStats:
    """A point-in-time view of the engine and its KV cache (``LLMEngine.get_stats()``)."""

    num_running: int  # sequences (a request with n > 1 has several)
    num_waiting: int
    num_swapped: int
    num_requests_running: int  # requests with a sequence in the queue
    num_requests_waiting: int
    num_requests_swapped: int
    num_preemptions: int
    num_swap_outs: int
    num_swap_ins: int
    num_steps: int
    prompt_tokens_total: int
    generation_tokens_total: int
    num_requests_finished: int
    # KV cache
    num_blocks: int
    num_free_blocks: int
    num_cached_blocks: int
    kv_usage: float  # used / total device blocks, 0..1
    kv_waste_ratio: float  # allocated-but-unfilled slots / allocated slots, 0..1
    slots_allocated: int
    slots_filled: int
    prefix_cache_queries: int  # tokens looked up
    prefix_cache_hits: int  # tokens served from cached blocks
    prefix_hit_rate: float
    num_cpu_blocks: int
    num_free_cpu_blocks: int
    external_fragmentation: float
    seq_block_counts: dict = field(default_factory=dict)
    lora: dict = field(default_factory=dict)  # adapter caches (LoRAManager.get_stats)
    kv_cache_dtype: str = "auto"  # EngineArgs.kv_cache_dtype
    kv_bytes_per_block: int = 0  # K and V of one block over all layers (scales included)
    quantization: str | None = None  # EngineArgs.quantization: the weights' format

    @property
    def num_swaps(self) -> int:
        return self.num_swap_outs

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class StatsTracker:
    """Counters the engine updates on its hot path: keep each update O(1)."""

    def __init__(self) -> None:
        self.num_steps = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.num_requests_finished = 0
        self.started = time.time()

    def record_schedule(self, plan: SchedulerOutput, seqs: dict[str, Sequence]) -> None:
        """``seqs``: the scheduler's sequences by id."""
        self.num_steps += 1
        now = None
        for item in plan.scheduled:
            request = seqs[item.seq_id].request
            metrics = request.metrics
            if metrics.first_scheduled_time is None:
                now = now or time.time()
                metrics.first_scheduled_time = now
                self.prompt_tokens_total += request.num_prompt_tokens

    def record_token(self, seq: Sequence, now: float) -> None:
        self.generation_tokens_total += 1
        metrics = seq.request.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = now
        metrics.last_token_time = now
        seq.last_token_time = now

    def record_finished(self, request: Request) -> None:
        self.num_requests_finished += 1

    def snapshot(self, scheduler: Scheduler, kv) -> EngineStats:
        k = kv.get_stats()
        return EngineStats(
            num_running=len(scheduler.running), num_waiting=len(scheduler.waiting),
            num_swapped=len(scheduler.swapped),
            num_requests_running=_num_requests(scheduler.running),
            num_requests_waiting=_num_requests(scheduler.waiting),
            num_requests_swapped=_num_requests(scheduler.swapped),
            num_preemptions=scheduler.num_preemptions,
            num_swap_outs=scheduler.num_swap_outs, num_swap_ins=scheduler.num_swap_ins,
            num_steps=self.num_steps, prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
            num_requests_finished=self.num_requests_finished,
            num_blocks=k.num_blocks, num_free_blocks=k.num_free_blocks,
            num_cached_blocks=k.num_cached_blocks, kv_usage=k.usage, kv_waste_ratio=k.waste_ratio,
            slots_allocated=k.slots_allocated, slots_filled=k.slots_filled,
            prefix_cache_queries=k.prefix_queries, prefix_cache_hits=k.prefix_hits,
            prefix_hit_rate=k.prefix_hit_rate, num_cpu_blocks=k.num_cpu_blocks,
            num_free_cpu_blocks=k.num_free_cpu_blocks,
            external_fragmentation=k.external_fragmentation,
            seq_block_counts=dict(kv.seq_block_counts()))


def _num_requests(queue: list[Sequence]) -> int:
    return len({id(seq.request) for seq in queue})
