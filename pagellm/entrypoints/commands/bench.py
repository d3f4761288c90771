"""``pagellm bench throughput|memory|serving|engine``: reproducible benchmarks that print JSON.

- ``throughput``: offline throughput of the engine on a seeded workload;
- ``memory``: the seed's experiment, four systems on one KV memory budget;
- ``serving``: latency and throughput of a running OpenAI-compatible server;
- ``engine``: the engine's step time split into model forward and everything else.

``--model tiny``, ``small`` and ``narrow`` name the built-in seeded random-weight Llama configs
(built once in the cache folder; ``narrow`` has small's 12 layers at widths of 128, so that its
forward time is the step's Python and dispatch); any other value is a model folder or hub id.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from pagellm.bench.workloads import add_workload_args, spec_from_args


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "bench", help="benchmarks: throughput, memory (the seed's experiment), serving, engine",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    modes = parser.add_subparsers(dest="bench_mode", metavar="MODE", required=True)
    _add_throughput(modes)
    _add_memory(modes)
    _add_serving(modes)
    _add_engine(modes)


# ---------------------------------------------------------------------------- shared options

def _add_common(p: argparse.ArgumentParser, model: str, dtype: str = "bfloat16") -> None:
    p.add_argument("--model", default=model,
                   help=f"'tiny', 'small', 'narrow' (built-in random weights), a model folder or "
                        f"a .gguf file (default {model})")
    p.add_argument("--dtype", default=dtype, choices=("bfloat16", "float32", "float16"),
                   help=f"weights, activations and KV cache (default {dtype})")
    p.add_argument("--cache-dir", default=None,
                   help="where built-in models are built (default $PAGELLM_CACHE_DIR or "
                        "~/.cache/pagellm)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    p.add_argument("--output-json", default=None, metavar="FILE",
                   help="write the full result (with timelines) here")


def _add_engine_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=8192)
    g.add_argument("--kv-cache-memory-bytes", type=_size, default=None,
                   help="KV cache budget, e.g. 200MiB (default: see each mode)")


def _size(text: str) -> int:
    from pagellm.kv.memory import parse_size

    return parse_size(text)


def _int_list(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def _kv_dtype_list(text: str) -> tuple[str, ...]:
    from pagellm.config import KV_CACHE_DTYPES

    names = tuple(x.strip() for x in text.split(",") if x.strip())
    unknown = [n for n in names if n not in KV_CACHE_DTYPES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"{', '.join(map(repr, unknown or [text]))}: not a kv_cache_dtype; choose from "
            f"{', '.join(KV_CACHE_DTYPES)}")
    return names


def _prepare(args: argparse.Namespace) -> str:
    from pagellm.bench.throughput import resolve_model, set_threads

    set_threads(args.threads)
    return resolve_model(args.model, args.cache_dir)


def _vocab(model: str) -> tuple[int, Any]:
    from pagellm.model.loader import get_tokenizer, load_config

    return load_config(model).vocab_size, get_tokenizer(model)


def _emit(report: dict[str, Any], output_json: str | None, drop: tuple[str, ...] = ()) -> None:
    """Full report to the file; to stdout the same without timelines and per-request rows."""
    if output_json:
        Path(output_json).parent.mkdir(parents=True, exist_ok=True)
        Path(output_json).write_text(json.dumps(report, indent=2))
    print(json.dumps(_strip(report, drop), indent=2))


def _strip(value: Any, drop: tuple[str, ...]) -> Any:
    if isinstance(value, dict):
        return {k: _strip(v, drop) for k, v in value.items() if k not in drop}
    return value


# ---------------------------------------------------------------------------- throughput

def _add_throughput(modes) -> None:
    p = modes.add_parser("throughput", help="offline throughput on a seeded workload")
    _add_common(p, model="small")
    _add_engine_options(p)
    p.add_argument("--kv-allocator", choices=("paged", "contiguous"), default="paged")
    p.add_argument("--num-gpu-blocks-override", type=int, default=None)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--swap-space", type=float, default=1.0,
                   help="GiB of CPU swap space (default 1)")
    p.add_argument("--preemption-mode", choices=("swap", "recompute"), default=None)
    p.add_argument("--plot", default=None, metavar="FILE.png", help="KV slots over time")
    _add_quantization_options(p)
    add_workload_args(p, num_prompts=200)
    p.set_defaults(func=run_throughput)


def _add_quantization_options(p: argparse.ArgumentParser) -> None:
    """The engine's KV cache dtype and weight quantization, as ``pagellm serve`` takes them."""
    from pagellm.config import KV_CACHE_DTYPES, QUANTIZATION_METHODS
    from pagellm.entrypoints.commands.engine_flags import HELP

    g = p.add_argument_group("bytes per token")
    g.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help=HELP["kv_cache_dtype"])
    g.add_argument("--quantization", default=None,
                   choices=[m for m in QUANTIZATION_METHODS if m], help=HELP["quantization"])
    g.add_argument("--quantization-group-size", type=int, default=None,
                   help=HELP["quantization_group_size"])
    g.add_argument("--int8-activations", action="store_true", help=HELP["int8_activations"])


