"""benchmarks/decode_kernel_variants.py: two builds of one source agree bit for bit and are
reported per (source, KV dtype); bad arguments are usage errors naming the choices."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pagellm.attention import cpu_kernel

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks/decode_kernel_variants.py"

pytestmark = pytest.mark.skipif(not cpu_kernel.available(), reason="no compiled CPU kernel")


def test_two_builds_of_one_source_report_side_by_side(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import decode_kernel_variants as bench

    copy = tmp_path / "paged_decode.c"  # the same text: the same cached build
    shutil.copy(cpu_kernel._SOURCE, copy)
    kernels = [bench.load_kernel(0, Path(cpu_kernel._SOURCE)), bench.load_kernel(1, copy)]
    runs = bench.measure(kernels, ["package", "copy"], ["auto", "int8"], (3, 40, 2, 1), 1)
    assert [(r["source"], r["kv_cache_dtype"]) for r in runs] == [
        ("package", "auto"), ("package", "int8"), ("copy", "auto"), ("copy", "int8")]
    for run in runs:
        assert run["max_diff_from_first_source"] == 0.0
        assert run["ns_per_key_and_kv_head"] > 0
        assert (run["num_seqs"], run["context"], run["layers"]) == (3, 40, 2)
    assert runs[0]["vs_first_auto"] == 1.0


def test_another_block_size(monkeypatch):
    """--block-size lays the same workload out in blocks of that many tokens (here 32, with a
    last block half full), and the builds still agree bit for bit."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import decode_kernel_variants as bench

    kernel = bench.load_kernel(0, Path(cpu_kernel._SOURCE))
    runs = bench.measure([kernel, kernel], ["a", "b"], ["auto", "int8"], (3, 48, 1, 1), 1, 32)
    assert [r["block_size"] for r in runs] == [32] * 4
    assert all(r["max_diff_from_first_source"] == 0.0 for r in runs)


@pytest.mark.parametrize("args, message", [
    (["--kv-dtypes", "auto,int4"], "kv_cache_dtype='int4' is not supported"),
    (["--shapes", "8x8"],
     "unknown --shapes ['8x8']; choices: 4x256-l2, 16x512-l3, 4x256, 16x512, 64x512, 128x512"),
    (["--block-size", "0"], "--block-size must be at least 1, got 0"),
])
def test_bad_arguments_are_usage_errors(args, message):
    done = subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2
    assert message in done.stderr
