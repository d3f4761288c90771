"""What every benchmarked system reports: a timeline of KV slots and concurrency, and a summary.

A ``Timeline`` holds samples taken as a system runs (after each engine step, each ``generate``
step, or on a polling clock). Each sample's state is taken to hold until the next sample, so
time averages weight a sample by the time to the next one. The KV waste ratio is the share of
reserved KV slots that hold no token of a request, averaged over time:

    waste = 1 - integral(filled slots dt) / integral(reserved slots dt)

"Reserved" means set aside for a sequence (blocks allocated, a max-length reservation, or a
padded row of a static batch); "filled" means holding a prompt or a requested output token.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(slots=True)
class Sample:
    t: float  # seconds since the run started
    running: int  # sequences holding KV memory (the concurrency)
    waiting: int
    slots_reserved: int
    slots_filled: int


@dataclass(slots=True)
class Timeline:
    samples: list[Sample] = field(default_factory=list)

    def add(self, t: float, running: int, waiting: int, slots_reserved: int,
            slots_filled: int) -> None:
        self.samples.append(Sample(t, running, waiting, slots_reserved, slots_filled))

    def _weights(self, end: float) -> list[float]:
        times = [s.t for s in self.samples] + [end]
        return [max(times[i + 1] - times[i], 0.0) for i in range(len(self.samples))]

    def waste_ratio(self, end: float) -> float:
        weights = self._weights(end)
        reserved = sum(w * s.slots_reserved for w, s in zip(weights, self.samples))
        filled = sum(w * s.slots_filled for w, s in zip(weights, self.samples))
        return 1.0 - filled / reserved if reserved > 0 else 0.0

    def mean_concurrency(self, end: float) -> float:
        weights = self._weights(end)
        total = sum(weights)
        return sum(w * s.running for w, s in zip(weights, self.samples)) / total if total else 0.0

    def peak_concurrency(self) -> int:
        return max((s.running for s in self.samples), default=0)

    def peak_reserved(self) -> int:
        return max((s.slots_reserved for s in self.samples), default=0)

    def downsampled(self, max_points: int = 400) -> list[dict[str, Any]]:
        """At most ``max_points`` samples (evenly strided), for JSON and plots."""
        stride = max(1, -(-len(self.samples) // max_points))
        picked = self.samples[::stride]
        if self.samples and picked[-1] is not self.samples[-1]:
            picked.append(self.samples[-1])
        return [asdict(s) for s in picked]


@dataclass(slots=True)
class RunResult:
    """One system's run of a workload. ``output_tokens`` counts requested (useful) tokens only;
    ``generated_tokens`` also counts tokens a static batch computes past a request's length."""

    system: str
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    generated_tokens: int
    elapsed_s: float
    kv_slots_budget: int  # slots the KV memory budget holds
    timeline: Timeline = field(default_factory=Timeline)
    num_preemptions: int = 0
    num_swaps: int = 0
    prefix_hit_rate: float = 0.0
    ttft_s: list[float] = field(default_factory=list)  # per request, from the run's start
    extra: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        elapsed = max(self.elapsed_s, 1e-9)
        end = self.elapsed_s
        return {
            "system": self.system,
            "num_requests": self.num_requests,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "generated_tokens": self.generated_tokens,
            "elapsed_s": round(self.elapsed_s, 3),
            "requests_per_s": round(self.num_requests / elapsed, 3),
            "output_tokens_per_s": round(self.output_tokens / elapsed, 2),
            "total_tokens_per_s": round((self.prompt_tokens + self.output_tokens) / elapsed, 2),
            "kv_waste_ratio": round(self.timeline.waste_ratio(end), 4),
            "kv_slots_budget": self.kv_slots_budget,
            "kv_slots_peak_reserved": self.timeline.peak_reserved(),
            "peak_concurrency": self.timeline.peak_concurrency(),
            "mean_concurrency": round(self.timeline.mean_concurrency(end), 2),
            "num_preemptions": self.num_preemptions,
            "num_swaps": self.num_swaps,
            "prefix_hit_rate": round(self.prefix_hit_rate, 4),
            "ttft_ms": ttft_summary(self.ttft_s),
            **self.extra,
        }

    def to_dict(self, max_points: int = 400) -> dict[str, Any]:
        return {**self.summary(), "timeline": self.timeline.downsampled(max_points)}


def ttft_summary(ttft_s: list[float]) -> dict[str, float] | None:
    """Mean, median and 90th percentile time to first token in ms (every request is queued at
    the run's start, so this includes queueing), or None when not measured."""
    if not ttft_s:
        return None
    ordered = sorted(ttft_s)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {"mean": round(1000 * sum(ordered) / len(ordered), 1),
            "p50": round(1000 * pick(0.5), 1), "p90": round(1000 * pick(0.9), 1)}
