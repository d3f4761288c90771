"""Engine start-up: resolve the device, load the model, size the KV cache, build the layers
(the KV cache manager and the scheduler on the engine's side, the worker on the model's).

KV cache sizing follows vLLM: on CUDA, profile a maximum-size batch and give the KV cache
``gpu_memory_utilization`` × total memory minus what the weights and the peak activations take;
on the CPU, ``kv_cache_memory_bytes`` when given, else ``CPU_KV_CACHE_RAM_SHARE`` of the RAM
available at start-up. ``num_gpu_blocks_override`` wins over both.
"""
from __future__ import annotations

import importlib.util
import logging
import math
import os
from dataclasses import dataclass, fields, replace
from typing import Any

import torch

from pagellm.attention import kv_quant
from pagellm.attention.layer import runs_triton
from pagellm.config import CPU_KV_CACHE_RAM_SHARE, EngineArgs
from pagellm.core.scheduler import Scheduler, SchedulerConfig
from pagellm.distributed.parallel_state import TensorParallelGroup, single_device_group
from pagellm.kv import ContiguousKVCacheManager, KVCacheManager
from pagellm.lora.manager import LoRAManager
from pagellm.model.generation_config import load_generation_defaults
from pagellm.model.layers.linear import heads_per_rank
from pagellm.model.quantized_model import use_int8_activations
from pagellm.model.loader import (get_tokenizer, load_config, load_model, resolve_dtype,
                                  resolve_model_path)
from pagellm.structured_outputs import GrammarCompiler
from pagellm.worker.cache_engine import CacheEngine
from pagellm.worker.cpu_decode import CpuDecodePlan
from pagellm.worker.grammar import TokenMasks
from pagellm.worker.model_runner import ModelRunner, ScheduledSeq
from pagellm.worker.sampler import Sampler
from pagellm.worker.worker import Worker

logger = logging.getLogger("pagellm")


@dataclass(slots=True)
class EngineComponents:
    device: torch.device
    hf_config: Any
    tokenizer: Any
    max_model_len: int
    num_gpu_blocks: int
    num_cpu_blocks: int
    kv: Any
    cache_engine: CacheEngine
    runner: ModelRunner
    sampler: Sampler
    scheduler: Scheduler
    worker: Any  # the Worker, or the tensor-parallel executor (the same execute_model)
    # SamplingParams field -> the model's recommended value (generation_config.json)
    default_sampling: dict[str, Any]
    # every token that ends a sequence: the tokenizer's EOS, the config's, the generation
    # config's (computed once: the sampler's min_tokens ban and the scheduler's stop check
    # must agree)
    eos_token_ids: frozenset[int]
    # structured outputs: compiles a request's grammar once (engine) and per sequence (worker)
    grammar_compiler: GrammarCompiler


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was asked for, but no CUDA device is available")
    return torch.device(name)


def resolve_max_model_len(args: EngineArgs, hf_config: Any) -> int:
    limit = getattr(hf_config, "max_position_embeddings", None)
    if args.max_model_len is None:
        if limit is None:
            raise ValueError("the model config has no max_position_embeddings: set max_model_len")
        return int(limit)
    if limit is not None and args.max_model_len > limit:
        raise ValueError(f"max_model_len={args.max_model_len} exceeds the model's "
                         f"max_position_embeddings={limit}")
    return args.max_model_len


def available_ram_bytes() -> int:
    return _meminfo_bytes("MemAvailable:", "SC_AVPHYS_PAGES")


def total_ram_bytes() -> int:
    return _meminfo_bytes("MemTotal:", "SC_PHYS_PAGES")


