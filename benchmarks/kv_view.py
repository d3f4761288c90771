"""Cost of the dashboard's KV view (GET /stats/blocks) against the engine step it sits between.
Fixed seeds; prints one JSON object.

Workload (defaults): the tiny random-weight Llama (pagellm.bench.random_model, seed 0), float32,
block size 16, 4,096 device blocks; 256 requests with prompts uniform in 40..120 tokens (seed 0)
and 200 output tokens, all running (max_num_seqs 256). Once every sequence decodes, it times:

- step: one engine step (schedule, model forward of 256 decodes, update);
- kv_view: engine.get_kv_view(history of 240 points), what the engine loop builds at most
  4 times a second (core/async_engine.py: KV_VIEW_MAX_AGE_S), and its JSON encoding;
- the share of engine time the view takes at that rate: 4 x kv_view per second.

    python benchmarks/kv_view.py [--num-seqs 256] [--num-blocks 4096] [--samples 30]
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from pagellm import SamplingParams, native
from pagellm.bench.random_model import build_random_model
from pagellm.core.async_engine import KV_VIEW_MAX_AGE_S
from pagellm.core.engine import LLMEngine
from pagellm.core.kv_view import MetricsHistory


def ms(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {"median_ms": round(ordered[len(ordered) // 2] * 1e3, 3),
            "p90_ms": round(ordered[int(len(ordered) * 0.9)] * 1e3, 3)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--num-blocks", type=int, default=4096)
    p.add_argument("--samples", type=int, default=30)
    args = p.parse_args(argv)
    import torch
    torch.manual_seed(0)
    model = build_random_model(Path(tempfile.mkdtemp()) / "tiny", seed=0)
    from pagellm.config import EngineArgs
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=str(model), dtype="float32", num_gpu_blocks_override=args.num_blocks,
        block_size=16, max_num_seqs=args.num_seqs, max_model_len=512, swap_space=0.01))
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    for i in range(args.num_seqs):
        prompt = [rng.randrange(3, 500) for _ in range(rng.randint(40, 120))]
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    while engine.get_stats().num_running < args.num_seqs or engine.get_stats().num_waiting:
        engine.step()
    engine.step()  # every sequence decodes from here on
    history = MetricsHistory(max_points=240, interval_s=0.0)
    for i in range(240):
        history.add(engine.get_stats(), now=float(i))
    steps, views, encodes = [], [], []
    for _ in range(args.samples):
        start = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - start)
        start = time.perf_counter()
        view = engine.get_kv_view(history.points())
        views.append(time.perf_counter() - start)
        start = time.perf_counter()
        body = json.dumps(view, separators=(",", ":"))
        encodes.append(time.perf_counter() - start)
    stats = engine.get_stats()
    per_second = 1 / KV_VIEW_MAX_AGE_S
    view_s = statistics.median(views)
    print(json.dumps({
        "workload": {"num_seqs": args.num_seqs, "num_blocks": args.num_blocks, "block_size": 16,
                     "num_running": stats.num_running, "num_used_blocks":
                     stats.num_blocks - stats.num_free_blocks, "seed": 0},
        "step": ms(steps), "kv_view": ms(views), "json_encode_event_loop": ms(encodes),
        "json_bytes": len(body), "max_views_per_s": per_second,
        "engine_time_share_at_max_rate": round(view_s * per_second, 5),
        "view_over_step": round(view_s / statistics.median(steps), 4),
        "machine": {"cpu": native.cpu_model(), "python": sys.version.split()[0],
                    "torch_threads": torch.get_num_threads()},
    }, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
