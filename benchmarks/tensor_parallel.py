"""Step time, output tokens/s and communication time for tensor_parallel_size 1 and 2
(prints JSON). See pagellm/bench/tensor_parallel.py for what is timed.

    python benchmarks/tensor_parallel.py                         # small Llama, bfloat16
    python benchmarks/tensor_parallel.py --model tiny --dtype float32 --batch-sizes 1,4
"""
from __future__ import annotations

import argparse
import json
import os


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small",
                        help="'tiny', 'small' (built-in random weights) or a model folder")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tp", default="1,2", help="tensor_parallel_size values")
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--backend", default="mp", choices=("mp", "ray"))
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    from pagellm.bench.tensor_parallel import TensorParallelBenchConfig, run_tensor_parallel_bench
    from pagellm.bench.throughput import machine_info, resolve_model

    config = TensorParallelBenchConfig(
        model=resolve_model(args.model), dtype=args.dtype,
        tensor_parallel_sizes=tuple(int(x) for x in args.tp.split(",")),
        batch_sizes=tuple(int(x) for x in args.batch_sizes.split(",")),
        prompt_len=args.prompt_len, decode_steps=args.decode_steps, threads=args.threads,
        backend=args.backend)
    report = run_tensor_parallel_bench(config)
    report["machine"] = machine_info()
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