def _meminfo_bytes(field: str, sysconf_pages: str) -> int:
    """A /proc/meminfo field in bytes, else sysconf's page count of the same."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(field):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf(sysconf_pages) * os.sysconf("SC_PAGE_SIZE")


@dataclass(slots=True)
class RankSpec:
    """What every tensor-parallel rank needs to build its worker (picklable: it travels to
    the worker processes and Ray actors)."""

    args: EngineArgs
    path: str
    dtype: torch.dtype
    max_model_len: int
    max_num_batched_tokens: int
    eos_token_ids: frozenset[int]


@dataclass(slots=True)
class RankWorker:
    worker: Worker
    num_gpu_blocks: int
    num_cpu_blocks: int
    block_bytes: int


def build_components(args: EngineArgs) -> EngineComponents:
    args.validate()
    torch.manual_seed(args.seed)
    device = resolve_device(args.device)
    path = resolve_model_path(args.model)
    hf_config = load_config(path)
    check_tensor_parallel(args.tensor_parallel_size, hf_config, device, args.enable_lora)
    if args.tensor_parallel_size == 1 or args.distributed_executor_backend == "mp":
        # Ray: each rank, on its host
        args = _check_swap_space(args, _local_ranks(args), shrink_default=True)
    dtype = resolve_dtype(args.dtype, hf_config, device)
    tokenizer = get_tokenizer(args.tokenizer or path)
    generation = load_generation_defaults(path, args.generation_config)
    eos_token_ids = _eos_token_ids(tokenizer, hf_config) | generation.eos_token_ids
    max_model_len = resolve_max_model_len(args, hf_config)
    budget = args.resolve_max_num_batched_tokens(max_model_len)
    spec = RankSpec(args, str(path), dtype, max_model_len, budget, eos_token_ids)
    if args.tensor_parallel_size == 1:
        rank = build_rank_worker(spec, device, single_device_group())
        worker = rank.worker
    else:
        from pagellm.distributed.executor import make_executor

        worker, rank = make_executor(spec, device)
    num_gpu_blocks, num_cpu_blocks = rank.num_gpu_blocks, rank.num_cpu_blocks
    _log_sizing(args, num_gpu_blocks, num_cpu_blocks, rank.block_bytes, max_model_len)
    kv = _make_kv_manager(args, num_gpu_blocks, num_cpu_blocks, max_model_len)
    scheduler = Scheduler(SchedulerConfig(
        max_num_batched_tokens=budget, max_num_seqs=args.max_num_seqs,
        max_model_len=max_model_len, enable_chunked_prefill=args.enable_chunked_prefill,
        preemption_mode=args.preemption_mode, policy=args.scheduling_policy,
        max_loras=args.max_loras if args.enable_lora else None), kv, eos_token_ids)
    local = rank.worker
    # Only the driver's worker samples (rank 0 under tensor parallelism): the grammar state of
    # structured outputs lives there.
    grammar_compiler = GrammarCompiler(tokenizer, hf_config.vocab_size,
                                       _grammar_eos(tokenizer, eos_token_ids))
    local.token_masks = TokenMasks(grammar_compiler, hf_config.vocab_size)
    return EngineComponents(device, local.runner.model.config, tokenizer, max_model_len,
                            num_gpu_blocks, num_cpu_blocks, kv, local.cache_engine, local.runner,
                            local.sampler, scheduler, worker, generation.sampling, eos_token_ids,
                            grammar_compiler)


def _grammar_eos(tokenizer: Any, eos_token_ids: frozenset[int]) -> int | None:
    """The token a grammar ends with: the tokenizer's EOS, else the smallest engine EOS."""
    eos = getattr(tokenizer, "eos_token_id", None)
    if isinstance(eos, int) and eos in eos_token_ids:
        return eos
    return min(eos_token_ids) if eos_token_ids else None


