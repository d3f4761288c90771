"""The compiled decode kernel built from several C sources, timed side by side (prints JSON).

    .venv/bin/python benchmarks/decode_kernel_variants.py --rev HEAD~1        # against the last commit
    .venv/bin/python benchmarks/decode_kernel_variants.py --sources /tmp/a.c,/tmp/b.c --threads 1
    .venv/bin/python benchmarks/decode_kernel_variants.py --kv-dtypes auto,int8,fp8,fp8_e5m2
    .venv/bin/python benchmarks/decode_kernel_variants.py --no-amx   # AMX CPUs: without AMX
    .venv/bin/python benchmarks/decode_kernel_variants.py --no-near-prefetch   # with and without

For work on pagellm/attention/paged_decode.c: this machine's timings drift by 10-40% from one
minute to the next, more than most changes to the kernel move them, so two builds are only
comparable when measured in one process, round by round. Each source (the package's own
``paged_decode.c`` first, then ``--rev``'s version of it from git, then ``--sources``) is built
and loaded as its own library; every (source, KV dtype) is called on the same caches and
queries, interleaved within each round, and the fastest of ``--iters`` rounds (after one
warm-up) is reported as ns per key and KV head (both passes, all query heads) and as a ratio
to the first source's bfloat16 time. Every source's output must equal the first one's
bit for bit (reported, not asserted: a variant may reorder sums on purpose).

Workload (seed 0): the "small" Llama's decode attention (12 query heads over 4 KV heads,
head_dim 64, blocks of 16 tokens unless --block-size says otherwise, bfloat16 queries,
shuffled physical blocks): 4 x 256 over one layer's cache (1 MB of bfloat16 K/V, resident in
a 2 MB L2: what the loops cost), 16 x 512 over one layer's cache (resident in L3), and 4 x 256,
16 x 512, 64 x 512 and 128 x 512 over 12 layers' caches of their own (the layers in turn, as a
model step reads them).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from pagellm.attention import cpu_kernel, kv_quant
from pagellm.bench.throughput import machine_info
from quantization import BLOCK, HEAD_DIM, HEADS, KV_HEADS, decode_workload

SHAPES = {"4x256-l2": (4, 256, 1, 320), "16x512-l3": (16, 512, 1, 40),
          "4x256": (4, 256, 12, 27), "16x512": (16, 512, 12, 4),
          "64x512": (64, 512, 12, 2), "128x512": (128, 512, 12, 1)}
# name: (sequences, context, layers, calls per round)
KERNEL_SOURCE = "pagellm/attention/paged_decode.c"


def load_kernel(index: int, source: Path):
    """A separate copy of pagellm.attention.cpu_kernel whose library is built from source."""
    spec = importlib.util.spec_from_file_location(f"_decode_kernel_{index}", cpu_kernel.__file__)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module._SOURCE = source
    if module._KERNEL.load() is None:
        sys.exit(f"{source}: the kernel did not build (see the log above)")
    return module


def measure(kernels: list, names: list[str], kv_dtypes: list[str], shape: tuple[int, ...],
            iters: int, block_size: int = BLOCK) -> list[dict]:
    num_seqs, context, layers, calls_per_round = shape
    decode, query, caches = decode_workload(num_seqs, context, layers, kv_dtypes, block_size)
    scale = HEAD_DIM ** -0.5
    calls, outs = {}, {}
    for i, kernel in enumerate(kernels):
        # an older source (--rev) does not size its workspace: the package's layout, which
        # has grown only, holds it
        owner = kernel if hasattr(kernel._KERNEL.load(), "paged_decode_workspace_floats") \
            else kernels[0]
        workspace = owner.decode_workspace(num_seqs, HEADS, HEAD_DIM, decode.max_seq_len)
        for kv_dtype, (fmt, layer_caches) in caches.items():
            out = outs[i, kv_dtype] = torch.empty_like(query)
            calls[i, kv_dtype] = []
            for k_cache, v_cache in layer_caches:
                if fmt is None:
                    call = kernel.prepared_decode_attention(query, k_cache, v_cache, out, None,
                                                            None, scale, None)
                else:
                    call = kernel.prepared_decode_attention_quantized(
                        query, kv_quant.QuantizedKVCache(k_cache, v_cache, fmt), out, scale, None)
                kernel.set_step(call, decode.block_pairs(), decode.seq_lens, decode.max_seq_len,
                                None, workspace)
                calls[i, kv_dtype].append(call)
    times: dict[tuple, list[float]] = {key: [] for key in calls}
    for r in range(iters + 1):
        print(f"{num_seqs} x {context}: round {r + 1}/{iters + 1}", file=sys.stderr, flush=True)
        for key, layer_calls in calls.items():
            start = time.perf_counter()
            for _ in range(calls_per_round):
                for call in layer_calls:
                    call()
            times[key].append((time.perf_counter() - start) / calls_per_round / layers)
    key_heads = num_seqs * context * KV_HEADS
    best = {key: min(t[1:]) for key, t in times.items()}
    base = best[0, kv_dtypes[0]]
    return [{"source": names[i], "kv_cache_dtype": kv_dtype, "num_seqs": num_seqs,
             "context": context, "layers": layers, "block_size": block_size,
             "ns_per_key_and_kv_head": round(best[i, kv_dtype] / key_heads * 1e9, 2),
             f"vs_first_{kv_dtypes[0]}": round(best[i, kv_dtype] / base, 3),
             "max_diff_from_first_source": (outs[i, kv_dtype].float()
                                            - outs[0, kv_dtype].float()).abs().max().item()}
            for i in range(len(kernels)) for kv_dtype in kv_dtypes]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rev", action="append", default=[],
                        help=f"also build git REV's {KERNEL_SOURCE} (repeatable)")
    parser.add_argument("--sources", default="", help="also these C files, comma-separated")
    parser.add_argument("--kv-dtypes", default="auto,int8",
                        help="comma-separated, the first is the ratios' base (default auto,int8)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--iters", type=int, default=9, help="timed rounds (default 9)")
    parser.add_argument("--shapes", default=",".join(SHAPES),
                        help=f"comma-separated among: {', '.join(SHAPES)}")
    parser.add_argument("--block-size", type=int, default=BLOCK,
                        help=f"tokens per KV block (default {BLOCK})")
    parser.add_argument("--no-amx", action="store_true",
                        help="also the package's source with cpu_kernel.use_amx off (the "
                             "table kernels for fp8, and for int8 where use_vnni_int8 is off; "
                             "a CPU with AMX only)")
    parser.add_argument("--no-near-prefetch", action="store_true",
                        help="also the package's source with cpu_kernel.use_near_prefetch off")
    args = parser.parse_args()
    if args.block_size < 1:
        parser.error(f"--block-size must be at least 1, got {args.block_size}")
    kv_dtypes = args.kv_dtypes.split(",")
    for kv_dtype in kv_dtypes:
        try:
            kv_quant.kv_format(kv_dtype)
        except ValueError as error:
            parser.error(str(error))
    shapes = args.shapes.split(",")
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        parser.error(f"unknown --shapes {unknown}; choices: {', '.join(SHAPES)}")
    torch.set_num_threads(args.threads)
    names, sources = ["paged_decode.c"], [Path(cpu_kernel._SOURCE)]
    scratch = Path(tempfile.mkdtemp(prefix="pagellm-kernel-"))
    root = Path(__file__).resolve().parent.parent
    for rev in args.rev:
        text = subprocess.run(["git", "show", f"{rev}:{KERNEL_SOURCE}"], cwd=root, check=True,
                              capture_output=True, text=True).stdout
        path = scratch / f"paged_decode_{len(sources)}.c"
        path.write_text(text)
        names.append(rev)
        sources.append(path)
    for source in filter(None, args.sources.split(",")):
        names.append(source)
        sources.append(Path(source))
    switched = {}  # index of a copy of the package's source -> the switch it turns off
    for wanted, switch, label in ((args.no_amx, "use_amx", "AMX off"),
                                  (args.no_near_prefetch, "use_near_prefetch",
                                   "near prefetch off")):
        if wanted:  # a copy of the source: its own library, its own switch
            path = scratch / f"paged_decode_{len(sources)}.c"
            path.write_text(Path(cpu_kernel._SOURCE).read_text() + f"/* {label} */\n")
            switched[len(sources)] = switch
            names.append(f"paged_decode.c, {label}")
            sources.append(path)
    kernels = [load_kernel(i, source) for i, source in enumerate(sources)]
    for index, switch in switched.items():
        if not getattr(kernels[index], switch)():
            sys.exit(f"{names[index]}: {switch} is already off on this CPU or build")
        getattr(kernels[index], switch)(False)
    runs = [run for shape in shapes
            for run in measure(kernels, names, kv_dtypes, SHAPES[shape], args.iters,
                               args.block_size)]
    print(json.dumps({"mode": "decode kernel variants", "threads": args.threads,
                      "iters": args.iters, **machine_info(), "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
