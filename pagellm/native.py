"""The package's C kernels (CPU only), compiled on first use with the system C compiler.

Each source ships next to the Python module that calls it (``*.c`` package data). A build is
cached in ``cache_dir()/kernels`` (``$PAGELLM_CACHE_DIR``, default ``~/.cache/pagellm``), keyed
by a hash of the source, the flags, the compiler and the CPU (``-march=native`` builds are
CPU-specific), and loaded with ctypes. Sources built with ``-fopenmp`` link ``libgomp.so.1``,
the soname torch has already loaded, so the kernels follow ``torch.set_num_threads`` and share
torch's worker threads instead of competing with them.

Which instructions a build may use is an ISA level (``ISA_LEVELS``): ``native`` (default: all
the build machine's CPU has), one of the x86-64 micro-architecture levels, or ``generic`` (the
compiler's default target). ``$PAGELLM_CPU_ISA`` sets it for every kernel, so the code an
older CPU would run (AVX2 only: ``x86-64-v3``; AVX-512 without the bfloat16 dot products:
``x86-64-v4``) can be built and tested on a newer one.

The kernels accelerate, never decide: without a compiler, after a failed build, or with
``PAGELLM_CPU_KERNELS=0``, ``build_and_load`` returns None, logs once why, and callers run
their torch path. ``status()`` says what happened to each kernel.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger("pagellm")

# level -> (-march value or None for the compiler's default, /proc/cpuinfo flags it needs)
ISA_LEVELS: dict[str, tuple[str | None, frozenset[str]]] = {
    "native": ("native", frozenset()),
    "x86-64-v4": ("x86-64-v4", frozenset({"avx512f", "avx512bw", "avx512cd", "avx512dq",
                                          "avx512vl", "avx2", "fma", "f16c"})),  # no BF16
    "x86-64-v3": ("x86-64-v3", frozenset({"avx2", "fma", "f16c", "bmi2", "movbe"})),  # AVX2
    "x86-64-v2": ("x86-64-v2", frozenset({"sse4_2", "ssse3", "popcnt"})),
    "generic": (None, frozenset()),
}
_MARCH_NATIVE_MACHINES = ("x86_64", "AMD64", "aarch64", "arm64")
_status: dict[str, str] = {}  # what -> "built (...)" or "off: why"
_logged: set[str] = set()


def cache_dir() -> Path:
    """Where pagellm keeps what it builds (kernels, built-in random-weight models):
    ``$PAGELLM_CACHE_DIR``, else ``$XDG_CACHE_HOME/pagellm``, else ``~/.cache/pagellm``."""
    root = os.environ.get("PAGELLM_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or "~/.cache", "pagellm")
    return Path(root).expanduser()


def isa_level() -> str:
    """The ISA level kernels are built for: ``$PAGELLM_CPU_ISA``, default ``native``."""
    level = os.environ.get("PAGELLM_CPU_ISA") or "native"
    if level not in ISA_LEVELS:
        raise ValueError(f"PAGELLM_CPU_ISA={level!r} is not an ISA level; use one of "
                         f"{list(ISA_LEVELS)}")
    return level


def isa_flags(level: str) -> list[str]:
    """Compiler flags that target ``level`` on this machine (none for ``generic``, and for
    ``native`` where the compiler has no -march=native for this architecture)."""
    march, _ = ISA_LEVELS[level]
    machine = platform.machine()
    if march is None or (march == "native" and machine not in _MARCH_NATIVE_MACHINES):
        return []
    if march.startswith("x86-64") and machine not in ("x86_64", "AMD64"):
        raise ValueError(f"ISA level {level!r} is for x86-64 CPUs; this one is {machine}")
    return [f"-march={march}"]


def cpu_runs(level: str) -> bool:
    """Whether this CPU can run code built for ``level``."""
    if level in ("native", "generic"):
        return True
    if platform.machine() not in ("x86_64", "AMD64"):
        return False
    return ISA_LEVELS[level][1] <= cpu_flags()


def _cpuinfo_field(*names: str) -> str | None:
    """The value of the first /proc/cpuinfo line that starts with one of ``names`` ("" where
    none does; None where there is no such file)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln.partition(":")[2].strip() for ln in f if ln.startswith(names)), "")
    except OSError:
        return None


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    return frozenset((_cpuinfo_field("flags", "Features") or "").split())


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (the platform's processor string elsewhere)."""
    model = _cpuinfo_field("model name")
    if model is None:
        return platform.processor() or platform.machine()
    return model or platform.processor()


def cpu_vendor() -> str:
    """The CPU's vendor from /proc/cpuinfo ("AuthenticAMD", "GenuineIntel", ...; empty where
    there is none)."""
    return _cpuinfo_field("vendor_id") or ""


def status() -> dict[str, str]:
    """What happened to each kernel this process tried to build: ``built (...)`` or
    ``off: <why>``."""
    return dict(_status)


def build_and_load(source: Path, flags: list[str], what: str,
                   level: str | None = None, parts: int = 1) -> ctypes.CDLL | None:
    """The shared library of ``source`` built with ``flags`` for ISA ``level`` (default
    isa_level()), cached, or None. ``what`` names it in log messages and status().

    ``parts`` > 1: the source compiles as that many objects side by side, part k with
    ``-DPAGELLM_PART=k`` (the source says which code each part holds), linked into one
    library: a first build takes the time of its slowest part rather than of the whole."""
    if os.environ.get("PAGELLM_CPU_KERNELS", "1") == "0":
        return _off(what, "PAGELLM_CPU_KERNELS=0", logging.INFO)
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return _off(what, "no C compiler found (set CC or install gcc)", logging.WARNING)
    level = level or isa_level()
    flags = [*flags, *isa_flags(level)]
    text = source.read_text()
    key = hashlib.sha256("\n".join([text, " ".join(flags), compiler, _cpu_id()]
                                   + [f"parts={parts}"] * (parts > 1)).encode()).hexdigest()[:16]
    target = cache_dir() / "kernels" / f"{source.stem}_{key}.so"
    try:
        if not target.exists():
            _compile(compiler, source, flags, target, parts)
        library = ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as exc:
        return _off(what, f"the build with {compiler} failed ({_failure(exc)})",
                    logging.WARNING)
    _status[what] = f"built ({level}: {' '.join(isa_flags(level)) or 'compiler default'})"
    return library


class PreparedCall:
    """One kernel call with its arguments built once (a ctypes Structure passed by
    reference): ``call()`` runs it. Fields that change between calls are set on ``args``.
    ``keep``: the tensors ``args`` points into, alive as long as the call (``step``, the same
    for the fields set between calls), so that a pointer never outlives its buffer (a grown
    workspace, an output the caller dropped)."""

    __slots__ = ("function", "args", "pointer", "keep", "step")

    def __init__(self, function: Any, args: ctypes.Structure, keep: tuple = ()) -> None:
        self.function, self.args, self.pointer = function, args, ctypes.byref(args)
        self.keep, self.step = keep, ()

    def __call__(self) -> None:
        self.function(self.pointer)


class CallChain:
    """Prepared calls run in order by one C loop (call_chain.c): one ctypes call for all of
    them instead of one each. A decode step of a small model makes hundreds of kernel calls
    (SmolLM2-135M: 268 at batch 1), and each costs about a microsecond of Python and ctypes
    around its kernel. The calls' argument structures are read when the chain runs, so
    fields set on them between runs (cpu_kernel.set_step) hold. ``calls``: the chained
    PreparedCalls, kept alive by the chain (their args and the tensors they keep)."""

    __slots__ = ("calls", "_run", "_functions", "_args")

    def __init__(self, calls: list[PreparedCall], run: Any) -> None:
        self.calls = tuple(calls)
        self._run = run
        count = len(self.calls)
        self._functions = (ctypes.c_void_p * count)(
            *(ctypes.cast(c.function, ctypes.c_void_p).value for c in self.calls))
        self._args = (ctypes.c_void_p * count)(*(ctypes.addressof(c.args) for c in self.calls))

    def __call__(self) -> None:
        self._run(len(self.calls), self._functions, self._args)


def chain_calls(calls: list) -> list:
    """``calls`` (callables run in order) with each run of two or more consecutive
    PreparedCalls as one CallChain, the order kept; as they are where the chain's loop did
    not build (then each runs on its own, as before)."""
    library = _CHAINS.load()
    if library is None:
        return list(calls)
    out: list = []
    run: list[PreparedCall] = []
    for call in [*calls, None]:
        if isinstance(call, PreparedCall):
            run.append(call)
            continue
        out += [CallChain(run, library.run_calls)] if len(run) > 1 else run
        run = []
        if call is not None:
            out.append(call)
    return out


class KernelLibrary:
    """One compiled kernel library: built and loaded on first use (``load()``: the library,
    or None after a failed build; tried once), and a grow-only float32 workspace
    (``scratch``), so that steps do not page-fault a fresh buffer in every call. Subclasses
    build, declare and check their library in ``build()``.

    ``level`` is the ISA level built for (ISA_LEVELS; None: isa_level()).
    """

    def __init__(self, level: str | None = None) -> None:
        self.level = level
        self.library: ctypes.CDLL | None = None
        self.tried = False
        self.workspace = torch.empty(0)

    def load(self) -> ctypes.CDLL | None:
        if not self.tried:
            self.tried = True
            self.library = self.build()
        return self.library

    def build(self) -> ctypes.CDLL | None:
        raise NotImplementedError

    def scratch(self, numel: int) -> torch.Tensor:
        """At least ``numel`` floats (written through their pointer by the kernels: the
        buffer may have been grown under inference mode)."""
        if self.workspace.numel() < numel:
            self.workspace = torch.empty(int(numel * 1.25) + 1024)
        return self.workspace


def _off(what: str, why: str, level: int) -> None:
    """Record and log (once per reason) that a kernel is off."""
    _status[what] = f"off: {why}"
    if why not in _logged:
        _logged.add(why)
        logger.log(level, "compiled CPU kernels off: %s; the torch paths run instead", why)
    return None


def _failure(exc: Exception) -> str:
    """A one-line reason: the compiler's first error line, else its exit status or error."""
    detail = (getattr(exc, "stderr", b"") or b"").decode(errors="replace").strip()
    if detail:
        lines = detail.splitlines()
        return next((ln for ln in lines if "error" in ln), lines[-1])[-300:]
    if isinstance(exc, subprocess.CalledProcessError):
        return f"exit status {exc.returncode}, no message"
    return f"{type(exc).__name__}: {exc}"


COMPILE_TIMEOUT_S = 120  # per compiler process


def _compile(compiler: str, source: Path, flags: list[str], target: Path,
             parts: int = 1) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        library = Path(tmp) / target.name
        inputs = [str(source)]
        if parts > 1:
            inputs = _compile_parts(compiler, source, [f for f in flags if f != "-shared"],
                                    parts, Path(tmp))
        subprocess.run([compiler, *flags, *inputs, "-o", str(library), "-lm"], check=True,
                       capture_output=True, timeout=COMPILE_TIMEOUT_S)
        os.replace(library, target)  # atomic: concurrent builders never see a partial file


def _compile_parts(compiler: str, source: Path, flags: list[str], parts: int,
                   out_dir: Path) -> list[str]:
    """Compile ``-DPAGELLM_PART=k`` objects for k < parts, all at once; their paths."""
    objects = [str(out_dir / f"{source.stem}.part{k}.o") for k in range(parts)]
    procs = [subprocess.Popen([compiler, *flags, f"-DPAGELLM_PART={k}", "-c", str(source),
                               "-o", obj], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for k, obj in enumerate(objects)]
    deadline = time.monotonic() + COMPILE_TIMEOUT_S
    failure: subprocess.SubprocessError | None = None
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired as exc:
            failure = failure or exc
            continue
        if proc.returncode and failure is None:
            failure = subprocess.CalledProcessError(proc.returncode, proc.args, out, err)
    if failure is not None:
        for proc in procs:
            proc.kill()
            proc.wait()
        raise failure
    return objects


def _cpu_id() -> str:
    """What -march=native depends on: the CPU model and its feature flags."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags"))]
        return platform.machine() + "".join(sorted(set(lines)))
    except OSError:
        return platform.machine() + platform.processor()


class _ChainLibrary(KernelLibrary):
    """call_chain.c: the loop CallChain runs (no ISA-specific code)."""

    def build(self) -> ctypes.CDLL | None:
        library = build_and_load(Path(__file__).with_name("call_chain.c"),
                                 ["-O2", "-fPIC", "-shared"], "prepared call chains", self.level)
        if library is not None:
            library.run_calls.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
            library.run_calls.restype = None
        return library


_CHAINS = _ChainLibrary()