def build_rank_worker(spec: RankSpec, device: torch.device, tp: TensorParallelGroup,
                      local_ranks: int | None = None) -> RankWorker:
    """Load this rank's shard of the model, size the KV cache (the minimum over the ranks,
    so that every rank holds every block the driver's block tables name) and build the
    worker. Every rank runs this at once: the sizing is a collective. ``local_ranks``: the
    ranks on this rank's host where the executor knows it per rank (Ray, whose actors may
    share hosts or not; its swap space is checked here then), else ``_local_ranks``."""
    args = spec.args
    if local_ranks is None:
        local_ranks = _local_ranks(args)
    else:
        _check_swap_space(args, local_ranks)
    torch.manual_seed(args.seed)
    model, hf_config = load_model(spec.path, dtype=spec.dtype, device=device,
                                  allow_pickle=args.allow_pickle_weights, tp=tp,
                                  quantization=args.quantization,
                                  quantization_group_size=args.quantization_group_size)
    if args.int8_activations:
        use_int8_activations(model)
    kv_format = kv_quant.kv_format(args.kv_cache_dtype)
    block_bytes = CacheEngine.bytes_per_block(hf_config, args.block_size, spec.dtype,
                                              kv_format, tp.world_size)
    num_gpu_blocks = tp.all_reduce_min(_num_device_blocks(
        args, model, hf_config, spec.dtype, device, block_bytes, spec.max_num_batched_tokens,
        spec.max_model_len, tp.world_size))
    num_cpu_blocks = args.swap_space_bytes // block_bytes
    _check_fits(args, num_gpu_blocks, spec.max_model_len)
    if device.type == "cpu":
        _check_ram(args, num_gpu_blocks * block_bytes, local_ranks)
    cache_engine = CacheEngine(hf_config, num_gpu_blocks, num_cpu_blocks, args.block_size,
                               spec.dtype, device, kv_format, tp.world_size)
    runner = ModelRunner(model, cache_engine, device)
    lora_manager = _make_lora_manager(args, model, runner, device)
    _capture_decode_graphs(args, runner, device, spec.max_model_len)
    _plan_cpu_decode(args, runner, device)
    sampler = Sampler(hf_config.vocab_size, spec.eos_token_ids)
    worker = Worker(cache_engine, runner, sampler, device, lora_manager, is_driver=tp.is_first)
    return RankWorker(worker, num_gpu_blocks, num_cpu_blocks, block_bytes)


def check_tensor_parallel(tp_size: int, hf_config: Any, device: torch.device,
                          enable_lora: bool = False) -> None:
    """Refuse a tensor_parallel_size the model's heads or the devices cannot take, naming
    both numbers."""
    if tp_size == 1:
        return
    if enable_lora:
        raise ValueError(f"enable_lora=True with tensor_parallel_size={tp_size}: LoRA adapters "
                         "are not split over ranks; use tensor_parallel_size=1 with LoRA")
    heads_per_rank(hf_config.num_attention_heads, hf_config.num_key_value_heads, tp_size)
    if hf_config.intermediate_size % tp_size:
        raise ValueError(f"tensor_parallel_size={tp_size} does not divide the model's "
                         f"intermediate_size={hf_config.intermediate_size}")
    if device.type == "cuda" and tp_size > torch.cuda.device_count():
        raise ValueError(f"tensor_parallel_size={tp_size} exceeds the "
                         f"{torch.cuda.device_count()} CUDA device(s) of this machine")


def _make_lora_manager(args: EngineArgs, model, runner: ModelRunner,
                       device: torch.device) -> LoRAManager | None:
    """With enable_lora: wrap the projections in LoRA layers (after the KV cache sizing, so
    the profiled peak ignores the small adapter slots) and give the runner their step state."""
    if not args.enable_lora:
        return None
    use_triton = device.type == "cuda" and importlib.util.find_spec("triton") is not None
    manager = LoRAManager(model, args.max_loras, args.max_lora_rank,
                          args.resolved_max_cpu_loras, use_triton=use_triton)
    runner.lora_state = manager.state
    return manager


def _plan_cpu_decode(args: EngineArgs, runner: ModelRunner, device: torch.device) -> None:
    """On the CPU, unless enforce_eager: decode steps of up to max_num_seqs sequences call the
    layers' kernels in a row (worker/cpu_decode.py) where the model allows it."""
    if device.type != "cpu" or args.enforce_eager:
        return
    why_not = CpuDecodePlan.supports(runner.model, runner.cache_engine.kv_caches)
    if why_not is not None:
        logger.info("CPU decode plan off: %s; decode steps run the layers' forward", why_not)
        return
    runner.cpu_decode = CpuDecodePlan(runner.model, runner.cache_engine.kv_caches,
                                      args.max_num_seqs)
    logger.info("CPU decode plan on: decode steps of up to %d sequences call the layers' "
                "kernels in a row", runner.cpu_decode.max_rows)


def _capture_decode_graphs(args: EngineArgs, runner: ModelRunner, device: torch.device,
                           max_model_len: int) -> None:
    """On CUDA, unless enforce_eager: capture decode steps, after the KV cache is allocated
    (the graphs read it at fixed addresses). Their memory comes out of what the sizing left
    free (gpu_memory_utilization's margin); vLLM measures it instead."""
    if device.type != "cuda" or args.enforce_eager:
        return
    if args.tensor_parallel_size > 1:
        logger.info("CUDA graphs off: tensor parallelism runs every step eagerly (capturing "
                    "the collectives has not been tested)")
        return
    if args.enable_lora:
        logger.info("CUDA graphs off: LoRA steps run eagerly")
        return
    if not runs_triton(device):
        logger.info("CUDA graphs off: attention does not run the Triton kernels "
                    "(triton missing or PAGELLM_ATTENTION_BACKEND=torch)")
        return
    runner.capture_decode_graphs(args.max_num_seqs, max_model_len)


