"""The KV view: the block map with its sequences and a history of the engine's statistics.

What ``GET /stats/blocks`` serves and the dashboard draws (and what ``bench memory --html``
embeds for each system). Built on the engine loop thread between steps, from the scheduler's
queues and the KV manager's block map, so it is consistent with the ``EngineStats`` taken at the
same moment. Plain data, no torch.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Hashable, Iterable
from dataclasses import fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagellm.core.scheduler import Scheduler
    from pagellm.core.stats import EngineStats
    from pagellm.kv.interface import KVCacheManagerProtocol

# The states a block's ``state`` code stands for (kv/block_map.py: BlockState).
STATE_NAMES = ("free", "used", "cached_free")


def history_point(stats: EngineStats, t: float) -> dict[str, float]:
    """One sample of the metrics the dashboard charts, at ``t`` seconds."""
    return {"t": round(t, 3), "kv_usage": round(stats.kv_usage, 4),
            "kv_waste_ratio": round(stats.kv_waste_ratio, 4),
            "num_running": stats.num_running, "num_waiting": stats.num_waiting,
            "num_swapped": stats.num_swapped, "num_preemptions": stats.num_preemptions,
            "prefix_hit_rate": round(stats.prefix_hit_rate, 4),
            "cpu_usage": round(1 - stats.num_free_cpu_blocks / stats.num_cpu_blocks, 4)
            if stats.num_cpu_blocks else 0.0}


class MetricsHistory:
    """The latest ``max_points`` history points, at most one per ``interval_s``.

    Fed with snapshots the engine loop takes anyway (``add`` costs a dict), so keeping it costs
    the engine nothing measurable; ``t`` is wall-clock time (seconds since the epoch).
    """

    def __init__(self, max_points: int = 240, interval_s: float = 0.5) -> None:
        if max_points <= 0 or interval_s < 0:
            raise ValueError(f"max_points ({max_points}) must be positive and interval_s "
                             f"({interval_s}) non-negative")
        self.interval_s = interval_s
        self._points: deque[dict[str, float]] = deque(maxlen=max_points)
        self._last = float("-inf")

    def add(self, stats: EngineStats, now: float | None = None) -> None:
        now = time.time() if now is None else now
        if now - self._last >= self.interval_s:
            self._points.append(history_point(stats, now))
            self._last = now

    def points(self) -> list[dict[str, float]]:
        return list(self._points)


def build_kv_view(scheduler: Scheduler, kv: KVCacheManagerProtocol, stats: EngineStats,
                  history: Iterable[dict[str, float]] = ()) -> dict[str, Any]:
    """The block map (owners as indexes into ``sequences``), the sequences holding blocks or
    waiting for them, the statistics and the history, as JSON-ready data."""
    block_map = kv.block_map()
    sequences: list[dict[str, Any]] = []
    index = _SequenceIndex(sequences)
    for status, queue in (("running", scheduler.running), ("swapped", scheduler.swapped),
                          ("waiting", scheduler.waiting)):
        for seq in queue:
            index[seq.seq_id] = len(sequences)
            sequences.append({"seq_id": seq.seq_id, "request_id": seq.request.request_id,
                              "status": status, "num_tokens": seq.num_tokens})
    pools = block_map.to_dict(index)
    # Shallow: asdict() would deep-copy the per-sequence counts, which the map already shows.
    summary = {f.name: getattr(stats, f.name) for f in fields(stats)
               if f.name != "seq_block_counts"}
    return {"time": time.time(), "states": STATE_NAMES, **pools, "sequences": sequences,
            "stats": summary, "history": list(history)}


class _SequenceIndex(dict):
    """seq_id -> index in ``sequences``; a holder the scheduler's queues do not know (none
    should exist) is listed on first sight instead of failing the view."""

    def __init__(self, sequences: list[dict[str, Any]]) -> None:
        super().__init__()
        self.sequences = sequences

    def __missing__(self, seq_id: Hashable) -> int:
        self[seq_id] = len(self.sequences)
        self.sequences.append({"seq_id": str(seq_id), "request_id": str(seq_id),
                               "status": "unknown", "num_tokens": 0})
        return self[seq_id]
