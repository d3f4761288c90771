"""benchmarks/sampler.py: every case timed for the working sampler and, with --baseline, for a
git revision's beside it; bad arguments are usage errors naming the value. No timing asserts."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks/sampler.py"
CASES = ["greedy", "temperature 0.8", "top_p 0.95", "temperature 1, top_p 0.95", "min_p 0.05",
         "top_k 40", "mixed", "greedy, logprobs 0", "temperature 0.8, logprobs 0",
         "temperature 0.8, logprobs 5"]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=180, env={**os.environ, "PYTHONPATH": str(ROOT)})


HAS_GIT = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True,
                         ).returncode == 0


@pytest.mark.skipif(not HAS_GIT, reason="not a git checkout")
def test_every_case_is_timed_beside_a_baseline_revision():
    done = _run("--rows", "5", "--vocab", "700", "--iters", "1", "--baseline", "HEAD")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert (report["rows"], report["vocab"], report["baseline"]) == (5, 700, "HEAD")
    assert list(report["ms_per_call"]) == CASES
    for times in report["ms_per_call"].values():
        assert set(times) == {"baseline", "current"} and min(times.values()) > 0


@pytest.mark.parametrize("args, message", [
    (["--rows", "0"], "--rows must be at least 1, got 0"),
    pytest.param(["--baseline", "no-such-revision"], "--baseline 'no-such-revision'",
                 marks=pytest.mark.skipif(not HAS_GIT, reason="not a git checkout")),
])
def test_bad_arguments_name_the_value(args, message):
    done = _run(*args)
    assert done.returncode != 0
    assert message in done.stderr
