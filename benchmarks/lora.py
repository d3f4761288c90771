"""Throughput with many LoRA adapters mixed in one workload, against the base model alone
(prints JSON).

    .venv/bin/python benchmarks/lora.py --threads 1
    .venv/bin/python benchmarks/lora.py --threads 1 --model tiny --num-requests 16

Workload (seed 0): ``--num-requests`` requests of random token prompts (``--prompt-len``
tokens) and ``--output-len`` greedy output tokens each (EOS ignored), all queued at t = 0, on
the seeded "small" Llama (bfloat16). Adapters: seeded random PEFT-format folders of rank
``--rank`` on all seven projections (q/k/v/o, gate/up/down). Runs, in one process:

- ``base``: the engine without LoRA;
- ``lora-0``: LoRA enabled, no request uses an adapter (the wrapped layers' overhead);
- ``lora-K`` for K in ``--adapters``: request i uses adapter i mod K, ``max_loras = K``
  (every adapter resident: the cost of mixing, not of reloading).

All engines are built first, then the workload runs ``--repeats`` times on each, in turn
(base, lora-0, lora-1, ..., base, ...), so that a change in the machine's load falls on every
configuration alike; each reports its fastest repeat: output and total tokens per second of
wall time, and total tokens per second of the process's CPU time (``total_tok_cpu_s``: with
one torch thread, the measure that other processes on a shared machine disturb least), and
the ratio of the latter to ``base``'s (``vs_base``).
"""
from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import torch

from pagellm import LLM, LoRARequest, SamplingParams
from pagellm.bench.throughput import machine_info, resolve_model, set_threads

TARGETS = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
           "mlp": ("gate_proj", "up_proj", "down_proj")}


def write_adapter(folder: Path, config: dict, rank: int, seed: int) -> Path:
    """A PEFT-format adapter (adapter_config.json + adapter_model.safetensors) with seeded
    random A and B, as PEFT names them."""
    from safetensors.torch import save_file

    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = hidden // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * head_dim
    shapes = {"q_proj": (hidden, hidden), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
              "o_proj": (hidden, hidden), "gate_proj": (hidden, inter),
              "up_proj": (hidden, inter), "down_proj": (inter, hidden)}  # (in, out)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for block, names in TARGETS.items():
            for name in names:
                in_f, out_f = shapes[name]
                key = f"base_model.model.model.layers.{layer}.{block}.{name}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(rank, in_f, generator=gen) * 0.02
                tensors[f"{key}.lora_B.weight"] = torch.randn(out_f, rank, generator=gen) * 0.02
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
        "target_modules": [n for names in TARGETS.values() for n in names],
        "task_type": "CAUSAL_LM"}))
    return folder


def build(model: str, loras: list[LoRARequest | None], params: SamplingParams,
          engine_kwargs: dict) -> LLM:
    llm = LLM(model, **engine_kwargs)
    for lora in {lora for lora in loras if lora is not None}:
        llm.llm_engine.add_lora(lora)  # read from disk before the clock starts
    llm.generate([[5, 6, 7, 8]] * 2, params, use_tqdm=False)  # warm-up
    return llm


def run(llm: LLM, prompts: list[list[int]], loras: list[LoRARequest | None],
        params: SamplingParams) -> dict:
    start, start_cpu = time.perf_counter(), time.process_time()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                           lora_request=loras, use_tqdm=False)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - start_cpu
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    in_tokens = sum(map(len, prompts))
    result = {"seconds": round(elapsed, 2),
              "output_tok_s": round(out_tokens / elapsed, 1),
              "total_tok_s": round((in_tokens + out_tokens) / elapsed, 1),
              "cpu_seconds": round(cpu, 2),
              "total_tok_cpu_s": round((in_tokens + out_tokens) / cpu, 1),
              "output_tokens": out_tokens}
    stats = llm.llm_engine.get_stats()
    if stats.lora:
        result.update({key: stats.lora[key] for key in ("num_slot_loads",
                                                          "num_slot_evictions")})
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--adapters", default="1,4,16")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    set_threads(args.threads)
    model = resolve_model(args.model)
    config = json.loads((Path(model) / "config.json").read_text())
    rng = random.Random(0)
    prompts = [[rng.randrange(3, config["vocab_size"]) for _ in range(args.prompt_len)]
               for _ in range(args.num_requests)]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    counts = [int(k) for k in args.adapters.split(",")]
    base_kwargs = dict(dtype=args.dtype, max_model_len=args.prompt_len + args.output_len + 16,
                       max_num_seqs=args.max_num_seqs, swap_space=0.1,
                       kv_cache_memory_bytes=128 << 20)
    configs = {"base": ([None] * len(prompts), base_kwargs)}
    runs: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        adapters = [LoRARequest(f"adapter-{i}", i + 1,
                                str(write_adapter(Path(tmp) / f"a{i}", config, args.rank, i)))
                    for i in range(max(counts))]
        for k in [0, *counts]:
            loras = [adapters[i % k] if k else None for i in range(len(prompts))]
            configs[f"lora-{k}"] = (loras, dict(base_kwargs, enable_lora=True,
                                                max_loras=max(k, 1), max_lora_rank=args.rank))
        engines = {name: build(model, loras, params, kwargs)
                   for name, (loras, kwargs) in configs.items()}
        for _ in range(args.repeats):
            for name, (loras, _) in configs.items():
                result = run(engines[name], prompts, loras, params)
                if (name not in runs
                        or result["total_tok_cpu_s"] > runs[name]["total_tok_cpu_s"]):
                    runs[name] = result
    base = runs["base"]["total_tok_cpu_s"]
    for result in runs.values():
        result["vs_base"] = round(result["total_tok_cpu_s"] / base, 3)
    print(json.dumps({"benchmark": "lora", "model": args.model, "dtype": args.dtype,
                      "num_requests": args.num_requests, "prompt_len": args.prompt_len,
                      "output_len": args.output_len, "rank": args.rank,
                      "max_num_seqs": args.max_num_seqs, "repeats": args.repeats,
                      "runs": runs,
                      "machine": machine_info()}, indent=2))


if __name__ == "__main__":
    main()
