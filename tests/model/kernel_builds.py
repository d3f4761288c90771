"""The builds of the CPU decode kernel that the tests run, each as the CPUs that get it would:

- ``native``: ``-march=native``, what this machine runs (AVX-512 and bfloat16 dot products
  where the CPU has them);
- ``portable``: the plain-C inner loops only (``-DPAGELLM_PORTABLE``), as on ARM;
- ``x86-64-v4``: AVX-512 without the bfloat16 dot-product instructions (Skylake-X, Ice Lake
  servers without AVX512_BF16);
- ``x86-64-v3``: AVX2 and FMA, no AVX-512 (most desktop CPUs, older servers).

A build this CPU cannot execute is skipped with the reason; one that the compiler cannot
build fails the test.
"""
from __future__ import annotations

import pytest

from pagellm import native
from pagellm.attention import cpu_kernel

KERNEL_BUILDS = ("native", "portable", "x86-64-v4", "x86-64-v3")
_built: dict[str, cpu_kernel._Kernel] = {}


def kernel_build(name: str) -> cpu_kernel._Kernel:
    """The loaded kernel build ``name`` (one of KERNEL_BUILDS), or a pytest skip saying why
    it cannot run here."""
    if not cpu_kernel.available():
        pytest.skip(f"the CPU decode kernel is not built here "
                    f"({native.status().get('CPU decode attention kernel')})")
    if name == "native":
        return cpu_kernel._KERNEL
    if name not in _built:
        level = None if name == "portable" else name
        if level is not None and not native.cpu_runs(level):
            pytest.skip(f"this CPU cannot run {level} code")
        _built[name] = cpu_kernel._Kernel(level=level, portable=name == "portable")
    kernel = _built[name]
    assert kernel.load() is not None, f"the {name} build failed: {native.status()}"
    return kernel
