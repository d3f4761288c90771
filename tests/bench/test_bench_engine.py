"""Smoke runs of ``bench throughput``, ``bench memory`` and ``bench engine`` on a tiny model:
the JSON holds the promised fields and the books balance. No timing assertions."""
from __future__ import annotations

import json

import pytest

from pagellm.bench.memory_experiment import SYSTEMS, MemoryExperimentConfig, run_memory_experiment
from pagellm.bench.throughput import EngineOptions, accounting_errors, benchmark_throughput
from pagellm.bench.workloads import WorkloadSpec, build_workload

SMALL_WORKLOAD = WorkloadSpec(num_prompts=12, seed=5, input_len=(8, 64), output_len=(4, 32))


def _workload(spec=SMALL_WORKLOAD):
    return build_workload(spec, vocab_size=512)


def _check_run(result: dict, max_num_seqs: int, requested: int) -> None:
    assert result["output_tokens"] == requested
    assert 0.0 <= result["kv_waste_ratio"] <= 1.0
    assert 1 <= result["peak_concurrency"] <= max_num_seqs
    assert result["output_tokens_per_s"] > 0
    for point in result["timeline"]:
        assert point["running"] <= max_num_seqs
        assert 0 <= point["slots_filled"] <= point["slots_reserved"] <= result["kv_slots_budget"]


@pytest.mark.parametrize("allocator", ["paged", "contiguous"])
def test_throughput_accounting(tiny_model, allocator):
    workload = _workload()
    options = EngineOptions(model=str(tiny_model), kv_allocator=allocator, dtype="float32",
                            max_num_seqs=6, num_gpu_blocks_override=96, swap_space=0.01)
    result = benchmark_throughput(options, workload.requests)
    assert result["accounting_errors"] == []
    requested = sum(r.output_len for r in workload.requests)
    _check_run(result, 6, requested)
    assert result["generated_tokens"] == requested
    assert result["failed_requests"] == 0


def test_shared_prefix_hits_the_prefix_cache(tiny_model):
    spec = WorkloadSpec(name="shared-prefix", num_prompts=8, prefix_len=64, input_len=(4, 16),
                        output_len=(2, 8))
    options = EngineOptions(model=str(tiny_model), dtype="float32", max_num_seqs=4,
                            num_gpu_blocks_override=128, swap_space=0.01)
    result = benchmark_throughput(options, _workload(spec).requests)
    assert result["prefix_hit_rate"] > 0.5
    assert result["accounting_errors"] == []


def test_memory_experiment_report(tiny_model, tmp_path):
    from pagellm.bench.memory_experiment import save_plots

    workload = _workload()
    config = MemoryExperimentConfig(model=str(tiny_model), dtype="float32", max_num_seqs=16,
                                    max_num_batched_tokens=512, block_sizes=(8, 32))
    report = run_memory_experiment(config, workload)
    requested = sum(r.output_len for r in workload.requests)
    budget = report["budget"]
    assert budget["max_model_len"] == 256 and budget["max_len_reservations"] == 8
    for name in SYSTEMS:
        for key in ("kv_waste_ratio", "peak_concurrency", "output_tokens_per_s"):
            assert key in report[name]
        _check_run(report[name], 16, requested)
        assert report[name]["kv_slots_budget"] == budget["num_slots"]
        ttft = report[name]["ttft_ms"]  # every system reports its time to first token
        assert 0 < ttft["p50"] <= ttft["p90"] <= 1000 * report[name]["elapsed_s"]
    # Static batches compute at least what was asked; the others exactly that.
    assert report["hf"]["generated_tokens"] >= requested
    # The contiguous allocator holds at most the budget's number of max-length reservations.
    assert report["contiguous"]["peak_concurrency"] <= budget["max_len_reservations"]
    assert report["paged"]["kv_waste_ratio"] < report["contiguous"]["kv_waste_ratio"]
    assert set(report["ratios"]) >= {"concurrency_paged_over_contiguous",
                                     "throughput_paged_over_contiguous",
                                     "throughput_paged_over_hf",
                                     "throughput_paged_over_hf_continuous"}
    assert report["accounting_errors"] == []
    assert [row["block_size"] for row in report["block_size_sweep"]] == [8, 32]
    paths = save_plots(report, tmp_path)
    assert len(paths) == 4 and all(p.stat().st_size > 0 for p in paths)
    json.dumps(report)


