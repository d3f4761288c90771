"""The seed's experiment (``pagellm bench memory``): one model, one KV memory budget, one
workload, four systems, measured in one run.

1. ``paged``: pagellm with the paged KV cache (blocks allocated on demand);
2. ``contiguous``: the same engine with the traditional allocator, which reserves
   ``max_model_len`` contiguous slots for every sequence when it starts;
3. ``hf``: transformers ``generate`` with static batching, each batch as large as its padded KV
   allows within the budget;
4. ``hf_continuous``: transformers' continuous batching with its paged cache, given the same
   number of KV blocks of the same size.

As in the seed's experiment, memory is the binding constraint: by default the budget holds
``DEFAULT_BUDGET_SEQS`` reservations of ``max_model_len`` tokens. The optional block-size sweep
runs the paged engine alone at several block sizes on the same budget in bytes, and the KV
dtype sweep (``kv_cache_dtypes``) at several ``kv_cache_dtype`` on it: an 8-bit cache holds
about twice the tokens of a bfloat16 one in the same bytes.
"""
from __future__ import annotations

import gc
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pagellm.bench.throughput import (EngineOptions, accounting_errors, build_engine,
                                      machine_info, run_engine, warm_up)
from pagellm.bench.workloads import Workload

SYSTEMS = ("paged", "contiguous", "hf", "hf_continuous")
DEFAULT_BUDGET_SEQS = 8
# Targets from the seed's figures (and vLLM's reported gains over transformers).
TARGETS = {"paged_waste_max": 0.04, "contiguous_waste_min": 0.60, "concurrency_ratio_min": 4.0,
           "throughput_ratio_min": 2.4, "throughput_over_hf_min": 10.0}


