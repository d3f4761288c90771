"""benchmarks/gpu_check.py on a machine without CUDA: it fails fast and clearly, and the pieces
that need no GPU (peak bandwidth by name, time boxes, pytest report counts) are right."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_check  # noqa: E402


def test_without_cuda_it_exits_2_with_a_clear_message_and_a_json(tmp_path):
    out = tmp_path / "report.json"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks/gpu_check.py"), "--out",
                           str(out)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2
    assert "gpu_check needs an NVIDIA GPU" in done.stderr and "Nothing was measured" in done.stderr
    report = json.loads(out.read_text())
    assert report["device"]["available"] is False and "needs an NVIDIA GPU" in report["error"]
    assert report["parts"] == {}


@pytest.mark.parametrize("name, peak", [("NVIDIA H200", 4.8e12),
                                        ("NVIDIA H100 80GB HBM3", 3.35e12),
                                        ("NVIDIA H100 PCIe", 2.0e12),
                                        ("NVIDIA A100-SXM4-80GB", 2.039e12),
                                        ("NVIDIA A100-PCIE-40GB", 1.555e12),
                                        ("NVIDIA GeForce GTX 1080", None)])
def test_peak_bandwidth_by_device_name(name, peak):
    assert gpu_check.peak_bandwidth(name) == peak


def test_time_boxes_shrink_together_when_time_runs_short():
    parts = list(gpu_check.PART_BUDGETS_S)
    assert gpu_check.part_shares(10_000, parts) == gpu_check.PART_BUDGETS_S
    total = sum(gpu_check.PART_BUDGETS_S.values())
    half = gpu_check.part_shares(total / 2, parts)
    assert half == pytest.approx({p: b / 2 for p, b in gpu_check.PART_BUDGETS_S.items()})
    assert sum(gpu_check.part_shares(-5, parts).values()) == 0


def test_junit_counts(tmp_path):
    report = tmp_path / "r.xml"
    report.write_text(
        '<testsuites><testsuite tests="4" failures="1" errors="0" skipped="1">'
        '<testcase classname="m" name="ok"/><testcase classname="m" name="bad">'
        '<failure message="x"/></testcase><testcase classname="m" name="s"><skipped/>'
        '</testcase><testcase classname="m" name="ok2"/></testsuite></testsuites>')
    counts = gpu_check.junit_counts(report)
    assert (counts["tests"], counts["passed"], counts["failures"],
            counts["skipped"]) == (4, 2, 1, 1)
    assert counts["failed_ids"] == ["m::bad"]


def test_every_gpu_marked_test_file_is_run_and_compiles_the_kernels():
    marker = "pytest.mark." + "gpu"  # not spelled out: this file is not one of them
    marked = {str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
              if marker in p.read_text()}
    assert marked == set(gpu_check.GPU_TEST_FILES)
    for path in gpu_check.GPU_TEST_FILES:
        assert 'environ["TRITON_INTERPRET"]' not in (ROOT / path).read_text()
