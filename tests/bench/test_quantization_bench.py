"""benchmarks/quantization.py: the attention, prefill-attention and crossover modes' reports
(attention also one KV dtype per process), and the kv-memory mode's account of where each
run's steps went, which must add up to the workload's tokens."""
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


def test_attention_report_for_chosen_kv_dtypes(monkeypatch):
    from pagellm.attention import cpu_kernel

    if not cpu_kernel.available():
        pytest.skip("no compiled CPU kernel")
    bench = bench_module(monkeypatch)
    runs = bench.attention(3, 40, 1, ["int8", "auto"])
    assert [r["kv_cache_dtype"] for r in runs] == ["int8", "auto"]
    assert runs[1]["vs_auto"] == 1.0 and runs[0]["vs_auto"] > 0
    assert runs[0]["kv_bytes"] == 2 * 12 * 3 * 40 * 4 * 66  # rows of 64 codes and a scale
    (alone,) = bench.attention(3, 40, 1, ["fp8"])
    assert "vs_auto" not in alone and alone["ms_12_layers"] > 0


def test_attention_in_processes_reports_medians():
    from pagellm.attention import cpu_kernel

    if not cpu_kernel.available():
        pytest.skip("no compiled CPU kernel")
    report = run("attention", "--num-seqs", "3", "--context", "40", "--iters", "1",
                 "--processes", "2", "--kv-dtypes", "auto,int8")
    assert report["processes"] == 2
    assert [(r["kv_cache_dtype"], r["num_seqs"], r["context"]) for r in report["runs"]] == [
        ("auto", 3, 40), ("int8", 3, 40)]
    for entry in report["runs"]:
        fastest = entry["fastest_ms_12_layers"]
        times = fastest["per_process"]
        assert len(times) == 2 and min(times) > 0
        assert (fastest["min"], fastest["max"]) == (min(times), max(times))
        assert fastest["median"] == sum(times) / 2
    auto, int8 = (entry["fastest_ms_12_layers"]["median"] for entry in report["runs"])
    assert [entry["median_vs_auto"] for entry in report["runs"]] == [1.0, round(int8 / auto, 2)]


@pytest.mark.parametrize("args, named", [
    (["--kv-dtypes", "int4"], "--kv-dtypes 'int4'"),
    (["--kv-dtypes", "int8,int8"], "--kv-dtypes 'int8,int8'"),
    (["--num-seqs", "0"], "--num-seqs '0'"),
    (["--num-seqs", "a"], "--num-seqs 'a'"),
    (["--context", "0"], "--context 0"),
    (["--processes", "-1"], "--processes -1"),
])
def test_attention_bad_arguments_are_usage_errors(args, named):
    done = subprocess.run([sys.executable, SCRIPT, "attention", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and named in done.stderr, done.stderr[-1000:]


@pytest.mark.parametrize("args, named", [
    (["weights", "--kv-dtypes", "int8"],
     "--kv-dtypes is not read by mode 'weights'; the modes that read it: attention"),
    (["attention", "--budget", "1000"],
     "--budget is not read by mode 'attention'; the modes that read it: kv-memory"),
    (["matmul", "--group-size", "128"],
     "--group-size is not read by mode 'matmul'; the modes that read it: quality, weights"),
    (["weights", "--rows", "16"],
     "--rows is not read by mode 'weights'; the modes that read it: matmul"),
    (["matmul", "--rows", "0,16"], "--rows '0,16': give positive integers"),
])
def test_an_option_another_mode_reads_is_a_usage_error(args, named):
    done = subprocess.run([sys.executable, SCRIPT, *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and named in done.stderr, done.stderr[-1000:]


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
    assert quant_matmul.DOT_ROWS == 16
    assert [(r["shapes"], r["rows"]) for r in report["runs"]] == [
        (shapes, rows) for shapes in ("smollm2", "small") for rows in (3, 40)]
    for entry in report["runs"]:
        assert set(entry["ms_per_layer"]) == {f"{kind}/{path}" for kind in
                                              ("bfloat16", "int4", "int8")
                                              for path in ("kernel", "gemm")}
        assert all(ms > 0 for ms in entry["ms_per_layer"].values())


def test_matmul_report(monkeypatch):
    """Every variant timed at each row count; the compiled route without the AVX512-BF16
    products beside them from DOT_ROWS rows where they are built, DOT_ROWS restored after."""
    from pagellm.model.layers import quant_matmul

    if not quant_matmul.available():
        pytest.skip("the compiled matmul kernels are off here")
    bench = bench_module(monkeypatch)
    monkeypatch.setattr(bench, "MATMUL_SHAPES", ((64, 96),))
    report = bench.matmul(1, [3, quant_matmul.DOT_ROWS])
    assert quant_matmul.DOT_ROWS == 16
    assert [(r["shape"], r["rows"]) for r in report["runs"]] == [([64, 96], 3), ([64, 96], 16)]
    plain = {"pagellm_int4", "pagellm_int4_int8_activations", "torch_int4", "pagellm_int8",
             "torch_int8", "pagellm_int8_group32", "pagellm_bfloat16"}
    if quant_matmul.has_vnni_loops():
        plain |= {"pagellm_int4_panels", "pagellm_int8_panels"}
    dot = ({"pagellm_int4_no_dot", "pagellm_int8_no_dot", "pagellm_int8_group32_no_dot"}
           if quant_matmul.has_dot_products() else set())
    assert set(report["runs"][0]["ms"]) == plain
    assert set(report["runs"][1]["ms"]) == plain | dot
    assert all(ms > 0 for entry in report["runs"] for ms in entry["ms"].values())
