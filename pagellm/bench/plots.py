"""Benchmark plots (matplotlib, Agg backend, PNG). Every function takes the benchmark's JSON
dicts, so a plot can be redrawn from a saved ``--output-json`` file."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

LABELS = {
    "paged": "pagellm, paged KV",
    "contiguous": "pagellm, contiguous KV",
    "hf": "transformers generate (static batches)",
    "hf_continuous": "transformers continuous batching",
}
COLORS = {"paged": "tab:green", "contiguous": "tab:red", "hf": "tab:gray",
          "hf_continuous": "tab:blue"}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)
    return path


def _label(name: str) -> str:
    return LABELS.get(name, name)


def plot_kv_timelines(systems: Mapping[str, Mapping[str, Any]], path: str | Path,
                      title: str = "KV cache slots over time") -> Path:
    """One panel per system: slots reserved and slots filled with tokens, against the budget."""
    plt = _pyplot()
    fig, axes = plt.subplots(len(systems), 1, figsize=(8, 2.3 * len(systems)), squeeze=False)
    for ax, (name, result) in zip(axes[:, 0], systems.items()):
        points = result["timeline"]
        t = [p["t"] for p in points]
        ax.step(t, [p["slots_reserved"] for p in points], where="post", color="tab:orange",
                label="reserved")
        ax.fill_between(t, [p["slots_filled"] for p in points], step="post", alpha=0.5,
                        color=COLORS.get(name, "tab:green"), label="filled with tokens")
        ax.axhline(result["kv_slots_budget"], color="black", linestyle="--", linewidth=1,
                   label="budget")
        ax.set_title(f"{_label(name)}: waste {100 * result['kv_waste_ratio']:.1f}% "
                     "(time-averaged)", fontsize=10)
        ax.set_ylabel("KV slots")
        ax.legend(loc="upper right", fontsize=8)
    axes[-1, 0].set_xlabel("seconds")
    fig.suptitle(title)
    return _save(fig, path)


def plot_concurrency(systems: Mapping[str, Mapping[str, Any]], path: str | Path) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 3.5))
    for name, result in systems.items():
        points = result["timeline"]
        ax.step([p["t"] for p in points], [p["running"] for p in points], where="post",
                color=COLORS.get(name), label=f"{_label(name)} (peak {result['peak_concurrency']})")
    ax.set_xlabel("seconds")
    ax.set_ylabel("sequences holding KV memory")
    ax.set_title("Concurrent sequences over time")
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_throughput_bars(systems: Mapping[str, Mapping[str, Any]], path: str | Path) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 3.5))
    names = list(systems)
    values = [systems[n]["output_tokens_per_s"] for n in names]
    bars = ax.bar(range(len(names)), values, color=[COLORS.get(n, "tab:purple") for n in names])
    for bar, name in zip(bars, names):
        ax.annotate(f"{bar.get_height():.0f}\nwaste {100 * systems[name]['kv_waste_ratio']:.0f}%",
                    (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                    va="bottom", fontsize=8)
    ticks = [_label(n).replace(", ", ",\n").replace("transformers ", "transformers\n")
             for n in names]
    ax.set_xticks(range(len(names)), ticks, fontsize=8)
    ax.set_ylabel("useful output tokens/s")
    ax.set_ylim(0, max(values) * 1.3 if values else 1)
    ax.set_title("Throughput on the same KV memory budget")
    return _save(fig, path)


def plot_block_size_sweep(sweep: Sequence[Mapping[str, Any]], path: str | Path) -> Path:
    """KV waste (fragmentation) and throughput against the block size."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    sizes = [row["block_size"] for row in sweep]
    ax.plot(sizes, [100 * row["kv_waste_ratio"] for row in sweep], "o-", color="tab:red")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(s) for s in sizes])
    ax.set_xlabel("block size (tokens)")
    ax.set_ylabel("KV waste, % (time-averaged)", color="tab:red")
    right = ax.twinx()
    speeds = [row["output_tokens_per_s"] for row in sweep]
    right.plot(sizes, speeds, "s--", color="tab:green")
    right.set_ylim(0, 1.15 * max(speeds))  # from zero: small differences stay small
    right.set_ylabel("output tokens/s", color="tab:green")
    ax.set_title("Block size: fragmentation against kernel efficiency")
    return _save(fig, path)


def plot_latency(result: Mapping[str, Any], path: str | Path) -> Path:
    """Distributions (CDF) of TTFT, TPOT, ITL and end-to-end latency of one serving run."""
    plt = _pyplot()
    per_request = result["requests"]
    series = {
        "TTFT": [r["ttft_s"] for r in per_request if r.get("ttft_s") is not None],
        "TPOT": [r["tpot_s"] for r in per_request if r.get("tpot_s") is not None],
        "ITL": [x for r in per_request for x in r.get("itl_s", ())],
        "end-to-end": [r["e2e_s"] for r in per_request if r.get("e2e_s") is not None],
    }
    fig, axes = plt.subplots(1, 4, figsize=(12, 3))
    for ax, (name, values) in zip(axes, series.items()):
        values = sorted(1000 * v for v in values)
        if values:
            ax.plot(values, [(i + 1) / len(values) for i in range(len(values))])
        ax.set_title(name)
        ax.set_xlabel("ms")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("fraction of requests (CDF)")
    fig.suptitle(f"Serving latency ({result.get('label', '')})", fontsize=10)
    return _save(fig, path)