@dataclass(slots=True)
class MemoryExperimentConfig:
    model: str  # a model folder or a .gguf file
    dtype: str = "bfloat16"
    block_size: int = 16
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    kv_cache_memory_bytes: int | None = None  # default: DEFAULT_BUDGET_SEQS x max_model_len
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    systems: tuple[str, ...] = SYSTEMS
    block_sizes: tuple[int, ...] = ()
    kv_cache_dtypes: tuple[str, ...] = ()  # the paged engine at each, on the one budget
    seed: int = 0
    warmup: bool = True
    record_views: bool = False  # block maps for the --html report (adds their cost to the run)
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class Budget:
    """The KV memory every system gets, in bytes, and what it holds at a block size."""

    memory_bytes: int
    bytes_per_token: int
    max_model_len: int
    block_size: int

    @property
    def num_blocks(self) -> int:
        return self.memory_bytes // (self.bytes_per_token * self.block_size)

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    def to_dict(self) -> dict[str, Any]:
        return {"kv_cache_memory_bytes": self.memory_bytes,
                "bytes_per_token": self.bytes_per_token, "block_size": self.block_size,
                "num_blocks": self.num_blocks, "num_slots": self.num_slots,
                "max_model_len": self.max_model_len,
                "max_len_reservations": self.num_slots // self.max_model_len}


def _memory_model(config: MemoryExperimentConfig, kv_dtype: str = "auto"):
    """The KV memory model of the experiment's model, its cache in the model dtype (or in
    ``kv_dtype``)."""
    from pagellm.kv.memory import KVMemoryModel

    return KVMemoryModel.from_model_dir(config.model,
                                        dtype=config.dtype if kv_dtype == "auto" else kv_dtype)


def resolve_budget(config: MemoryExperimentConfig) -> Budget:
    memory = _memory_model(config)
    max_model_len = config.max_model_len or memory.max_model_len
    if max_model_len is None:
        raise ValueError("the model config has no max_position_embeddings: pass --max-model-len")
    per_token = memory.bytes_per_token
    budget = config.kv_cache_memory_bytes or DEFAULT_BUDGET_SEQS * max_model_len * per_token
    return Budget(budget, per_token, max_model_len, config.block_size)


def _engine_options(config: MemoryExperimentConfig, budget: Budget, allocator: str,
                    block_size: int) -> EngineOptions:
    """The swap space equals the device budget: enough to swap out every running sequence.

    The contiguous allocator gets no free-block watermark: its reservation already covers a
    sequence's whole growth, so it never preempts, and a watermark would only cost it one of the
    budget's few max-length reservations.
    """
    return EngineOptions(
        model=config.model, kv_allocator=allocator, dtype=config.dtype, block_size=block_size,
        watermark=0.0 if allocator == "contiguous" else 0.01,
        max_model_len=budget.max_model_len, max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        kv_cache_memory_bytes=budget.memory_bytes, swap_space=budget.memory_bytes / 2**30,
        seed=config.seed)


def run_engine_system(options: EngineOptions, workload: Workload, warmup: bool,
                      record_views: bool = False) -> dict[str, Any]:
    from pagellm.bench.kv_report import ViewRecorder

    engine = build_engine(options)
    recorder = ViewRecorder() if record_views else None
    try:
        if warmup:
            warm_up(engine, engine.hf_config.vocab_size)
        result = run_engine(engine, workload.requests, system=options.kv_allocator,
                            recorder=recorder).to_dict()
        if recorder is not None:
            result["kv_views"] = recorder.to_system(options.kv_allocator)
        return result
    finally:
        del engine
        gc.collect()


def run_hf_systems(config: MemoryExperimentConfig, budget: Budget, workload: Workload,
                   systems: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    from pagellm.bench.hf_baselines import load_hf_model, run_hf_continuous, run_hf_static

    model = load_hf_model(config.model, config.dtype)
    if config.warmup:
        _warm_up_hf(model)
    results = {}
    if "hf" in systems:
        results["hf"] = run_hf_static(model, workload.requests, budget.num_slots,
                                      max_batch_size=config.max_num_seqs).to_dict()
        results["hf"]["load_average_1min"] = round(os.getloadavg()[0], 2)
    if "hf_continuous" in systems:
        results["hf_continuous"] = run_hf_continuous(
            model, workload.requests, budget.num_blocks, budget.block_size, config.max_num_seqs,
            config.max_num_batched_tokens).to_dict()
        results["hf_continuous"]["load_average_1min"] = round(os.getloadavg()[0], 2)
    del model
    gc.collect()
    return results


def _warm_up_hf(model) -> None:
    import torch

    with torch.inference_mode():
        model.generate(input_ids=torch.arange(3, 35, device=model.device).unsqueeze(0),
                       max_new_tokens=4,
                       do_sample=False, pad_token_id=0)


def compute_ratios(results: dict[str, dict[str, Any]], budget: Budget
                   ) -> dict[str, float | None]:
    def ratio(a: str, b: str, key: str) -> float | None:
        if a not in results or b not in results or not results[b][key]:
            return None
        return round(results[a][key] / results[b][key], 3)

    reservations = budget.num_slots // budget.max_model_len
    return {
        "concurrency_paged_over_contiguous": ratio("paged", "contiguous", "peak_concurrency"),
        # Against the reservations the budget holds on paper, whatever the allocator admits.
        "concurrency_paged_over_max_len_reservations": (
            round(results["paged"]["peak_concurrency"] / reservations, 3)
            if "paged" in results and reservations else None),
        "mean_concurrency_paged_over_contiguous": ratio("paged", "contiguous",
                                                        "mean_concurrency"),
        "throughput_paged_over_contiguous": ratio("paged", "contiguous", "output_tokens_per_s"),
        "throughput_paged_over_hf": ratio("paged", "hf", "output_tokens_per_s"),
        "throughput_paged_over_hf_continuous": ratio("paged", "hf_continuous",
                                                     "output_tokens_per_s"),
    }


def check_targets(results: dict[str, dict[str, Any]], ratios: dict[str, float | None]
                  ) -> dict[str, bool | None]:
    def at_least(value, limit) -> bool | None:
        return None if value is None else value >= limit

    paged, contiguous = results.get("paged"), results.get("contiguous")
    return {
        "paged_waste_below_4pct": (None if paged is None
                                   else paged["kv_waste_ratio"] < TARGETS["paged_waste_max"]),
        "contiguous_waste_at_least_60pct": (
            None if contiguous is None
            else contiguous["kv_waste_ratio"] >= TARGETS["contiguous_waste_min"]),
        "concurrency_at_least_4x_contiguous": at_least(
            ratios["concurrency_paged_over_contiguous"], TARGETS["concurrency_ratio_min"]),
        "throughput_at_least_2.4x_contiguous": at_least(
            ratios["throughput_paged_over_contiguous"], TARGETS["throughput_ratio_min"]),
        "throughput_at_least_10x_hf": at_least(ratios["throughput_paged_over_hf"],
                                               TARGETS["throughput_over_hf_min"]),
    }


def block_size_sweep(config: MemoryExperimentConfig, budget: Budget, workload: Workload
                     ) -> list[dict[str, Any]]:
    """The paged engine at each block size, on the same budget in bytes."""
    rows = []
    for block_size in config.block_sizes:
        sized = replace(budget, block_size=block_size)
        result = run_engine_system(_engine_options(config, sized, "paged", block_size),
                                   workload, config.warmup)
        rows.append({"block_size": block_size, "num_blocks": sized.num_blocks,
                     **{k: result[k] for k in ("kv_waste_ratio", "peak_concurrency",
                                               "mean_concurrency", "output_tokens_per_s",
                                               "num_preemptions", "elapsed_s")}})
    return rows


def kv_dtype_sweep(config: MemoryExperimentConfig, budget: Budget, workload: Workload
                   ) -> list[dict[str, Any]]:
    """The paged engine at each kv_cache_dtype on the same budget in bytes (the model dtype's:
    ``budget``), with its peak and mean concurrency over the first dtype's."""
    rows = []
    for kv_dtype in config.kv_cache_dtypes:
        sized = replace(budget, bytes_per_token=_memory_model(config, kv_dtype).bytes_per_token)
        options = replace(_engine_options(config, sized, "paged", config.block_size),
                          kv_cache_dtype=kv_dtype)
        result = run_engine_system(options, workload, config.warmup)
        rows.append({"kv_cache_dtype": kv_dtype, "bytes_per_token": sized.bytes_per_token,
                     "num_blocks": sized.num_blocks,
                     **{k: result[k] for k in ("peak_concurrency", "mean_concurrency",
                                               "output_tokens_per_s", "num_preemptions",
                                               "kv_waste_ratio", "elapsed_s")}})
    for row in rows:
        for key in ("num_blocks", "peak_concurrency", "mean_concurrency"):
            row[f"{key}_vs_first"] = round(row[key] / rows[0][key], 3) if rows[0][key] else None
    return rows


def run_memory_experiment(config: MemoryExperimentConfig, workload: Workload) -> dict[str, Any]:
    unknown = set(config.systems) - set(SYSTEMS)
    if unknown:
        raise ValueError(f"unknown systems {sorted(unknown)}: choose from {', '.join(SYSTEMS)}")
    budget = resolve_budget(config)
    machine = machine_info()
    results: dict[str, dict[str, Any]] = {}
    for allocator in ("paged", "contiguous"):
        if allocator in config.systems:
            options = _engine_options(config, budget, allocator, config.block_size)
            results[allocator] = run_engine_system(options, workload, config.warmup,
                                                   config.record_views)
            results[allocator]["load_average_1min"] = round(os.getloadavg()[0], 2)
    hf_systems = tuple(s for s in ("hf", "hf_continuous") if s in config.systems)
    if hf_systems:
        results.update(run_hf_systems(config, budget, workload, hf_systems))
    ratios = compute_ratios(results, budget)
    report: dict[str, Any] = {
        "model": config.model, "dtype": config.dtype, "machine": machine,
        "budget": budget.to_dict(),
        "workload": workload.summary(), "max_num_seqs": config.max_num_seqs,
        "max_num_batched_tokens": config.max_num_batched_tokens,
        **{name: results[name] for name in SYSTEMS if name in results},
        "ratios": ratios, "targets": check_targets(results, ratios),
        "accounting_errors": [e for r in results.values() for e in accounting_errors(r)],
        **config.extra,
    }
    if config.block_sizes:
        report["block_size_sweep"] = block_size_sweep(config, budget, workload)
    if config.kv_cache_dtypes:
        report["kv_dtype_sweep"] = kv_dtype_sweep(config, budget, workload)
    return report


def save_plots(report: dict[str, Any], out_dir: str | Path, prefix: str = "memory") -> list[Path]:
    """KV slots over time, concurrency over time, throughput bars, and the block-size sweep."""
    from pagellm.bench import plots

    out_dir = Path(out_dir)
    systems = {name: report[name] for name in SYSTEMS if name in report}
    paths = [plots.plot_kv_timelines(systems, out_dir / f"{prefix}_kv_over_time.png"),
             plots.plot_concurrency(systems, out_dir / f"{prefix}_concurrency.png"),
             plots.plot_throughput_bars(systems, out_dir / f"{prefix}_throughput.png")]
    if report.get("block_size_sweep"):
        paths.append(plots.plot_block_size_sweep(report["block_size_sweep"],
                                                 out_dir / f"{prefix}_block_size_sweep.png"))
    return paths