def run_throughput(args: argparse.Namespace) -> int:
    from pagellm.bench.throughput import EngineOptions, benchmark_throughput
    from pagellm.bench.workloads import build_workload

    model = _prepare(args)
    vocab_size, tokenizer = _vocab(model)
    workload = build_workload(spec_from_args(args), vocab_size, tokenizer)
    options = EngineOptions(
        model=model, kv_allocator=args.kv_allocator, dtype=args.dtype,
        block_size=args.block_size, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        num_gpu_blocks_override=args.num_gpu_blocks_override,
        enable_prefix_caching=not args.no_prefix_caching, swap_space=args.swap_space,
        preemption_mode=args.preemption_mode, seed=args.seed,
        kv_cache_dtype=args.kv_cache_dtype, quantization=args.quantization,
        quantization_group_size=args.quantization_group_size,
        int8_activations=args.int8_activations)
    report = {"workload": workload.summary(), **benchmark_throughput(options, workload.requests)}
    if args.plot:
        from pagellm.bench.plots import plot_kv_timelines

        plot_kv_timelines({args.kv_allocator: report}, args.plot)
    _emit(report, args.output_json, drop=("timeline",))
    return 1 if report["accounting_errors"] else 0


# ---------------------------------------------------------------------------- memory

def _add_memory(modes) -> None:
    from pagellm.bench.memory_experiment import DEFAULT_BUDGET_SEQS, SYSTEMS

    p = modes.add_parser(
        "memory", help="the seed's experiment: paged vs contiguous vs transformers, one budget",
        description="Four systems on one KV memory budget, workload and model, in one run. "
                    f"The default budget holds {DEFAULT_BUDGET_SEQS} reservations of "
                    "max_model_len tokens.")
    _add_common(p, model="tiny")
    _add_engine_options(p)
    p.add_argument("--systems", default=",".join(SYSTEMS),
                   help=f"comma-separated subset of {','.join(SYSTEMS)}")
    p.add_argument("--block-sizes", type=_int_list, default=(), metavar="1,8,16,...",
                   help="also sweep the paged engine over these block sizes")
    p.add_argument("--kv-cache-dtypes", type=_kv_dtype_list, default=(),
                   metavar="auto,int8,fp8,...",
                   help="also run the paged engine at each of these kv_cache_dtype on the same "
                        "budget in bytes: blocks, peak and mean concurrency against the first")
    p.add_argument("--plot-dir", default=None, help="write the PNG plots here")
    p.add_argument("--plot-prefix", default="memory", help="file name prefix of the plots")
    p.add_argument("--html", default=None, metavar="REPORT.html",
                   help="write a static page of the paged and contiguous systems' block maps "
                        "and charts over the run (records block maps as it runs)")
    add_workload_args(p, num_prompts=48)
    p.set_defaults(func=run_memory)


def run_memory(args: argparse.Namespace) -> int:
    from pagellm.bench.memory_experiment import (MemoryExperimentConfig, run_memory_experiment,
                                                 save_plots)
    from pagellm.bench.workloads import build_workload

    model = _prepare(args)
    vocab_size, tokenizer = _vocab(model)
    workload = build_workload(spec_from_args(args), vocab_size, tokenizer)
    config = MemoryExperimentConfig(
        model=model, dtype=args.dtype, block_size=args.block_size,
        max_model_len=args.max_model_len, kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        systems=tuple(s for s in args.systems.split(",") if s), block_sizes=args.block_sizes,
        kv_cache_dtypes=args.kv_cache_dtypes, seed=args.seed, record_views=bool(args.html), extra={"model_name": args.model})
    report = run_memory_experiment(config, workload)
    if args.plot_dir:
        report["plots"] = [str(p) for p in save_plots(report, args.plot_dir, args.plot_prefix)]
    if args.html:
        from pagellm.bench.kv_report import save_html_report

        report["html_report"] = str(save_html_report(report, args.html))
        for name in ("paged", "contiguous"):
            report.get(name, {}).pop("kv_views", None)  # in the page, not in the JSON
    _emit(report, args.output_json, drop=("timeline", "batch_sizes", "kv_views"))
    return 1 if report["accounting_errors"] else 0


