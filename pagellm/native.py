"""The package's C kernels (CPU only), compiled on first use with the system C compiler.

Each source ships next to the Python module that calls it (``*.c`` package data). A build is
cached in ``$PAGELLM_CACHE_DIR`` (default ``~/.cache/pagellm``)/kernels, keyed by a hash of the
source, the flags, the compiler and the CPU (``-march=native`` builds are CPU-specific), and
loaded with ctypes. Sources built with ``-fopenmp`` link ``libgomp.so.1``, the soname torch has
already loaded, so the kernels follow ``torch.set_num_threads`` and share torch's worker
threads instead of competing with them.

The kernels accelerate, never decide: without a compiler, after a failed build, or with
``PAGELLM_CPU_KERNELS=0``, ``build_and_load`` returns None and callers run their torch path.
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
from pathlib import Path

logger = logging.getLogger("pagellm")


def build_and_load(source: Path, flags: list[str], what: str) -> ctypes.CDLL | None:
    """The shared library of ``source`` built with ``flags`` (cached), or None. ``what`` names
    it in log messages."""
    if os.environ.get("PAGELLM_CPU_KERNELS", "1") == "0":
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        logger.info("no C compiler found: the %s is not used", what)
        return None
    text = source.read_text()
    key = hashlib.sha256("\n".join([text, " ".join(flags), compiler, _cpu_id()])
                         .encode()).hexdigest()[:16]
    cache = Path(os.environ.get("PAGELLM_CACHE_DIR", "~/.cache/pagellm")).expanduser()
    target = cache / "kernels" / f"{source.stem}_{key}.so"
    try:
        if not target.exists():
            _compile(compiler, source, flags, target)
        return ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", b"") or b""
        logger.warning("could not build the %s (%s %s); using the torch path", what, exc,
                       detail.decode(errors="replace")[-500:])
        return None


def _compile(compiler: str, source: Path, flags: list[str], target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        library = Path(tmp) / target.name
        subprocess.run([compiler, *flags, str(source), "-o", str(library), "-lm"], check=True,
                       capture_output=True, timeout=120)
        os.replace(library, target)  # atomic: concurrent builders never see a partial file


def _cpu_id() -> str:
    """What -march=native depends on: the CPU model and its feature flags."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags"))]
        return platform.machine() + "".join(sorted(set(lines)))
    except OSError:
        return platform.machine() + platform.processor()
