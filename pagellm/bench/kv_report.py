"""The ``--html`` report of ``pagellm bench memory``: each engine system's block map at moments
of its run, with the dashboard's charts over the whole run, in one static page.

A ``ViewRecorder`` follows one run: a history point after every step, and a KV view
(core/kv_view.py) every ``stride`` steps. At most ``max_frames`` views are kept: when the list is
full every other one is dropped and the stride doubles, so a run of any length costs a bounded
number of views (each about a millisecond for a thousand blocks).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from pagellm.core.kv_view import history_point

DESCRIPTIONS = {
    "paged": "Blocks are allocated on demand as sequences grow; prompts share cached prefix "
             "blocks; under pressure sequences are preempted (swapped to the CPU pool).",
    "contiguous": "Each sequence reserves max_model_len slots, a run of consecutive blocks, "
                  "when it starts: the pale parts of its run are reserved but hold no token "
                  "(internal fragmentation); striped free blocks are too few in a row for a "
                  "reservation (external fragmentation).",
}


class ViewRecorder:
    """KV views and a metrics history of one engine run, for the HTML report."""

    def __init__(self, max_frames: int = 24, max_history: int = 400) -> None:
        if max_frames < 2:
            raise ValueError(f"max_frames must be at least 2, got {max_frames}")
        self.max_frames, self.max_history = max_frames, max_history
        self.frames: list[dict[str, Any]] = []
        self.history: list[dict[str, float]] = []
        self.stride = 1
        self._num_steps = 0

    def record(self, engine, t: float, stats) -> None:
        """After a step: ``t`` seconds into the run, ``stats`` the engine's stats just taken."""
        self.history.append(history_point(stats, t))
        if self._num_steps % self.stride == 0:
            view = engine.get_kv_view()
            view["time"] = round(t, 3)
            self.frames.append(view)
            if len(self.frames) > self.max_frames:
                self.frames = self.frames[::2]
                self.stride *= 2
        self._num_steps += 1

    def to_system(self, name: str) -> dict[str, Any]:
        """The report's record of this run (render_report's ``systems`` entry)."""
        stride = max(1, -(-len(self.history) // self.max_history))
        history = self.history[::stride]
        if self.history and history[-1] is not self.history[-1]:
            history.append(self.history[-1])
        peak = max(range(len(self.frames)), default=0,
                   key=lambda i: self.frames[i]["stats"]["kv_usage"])
        return {"name": name, "title": f"{name}: {self._headline()}",
                "description": DESCRIPTIONS.get(name, ""), "frames": self.frames,
                "history": history, "default_frame": peak}

    def _headline(self) -> str:
        if not self.history:
            return "no steps"
        peak = max(p["kv_usage"] for p in self.history)
        waste = sum(p["kv_waste_ratio"] for p in self.history) / len(self.history)
        running = max(p["num_running"] for p in self.history)
        return (f"peak KV usage {100 * peak:.0f}%, mean waste over steps {100 * waste:.0f}%, "
                f"at most {running} sequences running")


def save_html_report(report: dict[str, Any], path: str | Path) -> Path:
    """Write the static page for a memory experiment report run with views recorded."""
    from pagellm.dashboard import render_report

    systems = [report[name]["kv_views"] for name in ("paged", "contiguous")
               if name in report and "kv_views" in report[name]]
    if not systems:
        raise ValueError("the report holds no recorded KV views: run the paged or contiguous "
                         "system with views recorded (pagellm bench memory --html)")
    budget = report["budget"]
    intro = (f"One KV budget of {budget['num_blocks']} blocks of {budget['block_size']} tokens "
             f"(room for {budget['max_len_reservations']} reservations of max_model_len "
             f"{budget['max_model_len']}), the same workload for each system. Hover a block "
             "for its request, ref count and tokens; move the slider through the run.")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_report(systems, "pagellm bench memory: the KV cache of each system",
                                  intro), encoding="utf-8")
    return path
