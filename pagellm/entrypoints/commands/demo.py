"""``pagellm demo``: generate for a batch of prompts and show what the paged KV cache did."""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

DEMO_CONFIG = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
                   num_key_value_heads=4, intermediate_size=688, vocab_size=4096,
                   max_position_embeddings=2048)
SYSTEM_PROMPT = ("You are a helpful assistant that explains how LLM inference engines manage "
                 "GPU memory with a paged KV cache, block tables and continuous batching. ")
DEMO_QUESTIONS = [
    "Explain how PagedAttention works.",
    "Why does contiguous KV reservation waste memory?",
    "What is a block table?",
    "How does prefix caching share a system prompt?",
    "What happens when the KV cache runs out of blocks?",
    "Describe continuous batching in one paragraph.",
    "请解释PagedAttention的工作原理",
    "Why is block size 16 a good balance?",
]


def default_cache_dir() -> Path:
    root = os.environ.get("PAGELLM_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "pagellm")
    return Path(root)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "demo", help="generate for a batch of prompts on a built-in demo model",
        description="Generate for a batch of prompts that share a system prompt and print the "
                    "outputs, throughput and KV cache statistics. Without --model it builds "
                    "(once, seeded) a small random-weight Llama model with a tokenizer in the "
                    "cache folder: its text is gibberish, the engine's work is real.")
    p.add_argument("--model", default=None, help="a local model folder or hub id "
                   "(default: the built-in random-weight demo model)")
    p.add_argument("--cache-dir", default=None,
                   help="where the demo model is built (default: $PAGELLM_CACHE or "
                        "~/.cache/pagellm)")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-gpu-blocks-override", type=int, default=None,
                   help="number of KV blocks (small values force preemption)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the statistics as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pagellm import LLM, SamplingParams
    from pagellm.bench.random_model import cached_demo_model

    model = args.model
    if model is None:
        cache = Path(args.cache_dir) if args.cache_dir else default_cache_dir()
        model = str(cached_demo_model(cache, "demo-llama-v1", **DEMO_CONFIG))
        print(f"Demo model: {model} (random weights, seeded: the text is gibberish; "
              "pass --model for a real one)")
    llm = LLM(model, block_size=args.block_size, dtype=args.dtype, seed=args.seed,
              num_gpu_blocks_override=args.num_gpu_blocks_override, max_model_len=1024,
              enable_prefix_caching=True)
    prompts = [SYSTEM_PROMPT + DEMO_QUESTIONS[i % len(DEMO_QUESTIONS)]
               for i in range(args.num_prompts)]
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p,
                            max_tokens=args.max_tokens, seed=args.seed, ignore_eos=True)
    engine = llm.llm_engine
    peak_used = allocated = filled = 0
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        stats = engine.get_stats()
        peak_used = max(peak_used, stats.num_blocks - stats.num_free_blocks)
        allocated += stats.slots_allocated
        filled += stats.slots_filled
    elapsed = time.perf_counter() - start
    outputs = [finished[str(i)] for i in range(len(prompts))]
    waste = 1 - filled / allocated if allocated else 0.0
    summary = _summary(outputs, engine.get_stats(), elapsed, peak_used, waste)
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    for out in outputs[:4]:
        print(f"\nPrompt: {out.prompt!r}\nOutput: {out.outputs[0].text!r}")
    print("\n" + "\n".join(f"{k:>28}: {v}" for k, v in summary.items()))
    return 0


def _summary(outputs, stats, elapsed: float, peak_used: int, waste: float) -> dict:
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    in_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    return {
        "requests": len(outputs),
        "prompt_tokens": in_tokens,
        "output_tokens": out_tokens,
        "elapsed_s": round(elapsed, 3),
        "output_tokens_per_s": round(out_tokens / elapsed, 1),
        "kv_blocks_total": stats.num_blocks,
        "kv_blocks_peak_used": peak_used,
        "kv_waste_ratio_time_avg": round(waste, 4),
        "prefix_cache_hit_rate": round(stats.prefix_hit_rate, 4),
        "prefix_cache_hit_tokens": stats.prefix_cache_hits,
        "preemptions": stats.num_preemptions,
        "swaps": stats.num_swap_outs,
    }
