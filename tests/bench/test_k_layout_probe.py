"""benchmarks/k_layout_probe.c: both K layouts give the same scores (to float rounding) for
int8 and e4m3 codes, and the probe prints its timings as JSON."""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from pagellm import native

ROOT = Path(__file__).resolve().parents[2]
SOURCE = ROOT / "benchmarks/k_layout_probe.c"

pytestmark = pytest.mark.skipif(
    shutil.which("gcc") is None or not {"avx2", "fma", "f16c"} <= native.cpu_flags(),
    reason="needs gcc and an AVX2 CPU with FMA and F16C")


@pytest.mark.parametrize("fmt", ["int8", "e4m3"])
def test_layouts_agree(tmp_path, fmt):
    binary = tmp_path / "probe"
    defines = ["-DE4M3"] if fmt == "e4m3" else []
    subprocess.run(["gcc", "-O3", "-march=native", *defines, "-o", str(binary), str(SOURCE),
                    "-lm"], check=True)
    out = subprocess.run([str(binary), "8", "2"], check=True, capture_output=True, text=True)
    report = json.loads(out.stdout)
    assert report["format"] == fmt and report["blocks"] == 8
    assert report["rows_ns"] > 0 and report["lanes_ns"] > 0
    assert report["max_score"] > 0
    # 64 float32 products per score, summed in two orders
    assert report["max_diff"] <= 1e-5 * report["max_score"]
