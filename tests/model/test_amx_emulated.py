"""paged_decode.c's AMX kernels (8-bit caches: the tile products of scores and values) on a
CPU without AMX: the kernel's source built after amx_emulation.h, which implements the tile
instructions in plain C, and test_kv_quant's AMX tests (and its non-finite query test, on
every 8-bit path) run against that build. So the AMX kernels' logic (layouts, tile shapes,
the deferred value products, the scaled weights, the single pass) is checked on every
AVX-512 CPU with BF16 and VBMI, not only on the AMX Xeons, which run the same tests natively
in test_kv_quant.
"""
from __future__ import annotations

from pathlib import Path

import pytest
from test_kv_quant import (  # noqa: F401  collected here as well, on the emulated build
    amx, test_amx_kernels_keep_within_their_workspace, test_amx_products_match_the_table_kernels,
    test_non_finite_queries_and_rows_reach_only_their_heads)

from pagellm import native
from pagellm.attention import cpu_kernel

EMULATION = Path(__file__).with_name("amx_emulation.h")


@pytest.fixture(scope="module")
def emulated_kernel(tmp_path_factory):
    """The kernel built from amx_emulation.h + paged_decode.c (skipped where the CPU cannot
    run the AVX-512 code around the AMX kernels, has AMX itself, or the compiler has no AMX
    flags)."""
    flags = native.cpu_flags()
    if not cpu_kernel.available() or native.isa_level() != "native":
        pytest.skip("the native CPU decode kernel is not built here")
    if not {"avx512f", "avx512_bf16", "avx512vbmi"} <= flags:
        pytest.skip("the AMX kernels sit on the AVX512-BF16 and VBMI ones, which this CPU "
                    "lacks")
    if "amx_tile" in flags:
        pytest.skip("this CPU runs the AMX kernels natively (test_kv_quant)")
    source = tmp_path_factory.mktemp("amx") / "paged_decode_amx_emulated.c"
    source.write_text(EMULATION.read_text() + cpu_kernel._SOURCE.read_text())
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cpu_kernel, "_SOURCE", source)
        patch.setattr(cpu_kernel, "_FLAGS",
                      [*cpu_kernel._FLAGS, "-mamx-tile", "-mamx-bf16"])
        kernel = cpu_kernel._Kernel()
        if kernel.load() is None:
            pytest.skip(f"the emulated build failed: {native.status()}")
    return kernel


@pytest.fixture(autouse=True)
def on_the_emulated_kernel(emulated_kernel, monkeypatch):
    monkeypatch.setattr(cpu_kernel, "_KERNEL", emulated_kernel)
    assert emulated_kernel.load().paged_decode_features() & 32  # AMX


def test_the_emulated_build_runs_the_amx_kernels():
    assert cpu_kernel.use_amx()
    assert cpu_kernel.vector_paths()["8-bit"].startswith("AMX")
