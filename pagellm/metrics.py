"""Prometheus metrics and the periodic stats log line of a serving engine.

Two sources feed them. Engine-wide state (queue lengths, KV cache usage, token and preemption
counters) comes from the ``EngineStats`` snapshot the engine loop takes; it is exposed by a
custom collector that reads the latest snapshot at scrape time, so the exported counters are
exactly the engine's own and scraping never touches the engine. Per-request latencies (time to
first token, inter-token latency, end-to-end latency) come from the ``RequestOutput`` metrics of
each step and are observed into histograms.

Names follow vLLM with a ``pagellm:`` prefix. ``*_perc`` gauges are fractions in [0, 1], as in
vLLM.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pagellm.core.stats import EngineStats
from pagellm.outputs import RequestOutput

logger = logging.getLogger("pagellm")

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
               0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0)

# (metric name, help, EngineStats attribute)
_GAUGES = (
    ("pagellm:num_requests_running", "Requests in the running batch.", "num_requests_running"),
    ("pagellm:num_requests_waiting", "Requests waiting to be admitted.", "num_requests_waiting"),
    ("pagellm:num_requests_swapped", "Requests swapped out to CPU memory.",
     "num_requests_swapped"),
    ("pagellm:kv_cache_usage_perc", "Fraction of device KV blocks in use (0..1).", "kv_usage"),
    ("pagellm:kv_cache_waste_perc",
     "Fraction of allocated KV slots not holding a token (0..1).", "kv_waste_ratio"),
)
_COUNTERS = (
    ("pagellm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
     "prefix_cache_queries"),
    ("pagellm:prefix_cache_hits", "Prompt tokens served from the prefix cache.",
     "prefix_cache_hits"),
    ("pagellm:num_preemptions", "Sequences preempted (swap or recompute).", "num_preemptions"),
    ("pagellm:num_swaps", "Sequences swapped out to CPU memory.", "num_swap_outs"),
    ("pagellm:prompt_tokens", "Prompt tokens admitted.", "prompt_tokens_total"),
    ("pagellm:generation_tokens", "Tokens generated.", "generation_tokens_total"),
)

# With LoRA enabled: (metric name, help, key of EngineStats.lora, counter?)
_LORA = (
    ("pagellm:lora_adapters_resident", "LoRA adapters in device slots.", "num_resident", False),
    ("pagellm:lora_adapters_registered", "LoRA adapters known to the engine.",
     "num_registered", False),
    ("pagellm:lora_loads", "LoRA adapters read from disk.", "num_loads", True),
    ("pagellm:lora_slot_evictions", "LoRA adapters pushed out of a device slot.",
     "num_slot_evictions", True),
)


class _StatsCollector(Collector):
    """Exports the newest EngineStats snapshot; replaced atomically by the engine loop."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.stats: EngineStats | None = None

    def collect(self) -> Iterator[Metric]:
        stats = self.stats
        if stats is None:
            return
        for name, doc, attr in _GAUGES:
            family = GaugeMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([self.model_name], float(getattr(stats, attr)))
            yield family
        for name, doc, attr in _COUNTERS:
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([self.model_name], float(getattr(stats, attr)))
            yield family
        for name, doc, key, counter in _LORA if stats.lora else ():
            family = (CounterMetricFamily if counter else GaugeMetricFamily)(
                name, doc, labels=["model_name"])
            family.add_metric([self.model_name], float(stats.lora[key]))
            yield family


