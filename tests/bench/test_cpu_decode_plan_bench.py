"""benchmarks/cpu_decode_plan.py on the tiny model: both kernel choices over an int8 KV cache,
a JSON report whose plan and eager engines agree token for token, and bad arguments named."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pagellm.attention import cpu_kernel
from pagellm.model.layers import cpu_ops

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "benchmarks/cpu_decode_plan.py")


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, SCRIPT, *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


def test_report_of_both_kernel_choices(tiny_model):
    done = run("--model", str(tiny_model), "--batch-sizes", "1,3", "--repeats", "1",
               "--new-tokens", "4", "--weights", "int4,bfloat16", "--max-model-len", "64",
               "--kv-cache-dtype", "int8")
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    # the plan needs the compiled layer ops and attention kernel, which a CPU may turn off
    # (CpuDecodePlan.supports; the bfloat16 model of this run)
    probe = torch.empty(1, 1, dtype=torch.bfloat16)
    plan_runs_here = cpu_kernel.available() and all(
        cpu_ops.available(probe, op) for op in ("rms_norm", "rotary"))
    runs = {(r["kernels"], r["weights"], r["batch"]): r for r in report["runs"]}
    # bfloat16 has no torch variant (no int4/int8 layers)
    assert set(runs) == {(k, w, b) for k, w in (("compiled", "int4"), ("torch", "int4"),
                                                ("compiled", "bfloat16")) for b in (1, 3)}
    for entry in runs.values():
        assert entry["same_tokens"] and entry["plan_tok_s"][0] > 0 < entry["eager_tok_s"][0]
        assert entry["plan_on"] == plan_runs_here  # over the 8-bit cache too
    assert report["machine"]["cpu"] and report["threads"] == 1
    assert report["kv_cache_dtype"] == "int8"


def test_bad_arguments_are_named(monkeypatch):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import cpu_decode_plan

    for args, message in ((["--weights", "int3"], "'int3' is not one of"),
                          (["--kernels", "cuda"], "'cuda' is not one of compiled, torch")):
        monkeypatch.setattr(sys, "argv", ["cpu_decode_plan.py", *args])
        with pytest.raises(SystemExit, match=message):
            cpu_decode_plan.main()
