"""The compiled CPU kernels on every kind of machine: built for older x86 ISA levels, compiled
for ARM (aarch64), and absent (switched off, no compiler, a failing build), where generation
must run on the torch paths with the same greedy tokens and say once why."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import hf_greedy, load_hf_model, make_tiny_model, random_prompts

from pagellm import native
from pagellm.attention import cpu_kernel
from pagellm.model.layers import cpu_ops, quant_matmul

_SOURCES = [Path(cpu_kernel.__file__).with_name("paged_decode.c"),
            Path(cpu_ops.__file__).with_name("cpu_ops.c"),
            Path(quant_matmul.__file__).with_name("quant_matmul.c")]
_CROSS_COMPILER = "aarch64-linux-gnu-gcc"


@pytest.mark.parametrize("level", ["x86-64-v4", "x86-64-v3", "x86-64-v2", "generic"])
def test_layer_ops_built_for_older_isa_levels_match_torch(level, monkeypatch):
    """cpu_ops.c built for each level this CPU can run: every op that passes its load-time
    check at the native level passes it here too (plain C with no FMA contraction rounds the
    same whatever vector width the compiler picks)."""
    if cpu_ops._LIBRARY.load() is None:
        pytest.skip(f"the layer ops are off here: {native.status().get(cpu_ops.WHAT)}")
    if not native.cpu_runs(level):
        pytest.skip(f"this CPU cannot run {level} code")
    native_ops = set(cpu_ops.enabled_ops())
    fresh = cpu_ops._Library(level)
    monkeypatch.setattr(cpu_ops, "_LIBRARY", fresh)
    assert fresh.load() is not None, native.status()
    assert set(cpu_ops.enabled_ops()) == native_ops


def _cross_compiler() -> str:
    """The aarch64 cross compiler, installed from Debian's packages where it is missing and
    this test runs as root with apt-get (as CI does); else a skip saying so."""
    if shutil.which(_CROSS_COMPILER):
        return _CROSS_COMPILER
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        pytest.skip(f"{_CROSS_COMPILER} missing and cannot be installed (not root / no apt)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for command in (["apt-get", "update", "-qq"],
                    ["apt-get", "install", "-y", "-qq", "--no-install-recommends",
                     "gcc-aarch64-linux-gnu", "libc6-dev-arm64-cross"]):
        done = subprocess.run(command, env=env, capture_output=True, timeout=600)
        if done.returncode != 0 and command[1] == "install":
            pytest.skip(f"could not install the aarch64 cross compiler: "
                        f"{done.stderr.decode(errors='replace')[-300:]}")
    return _CROSS_COMPILER


@pytest.mark.parametrize("source", _SOURCES, ids=lambda p: p.name)
def test_kernels_compile_for_aarch64(source, tmp_path):
    """On ARM the plain-C loops are what runs: every source compiles for aarch64 (armv8-a, the
    baseline every 64-bit ARM server has) with the flags pagellm builds them with."""
    compiler = _cross_compiler()
    flags = ["-O3", "-fopenmp", "-fPIC", "-shared", "-ffp-contract=off", "-march=armv8-a"]
    out = tmp_path / (source.stem + ".so")
    done = subprocess.run([compiler, *flags, str(source), "-o", str(out), "-lm"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    header = out.read_bytes()[:20]
    assert header[:4] == b"\x7fELF" and int.from_bytes(header[18:20], "little") == 183  # EM_AARCH64


_PARTED_SOURCE = """
#if !defined(PAGELLM_PART) || PAGELLM_PART == 0
int part_zero(void) { return 10; }
#endif
#if !defined(PAGELLM_PART) || PAGELLM_PART == 1
int part_one(void) { return 11; }
#if defined(PAGELLM_PART) && defined(BREAK_PART_ONE)
#error part one does not compile
#endif
#endif
"""


def test_a_split_build_links_its_parts_and_names_a_failing_one(tmp_path, monkeypatch):
    """build_and_load(parts=2): part k compiled with -DPAGELLM_PART=k beside the other, both
    in the one library; a part that fails to compile turns the kernel off with its error."""
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler")
    monkeypatch.setenv("PAGELLM_CACHE_DIR", str(tmp_path / "cache"))
    source = tmp_path / "parted.c"
    source.write_text(_PARTED_SOURCE)
    flags = ["-O1", "-fPIC", "-shared"]
    library = native.build_and_load(source, flags, "split test", parts=2)
    assert library is not None, native.status()["split test"]
    assert (library.part_zero(), library.part_one()) == (10, 11)
    assert native.build_and_load(source, [*flags, "-DBREAK_PART_ONE"], "broken split test",
                                 parts=2) is None
    assert "part one does not compile" in native.status()["broken split test"]


_RUN = """
import json, logging, sys
logging.basicConfig(level=logging.INFO, format="LOG %(message)s")
import torch
from pagellm import LLM, SamplingParams, native
from pagellm.attention import cpu_kernel
from pagellm.model.layers import cpu_ops
torch.set_num_threads(1)
prompts = json.loads(sys.argv[2])
llm = LLM(model=sys.argv[1], dtype="float32", kv_cache_memory_bytes=1 << 22, block_size=4)
outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                    SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
print("RESULT " + json.dumps({"tokens": [o.outputs[0].token_ids for o in outs],
                              "status": native.status(), "decode": cpu_kernel.describe(),
                              "ops": cpu_ops.enabled_ops()}))