def _eos_token_ids(tokenizer: Any, hf_config: Any) -> frozenset[int]:
    ids: set[int] = set()
    for source in (getattr(tokenizer, "eos_token_id", None),
                   getattr(hf_config, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, (list, tuple)):
            ids.update(int(t) for t in source)
    return frozenset(ids)


def _make_kv_manager(args: EngineArgs, num_gpu_blocks: int, num_cpu_blocks: int,
                     max_model_len: int):
    if args.kv_allocator == "contiguous":
        return ContiguousKVCacheManager(num_gpu_blocks, args.block_size, max_model_len,
                                        num_cpu_blocks=num_cpu_blocks, watermark=args.watermark)
    return KVCacheManager(num_gpu_blocks, args.block_size, num_cpu_blocks=num_cpu_blocks,
                          enable_prefix_caching=args.enable_prefix_caching,
                          watermark=args.watermark)


def _num_device_blocks(args: EngineArgs, model, hf_config, dtype, device: torch.device,
                       block_bytes: int, budget: int, max_model_len: int,
                       tp_size: int = 1) -> int:
    if args.num_gpu_blocks_override is not None:
        return args.num_gpu_blocks_override
    if args.kv_cache_memory_bytes is not None:
        kv_bytes = args.kv_cache_memory_bytes
    elif device.type == "cuda":
        kv_bytes = _profile_cuda_kv_bytes(args, model, hf_config, dtype, device, budget,
                                          max_model_len, tp_size)
    else:
        kv_bytes = int(available_ram_bytes() * CPU_KV_CACHE_RAM_SHARE)
    return max(kv_bytes // block_bytes, 0)


def _profile_cuda_kv_bytes(args: EngineArgs, model, hf_config, dtype, device: torch.device,
                           budget: int, max_model_len: int, tp_size: int = 1) -> int:
    """Run one maximum-size prefill batch over a scratch cache and measure the peak memory."""
    num_tokens = min(budget, args.max_num_seqs * max_model_len)
    seq_len = min(max_model_len, num_tokens)
    num_seqs = -(-num_tokens // seq_len)
    blocks_per_seq = -(-seq_len // args.block_size)
    kv_format = kv_quant.kv_format(args.kv_cache_dtype)
    scratch = CacheEngine(hf_config, num_seqs * blocks_per_seq, 0, args.block_size, dtype, device,
                          kv_format, tp_size)
    runner = ModelRunner(model, scratch, device)
    batch = [ScheduledSeq([0] * seq_len, 0, seq_len,
                          list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)),
                          need_logits=True) for i in range(num_seqs)]
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    runner.execute(batch)
    torch.cuda.synchronize(device)
    scratch_bytes = CacheEngine.bytes_per_block(hf_config, args.block_size, dtype, kv_format,
                                                tp_size) * (
        num_seqs * blocks_per_seq)
    peak = torch.cuda.max_memory_allocated(device) - scratch_bytes
    del runner, scratch
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(device).total_memory
    kv_bytes = int(total * args.gpu_memory_utilization) - peak
    if kv_bytes <= 0:
        raise ValueError(
            f"no memory left for the KV cache: weights and activations peak at {peak} bytes, "
            f"gpu_memory_utilization={args.gpu_memory_utilization} allows {int(total * args.gpu_memory_utilization)}")
    return kv_bytes


def _check_fits(args: EngineArgs, num_gpu_blocks: int, max_model_len: int) -> None:
    needed = -(-max_model_len // args.block_size)
    if num_gpu_blocks < needed:
        raise ValueError(
            f"the KV cache has {num_gpu_blocks} blocks of {args.block_size} tokens, but one "
            f"sequence of max_model_len={max_model_len} needs {needed}: give the KV cache more "
            "memory (kv_cache_memory_bytes, gpu_memory_utilization, num_gpu_blocks_override) or "
            "lower max_model_len")


def _check_ram(args: EngineArgs, cache_bytes: int, local_ranks: int = 1) -> None:
    """A CPU KV cache commits its pages as its blocks fill (cache_engine._allocate_zeroed),
    so caches larger than the RAM available would fail mid-run: they are refused at start.
    ``local_ranks``: the ranks whose caches (each ``cache_bytes``) share this host's RAM. The
    default size (a share of the available RAM per rank) fits up to 9 ranks."""
    available = available_ram_bytes()
    if cache_bytes * local_ranks <= available:
        return
    setting = (f"num_gpu_blocks_override={args.num_gpu_blocks_override}"
               if args.num_gpu_blocks_override is not None
               else f"kv_cache_memory_bytes={args.kv_cache_memory_bytes}"
               if args.kv_cache_memory_bytes is not None
               else f"{CPU_KV_CACHE_RAM_SHARE:.0%} of the available RAM per rank")
    raise ValueError(f"the KV cache ({setting}: {cache_bytes} bytes{_ranks(local_ranks)}) "
                     f"exceeds the {available} bytes of RAM available; give it less")


def _ranks(local_ranks: int) -> str:
    return f" x {local_ranks} ranks on this host" if local_ranks > 1 else ""


def _local_ranks(args: EngineArgs) -> int:
    """The ranks whose memory is on this host as far as the arguments tell: all of them under
    "mp", this one alone otherwise (Ray tells each rank its own count, build_rank_worker)."""
    return args.tensor_parallel_size if args.distributed_executor_backend == "mp" else 1


SWAP_RAM_SHARE_LIMIT, SWAP_RAM_SHARE_WARNING = 0.7, 0.4  # vLLM's limits


def _check_swap_space(args: EngineArgs, local_ranks: int = 1,
                      shrink_default: bool = False) -> EngineArgs:
    """Each rank allocates ``swap_space`` GiB of CPU memory for swapped-out blocks at start
    (pinned, hence committed, beside a CUDA device; committed as swapped blocks land beside a
    CPU one). As vLLM does, the ranks on this host together may take at most 70% of its RAM,
    and more than 40% is warned of: a larger swap space fails to allocate or takes the memory
    the rest of the host needs. With ``shrink_default`` (every rank on this host, so that all
    of them get the same value), the default 4 GiB on a small host is lowered to 40% of its
    RAM instead, with a warning: a default must not refuse to start. Returns the args to use."""
    total = total_ram_bytes()
    swap = args.swap_space_bytes * local_ranks
    if swap <= SWAP_RAM_SHARE_WARNING * total:
        return args
    what = (f"swap_space={args.swap_space} GiB{_ranks(local_ranks)} ({swap} bytes) is "
            f"{swap / total:.0%} of this host's {total} bytes of RAM")
    if shrink_default and args.swap_space == _DEFAULT_SWAP_SPACE:
        gib = math.floor(SWAP_RAM_SHARE_WARNING * total / local_ranks / 2**30 * 100) / 100
        over = " over the ranks" if local_ranks > 1 else ""
        logger.warning("%s, the default: using swap_space=%.2f GiB (%.0f%% of the RAM%s) "
                       "instead; set swap_space to choose", what, gib,
                       100 * SWAP_RAM_SHARE_WARNING, over)
        return replace(args, swap_space=gib)
    if swap > SWAP_RAM_SHARE_LIMIT * total:
        raise ValueError(f"{what}; at most {SWAP_RAM_SHARE_LIMIT:.0%} may go to the swap "
                         "space: give it less")
    logger.warning("%s; the swap space may crowd out the rest of the host", what)
    return args


_DEFAULT_SWAP_SPACE = {f.name: f.default for f in fields(EngineArgs)}["swap_space"]


def _log_sizing(args: EngineArgs, num_gpu_blocks: int, num_cpu_blocks: int, block_bytes: int,
                max_model_len: int) -> None:
    tokens = num_gpu_blocks * args.block_size
    logger.info("KV cache: %d device blocks, %d CPU swap blocks of %d tokens (%.2f MiB device, "
                "%.2f MiB swap); %d tokens; maximum concurrency at %d tokens per request: %.2fx",
                num_gpu_blocks, num_cpu_blocks, args.block_size,
                num_gpu_blocks * block_bytes / 2**20, num_cpu_blocks * block_bytes / 2**20,
                tokens, max_model_len, tokens / max_model_len)
