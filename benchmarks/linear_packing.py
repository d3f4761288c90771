"""The small Llama's projections through plain F.linear and through weights packed for oneDNN
(Linear.pack, what load_model does on the CPU), by number of rows (prints JSON).

    .venv/bin/python benchmarks/linear_packing.py
    .venv/bin/python benchmarks/linear_packing.py --rows 1,64 --dtypes bfloat16

Workload (seed 0): the five weight shapes of the ~125M "small" Llama (q/k/v 1280 x 768,
o 768 x 768, gate/up 4096 x 768, down 768 x 2048, lm_head 32000 x 768), random N(0, 0.02)
weights, inputs of ``rows`` rows. For each dtype and row count: GFLOP/s over the five shapes
(2 x rows x out x in per shape, summed, over the summed median times), plain and packed, and
whether the packed outputs equal F.linear's bit for bit. Where oneDNN has no bfloat16 path
(AVX2-only CPUs) the bfloat16 "packed" column is the layer's own path there (``layer_path``):
the compiled bfloat16 kernel below quant_matmul.GEMM_ROWS rows and float32 matmuls from there
(without the compiled kernels: float32 from 4 rows up).
"""
from __future__ import annotations

import argparse
import json
import platform

import torch
import torch.nn.functional as F
from model_runner import median_ms  # benchmarks/, the script's folder

from pagellm.model.layers import Linear, quant_matmul

SHAPES = [(768, 1280), (768, 768), (768, 4096), (2048, 768), (768, 32000)]  # (in, out)


def measure(dtype: torch.dtype, rows: int, layers: list[tuple[Linear, torch.Tensor]],
            iters: int) -> dict:
    gen = torch.Generator().manual_seed(rows)
    flops = plain_s = packed_s = 0.0
    identical = True
    for layer, weight in layers:
        x = torch.randn(rows, layer.in_features, generator=gen).to(dtype)
        flops += 2 * rows * layer.in_features * layer.out_features
        plain_s += median_ms(lambda: F.linear(x, weight), iters) / 1e3
        packed_s += median_ms(lambda: layer(x), iters) / 1e3
        identical &= torch.equal(layer(x), F.linear(x, weight))
    return {"dtype": str(dtype).removeprefix("torch."), "rows": rows,
            "plain_gflops": round(flops / plain_s / 1e9, 1),
            "packed_gflops": round(flops / packed_s / 1e9, 1),
            "speedup": round(plain_s / packed_s, 2), "bit_identical": identical}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--rows", default="1,8,32,64,128,512,2048")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    results = []
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        layers = []
        for in_features, out_features in SHAPES:
            layer = Linear(in_features, out_features)
            with torch.no_grad():
                layer.weight.copy_(torch.randn(out_features, in_features, generator=gen) * 0.02)
            layer = layer.to(dtype)
            weight = layer.weight.detach().clone()
            if not layer.pack() and not layer.upcast:
                raise SystemExit(f"{name} weights cannot be packed here: {layer.pack_failure}")
            layers.append((layer, weight))
        # where oneDNN has no bfloat16 path the layer stays unpacked and computes in float32
        first = layers[0][0]
        path = ("packed" if not first.upcast else
                f"compiled bfloat16 kernel, float32 from {quant_matmul.GEMM_ROWS} rows"
                if first.bf16_kernel is not None
                else "float32 from 4 rows")
        results += [dict(measure(dtype, int(rows), layers, args.iters), layer_path=path)
                    for rows in args.rows.split(",")]
    print(json.dumps({"threads": args.threads, "torch": torch.__version__,
                      "cpu": platform.processor() or platform.machine(),
                      "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                      "results": results}, indent=1))


if __name__ == "__main__":
    main()