"""


@pytest.fixture(scope="module")
def model_and_expected(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("model"), "LlamaForCausalLM", seed=11)
    prompts = random_prompts([5, 23, 40], seed=3)
    hf = load_hf_model(path)
    return path, prompts, [hf_greedy(hf, p, 12) for p in prompts]


@pytest.mark.parametrize("mode", ["on", "switched_off", "broken_compiler", "no_compiler"])
def test_generation_with_and_without_kernels(mode, model_and_expected, tmp_path):
    """The same greedy tokens as transformers (float32) with the kernels on, off
    (PAGELLM_CPU_KERNELS=0), with a compiler that fails, and with none; one log line says
    why they are off."""
    path, prompts, expected = model_and_expected
    env = dict(os.environ)  # the build cache is keyed by compiler: a broken one builds afresh
    env.pop("PAGELLM_CPU_KERNELS", None)
    if mode == "on" and not cpu_kernel.available():
        pytest.skip(f"the kernels cannot be built here: {native.status()}")
    if mode == "switched_off":
        env["PAGELLM_CPU_KERNELS"] = "0"
    elif mode == "broken_compiler":
        env["CC"] = shutil.which("false") or "/bin/false"
    elif mode == "no_compiler":
        env.pop("CC", None)
        env["PATH"] = str(tmp_path)  # holds no cc or gcc
    done = subprocess.run([sys.executable, "-c", _RUN, str(path), json.dumps(prompts)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(next(line for line in done.stdout.splitlines()
                             if line.startswith("RESULT "))[len("RESULT "):])
    assert result["tokens"] == expected
    off_lines = [line for line in done.stderr.splitlines()
                 if "compiled CPU kernels off" in line]
    if mode == "on":
        assert not off_lines and result["ops"]
        assert all(state.startswith("built") for state in result["status"].values())
        assert result["decode"].startswith("compiled paged kernel")
        return
    why = {"switched_off": "PAGELLM_CPU_KERNELS=0", "broken_compiler": "failed",
           "no_compiler": "no C compiler found"}[mode]
    assert len(off_lines) == 1 and why in off_lines[0], done.stderr[-2000:]
    assert result["ops"] == [] and result["decode"].startswith("torch")
    assert all(state.startswith("off") for state in result["status"].values())


def test_cpu_vendor_is_read_from_cpuinfo(tmp_path, monkeypatch):
    """native.cpu_vendor (which picks the few-rows kernel's thresholds in quant_matmul): the
    vendor_id line of /proc/cpuinfo, empty where there is no such file."""
    import builtins
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\n"
                    "processor\t: 1\nvendor_id\t: AuthenticAMD\n")
    monkeypatch.setattr(native, "open", lambda path, *a, **k: builtins.open(info, *a, **k),
                        raising=False)
    assert native.cpu_vendor() == "AuthenticAMD"

    def missing(*args, **kwargs):
        raise OSError("no /proc/cpuinfo")
    monkeypatch.setattr(native, "open", missing, raising=False)
    assert native.cpu_vendor() == ""
    monkeypatch.undo()
    assert quant_matmul.FEW_ROWS_PAY == (native.cpu_vendor() == "AuthenticAMD")
