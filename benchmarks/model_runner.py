"""Model runner step time on the ~125M "small" Llama, with attention's share (prints JSON).

    .venv/bin/python benchmarks/model_runner.py                  # float32 and bfloat16
    .venv/bin/python benchmarks/model_runner.py --dtypes bfloat16 --batch-sizes 64 --iters 5
    .venv/bin/python benchmarks/model_runner.py --torch-decode   # without the CPU kernel
    .venv/bin/python benchmarks/model_runner.py --unpacked       # plain F.linear weights
    .venv/bin/python benchmarks/model_runner.py --profile        # + torch profiler top ops
    .venv/bin/python benchmarks/model_runner.py --kv-cache-dtype int8   # an 8-bit KV cache

Workload (fixed seed, random weights std 0.02, nothing downloaded): decode steps of 1, 8, 32,
64 and 128 sequences, each at 512 tokens of context (511 cached + 1 new), and one 512-token
prefill. Block tables are shuffled physical blocks, as after allocator churn. The KV cache is
of the model dtype, or 8-bit with --kv-cache-dtype (int8, fp8 / fp8_e4m3, fp8_e5m2).

For every shape it reports:
- ``step_ms``: median wall time of ``ModelRunner.execute`` (input building included);
- ``attention_ms`` / ``attention_share``: time inside the attention backend (K/V write,
  gather through the block tables, softmax, weighted sum), measured in a separate pass with a
  timer around each layer's call;
- ``matmul_ms``: a lower bound measured in the same run, the model's linear layers
  (q/k/v, o, gate/up, down for every layer, lm_head on the sampled rows) timed alone on the
  same weights and activation shapes, through the same (packed or plain) layers.
- with ``--profile``, ``profile_ms_per_step``: the torch profiler's ten largest ops by self CPU
  time, per step (the compiled CPU kernels and Python are not ops: they are the difference
  between the step and the ops' sum).
Target: attention under 25% of a decode step at 64 sequences x 512 context.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
from transformers import LlamaConfig

import pagellm.attention.layer as attention_layer
from pagellm.attention import cpu_kernel, kv_quant, quantized_backend
from pagellm.bench.throughput import machine_info
from pagellm.config import KV_CACHE_DTYPES
from pagellm.model.llama import LlamaForCausalLM
from pagellm.worker.cache_engine import CacheEngine
from pagellm.worker.model_runner import ModelRunner, ScheduledSeq

SMALL_LLAMA = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                   num_key_value_heads=4, intermediate_size=2048, vocab_size=32000,
                   max_position_embeddings=2048)
BLOCK_SIZE = 16


def build_model(dtype: torch.dtype, seed: int = 0,
                pack: bool = True) -> tuple[LlamaForCausalLM, LlamaConfig]:
    config = LlamaConfig(**SMALL_LLAMA)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        model = LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(previous)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.02
                        if param.dim() > 1 else torch.ones(param.shape))
    if pack:  # as load_model does on the CPU
        model.pack_weights()
    return model, config


def decode_batch(num_seqs: int, context: int, num_blocks: int, seed: int) -> list[ScheduledSeq]:
    """num_seqs sequences with context - 1 cached tokens computing their last one."""
    gen = torch.Generator().manual_seed(seed)
    per_seq = -(-context // BLOCK_SIZE)
    blocks = torch.randperm(num_blocks, generator=gen)[:num_seqs * per_seq].view(num_seqs, -1)
    return [ScheduledSeq(torch.randint(0, 32000, (context,), generator=gen).tolist(),
                         context - 1, 1, blocks[i].tolist(), need_logits=True)
            for i in range(num_seqs)]


def prefill_batch(length: int, num_blocks: int, seed: int) -> list[ScheduledSeq]:
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randperm(num_blocks, generator=gen)[:-(-length // BLOCK_SIZE)].tolist()
    tokens = torch.randint(0, 32000, (length,), generator=gen).tolist()
    return [ScheduledSeq(tokens, 0, length, blocks, need_logits=True)]


def median_ms(fn: Callable[[], object], iters: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def attention_ms(runner: ModelRunner, batch: list[ScheduledSeq], iters: int) -> float:
    """Median per-step time spent inside the attention backend (all layers; the 8-bit
    caches' backend where the cache is one)."""
    originals = {module: module.paged_attention
                 for module in (attention_layer, quantized_backend)}
    spent = [0.0]

    def timer(original):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            out = original(*args, **kwargs)
            spent[0] += time.perf_counter() - start
            return out
        return timed

    for module, original in originals.items():
        module.paged_attention = timer(original)
    try:
        runner.execute(batch)
        per_step = []
        for _ in range(iters):
            spent[0] = 0.0
            runner.execute(batch)
            per_step.append(spent[0])
    finally:
        for module, original in originals.items():
            module.paged_attention = original
    return statistics.median(per_step) * 1e3


def matmul_ms(model: LlamaForCausalLM, num_tokens: int, num_logits: int, iters: int) -> float:
    """The step's linear layers alone: same weights, same activation shapes."""
    dtype = model.lm_head.weight.dtype  # (an empty tensor of the dtype once packed)
    hidden = torch.randn(num_tokens, SMALL_LLAMA["hidden_size"], dtype=dtype)
    inner = torch.randn(num_tokens, SMALL_LLAMA["intermediate_size"], dtype=dtype)
    rows = hidden[:num_logits]

    def run() -> None:
        with torch.inference_mode():
            for layer in model.model.layers:
                layer.self_attn.qkv_proj(hidden)
                layer.self_attn.o_proj(hidden)
                layer.mlp.gate_up_proj(hidden)
                layer.mlp.down_proj(inner)
            model.lm_head(rows)

    return median_ms(run, iters)


def profile_ms(runner: ModelRunner, batch: list[ScheduledSeq], iters: int) -> dict:
    """The ten largest torch ops by self CPU time, milliseconds per step."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(iters):
            runner.execute(batch)
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    return {e.key: round(e.self_cpu_time_total / 1e3 / iters, 2) for e in events[:10]}


def measure(runner: ModelRunner, model: LlamaForCausalLM, batch: list[ScheduledSeq],
            iters: int, profile: bool = False) -> dict:
    num_tokens = sum(s.num_new_tokens for s in batch)
    step = median_ms(lambda: runner.execute(batch), iters)
    attention = attention_ms(runner, batch, iters)
    matmul = matmul_ms(model, num_tokens, len(batch), iters)
    result = {"step_ms": round(step, 2), "tokens_per_s": round(num_tokens / step * 1e3, 1),
              "attention_ms": round(attention, 2), "attention_share": round(attention / step, 3),
              "matmul_ms": round(matmul, 2), "step_over_matmul": round(step / matmul, 2)}
    if profile:
        result["profile_ms_per_step"] = profile_ms(runner, batch, iters)
    return result


def run(dtype_name: str, batch_sizes: list[int], context: int, prefill: int,
        iters: int, pack: bool, profile: bool = False, kv_cache_dtype: str = "auto"
        ) -> list[dict]:
    dtype = getattr(torch, dtype_name)
    model, config = build_model(dtype, pack=pack)
    num_blocks = max(batch_sizes) * -(-context // BLOCK_SIZE) + 64
    cache = CacheEngine(config, num_blocks, 0, BLOCK_SIZE, dtype, "cpu",
                        kv_quant.kv_format(kv_cache_dtype))
    runner = ModelRunner(model, cache, "cpu")
    results = []
    for num_seqs in batch_sizes:
        batch = decode_batch(num_seqs, context, num_blocks, seed=num_seqs)
        runner.execute([ScheduledSeq(s.token_ids, 0, context, s.block_table, False)
                        for s in batch])  # fill the caches with real K/V
        results.append({"dtype": dtype_name, "kv_cache_dtype": kv_cache_dtype,
                        "kind": "decode", "num_seqs": num_seqs,
                        "context": context, **measure(runner, model, batch, iters, profile)})
    if prefill:
        batch = prefill_batch(prefill, num_blocks, seed=1)
        results.append({"dtype": dtype_name, "kv_cache_dtype": kv_cache_dtype,
                        "kind": "prefill", "num_seqs": 1,
                        "context": prefill,
                        **measure(runner, model, batch, max(3, iters // 2), profile)})
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--batch-sizes", default="1,8,32,64,128")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--prefill", type=int, default=512, help="0 to skip")
    parser.add_argument("--iters", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--torch-decode", action="store_true",
                        help="decode attention through the pure-torch path, not the CPU kernel")
    parser.add_argument("--profile", action="store_true",
                        help="add the torch profiler's largest ops for every shape")
    parser.add_argument("--unpacked", action="store_true",
                        help="plain F.linear weights, not packed for oneDNN")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                        help="the KV cache's dtype (default auto: the model dtype)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.torch_decode:
        cpu_kernel.supports = lambda query: False
    results = []
    for dtype_name in args.dtypes.split(","):
        results += run(dtype_name, [int(b) for b in args.batch_sizes.split(",")], args.context,
                       args.prefill, args.iters, not args.unpacked, args.profile,
                       args.kv_cache_dtype)
    print(json.dumps({"model": "small Llama (random weights)", **SMALL_LLAMA,
                      "block_size": BLOCK_SIZE, "threads": args.threads,
                      "packed_weights": not args.unpacked,
                      "decode_attention": "torch" if args.torch_decode or not
                      cpu_kernel.available() else "cpu_kernel",
                      **machine_info(), "results": results}, indent=1))


if __name__ == "__main__":
    main()