# ---------------------------------------------------------------------------- serving

def _add_serving(modes) -> None:
    p = modes.add_parser("serving", help="latency and throughput of an OpenAI-compatible server")
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--endpoint", default="/v1/completions")
    p.add_argument("--served-model-name", default=None,
                   help="the model name to send (default: the first of GET /v1/models)")
    p.add_argument("--tokenizer", default=None,
                   help="'tiny', 'small', 'narrow' or a folder: its vocabulary sizes the random "
                        "prompts and decodes them for --prompt-format text")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="vocabulary size for random token prompts when there is no tokenizer")
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--prompt-format", choices=("token_ids", "text"), default="token_ids",
                   help="send prompts as token id lists (exact lengths) or as decoded text")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="Poisson arrivals per second (default inf: all at once)")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--output-json", default=None, metavar="FILE")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="latency distributions")
    p.add_argument("--label", default="", help="a label for the plot and the JSON")
    add_workload_args(p, num_prompts=64, input_len="32,256", output_len="16,128")
    p.set_defaults(func=run_serving)


def run_serving(args: argparse.Namespace) -> int:
    from pagellm.bench.serving import ServingConfig, benchmark_serving, first_served_model
    from pagellm.bench.workloads import build_workload

    tokenizer = _serving_tokenizer(args)
    vocab_size = len(tokenizer) if tokenizer is not None else args.vocab_size
    if vocab_size is None:
        raise ValueError("random prompts need --tokenizer or --vocab-size")
    workload = build_workload(spec_from_args(args), vocab_size, tokenizer)
    if args.prompt_format == "text":
        if tokenizer is None:
            raise ValueError("--prompt-format text needs --tokenizer")
        for request in workload.requests:
            request.prompt = request.prompt or tokenizer.decode(request.prompt_token_ids)
    model = args.served_model_name or first_served_model(args.base_url)
    config = ServingConfig(base_url=args.base_url, model=model, endpoint=args.endpoint,
                           request_rate=args.request_rate, max_concurrency=args.max_concurrency,
                           seed=args.seed, prompt_format=args.prompt_format)
    report = {"label": args.label, "workload": workload.summary(),
              **benchmark_serving(config, workload.requests)}
    if args.plot:
        from pagellm.bench.plots import plot_latency

        plot_latency(report, args.plot)
    _emit(report, args.output_json, drop=("requests",))
    return 1 if report["failed"] else 0


def _serving_tokenizer(args: argparse.Namespace):
    if args.tokenizer is None:
        return None
    from pagellm.bench.throughput import resolve_model
    from pagellm.model.loader import get_tokenizer

    return get_tokenizer(resolve_model(args.tokenizer, args.cache_dir))


# ---------------------------------------------------------------------------- engine

def _add_engine(modes) -> None:
    p = modes.add_parser("engine", help="step time: model forward vs everything else")
    _add_common(p, model="small")
    p.add_argument("--batch-sizes", type=_int_list, default=(1, 32, 128, 256),
                   metavar="1,32,...", help="running sequences (default 1,32,128,256)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--decode-steps", type=int, default=16,
                   help="decode steps timed at each batch size (default 16)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0,
                   help="every request's temperature (default 0: greedy; above 0 each request "
                        "is seeded)")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="every request's top_p (default 1: off); needs --temperature above 0")
    p.set_defaults(func=run_engine_split)


def run_engine_split(args: argparse.Namespace) -> int:
    from pagellm.bench.engine_step import StepBenchConfig, benchmark_engine_step

    if args.top_p != 1.0 and args.temperature == 0.0:
        raise ValueError(f"--top-p {args.top_p} needs --temperature above 0 (greedy ignores it)")
    model = _prepare(args)
    config = StepBenchConfig(model=model, dtype=args.dtype, batch_sizes=args.batch_sizes,
                             prompt_len=args.prompt_len, decode_steps=args.decode_steps,
                             block_size=args.block_size, seed=args.seed,
                             temperature=args.temperature, top_p=args.top_p)
    report = benchmark_engine_step(config)
    report["model_name"] = args.model
    _emit(report, args.output_json)
    return 0
