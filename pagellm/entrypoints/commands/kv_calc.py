"""``pagellm kv-calc``: KV cache bytes per token and per batch, and what a memory budget holds.

Pure Python (pagellm.kv.memory): runs instantly, without torch (a GGUF file's metadata is read by
the model loader's GGUF code, which imports torch and takes a few seconds).
"""
from __future__ import annotations

import argparse
import json
import textwrap
from typing import Any

from pagellm.kv.memory import (PRESETS, KVMemoryModel, canonical_dtype, format_bytes,
                              parse_size)

# what --dtype may name: the dtypes weights and activations are computed in
MODEL_DTYPES = ("float16", "bfloat16", "float32")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "kv-calc",
        help="KV cache size per token and per batch; capacity of a memory budget",
        description="Bytes of KV cache per token = 2 x layers x KV heads x head_dim x dtype bytes, "
                    "with the KV heads of grouped-query attention (num_key_value_heads).",
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", metavar="PATH",
                        help="model directory holding config.json, or a GGUF file")
    source.add_argument("--config", metavar="FILE", help="a HuggingFace config.json")
    source.add_argument("--preset", choices=sorted(PRESETS), help="a built-in public config")
    parser.add_argument("--dtype", type=_model_dtype, default="auto",
                        help="the model dtype, as for serve: auto (the config's torch_dtype), "
                             "float16, bfloat16 or float32; the KV cache's unless "
                             "--kv-cache-dtype says otherwise")
    parser.add_argument("--kv-cache-dtype", default="auto",
                        help="KV cache dtype: auto (the model dtype), float16, bfloat16, "
                             "float32, int8, fp8 (= fp8_e4m3), fp8_e5m2 (8-bit caches add a "
                             "2-byte scale per token and KV head)")
    parser.add_argument("--batch", type=_positive_int, default=1, help="sequences (default 1)")
    parser.add_argument("--seq-len", type=_positive_int, default=2048,
                        help="tokens per sequence (default 2048)")
    parser.add_argument("--memory", type=_memory_size, default=None,
                        help="a KV cache budget such as 40GiB: report blocks, tokens and "
                             "maximum concurrency at --seq-len")
    parser.add_argument("--block-size", type=_positive_int, default=16,
                        help="tokens per KV block (default 16)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(func=run)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def _model_dtype(text: str) -> str:
    if text == "auto":
        return text
    try:
        dtype = canonical_dtype(text)
    except ValueError:
        dtype = None
    if dtype not in MODEL_DTYPES:
        hint = (f"; an {text} KV cache is --kv-cache-dtype {text}"
                if dtype is not None else "")
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a model dtype: auto, {', '.join(MODEL_DTYPES)}{hint}")
    return dtype


def _memory_size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def load_memory_model(args: argparse.Namespace) -> KVMemoryModel:
    dtype = args.dtype if args.kv_cache_dtype == "auto" else args.kv_cache_dtype
    if args.preset:
        return KVMemoryModel.from_preset(args.preset, dtype)
    if args.config:
        return KVMemoryModel.from_config_file(args.config, dtype)
    return KVMemoryModel.from_model_dir(args.model, dtype)


def compute_report(model: KVMemoryModel, batch: int, seq_len: int, block_size: int,
                   memory_bytes: int | None = None) -> dict[str, Any]:
    report: dict[str, Any] = {
        "model": model.name, "dtype": model.dtype, "dtype_bytes": model.dtype_bytes,
        "scale_bytes": model.scale_bytes,
        "num_layers": model.num_layers, "num_attention_heads": model.num_attention_heads,
        "num_kv_heads": model.num_kv_heads, "head_dim": model.head_dim,
        "grouped_query_attention": model.is_grouped_query,
        "bytes_per_token": model.bytes_per_token,
        "bytes_per_token_if_mha": model.bytes_per_token_if_mha,
        "batch": batch, "seq_len": seq_len, "num_tokens": batch * seq_len,
        "total_bytes": model.bytes_for(batch, seq_len),
        "total_bytes_if_mha": batch * seq_len * model.bytes_per_token_if_mha,
        "block_size": block_size, "bytes_per_block": model.bytes_per_block(block_size),
    }
    if memory_bytes is not None:
        capacity = model.capacity(memory_bytes, block_size, seq_len)
        report.update(memory_bytes=memory_bytes, num_blocks=capacity.num_blocks,
                      capacity_tokens=capacity.num_tokens, blocks_per_seq=capacity.blocks_per_seq,
                      max_concurrency=capacity.max_concurrency)
    return report


def format_report(r: dict[str, Any]) -> str:
    """The report as prose: the formula with the model's numbers, then what they mean."""
    kind = "grouped-query attention" if r["grouped_query_attention"] else "multi-head attention"
    per_token_mib = format_bytes(r["bytes_per_token"], "MiB")
    paragraphs = [
        f"{r['model']}: {r['num_layers']} layers, {r['num_attention_heads']} query heads, "
        f"{r['num_kv_heads']} KV heads ({kind}), head_dim {r['head_dim']}; "
        f"KV cache in {r['dtype']} ({r['dtype_bytes']} byte{'s' * (r['dtype_bytes'] != 1)}).",
    ]
    formula = (
        f"  KV cache per token = 2 (K and V) x {r['num_layers']} layers x {r['num_kv_heads']} "
        f"KV heads x {r['head_dim']} head_dim x {r['dtype_bytes']} bytes\n"
        if not r["scale_bytes"] else
        f"  KV cache per token = 2 (K and V) x {r['num_layers']} layers x {r['num_kv_heads']} "
        f"KV heads x ({r['head_dim']} head_dim x {r['dtype_bytes']} byte + "
        f"{r['scale_bytes']}-byte scale)\n")
    formula += (
        f"                     = {r['bytes_per_token']:,} bytes ({per_token_mib})\n"
        f"  {r['batch']:,} sequence{'s' if r['batch'] != 1 else ''} x {r['seq_len']:,} tokens"
        f" = {r['num_tokens']:,} tokens -> {r['total_bytes']:,} bytes "
        f"({format_bytes(r['total_bytes'])})")
    if r["grouped_query_attention"]:
        group = r["num_attention_heads"] // r["num_kv_heads"]
        paragraphs.append(
            f"Counting all {r['num_attention_heads']} heads, as for multi-head attention, would "
            f"give {format_bytes(r['bytes_per_token_if_mha'], 'MiB')} per token and "
            f"{format_bytes(r['total_bytes_if_mha'])} for this batch: {group}x too much. "
            f"{r['model']} has {r['num_kv_heads']} KV heads, each shared by {group} query "
            f"heads, so it needs {per_token_mib} per token and {format_bytes(r['total_bytes'])}.")
    else:
        paragraphs.append(f"Every one of the {r['num_attention_heads']} heads has its own K "
                          "and V (multi-head attention): no grouped-query saving.")
    if "memory_bytes" in r:
        paragraphs.append(
            f"{format_bytes(r['memory_bytes'])} holds {r['num_blocks']:,} blocks of "
            f"{r['block_size']} tokens ({format_bytes(r['bytes_per_block'])} each) = "
            f"{r['capacity_tokens']:,} tokens: at most {r['max_concurrency']:,} sequences of "
            f"{r['seq_len']:,} tokens at once ({r['blocks_per_seq']:,} blocks each).")
    wrapped = [textwrap.fill(p, width=92, break_on_hyphens=False) for p in paragraphs]
    return "\n\n".join([wrapped[0], formula, *wrapped[1:]])


def run(args: argparse.Namespace) -> int:
    model = load_memory_model(args)
    report = compute_report(model, args.batch, args.seq_len, args.block_size, args.memory)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0