def test_memory_experiment_kv_dtype_sweep(tiny_model):
    """--kv-cache-dtypes: the paged engine at each KV dtype on one budget in bytes; the 8-bit
    cache holds the blocks its bytes per token allow (the tiny float32 model's 64-byte rows
    against 16 bytes and a 2-byte scale) and, memory binding, runs more sequences at once."""
    from pagellm.kv.memory import KVMemoryModel

    spec = WorkloadSpec(num_prompts=24, seed=5, input_len=(32, 64), output_len=(8, 16))
    auto = KVMemoryModel.from_model_dir(tiny_model, "float32")
    config = MemoryExperimentConfig(model=str(tiny_model), dtype="float32", systems=("paged",),
                                    max_num_seqs=32, max_num_batched_tokens=2048,
                                    kv_cache_memory_bytes=512 * auto.bytes_per_token,
                                    kv_cache_dtypes=("auto", "int8"), warmup=False)
    rows = run_memory_experiment(config, _workload(spec))["kv_dtype_sweep"]
    assert [row["kv_cache_dtype"] for row in rows] == ["auto", "int8"]
    int8 = KVMemoryModel.from_model_dir(tiny_model, "int8")
    assert [row["bytes_per_token"] for row in rows] == [auto.bytes_per_token,
                                                        int8.bytes_per_token]
    assert [row["num_blocks"] for row in rows] == [
        512 * auto.bytes_per_token // (16 * b.bytes_per_token) for b in (auto, int8)]
    assert rows[1]["peak_concurrency"] > rows[0]["peak_concurrency"]
    assert rows[1]["peak_concurrency_vs_first"] == round(
        rows[1]["peak_concurrency"] / rows[0]["peak_concurrency"], 3)


def test_bench_memory_refuses_an_unknown_kv_dtype(capsys):
    from pagellm.entrypoints.cli import main

    with pytest.raises(SystemExit):
        main(["bench", "memory", "--kv-cache-dtypes", "auto,fp16"])
    assert "'fp16': not a kv_cache_dtype" in capsys.readouterr().err


def test_accounting_errors_are_reported():
    good = {"system": "paged", "output_tokens": 10, "requested_output_tokens": 10,
            "generated_tokens": 10, "kv_waste_ratio": 0.1, "peak_concurrency": 4,
            "max_num_seqs": 4}
    assert accounting_errors(good) == []
    assert len(accounting_errors({**good, "generated_tokens": 9, "peak_concurrency": 5})) == 2


def test_engine_step_split(tiny_model):
    from pagellm.bench.engine_step import StepBenchConfig, benchmark_engine_step

    report = benchmark_engine_step(StepBenchConfig(model=str(tiny_model), dtype="float32",
                                                   batch_sizes=(1, 4), prompt_len=20,
                                                   decode_steps=3))
    rows = report["results"]
    assert [r["num_seqs"] for r in rows] == [1, 4]
    for row in rows:
        assert 0.0 <= row["overhead_fraction"] <= 1.0
        assert row["model_forward_ms"] > 0 and row["stages_ms"]["sample"] > 0
    assert report["target"]["num_seqs"] == 4


def test_engine_step_samples_at_random_when_asked(tiny_model):
    """--temperature/--top-p: every request samples (seeded), the report says how."""
    from pagellm.bench.engine_step import StepBenchConfig, benchmark_engine_step

    report = benchmark_engine_step(StepBenchConfig(model=str(tiny_model), dtype="float32",
                                                   batch_sizes=(3,), prompt_len=12,
                                                   decode_steps=2, temperature=1.0, top_p=0.9))
    assert report["config"]["temperature"] == 1.0 and report["config"]["top_p"] == 0.9
    assert report["results"][0]["stages_ms"]["sample"] > 0


def test_bench_engine_top_p_needs_a_temperature(capsys):
    from pagellm.entrypoints.cli import main

    assert main(["bench", "engine", "--top-p", "0.9"]) == 2
    assert "--top-p 0.9 needs --temperature above 0" in capsys.readouterr().err


def test_engine_step_forward_counts_the_cpu_decode_plan(tiny_model):
    """Decode-only steps on the CPU run the decode plan instead of model.forward: its time is
    the forward's, not "other"'s."""
    import time

    from pagellm.bench.engine_step import (StepBenchConfig, _add_requests, _all_decoding,
                                           build_step_engine, install_timers)

    config = StepBenchConfig(model=str(tiny_model), dtype="float32", batch_sizes=(3,),
                             prompt_len=20, decode_steps=3)
    engine = build_step_engine(config)
    plan = engine.runner.cpu_decode
    assert plan is not None
    inner, spent = plan.run, []

    def run(*args, **kwargs):  # wrapped first, so the benchmark's timer is around this one
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            spent.append(time.perf_counter() - start)

    plan.run = run
    timers = install_timers(engine)
    _add_requests(engine, 3, config, "t")
    while not _all_decoding(engine, 3):
        engine.step()
    timers.reset()
    spent.clear()
    for _ in range(3):
        engine.step()
    assert len(spent) == 3
    assert timers.seconds["model_forward"] >= sum(spent) > 0


def test_cli_memory_and_throughput(tiny_model, tmp_path, monkeypatch):
    from pagellm.entrypoints.cli import main

    common = ["--model", str(tiny_model), "--dtype", "float32", "--num-prompts", "6",
              "--input-len", "8,32", "--output-len", "2,12", "--max-num-seqs", "8"]
    out = tmp_path / "memory.json"
    assert main(["bench", "memory", *common, "--systems", "paged,contiguous",
                 "--output-json", str(out), "--plot-dir", str(tmp_path / "img")]) == 0
    report = json.loads(out.read_text())
    assert set(report) >= {"paged", "contiguous", "ratios", "budget", "workload"}
    assert "hf" not in report and report["ratios"]["throughput_paged_over_hf"] is None
    assert (tmp_path / "img" / "memory_kv_over_time.png").exists()
    out = tmp_path / "throughput.json"
    assert main(["bench", "throughput", *common, "--num-gpu-blocks-override", "64",
                 "--swap-space", "0.01", "--output-json", str(out)]) == 0
    assert json.loads(out.read_text())["output_tokens"] == report["workload"]["output_tokens_total"]


def test_cli_memory_html_report_holds_both_systems_maps(tiny_model, tmp_path):
    from pagellm.entrypoints.cli import main

    html_path = tmp_path / "report.html"
    out = tmp_path / "memory.json"
    assert main(["bench", "memory", "--model", str(tiny_model), "--dtype", "float32",
                 "--num-prompts", "10", "--input-len", "8,32", "--output-len", "8,48",
                 "--max-num-seqs", "8", "--systems", "paged,contiguous",
                 "--output-json", str(out), "--html", str(html_path)]) == 0
    report = json.loads(out.read_text())
    assert report["html_report"] == str(html_path) and "kv_views" not in report["paged"]
    page = html_path.read_text()
    assert "PagellmDashboard.report(" in page and page.count("</script>") == 2
    data = page.split('<script type="application/json" id="report-data">', 1)[1]
    systems = json.loads(data.split("</script>", 1)[0])
    assert [s["name"] for s in systems] == ["paged", "contiguous"]
    for system in systems:
        frames = system["frames"]
        assert 2 <= len(frames) <= 24 and system["history"]
        assert 0 <= system["default_frame"] < len(frames)
        for frame in frames:
            assert frame["kind"] == system["name"]
            assert frame["num_blocks"] == report["budget"]["num_blocks"]
            assert len(frame["blocks"]["state"]) == frame["num_blocks"]
        used = [sum(s == 1 for s in f["blocks"]["state"]) for f in frames]
        assert max(used) > 0
    # The contiguous system reserves whole runs: its peak frame holds more empty slots.
    def empty_share(frame):
        held = [f for f, s in zip(frame["blocks"]["fill"], frame["blocks"]["state"]) if s == 1]
        return 1 - sum(held) / (len(held) * frame["block_size"])
    paged, contiguous = (s["frames"][s["default_frame"]] for s in systems)
    assert empty_share(contiguous) > empty_share(paged)


def test_cli_throughput_with_fewer_bytes_per_token(tiny_model, tmp_path, capsys):
    """--kv-cache-dtype and --quantization reach the engine (and its report); a combination
    the engine refuses is an error naming the value, not a run."""
    from pagellm.entrypoints.cli import main

    common = ["--model", str(tiny_model), "--num-prompts", "4", "--input-len", "8,32",
              "--output-len", "2,8", "--max-num-seqs", "4", "--num-gpu-blocks-override", "64",
              "--swap-space", "0.01"]
    out = tmp_path / "throughput.json"
    assert main(["bench", "throughput", *common, "--kv-cache-dtype", "int8",
                 "--quantization", "int4", "--quantization-group-size", "32",
                 "--int8-activations", "--output-json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["accounting_errors"] == []
    assert {k: report["engine"][k] for k in ("kv_cache_dtype", "quantization",
                                             "quantization_group_size",
                                             "int8_activations")} == {
        "kv_cache_dtype": "int8", "quantization": "int4", "quantization_group_size": 32,
        "int8_activations": True}
    capsys.readouterr()
    assert main(["bench", "throughput", *common, "--int8-activations"]) == 2
    assert "int8_activations" in capsys.readouterr().err
