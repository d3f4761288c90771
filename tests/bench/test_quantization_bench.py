"""benchmarks/quantization.py: the prefill-attention and crossover modes' reports, and the
kv-memory mode's account of where each run's steps went, which must add up to the workload's
tokens."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pagellm.bench.random_model import TINY_LLAMA, build_random_model

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "benchmarks/quantization.py")


def run(*args: str) -> dict:
    done = subprocess.run([sys.executable, SCRIPT, *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


def bench_module(monkeypatch):
    """benchmarks/quantization.py imported, for the modes run in-process at small sizes."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import quantization

    return quantization


def test_prefill_attention_report(monkeypatch):
    bench = bench_module(monkeypatch)
    monkeypatch.setattr(bench, "PREFILL_SHAPES", ((0, 24), (40, 8)))
    runs = bench.prefill_attention(1)
    assert [(r["context"], r["query"]) for r in runs] == [(0, 24), (40, 8)]
    for entry in runs:
        assert set(entry["ms"]) == {"auto", "int8", "int8/chunked_attention", "fp8",
                                    "fp8/chunked_attention"}
        assert all(ms > 0 for ms in entry["ms"].values())


def test_kv_memory_steps_add_up_to_the_workload(tmp_path):
    """A budget that holds every request at once: no preemption, so each prompt token is
    computed once in a prefill step and each output token but the last once as a decode
    row."""
    model = build_random_model(tmp_path / "m", seed=0, **{
        **TINY_LLAMA, "vocab_size": 32000, "max_position_embeddings": 512})
    report = run("kv-memory", "--model", str(model), "--requests", "6", "--seeds", "3",
                 "--budget", str(8 << 20))
    (entry,) = report["runs"]
    gen = torch.Generator().manual_seed(3)  # the benchmark's draw
    prompt_lens = torch.randint(32, 257, (6,), generator=gen).tolist()
    output_lens = torch.randint(64, 193, (6,), generator=gen).tolist()
    assert entry["output_tokens"] == sum(output_lens)
    for kv_dtype, result in entry["results"].items():
        steps = result["steps"]
        assert result["num_preemptions"] == 0 and result["peak_concurrency"] == 6, kv_dtype
        assert steps["prefill_tokens"] == sum(prompt_lens)
        assert steps["prefill_tokens_with_context"] == 0
        decode_rows = steps["decode_rows"] + steps["decode_rows_in_prefill_steps"]
        assert decode_rows == sum(output_lens) - 6
        assert 0 <= steps["plan_steps"] <= steps["decode_only_steps"]


def test_crossover_report(monkeypatch):
    from pagellm.model.layers import quant_matmul

    if not quant_matmul.available():
        pytest.skip("the compiled matmul kernels are off here")
    bench = bench_module(monkeypatch)
    monkeypatch.setattr(bench, "CROSSOVER_ROWS", (3, 40))
    report = bench.crossover(1)
    assert report["gemm_rows"] == quant_matmul.GEMM_ROWS == 32  # the forced paths restored
    assert [(r["shapes"], r["rows"]) for r in report["runs"]] == [
        (shapes, rows) for shapes in ("smollm2", "small") for rows in (3, 40)]
    for entry in report["runs"]:
        assert set(entry["ms_per_layer"]) == {f"{kind}/{path}" for kind in
                                              ("bfloat16", "int4", "int8")
                                              for path in ("kernel", "gemm")}
        assert all(ms > 0 for ms in entry["ms_per_layer"].values())
