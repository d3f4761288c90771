"""The CUDA path measured on one GPU machine, in one command (prints progress, writes JSON).

    python benchmarks/gpu_check.py --setup --out gpu_check.json  # bare machine: pip first
    .venv/bin/python benchmarks/gpu_check.py --out gpu_check.json
    .venv/bin/python benchmarks/gpu_check.py --plan                # what it would run

Parts, each in its own process and time box (a part that overruns is killed; what it wrote so
far stays in the JSON, which is rewritten after every case):

- tests: ``pytest -m gpu`` on GPU_TEST_FILES without TRITON_INTERPRET, so the Triton kernels
  run compiled in bfloat16, float16 and float32 (not upcast), plus CUDA graphs and swaps;
- kernels: paged decode attention at batch 1/32/128 x context 1k/8k/32k, 32 query heads over
  8 KV heads, head_dim 128, bfloat16: K/V bytes read per second against the device's peak
  (PEAK_BANDWIDTH by name, and a measured device-to-device copy), beside the torch path
  (scaled_dot_product_attention on gathered K/V);
- engine: the engine end to end (CUDA graphs, and enforce_eager) on ~0.5B and ~1.5B
  random-weight Llama configs in bfloat16, beside transformers ``generate`` and its continuous
  batching on the same weights and requests (pagellm.bench.throughput, hf_baselines);
- memory: the seed's experiment, paged vs contiguous on one KV budget (bench/memory_experiment).

``--setup`` runs one ``pip install -e .[dev]`` (torch 2.13.0 from PyPI, a CUDA build, and
triton) before anything imports torch. The time limit (``--time-limit``, 480 s) counts from the
start, setup included; each part gets a share of what is left. Without CUDA the script says so
and exits with status 2.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GPU_TEST_FILES = ["tests/model/test_cuda_path.py"]
PART_BUDGETS_S = {"tests": 100, "kernels": 90, "engine": 200, "memory": 70}
DECODE_BATCHES, DECODE_CONTEXTS = (1, 32, 128), (1024, 8192, 32768)
# (substring of torch.cuda.get_device_name(), peak memory bandwidth in bytes/s), most
# specific first; vendors' data sheets.
PEAK_BANDWIDTH = [("H200", 4.8e12), ("H100 NVL", 3.9e12), ("H100 PCIe", 2.0e12),
                  ("H100", 3.35e12), ("A100-SXM4-80GB", 2.039e12), ("A100 80GB PCIe", 1.935e12),
                  ("A100", 1.555e12), ("L40S", 0.864e12), ("A10G", 0.6e12), ("A10", 0.6e12),
                  ("L4", 0.3e12), ("RTX 4090", 1.008e12)]
# ~0.5B and ~1.5B Llama shapes (untied embeddings, 32k vocabulary)
MODELS = {
    "llama-0.5b": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                       num_key_value_heads=8, intermediate_size=4096, vocab_size=32000,
                       max_position_embeddings=4096),
    "llama-1.5b": dict(hidden_size=2048, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, intermediate_size=5632, vocab_size=32000,
                       max_position_embeddings=4096),
}
NO_CUDA = ("gpu_check needs an NVIDIA GPU: torch.cuda.is_available() is False on this machine "
           "({why}). Nothing was measured.")


def peak_bandwidth(device_name: str) -> float | None:
    """The data-sheet memory bandwidth of a device, by name, or None when unknown."""
    return next((peak for key, peak in PEAK_BANDWIDTH if key in device_name), None)


def junit_counts(path: Path) -> dict:
    """Test counts and the failed tests' ids of a pytest --junitxml report."""
    root = ElementTree.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {key: sum(int(s.get(key, 0)) for s in suites)
              for key in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    counts["failed_ids"] = [f"{case.get('classname')}::{case.get('name')}"
                            for case in root.iter("testcase")
                            if case.find("failure") is not None or case.find("error") is not None]
    return counts


def part_shares(remaining_s: float, parts: list[str]) -> dict[str, float]:
    """Each part's time box: its budget, scaled down when less time is left than they sum to."""
    total = sum(PART_BUDGETS_S[p] for p in parts)
    scale = min(1.0, max(remaining_s, 0.0) / total) if total else 1.0
    return {p: PART_BUDGETS_S[p] * scale for p in parts}


class JsonFile:
    """A JSON object written whole (via a temporary file) after every change."""

    def __init__(self, path: Path, data: dict | None = None) -> None:
        self.path, self.data = path, data or {}
        self.write()

    def set(self, key: str, value) -> None:
        self.data[key] = value
        self.write()

    def append(self, key: str, value) -> None:
        self.data.setdefault(key, []).append(value)
        self.write()

    def write(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        tmp.replace(self.path)


def log(message: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {message}", flush=True)


# ---- parent: setup, CUDA check, parts in subprocesses -------------------------------------

def setup() -> dict:
    command = [sys.executable, "-m", "pip", "install", "-q", "-e", ".[dev]"]
    log(f"setup: {' '.join(command)}")
    start = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    return {"command": command, "returncode": done.returncode,
            "seconds": round(time.perf_counter() - start, 1), "stderr_tail": done.stderr[-2000:]}


def cuda_info() -> dict:
    try:
        import torch
    except ImportError as error:
        return {"available": False, "why": f"torch does not import: {error}"}
    if not torch.cuda.is_available():
        why = ("torch is a CPU build" if torch.version.cuda is None
               else "no CUDA device is visible")
        return {"available": False, "why": f"{why}; torch {torch.__version__}"}
    props = torch.cuda.get_device_properties(0)
    return {"available": True, "name": props.name,
            "memory_gib": round(props.total_memory / 2**30, 1),
            "capability": f"{props.major}.{props.minor}", "torch": torch.__version__,
            "cuda": torch.version.cuda, "peak_bandwidth_bytes_per_s": peak_bandwidth(props.name)}


def run_tests(budget_s: float, work_dir: Path) -> dict:
    junit = work_dir / "gpu_tests.xml"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu",
               f"--junitxml={junit}", *GPU_TEST_FILES]
    try:
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=budget_s)
        result = {"returncode": done.returncode, "output_tail": done.stdout[-3000:]}
    except subprocess.TimeoutExpired:
        result = {"timed_out": True}
    if junit.exists():
        result.update(junit_counts(junit))
    return result


def run_part(name: str, budget_s: float, work_dir: Path, args: argparse.Namespace) -> dict:
    if name == "tests":
        return run_tests(budget_s, work_dir)
    out = work_dir / f"{name}.json"
    command = [sys.executable, __file__, "--part", name, "--part-out", str(out),
               "--deadline", str(time.time() + budget_s), "--work-dir", str(work_dir),
               "--num-prompts", str(args.num_prompts)]
    try:
        done = subprocess.run(command, cwd=ROOT, timeout=budget_s + 15)
        status = {"returncode": done.returncode}
    except subprocess.TimeoutExpired:
        status = {"timed_out": True}
    result = json.loads(out.read_text()) if out.exists() else {}
    return {**status, **result}


def plan(args: argparse.Namespace) -> dict:
    return {"parts": args.parts, "time_limit_s": args.time_limit,
            "budgets_s": part_shares(args.time_limit, args.parts), "gpu_test_files": GPU_TEST_FILES,
            "decode_cases": [[b, c] for c in DECODE_CONTEXTS for b in DECODE_BATCHES],
            "models": MODELS, "num_prompts": args.num_prompts}


def main() -> None:
    args = parse_args()
    if args.part:
        return run_child(args)
    if args.plan:
        print(json.dumps(plan(args), indent=1))
        return
    start = time.time()
    report = JsonFile(Path(args.out), {"started": time.strftime("%Y-%m-%d %H:%M:%S"),
                                       "plan": plan(args), "parts": {}})
    if args.setup:
        report.set("setup", setup())
    device = cuda_info()
    report.set("device", device)
    if not device["available"]:
        message = NO_CUDA.format(why=device["why"])
        report.set("error", message)
        print(message, file=sys.stderr)
        raise SystemExit(2)
    log(f"device: {device['name']} ({device['memory_gib']} GiB), torch {device['torch']}")
    work_dir = Path(args.work_dir or tempfile.mkdtemp(prefix="gpu_check_"))
    for i, part in enumerate(args.parts):
        budget = part_shares(start + args.time_limit - time.time() - 5, args.parts[i:])[part]
        log(f"part {part}: up to {budget:.0f} s")
        part_start = time.time()
        result = run_part(part, budget, work_dir, args)
        result["seconds"] = round(time.time() - part_start, 1)
        report.data["parts"][part] = result
        report.set("elapsed_s", round(time.time() - start, 1))
        log(f"part {part}: done in {result['seconds']} s")
    log(f"wrote {args.out} ({report.data['elapsed_s']} s)")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="gpu_check.json", help="the JSON report")
    parser.add_argument("--setup", action="store_true", help="pip install -e .[dev] first")
    parser.add_argument("--plan", action="store_true", help="print the plan and exit")
    parser.add_argument("--parts", type=lambda s: s.split(","), default=list(PART_BUDGETS_S))
    parser.add_argument("--time-limit", type=float, default=480.0, help="seconds, in total")
    parser.add_argument("--num-prompts", type=int, default=64, help="requests per engine run")
    parser.add_argument("--work-dir", help="models and part outputs (default: a temp dir)")
    parser.add_argument("--part", help=argparse.SUPPRESS)
    parser.add_argument("--part-out", help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    unknown = set(args.parts) - set(PART_BUDGETS_S)
    if unknown:
        parser.error(f"unknown parts {sorted(unknown)}: choose from {', '.join(PART_BUDGETS_S)}")
    return args


# ---- child processes: one part each, writing its JSON as it goes --------------------------

def run_child(args: argparse.Namespace) -> None:
    out = JsonFile(Path(args.part_out))
    {"kernels": part_kernels, "engine": part_engine, "memory": part_memory}[args.part](
        out, args.deadline, Path(args.work_dir), args)


def measured_copy_bandwidth(num_bytes: int = 4 << 30) -> float:
    """Bytes moved per second by a device-to-device copy (each byte read and written)."""
    import torch

    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    return 2 * num_bytes * 10 / (start.elapsed_time(end) / 1e3)


def part_kernels(out: JsonFile, deadline: float, work_dir: Path, args) -> None:
    import torch
    from triton.testing import do_bench

    import triton_attention  # benchmarks/, this script's folder
    from pagellm.attention.triton_backend import paged_attention

    name = torch.cuda.get_device_name()
    peak = peak_bandwidth(name)
    copy = measured_copy_bandwidth()
    out.set("bandwidth", {"device": name, "peak_bytes_per_s": peak,
                          "measured_copy_bytes_per_s": round(copy)})
    shape = triton_attention.AttentionShape(num_heads=32, num_kv_heads=8, head_dim=128)
    free = torch.cuda.mem_get_info()[0]
    for context in DECODE_CONTEXTS:
        for batch in DECODE_BATCHES:
            if time.time() > deadline - 10:
                out.append("skipped", [batch, context])
                continue
            kv_bytes = 2 * batch * context * shape.num_kv_heads * shape.head_dim * 2
            # the torch path gathers another copy of the K/V beside the cache
            row = triton_attention.bench_case(
                "decode", [1] * batch, [context] * batch, torch.bfloat16, paged_attention,
                do_bench, shape=shape, with_torch=3 * kv_bytes < 0.8 * free)
            rate = row["triton_kv_read_gb_per_s"] * 1e9
            row["triton_fraction_of_peak"] = round(rate / peak, 3) if peak else None
            row["triton_fraction_of_copy"] = round(rate / copy, 3)
            out.append("decode", row)
            log(f"decode batch {batch} context {context}: triton {row['triton_ms']} ms "
                f"({row['triton_kv_read_gb_per_s']} GB/s), torch {row['torch_ms']} ms")
            torch.cuda.empty_cache()


def ensure_model(work_dir: Path, name: str) -> Path:
    """The random-weight model folder (bfloat16), built on the GPU once per work dir."""
    import shutil

    import torch

    from pagellm.bench.random_model import build_random_model

    path = work_dir / name
    if not (path / "config.json").exists() or not (path / "tokenizer.json").exists():
        tmp = work_dir / f"{name}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        start = time.perf_counter()
        with torch.device("cuda"):  # random init of 1.5B parameters: seconds, not minutes
            build_random_model(tmp, dtype="bfloat16", **MODELS[name])
        tmp.rename(path)
        log(f"built {name} in {time.perf_counter() - start:.1f} s")
    return path


def _workload(num_prompts: int, vocab_size: int):
    from pagellm.bench.workloads import WorkloadSpec, build_workload

    spec = WorkloadSpec(num_prompts=num_prompts, input_len=(64, 512), output_len=(64, 256))
    return build_workload(spec, vocab_size)


def part_engine(out: JsonFile, deadline: float, work_dir: Path, args) -> None:
    import gc

    import torch

    from pagellm.bench.hf_baselines import load_hf_model, run_hf_continuous, run_hf_static
    from pagellm.bench.throughput import EngineOptions, benchmark_throughput

    max_num_seqs, max_model_len = 128, 1024
    for name in MODELS:
        path = ensure_model(work_dir, name)
        workload = _workload(args.num_prompts, MODELS[name]["vocab_size"])
        requests = workload.requests
        out.set(f"{name}/workload", workload.summary())
        for system, eager in (("pagellm", False), ("pagellm_eager", True)):
            if time.time() > deadline - 20:
                out.append("skipped", f"{name}/{system}")
                return
            options = EngineOptions(model=str(path), max_model_len=max_model_len,
                                    max_num_seqs=max_num_seqs, enforce_eager=eager)
            result = benchmark_throughput(options, requests)
            result.pop("timeline", None)
            out.set(f"{name}/{system}", result)
            log(f"{name} {system}: {result['output_tokens_per_s']:.0f} output tokens/s")
            gc.collect()
            torch.cuda.empty_cache()
        model = load_hf_model(path, "bfloat16").to("cuda")
        slots = len(requests) * workload.max_len
        for system in ("hf_generate", "hf_continuous"):
            if time.time() > deadline - 20:
                out.append("skipped", f"{name}/{system}")
                continue
            if system == "hf_generate":
                run = run_hf_static(model, requests, slots, max_batch_size=max_num_seqs)
            else:
                run = run_hf_continuous(model, requests, -(-slots // 16), 16, max_num_seqs, 8192)
            result = run.to_dict()
            result.pop("timeline", None)
            out.set(f"{name}/{system}", result)
            log(f"{name} {system}: {result['output_tokens_per_s']:.0f} output tokens/s")
        del model
        gc.collect()
        torch.cuda.empty_cache()


def part_memory(out: JsonFile, deadline: float, work_dir: Path, args) -> None:
    from pagellm.bench.memory_experiment import MemoryExperimentConfig, run_memory_experiment

    name = "llama-0.5b"
    path = ensure_model(work_dir, name)
    config = MemoryExperimentConfig(model=str(path), max_model_len=1024,
                                    systems=("paged", "contiguous"))
    report = run_memory_experiment(config, _workload(args.num_prompts,
                                                     MODELS[name]["vocab_size"]))
    for system in ("paged", "contiguous"):
        report.get(system, {}).pop("timeline", None)
    out.set("report", report)
    log(f"memory: ratios {report['ratios']}")


if __name__ == "__main__":
    main()
