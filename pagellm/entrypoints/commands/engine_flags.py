"""Every ``EngineArgs`` field as a command-line flag, with vLLM's spelling (``--block-size``).

The flags are derived from the dataclass fields and their type hints, so a new engine argument
becomes a flag without touching this file and the defaults shown by ``--help`` are the code's.
Values are checked by ``EngineArgs.validate`` (the same messages as the Python API), not by
argparse, so that the command line never accepts or rejects something the engine would not.
"""
from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any

from pagellm.config import EngineArgs

# Help for the flags; a field missing here still gets a flag, with a generic help line.
HELP = {
    "tokenizer": "tokenizer folder or hub id (default: the model's)",
    "dtype": "weights and activations dtype: auto, float32, bfloat16, float16",
    "seed": "seed of the engine's random generator",
    "device": "auto, cpu or cuda",
    "tensor_parallel_size": "number of devices (CPU: processes) to shard the model over",
    "distributed_executor_backend": "mp (worker processes on this host) or ray (Ray actors, "
                                    "one host or a Ray cluster) for tensor_parallel_size > 1 "
                                    "(default: mp)",
    "gpu_memory_utilization": "fraction of GPU memory for weights, activations and KV cache",
    "kv_cache_memory_bytes": "bytes of KV cache (overrides the automatic sizing)",
    "num_gpu_blocks_override": "number of device KV blocks, whatever the device's memory",
    "max_model_len": "context length: prompt plus generated tokens (default: the model's)",
    "max_num_batched_tokens": "token budget of one engine step",
    "max_num_seqs": "most sequences in one step",
    "block_size": "tokens per KV cache block",
    "swap_space": "GiB of CPU memory for swapped-out KV blocks",
    "enable_prefix_caching": "share KV blocks of identical prompt prefixes",
    "enable_chunked_prefill": "split long prompts across steps, mixed with decodes",
    "preemption_mode": "swap or recompute (default: swap while CPU swap space has room)",
    "scheduling_policy": "fcfs or priority",
    "kv_allocator": "paged, or contiguous (the max-length reservation baseline)",
    "allow_pickle_weights": "allow loading pickled (.bin/.pt) weights: runs code from the file",
    "watermark": "fraction of KV blocks kept free when admitting new requests",
    "generation_config": "auto: the model's generation_config.json sets the default "
                         "temperature, top_p, top_k, min_p and repetition_penalty; vllm: the "
                         "engine's own defaults; or a folder holding generation_config.json "
                         "(default: auto)",
    "enforce_eager": "run every step eagerly: no CUDA graphs for decode steps on CUDA, no "
                     "CPU decode plan (the layers' kernels called in a row) on the CPU",
    "enable_lora": "serve LoRA adapters (docs/LORA.md) beside the base model",
    "max_loras": "LoRA adapters on the device at once: the most one step mixes",
    "max_lora_rank": "the highest LoRA rank an adapter may have",
    "max_cpu_loras": "LoRA adapters kept loaded in CPU memory (default: max_loras)",
    "kv_cache_dtype": "KV cache storage: auto (the model dtype), int8, fp8 (= fp8_e4m3) or "
                      "fp8_e5m2, with a scale per token and KV head (default: auto)",
    "quantization": "weight-only quantization of the linear layers: int8 (per output "
                    "channel; a GGUF file's blocks as they are), int4 (groups of "
                    "--quantization-group-size) or gguf (a GGUF file's blocks as they are, "
                    "int4 for Q4 types and int8 for the others); CPU only (default: None)",
    "quantization_group_size": "input columns per int4 scale: 32, 64, 128 or 256 (default: 32 "
                               "for a GGUF file, its Q4 blocks' groups; else 128, or 64 or 32 "
                               "where 128 does not divide a layer's input width)",
    "int8_activations": "with --quantization int4, int8 or gguf: multiply the int4 layers "
                        "(and, with AVX512-VNNI, the symmetric int8 ones: int8's, a GGUF's "
                        "Q8_0 ones, the vocabulary projection) by activations "
                        "rounded to int8 per 32 columns, with integer dot products (as "
                        "llama.cpp's Q4 x Q8 and Q8 x Q8): faster small-batch decode on the "
                        "CPU (AVX512-VNNI or AVX2 loops), adds the activations' rounding "
                        "(default: off)",
}
POSITIONAL = ("model",)
# vLLM's short spellings
SHORT_FLAGS = {"tensor_parallel_size": ("-tp",)}
# token counts that accept vLLM's suffixes: 32k = 32,000, 32K = 32,768 (also m/M, g/G)
HUMAN_READABLE_INTS = ("max_model_len", "max_num_batched_tokens")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _base_type(hint: Any) -> tuple[type, bool]:
    """(the non-None type, whether None is allowed) of a hint such as ``int | None``."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        concrete = [a for a in args if a is not type(None)]
        return (concrete[0] if len(concrete) == 1 else str), len(concrete) < len(args)
    return hint, False


def engine_fields() -> list[tuple[dataclasses.Field, type, bool]]:
    hints = typing.get_type_hints(EngineArgs)
    return [(f, *_base_type(hints[f.name])) for f in dataclasses.fields(EngineArgs)
            if f.name not in POSITIONAL]


def add_engine_flags(parser: argparse.ArgumentParser, overrides: dict[str, Any] | None = None
                     ) -> None:
    """Add ``--<field>`` for each EngineArgs field; ``overrides`` changes a default (e.g. a
    smaller ``max_model_len`` for an interactive command)."""
    group = parser.add_argument_group("engine arguments (EngineArgs)")
    for f, base, optional in engine_fields():
        default = (overrides or {}).get(f.name, f.default)
        help_text = HELP.get(f.name, f"EngineArgs.{f.name}")
        if "default" not in help_text:
            help_text += f" (default: {default})"
        if base is bool:
            group.add_argument(_flag(f.name), dest=f.name, default=default,
                               action=argparse.BooleanOptionalAction, help=help_text)
        else:
            parse = (_human_readable_int if f.name in HUMAN_READABLE_INTS
                     else _parser_for(base, optional))
            group.add_argument(*SHORT_FLAGS.get(f.name, ()), _flag(f.name), dest=f.name,
                               type=parse, default=default, metavar=base.__name__.upper(),
                               help=help_text)


def _parser_for(base: type, optional: bool):
    def parse(text: str):
        if optional and text.lower() in ("none", "null"):
            return None
        try:
            return base(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {base.__name__}, got {text!r}")

    parse.__name__ = base.__name__  # argparse names the type in its error message
    return parse


_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def _human_readable_int(text: str) -> int | None:
    """vLLM's token counts: an int, ``none``, or a number with a suffix (``32k``, ``1.5K``)."""
    if text.lower() in ("none", "null"):
        return None
    multiplier = _SUFFIXES.get(text[-1:], 1)
    number = text[:-1] if multiplier != 1 else text
    try:
        value = float(number) * multiplier if multiplier != 1 else int(number)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int such as 4096 or 32k, got {text!r}")
    if value != int(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of tokens")
    return int(value)


_human_readable_int.__name__ = "int"


def engine_args_from(namespace: argparse.Namespace, model: str | None = None) -> EngineArgs:
    """EngineArgs from parsed flags; raises ValueError (naming the field) for a bad value."""
    values = {f.name: getattr(namespace, f.name) for f, _, _ in engine_fields()}
    args = EngineArgs(model=model if model is not None else namespace.model, **values)
    args.validate()
    return args
