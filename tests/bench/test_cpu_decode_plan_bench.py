"""benchmarks/cpu_decode_plan.py on the tiny model: both kernel choices, a JSON report whose
plan and eager engines agree token for token, and bad arguments named."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "benchmarks/cpu_decode_plan.py")


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, SCRIPT, *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


def test_report_of_both_kernel_choices(tiny_model):
    done = run("--model", str(tiny_model), "--batch-sizes", "1,2", "--repeats", "1",
               "--new-tokens", "4", "--weights", "int4,int8,bfloat16", "--max-model-len", "64")
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    runs = {(r["kernels"], r["weights"], r["batch"]): r for r in report["runs"]}
    # bfloat16 has no torch variant (no int4/int8 layers)
    assert set(runs) == {(k, w, b) for k in ("compiled", "torch") for w in ("int4", "int8")
                         for b in (1, 2)} | {("compiled", "bfloat16", 1),
                                             ("compiled", "bfloat16", 2)}
    for entry in runs.values():
        assert entry["same_tokens"] and entry["plan_tok_s"][0] > 0 < entry["eager_tok_s"][0]
    assert report["machine"]["cpu"] and report["threads"] == 1


def test_bad_arguments_are_named(tiny_model):
    done = run("--model", str(tiny_model), "--weights", "int3")
    assert done.returncode != 0 and "'int3' is not one of" in done.stderr
    done = run("--model", str(tiny_model), "--kernels", "cuda")
    assert done.returncode != 0 and "'cuda' is not one of compiled, torch" in done.stderr