class EngineMetrics:
    """The Prometheus metrics of one served model, in a registry of their own (so that several
    servers in one process, as in tests, do not collide).

    ``observe_step`` is called by the engine loop thread after each step; prometheus-client
    metrics are thread-safe, and ``_last_token_time`` is only touched by that thread.
    """

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.collector = _StatsCollector(model_name)
        self.registry.register(self.collector)
        labels = ["model_name"]
        self.request_success = Counter(
            "pagellm:request_success", "Requests finished by a stop condition or length.",
            labels + ["finished_reason"], registry=self.registry)
        self.ttft = Histogram("pagellm:time_to_first_token_seconds",
                              "Time from arrival to the first generated token.", labels,
                              buckets=TTFT_BUCKETS, registry=self.registry).labels(model_name)
        self.itl = Histogram("pagellm:inter_token_latency_seconds",
                             "Time between consecutive token outputs of a request.", labels,
                             buckets=ITL_BUCKETS, registry=self.registry).labels(model_name)
        self.e2e = Histogram("pagellm:e2e_request_latency_seconds",
                             "Time from arrival to the end of the request.", labels,
                             buckets=E2E_BUCKETS, registry=self.registry).labels(model_name)
        self.model_name = model_name
        self._last_token_time: dict[str, float] = {}

    def observe_step(self, outputs: list[RequestOutput], stats: EngineStats | None) -> None:
        if stats is not None:
            self.collector.stats = stats
        for output in outputs:
            self._observe_output(output)

    def _observe_output(self, output: RequestOutput) -> None:
        m = output.metrics
        rid = output.request_id
        if m is not None and m.last_token_time is not None:
            previous = self._last_token_time.get(rid)
            if previous is None:
                if m.first_token_time is not None:
                    self.ttft.observe(max(m.first_token_time - m.arrival_time, 0.0))
            elif m.last_token_time > previous:
                self.itl.observe(m.last_token_time - previous)
            self._last_token_time[rid] = m.last_token_time
        if not output.finished:
            return
        self._last_token_time.pop(rid, None)
        if m is not None and m.finished_time is not None:
            self.e2e.observe(max(m.finished_time - m.arrival_time, 0.0))
        for completion in output.outputs:
            if completion.finish_reason in ("stop", "length"):
                self.request_success.labels(self.model_name, completion.finish_reason).inc()
                break

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)


class StatsLogger:
    """Logs one line of throughput, queue and KV cache figures every ``interval`` seconds
    while the engine is busy, and once more when it goes quiet."""

    def __init__(self, interval: float = 10.0) -> None:
        self.interval = interval
        self._lock = threading.Lock()
        self._last_time = 0.0
        self._last: EngineStats | None = None
        self._logged_idle = False

    def maybe_log(self, stats: EngineStats | None, now: float | None = None) -> str | None:
        """Log (and return) the line when it is due; None otherwise."""
        if stats is None:
            return None
        now = time.monotonic() if now is None else now
        with self._lock:
            if self._last is None:  # the first snapshot starts the first interval
                self._last, self._last_time = stats, now
                return None
            if now - self._last_time < self.interval:
                return None
            busy = stats.num_running + stats.num_waiting + stats.num_swapped > 0
            moved = (stats.prompt_tokens_total != self._last.prompt_tokens_total
                     or stats.generation_tokens_total != self._last.generation_tokens_total)
            if not busy and not moved and self._logged_idle:
                self._last_time = now  # quiet time is not averaged into the next line
                return None
            line = format_stats_line(stats, self._last, now - self._last_time)
            self._logged_idle = not busy
            self._last, self._last_time = stats, now
        logger.info(line)
        return line


def format_stats_line(stats: EngineStats, previous: EngineStats | None, elapsed: float) -> str:
    prompt_before = previous.prompt_tokens_total if previous else 0
    gen_before = previous.generation_tokens_total if previous else 0
    elapsed = max(elapsed, 1e-9)
    return (f"Avg prompt throughput: {(stats.prompt_tokens_total - prompt_before) / elapsed:.1f} "
            f"tokens/s, Avg generation throughput: "
            f"{(stats.generation_tokens_total - gen_before) / elapsed:.1f} tokens/s, "
            f"Running: {stats.num_requests_running} reqs, Waiting: {stats.num_requests_waiting} "
            f"reqs, Swapped: {stats.num_requests_swapped} reqs, KV cache usage: {stats.kv_usage * 100:.1f}%, "
            f"Prefix cache hit rate: {stats.prefix_hit_rate * 100:.1f}%")
