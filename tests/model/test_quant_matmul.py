"""The compiled weight-only int4 / int8 matmuls (model/layers/quant_matmul.c) against a float64
matmul of the weights dequantized as the layers' reference does, in each build a CPU may run
(AVX2 + FMA, plain C), for tiles of 1-4 rows, the GEMM path of many rows, float32 and bfloat16
activations and parameters; and the layers on torch's kernels when the compiled ones are off."""
from __future__ import annotations

import pytest
import torch

from pagellm import native
from pagellm.model.layers import quant_library, quant_matmul, quant_panels
from pagellm.model.layers.quantized_linear import (Int4Weight, Int8Weight, int4_quantize,
                                                   int8_quantize)

ROWS = (1, 2, 3, 4, 5, 7, 8, 12, 15, quant_matmul.GEMM_ROWS, quant_matmul.GEMM_ROWS + 5)
_builds: dict[str, quant_library.QuantLibrary] = {}


@pytest.fixture(params=["native", "x86-64-v3", "generic"])
def build(request, monkeypatch):
    """The library built for an ISA level (x86-64-v3: the AVX2 loops; generic: plain C),
    installed as the one the module calls."""
    if not quant_matmul.available():
        pytest.skip(f"the compiled kernels are off here ({native.status()[quant_matmul.WHAT]})")
    level = request.param
    if level != "native" and not native.cpu_runs(level):
        pytest.skip(f"this CPU cannot run {level} code")
    library = quant_matmul._LIBRARY if level == "native" else _builds.setdefault(
        level, quant_library.QuantLibrary(level))
    assert library.load() is not None, native.status()
    if level != "native":  # the loops the level selects are the ones under test
        assert library.load().quant_matmul_features() == (level == "x86-64-v3")
    monkeypatch.setattr(quant_matmul, "_LIBRARY", library)
    return library


def test_the_native_build_has_the_loops_this_cpu_allows():
    """The native build's int8 activations take the AVX512-VNNI loop exactly where the CPU
    has it (so that the int8-activation tests below cover it on such CPUs), the AVX512-BF16
    products where it has AVX512-BF16 (so that the dot-product tests run there), and the AVX2
    loops where it has AVX2 and FMA."""
    if not quant_matmul.available() or native.isa_level() != "native":
        pytest.skip("the native build only")
    features = quant_matmul._LIBRARY.load().quant_matmul_features()
    flags = native.cpu_flags()
    assert bool(features & 1) == ({"avx2", "fma"} <= flags)
    assert bool(features & 2) == ("avx512f" in flags)
    assert bool(features & 4) == ({"avx2", "fma", "avx512_vnni", "avx512bw", "avx512vl"}
                                  <= flags)
    assert bool(features & 8) == ({"avx2", "fma", "avx512_bf16", "avx512bw", "avx512vl"}
                                  <= flags)


def check_close(out: torch.Tensor, expected: torch.Tensor) -> None:
    """float32: the float64 value up to float32 additions; bfloat16: one rounding of it."""
    assert out.shape == expected.shape
    scale = expected.abs().max().item()
    if out.dtype == torch.float32:
        assert (out.double() - expected).abs().max().item() <= 2e-6 * scale
    else:  # within one bfloat16 step (2^-8 relative) of the exact value, plus float32 noise
        step = expected.abs() * 2 ** -8 + 1e-6 * scale
        assert ((out.double() - expected).abs() <= step).all()


def inputs(out_features, in_features, dtype, rows, seed=0):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=gen) * 0.3
    x = torch.randn(rows, in_features, generator=gen).to(dtype)
    return weight, x


def int4_case(out_features, in_features, x_dtype, param_dtype, group_size, seed):
    """Activations (a row with a block of zeros, one with a block of one large value among
    small ones), int4 codes and (scale, zero) parameters of a random weight, and the
    dequantized weight in float64."""
    weight, x = inputs(out_features, in_features, x_dtype, max(ROWS), seed=seed)
    x[1, 32:64] = 0
    x[2, 64:96] = x[2, 64:96] * 1e-3
    x[2, 70] = 50
    q, scale, zero = int4_quantize(weight, group_size, param_dtype)
    params = torch.stack([scale, zero], -1).to(param_dtype).contiguous()
    p = params.double()
    deq = ((q.double().view(out_features, -1, group_size) - 8) * p[..., :1] + p[..., 1:]
           ).view(out_features, in_features)
    return x, q, params, deq


@pytest.mark.parametrize("x_dtype, param_dtype", [
    (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.bfloat16), (torch.bfloat16, torch.float16)])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_matmul_matches_float64_reference(build, x_dtype, param_dtype, group_size):
    weight, x = inputs(40, 256, x_dtype, max(ROWS))
    q, scale, zero = int4_quantize(weight, group_size, param_dtype)
    params = torch.stack([scale, zero], -1).to(param_dtype).contiguous()
    p = params.double()
    deq = ((q.double().view(40, -1, group_size) - 8) * p[..., :1] + p[..., 1:]).view(40, 256)
    packed = quant_matmul.pack_int4(q)
    assert torch.equal(quant_matmul.unpack_int4(packed), q)
    for rows in ROWS:
        out = quant_matmul.int4_matmul(x[:rows], packed, params, group_size)
        assert out.dtype == x_dtype
        check_close(out, x[:rows].double() @ deq.T)


@pytest.mark.parametrize("x_dtype, param_dtype", [
    (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
    (torch.bfloat16, torch.float16)])
@pytest.mark.parametrize("group_size, in_features", [
    (32, 256), (64, 256), (128, 256), (32, 352), (64, 320), (32, 96)])
def test_int4_times_int8_activations_matches_float64_reference(build, x_dtype, param_dtype,
                                                               group_size, in_features):
    """int8_activations: the float64 product of the activations rounded by
    quantize_activations with the dequantized weight. A code off by one would be off by
    about 1/127 of a block's largest activation, far beyond the float32 tolerance. Rows with
    a block of zeros and with a block of one large value among small ones. The widths give
    the VNNI loop's eight blocks at a time, then a pair, then one (352 = 11 blocks of 32),
    and fewer than eight blocks (96)."""
    x, q, params, deq = int4_case(40, in_features, x_dtype, param_dtype, group_size, 4)
    packed = quant_matmul.pack_int4(q)
    for rows in ROWS:
        out = quant_matmul.int4_matmul(x[:rows], packed, params, group_size,
                                       int8_activations=True)
        assert out.dtype == x_dtype
        check_close(out, quant_matmul.quantize_activations(x[:rows]).double() @ deq.T)


@pytest.mark.parametrize("x_dtype, param_dtype", [
    (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
    (torch.bfloat16, torch.float16)])
@pytest.mark.parametrize("group_size, in_features", [
    (32, 256), (64, 256), (32, 352), (352, 352), (32, 96), (96, 96), (32, 576)])
def test_int8_times_int8_activations_matches_float64_reference(build, x_dtype, param_dtype,
                                                               group_size, in_features):
    """int8_activations on symmetric int8 weights (GGUF's Q8_0, or one scale per row): the
    float64 product of the rounded activations with the dequantized weight, codes of +-127
    included (the VNNI loop's unsigned offset of 128 must come off exactly). Widths as
    above (eight blocks at a time, then a pair, then one; fewer than eight), groups of one
    block, of several, and the whole row."""
    weight, x = inputs(40, in_features, x_dtype, max(ROWS), seed=5)
    x[1, 32:64] = 0
    x[2, 70] = 50
    groups = in_features // group_size
    scale = (torch.rand(40, groups, generator=torch.Generator().manual_seed(6)) + 0.5) / 100
    q = torch.randint(-127, 128, (40, in_features), dtype=torch.int8,
                      generator=torch.Generator().manual_seed(7))
    q[0, :64], q[3, :32] = 127, -127
    scale = scale.to(param_dtype).contiguous()
    params = scale[:, 0].contiguous() if groups == 1 else scale
    deq = (q.double().view(40, groups, -1) * scale.double()[..., None]).view(40, in_features)
    for rows in ROWS:
        out = quant_matmul.int8_matmul(x[:rows], q, params, group_size, int8_activations=True)
        assert out.dtype == x_dtype
        check_close(out, quant_matmul.quantize_activations(x[:rows]).double() @ deq.T)
    with pytest.raises(ValueError, match="group_size=16 and in_features=96 must be multiples"):
        quant_matmul.int8_matmul(x[:1, :96], q[:, :96], torch.ones(40, 6), 16,
                                 int8_activations=True)


def test_int4_panels_round_trip():
    """pack_int4_panels' layout: byte 64 c + 4 j + i of block b holds column j's codes at
    32 b + 4 c + i (low nibble) and 32 b + 16 + 4 c + i (high), parameters 16 columns to a
    row, the last panel padded with zeros; unpack_int4_panels inverts it."""
    gen = torch.Generator().manual_seed(5)
    q = torch.randint(0, 16, (21, 64), generator=gen, dtype=torch.uint8)
    params = torch.randn(21, 2, 2, generator=gen).to(torch.bfloat16)
    packed, panel_params = quant_panels.pack_int4_panels(q, params)
    assert packed.shape == (2, 2, 256) and panel_params.shape == (2, 2, 2, 16)
    assert packed[1, 1, 64 * 2 + 4 * 3 + 1] == q[19, 32 + 8 + 1] | (q[19, 32 + 16 + 8 + 1] << 4)
    assert panel_params[1, 0, 1, 3] == params[19, 0, 1]
    assert not packed[1].view(2, 4, 16, 4)[:, :, 5:].any()  # columns 21-31: padding
    assert not panel_params[1, :, :, 5:].any()
    codes, unpacked = quant_panels.unpack_int4_panels(packed, panel_params, 21)
    assert torch.equal(codes, q) and torch.equal(unpacked, params)
    with pytest.raises(ValueError, match="out_features=40 for 2 panels of 16"):
        quant_matmul.QuantizedMatmul("int4_panels", packed, panel_params, 32, out_features=40)


@pytest.mark.parametrize("x_dtype, param_dtype", [
    (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
    (torch.bfloat16, torch.float16)])
@pytest.mark.parametrize("group_size, in_features, out_features", [
    (32, 256, 40), (64, 256, 16), (128, 256, 33), (32, 352, 40), (64, 320, 8), (32, 96, 47)])
def test_int4_panels_times_int8_activations_match_float64_reference(
        x_dtype, param_dtype, group_size, in_features, out_features, monkeypatch):
    """The panel kernel (int4_panel_a8_matmul, AVX512-VNNI builds): the float64 product of
    the activations rounded by quantize_activations with the dequantized weight, for every
    tile of 1-8 rows and the tiles after it (ROWS), with and without a bias, and for the
    most rows in calls of 3 rows (PANEL_CHUNK_ROWS, a last call of fewer). Widths with an odd
    last block (352, 96: the activations' pair order), groups of one to four blocks, a last
    panel of 1-15 columns, rows with a block of zeros and with one large value."""
    if not quant_matmul.has_vnni_loops():
        pytest.skip("the panel kernel is built for AVX512-VNNI CPUs only")
    x, q, params, deq = int4_case(out_features, in_features, x_dtype, param_dtype,
                                  group_size, 14)
    bias = torch.randn(out_features, generator=torch.Generator().manual_seed(15))
    packed, panel_params = quant_panels.pack_int4_panels(q, params)
    kernel = quant_matmul.QuantizedMatmul("int4_panels", packed, panel_params, group_size,
                                          bias, out_features=out_features)
    assert kernel.integer()
    for rows in ROWS:
        expected = quant_matmul.quantize_activations(x[:rows]).double() @ deq.T
        out = kernel(x[:rows], add_bias=False)
        assert out.dtype == x_dtype
        check_close(out, expected)
        check_close(kernel(x[:rows]), expected + bias.double())
    monkeypatch.setattr(quant_matmul, "PANEL_CHUNK_ROWS", 3)
    assert max(ROWS) % 3
    check_close(kernel(x), quant_matmul.quantize_activations(x).double() @ deq.T
                + bias.double())


@pytest.mark.parametrize("layout", ["int4", "int8", "int4_panels"])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_non_finite_activations_reach_only_their_rows(build, layout, x_dtype):
    """With int8 activations a row with a NaN or an infinity comes out all NaN, as torch's
    rounding (quantize_activations) makes it, not as whatever integer the codes would round
    it to; every other row as without them, bit for bit. Tiles of few rows and the GEMM's
    (INTEGER_ROWS and more), the panels on AVX512-VNNI builds."""
    if layout == "int4_panels" and (build is not quant_matmul._LIBRARY
                                    or not quant_matmul.has_vnni_loops()):
        pytest.skip("the panel kernel is built for AVX512-VNNI CPUs only")
    x, q, params, _ = int4_case(40, 256, x_dtype, torch.bfloat16, 32, 40)
    if layout == "int4":
        kernel = quant_matmul.QuantizedMatmul("int4", quant_matmul.pack_int4(q), params, 32)
    elif layout == "int4_panels":
        kernel = quant_matmul.QuantizedMatmul(
            "int4_panels", *quant_panels.pack_int4_panels(q, params), 32, out_features=40)
    else:
        codes = torch.randint(-127, 128, (40, 256), dtype=torch.int8,
                              generator=torch.Generator().manual_seed(41))
        kernel = quant_matmul.QuantizedMatmul("int8", codes, params[..., 0].contiguous(), 32)
    kernel.int8_activations = True
    bad = x.clone()
    bad[0, 5] = float("nan")
    bad[3, 200] = float("inf")
    bad[-1, 31] = float("-inf")
    hit = ~torch.isfinite(bad).all(dim=-1)
    for rows in (4, max(ROWS)):
        expected = quant_matmul.quantize_activations(bad[:rows])
        assert expected[hit[:rows]].isnan().any(dim=-1).all()
        clean, out = kernel(x[:rows]), kernel(bad[:rows])
        assert out[hit[:rows]].isnan().all()
        assert torch.equal(out[~hit[:rows]], clean[~hit[:rows]])
        assert torch.isfinite(clean).all()


def test_int8_panels_layout():
    """pack_int8_panels' layout: byte 64 c + 4 j + i of block b holds column j's code at
    k = 32 b + 4 c + i plus 128, scales [panel, group, column]; the last panel padded with
    zero codes (128) and zero scales."""
    q = torch.randint(-127, 128, (21, 64), dtype=torch.int8,
                      generator=torch.Generator().manual_seed(30))
    scale = torch.rand(21, 2, generator=torch.Generator().manual_seed(31)).bfloat16()
    packed, scales = quant_panels.pack_int8_panels(q, scale)
    assert packed.shape == (2, 2, 512) and scales.shape == (2, 2, 16)
    assert packed.dtype == torch.uint8 and scales.dtype == torch.bfloat16
    for n, k in ((0, 0), (5, 37), (17, 63), (20, 30)):
        p, j, b, c, i = n // 16, n % 16, k // 32, k % 32 // 4, k % 4
        assert int(packed[p, b, 64 * c + 4 * j + i]) == int(q[n, k]) + 128
    assert scales[1, 1, 4] == scale[20, 1]
    assert (packed[1, :, :].view(2, 8, 16, 4)[:, :, 5:] == 128).all()
    assert not scales[1, :, 5:].any()
    _, row_scales = quant_panels.pack_int8_panels(q, scale[:, 0].contiguous())
    assert row_scales.shape == (2, 1, 16) and row_scales[1, 0, 3] == scale[19, 0]


@pytest.mark.parametrize("group_size, in_features, out_features", [
    (32, 256, 47), (64, 256, 16), (352, 352, 33), (32, 96, 1)])
def test_int8_panels_times_int8_activations_match_float64_reference(
        group_size, in_features, out_features, monkeypatch):
    """Symmetric int8 with int8 activations on AVX512-VNNI builds runs in panels
    (int8_panel_a8_matmul) at every row count, the GEMM's included: the float64 product of
    the rounded activations with the dequantized weight, with a bias, codes of +-127, in calls
    of 3 rows (PANEL_CHUNK_ROWS) and as the decode plan's prepared call."""
    if not quant_matmul.has_vnni_loops():
        pytest.skip("the panel kernel is built for AVX512-VNNI CPUs only")
    weight, x = inputs(out_features, in_features, torch.bfloat16, max(ROWS), seed=32)
    x[1, 32:64] = 0
    x[2, 70] = 50
    groups = in_features // group_size
    scale = ((torch.rand(out_features, groups, generator=torch.Generator().manual_seed(33))
              + 0.5) / 100).bfloat16()
    q = torch.randint(-127, 128, (out_features, in_features), dtype=torch.int8,
                      generator=torch.Generator().manual_seed(34))
    q[0, :64] = 127
    q[-1, :32] = -127
    params = scale[:, 0].contiguous() if groups == 1 else scale
    deq = (q.double().view(out_features, groups, -1) * scale.double()[..., None]).view(
        out_features, in_features)
    bias = torch.randn(out_features, generator=torch.Generator().manual_seed(35))
    kernel = quant_matmul.QuantizedMatmul("int8", q, params, group_size, bias)
    kernel.int8_activations = True
    for rows in ROWS:
        expected = quant_matmul.quantize_activations(x[:rows]).double() @ deq.T
        check_close(kernel(x[:rows], add_bias=False), expected)
        check_close(kernel(x[:rows]), expected + bias.double())
    assert kernel._panel_matmul is not None
    out = torch.empty(5, out_features, dtype=torch.bfloat16)
    workspace = torch.empty(quant_matmul.workspace_floats(5, in_features))
    kernel.prepared(x[:5], out, workspace)()
    check_close(out, quant_matmul.quantize_activations(x[:5]).double() @ deq.T)
    monkeypatch.setattr(quant_matmul, "PANEL_CHUNK_ROWS", 3)
    check_close(kernel(x), quant_matmul.quantize_activations(x).double() @ deq.T
                + bias.double())
    kernel.int8_activations = False  # the float loops on x itself again
    check_close(kernel(x[:4], add_bias=False), x[:4].double() @ deq.T)


def test_int4_layer_takes_the_panels_with_int8_activations(monkeypatch):
    """Where the build has the AVX512-VNNI loops, an int4 layer's codes and parameters move
    to the panel layout when int8 activations are turned on and back when they are turned
    off: the same codes and dequantized weight throughout, the products of the rounded
    activations, prepared calls equal to the layer's, and after turning them off the float
    loops' products as before, bit for bit."""
    if not quant_matmul.has_vnni_loops():
        pytest.skip("the panel layout is used on AVX512-VNNI CPUs only")
    monkeypatch.setattr(quant_matmul, "preferred", lambda: True)  # from the row layout on
    weight, x = inputs(50, 128, torch.bfloat16, 20, seed=16)
    layer = Int4Weight.quantize(weight, 32)
    codes, deq = layer.codes(), layer.dequantized()
    before = layer(x)
    layer.int8_activations = True
    assert layer.panels and layer.kernel.kind == "int4_panels"
    assert layer.packed.shape == (4, 4, 256) and layer.scale_and_zero.shape == (4, 4, 2, 16)
    assert torch.equal(layer.codes(), codes) and torch.equal(layer.dequantized(), deq)
    for rows in (1, 4, 7, 8, 9, 20):
        out = layer(x[:rows])
        check_close(out, quant_matmul.quantize_activations(x[:rows]).double() @ deq.double().T)
        prepared_out = torch.empty(rows, 50, dtype=torch.bfloat16)
        workspace = torch.empty(quant_matmul.workspace_floats(rows, 128))
        layer.kernel.prepared(x[:rows], prepared_out, workspace)()
        assert torch.equal(prepared_out, out)
    layer.int8_activations = False
    assert not layer.panels and layer.kernel.kind == "int4"
    assert torch.equal(layer.codes(), codes) and torch.equal(layer.dequantized(), deq)
    assert torch.equal(layer(x), before)


def test_quantize_activations_rounds_each_block_of_32_to_int8():
    """Codes in [-127, 127] with the block's largest magnitude at +-127, each value within
    half a step (amax / 254) of the input; a block of zeros stays zero; K must be a multiple
    of 32."""
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(5)) * 4
    x[0, :32] = 0
    rounded = quant_matmul.quantize_activations(x)
    assert rounded.dtype == torch.float32 and rounded.shape == x.shape
    blocks, out = x.view(3, 3, 32), rounded.view(3, 3, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    step = amax / 127
    assert torch.equal(out[0, 0], torch.zeros(32))
    codes = torch.where(step > 0, out / step, 0.0)
    assert torch.allclose(codes, codes.round(), atol=1e-4) and codes.abs().max() <= 127 + 1e-4
    assert ((out - blocks).abs() <= step / 2 * (1 + 1e-5)).all()
    assert torch.equal(quant_matmul.quantize_activations(x.bfloat16()),
                       quant_matmul.quantize_activations(x.bfloat16().float()))
    with pytest.raises(ValueError, match="in_features=40 must be a multiple of 32"):
        quant_matmul.quantize_activations(torch.ones(2, 40))


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_compiled_rounding_of_activations_is_torch_s_exactly(build, x_dtype):
    """The compiled round_activations (the rows the float loops multiply from INTEGER_ROWS
    rows on) equals quantize_activations bit for bit, zeros and a strided view included."""
    x = (torch.randn(9, 200, generator=torch.Generator().manual_seed(6)) * 3).to(x_dtype)
    x[2, 32:64] = 0
    x[3, :32] = torch.arange(32) - 16.0  # codes at exact multiples of the step
    view = x[:, :192]
    matmul = quant_matmul.QuantizedMatmul("int4", torch.zeros(1, 96, dtype=torch.uint8),
                                          torch.ones(1, 6, 2), 32)
    rounded = quant_library.rounded_rows(build.load(), matmul.args, view)
    assert torch.equal(rounded, quant_matmul.quantize_activations(view))


@pytest.mark.parametrize("x_dtype, param_dtype", [
    (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
    (torch.bfloat16, torch.float16), (torch.float32, torch.float16)])
@pytest.mark.parametrize("group_size", [8, 16, 32, None])
def test_int8_matmul_matches_float64_reference(build, x_dtype, param_dtype, group_size):
    """Scales in float16 too (a GGUF file's Q8_0 / Q4_0 / Q5_0 block scales as they are),
    one of them a float16 subnormal."""
    weight, x = inputs(24, 96, x_dtype, max(ROWS), seed=1)
    weight[0, :8] *= 2 ** -10  # its scales ~7e-6: float16 subnormals (normals from 6.1e-5)
    if group_size is None:  # one scale per output channel
        q, scale = int8_quantize(weight, param_dtype)
        deq = q.double() * scale.double()[:, None]
    else:
        groups = weight.view(24, -1, group_size)
        scale = (groups.abs().amax(-1) / 127).to(param_dtype)  # [N, K / group_size]
        q = (groups / scale.float()[..., None]).round().to(torch.int8).view(24, 96)
        deq = (q.double().view(24, -1, group_size) * scale.double()[..., None]).view(24, 96)
    layer = Int8Weight(q, scale, group_size)
    torch.testing.assert_close(layer.dequantized().double(), deq)
    for rows in ROWS:  # the kernel itself (the layer takes torch's on AVX-512 CPUs)
        check_close(quant_matmul.int8_matmul(x[:rows], q, scale, group_size or 96),
                    x[:rows].double() @ deq.T)


@pytest.mark.parametrize("x_dtype, param_dtype", [
    (torch.float32, torch.float32), (torch.bfloat16, torch.float32),
    (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float16),
    (torch.float32, torch.float16)])
@pytest.mark.parametrize("group_size", [16, 32, 48])
def test_int8_with_zeros_matches_float64_reference(build, x_dtype, param_dtype, group_size):
    """int8 codes with a scale and a zero per group (GGUF's blocks with a min: q * scale +
    zero, codes 0..31 as Q5_1 / Q5_K hold them), through the layer and the kernel: the narrow
    tiles, the 8-row tiles and the GEMM path; K = 96 with groups of 48 (not a multiple of 16
    or 32: the int8 loops' tail of 8)."""
    gen = torch.Generator().manual_seed(7)
    q = torch.randint(0, 32, (24, 96), generator=gen, dtype=torch.int8)
    scale = (torch.rand(24, 96 // group_size, generator=gen) * 0.02 + 0.002).to(param_dtype)
    zero = (-torch.rand(24, 96 // group_size, generator=gen) * 0.3).to(param_dtype)
    scale[1, 0], zero[2, 0] = 2 ** -20, -(2 ** -22)  # float16 subnormals
    x = torch.randn(max(ROWS), 96, generator=gen).to(x_dtype)
    deq = (q.double().view(24, -1, group_size) * scale.double()[..., None]
           + zero.double()[..., None]).view(24, 96)
    layer = Int8Weight(q, scale, group_size, zero)
    assert layer.kernel.kind == "int8_zero" and layer.compiled
    assert torch.equal(layer.scale, scale) and torch.equal(layer.zero, zero)
    assert layer.nbytes == q.nbytes + scale.nbytes + zero.nbytes
    torch.testing.assert_close(layer.dequantized().double(), deq)
    for rows in ROWS:
        out = layer(x[:rows])
        assert out.dtype == x_dtype
        check_close(out, x[:rows].double() @ deq.T)


def test_int8_zeros_need_group_wise_scales_of_their_shape():
    q = torch.zeros(4, 32, dtype=torch.int8)
    with pytest.raises(ValueError, match=r"zeros go with group-wise scales"):
        Int8Weight(q, torch.ones(4), None, torch.zeros(4))
    with pytest.raises(ValueError, match=r"int8 zeros of shape \(4, 1\)"):
        Int8Weight(q, torch.ones(4, 2), 16, torch.zeros(4, 1))


def test_int8_with_zeros_without_the_compiled_kernels(monkeypatch):
    """Where the compiled kernels are not built, the layer multiplies its dequantized weight
    (torch has no kernel for group-wise int8)."""
    monkeypatch.setattr(quant_matmul, "available", lambda: False)
    monkeypatch.setattr(quant_matmul, "preferred", lambda: False)
    gen = torch.Generator().manual_seed(8)
    q = torch.randint(0, 16, (8, 64), generator=gen, dtype=torch.int8)
    scale, zero = torch.rand(8, 2, generator=gen), -torch.rand(8, 2, generator=gen)
    layer = Int8Weight(q, scale, 32, zero)
    assert not layer.compiled
    x = torch.randn(3, 64, generator=gen)
    check_close(layer(x), x.double() @ layer.dequantized().double().T)


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_bfloat16_weight_matmul_matches_float64_reference(build, x_dtype, bias):
    """A bfloat16 weight as it is (kind "bf16", what Linear runs where oneDNN has no bfloat16
    matmul), K = 72 (a tail of 8 after the pairs of 8), with and without a bias."""
    weight, x = inputs(24, 72, x_dtype, max(ROWS), seed=2)
    weight = weight.bfloat16()
    b = torch.randn(24, generator=torch.Generator().manual_seed(3)) if bias else None
    kernel = quant_matmul.QuantizedMatmul("bf16", weight, weight, 72, b)
    for rows in ROWS:
        expected = x[:rows].double() @ weight.double().T
        if bias:
            expected = expected + b.double()
            check_close(kernel(x[:rows], add_bias=False), expected - b.double())
        check_close(kernel(x[:rows]), expected)


def test_strided_and_batched_activations(build):
    """x as a view with a row stride and as [batch, tokens, K]: the rows as given."""
    weight, x = inputs(32, 64, torch.float32, 6)
    q, scale, zero = int4_quantize(weight, 32, torch.float32)
    params = torch.stack([scale, zero], -1).contiguous()
    kernel = quant_matmul.QuantizedMatmul("int4", quant_matmul.pack_int4(q), params, 32)
    deq = (q.double().view(32, -1, 32) - 8) * params.double()[..., :1] + params.double()[..., 1:]
    expected = x.double() @ deq.view(32, 64).T
    wide = torch.cat([x, torch.ones(6, 8)], 1)[:, :64]
    check_close(kernel(wide), expected)
    check_close(kernel(x.view(2, 3, 64)), expected.view(2, 3, 32))


def test_layers_on_torch_kernels_when_the_compiled_ones_are_off(monkeypatch):
    """No compiler (or an AVX-512 CPU, int4 and per-channel int8): torch's int4pack / int8pack kernels, group-wise int8 as a float32 matmul
    of the dequantized weight; torch's int4 packing needs out_features % 16 == 0."""
    monkeypatch.setattr(quant_matmul, "available", lambda: False)
    monkeypatch.setattr(quant_matmul, "preferred", lambda: False)
    weight, x = inputs(48, 128, torch.float32, 5)
    layer = Int4Weight.quantize(weight, 32)
    assert not layer.compiled and layer.codes().shape == (48, 128)
    check_close(layer(x), x.double() @ layer.dequantized().double().T)
    int8 = Int8Weight.quantize(weight)
    check_close(int8(x), x.double() @ int8.dequantized().double().T)
    grouped = Int8Weight(int8.q, int8.scale[:, None].repeat(1, 4).contiguous(), 32)
    check_close(grouped(x), x.double() @ grouped.dequantized().double().T)
    layer.int8_activations = True
    check_close(layer(x), quant_matmul.quantize_activations(x).double()
                @ layer.dequantized().double().T)
    with pytest.raises(ValueError, match="out_features=40 must be a multiple of 16"):
        Int4Weight.quantize(weight[:40], 32)


def test_int4_layer_with_int8_activations(build):
    """The layer's switch reaches its compiled kernel, and use_int8_activations sets it on
    every int4 layer of a model and on the int8 ones that take it (symmetric, whole blocks
    of 32), and on no other."""
    from torch import nn

    from pagellm.model.quantized_model import use_int8_activations

    weight, x = inputs(48, 128, torch.bfloat16, 3)
    layer = Int4Weight.quantize(weight, 32)
    int8 = Int8Weight.quantize(weight)  # per row, 128 columns: takes them
    grouped = Int8Weight(int8.q, int8.scale[:, None].repeat(1, 4).contiguous(), 32)
    narrow = Int8Weight.quantize(weight[:, :48])  # 48 columns: not whole blocks of 32
    zeros = Int8Weight(int8.q, int8.scale[:, None].repeat(1, 4).contiguous(), 32,
                       torch.zeros(48, 4))
    model = nn.Sequential(layer, int8, grouped, narrow, zeros)
    vnni = quant_matmul.has_vnni_loops()  # int8 layers take them by default only there
    assert not layer.int8_activations and use_int8_activations(model) == (3 if vnni else 1)
    assert layer.int8_activations
    assert int8.int8_activations == grouped.int8_activations == vnni
    assert not narrow.int8_activations and not zeros.int8_activations
    int8.int8_activations = grouped.int8_activations = True  # settable on every build
    rounded = quant_matmul.quantize_activations(x).double()
    for module in (layer, int8, grouped):
        check_close(module(x), rounded @ module.dequantized().double().T)
    with pytest.raises(ValueError, match="groups of 48 columns .*multiple of 32 only"):
        narrow.int8_activations = True


def test_int8_activations_take_the_compiled_kernel_where_torch_s_is_preferred(monkeypatch):
    """On CPUs whose int4 layers take torch's kernel (AVX-512), int8_activations moves the
    layer to the compiled kernels where they are built (torch's would take the rounded rows
    in float32, its slow path): the same codes and parameters, the same results as a layer
    built on the compiled kernels from the start, bit for bit."""
    if not quant_matmul.available():
        pytest.skip("the compiled kernels are off here")
    weight, x = inputs(48, 128, torch.bfloat16, 12)
    native_layer = Int4Weight.quantize(weight, 32)
    native_layer.int8_activations = True
    monkeypatch.setattr(quant_matmul, "preferred", lambda: False)
    layer = Int4Weight.quantize(weight, 32)
    assert not layer.compiled and hasattr(layer, "torch_scale_and_zero")
    codes, deq = layer.codes(), layer.dequantized()
    layer.int8_activations = True
    assert layer.compiled and layer.kernel.int8_activations
    assert not hasattr(layer, "torch_scale_and_zero")
    assert torch.equal(layer.codes(), codes) and torch.equal(layer.dequantized(), deq)
    for rows in (1, 5, 12):
        assert torch.equal(layer(x[:rows]), native_layer(x[:rows]))


def test_bad_int8_groups_name_the_limit():
    q = torch.zeros(4, 96, dtype=torch.int8)
    with pytest.raises(ValueError, match="group_size=12 must be a multiple of 8 dividing "
                                         "in_features=96"):
        Int8Weight(q, torch.ones(4, 8), 12)
    with pytest.raises(ValueError, match=r"shape \(4, 2\), expected \(4, 3\)"):
        Int8Weight(q, torch.ones(4, 2), 32)


def needs_dot_products():
    if not quant_matmul.has_dot_products():
        pytest.skip("the AVX512-BF16 products are built for CPUs with AVX512-BF16 only")


# rows: LOOP_DOT_ROWS (a block of 16 mostly zeros), one block of 16 and a tail, tiles of 3
# blocks and their tails (1, 2 blocks left)
DOT_ROWS = (10, 16, 17, 31, 47, 48, 49, 100, 161)
# and where the few-rows kernel takes the weight: its tiles of 4 rows and their tails (below
# 10 rows), and the blocks of 16 from 10 rows
FEW_ROWS = (1, 2, 3, 4, 5, 7, 8, 9, 15)


@pytest.mark.parametrize("kind, group_size, in_features", [
    ("int4", 32, 256), ("int4", 64, 320), ("int4", 128, 256), ("int4", 256, 512),
    ("int8", None, 96), ("int8", 8, 40), ("int8", 32, 352), ("int8_zero", 16, 96),
    ("int8_zero", 48, 96), ("int4", 32, 4096)])
@pytest.mark.parametrize("param_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_dot_products_match_float64_reference(kind, group_size, in_features, param_dtype,
                                              monkeypatch):
    """The AVX512-BF16 products (bfloat16 rows from LOOP_DOT_ROWS on): the float64 product of the
    rows with the dequantized weight, rounded once to bfloat16, for every code kind, with
    output columns not a multiple of the kernel's 8 (37), K with pairs not a multiple of 16
    (40, 96: the repacking's tail) and K = 4096 (the rows taken a few blocks at a time);
    with a bias; and the same bits as a prepared call in a workspace of its size."""
    needs_dot_products()
    gen = torch.Generator().manual_seed(11)
    n, k = 37, in_features
    x = torch.randn(max(DOT_ROWS), k, generator=gen).bfloat16()
    x[1, :k // 2] = 0
    x[2, 5] = 300.0
    bias = torch.randn(n, generator=gen)
    if kind == "int4":
        q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
        params = torch.stack([torch.rand(n, k // group_size, generator=gen) * 0.1 + 0.01,
                              torch.randn(n, k // group_size, generator=gen) * 0.1], -1)
        params = params.to(param_dtype).contiguous()
        p = params.double()
        deq = ((q.double().view(n, -1, group_size) - 8) * p[..., :1] + p[..., 1:]).view(n, k)
        codes = quant_matmul.pack_int4(q)
    elif kind == "int8":
        codes = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
        shape = (n,) if group_size is None else (n, k // group_size)
        params = (torch.rand(*shape, generator=gen) * 0.01 + 0.001).to(param_dtype)
        p = params.double().view(n, -1, 1)
        deq = (codes.double().view(n, p.shape[1], -1) * p).view(n, k)
    else:
        codes = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
        params = torch.stack([torch.rand(n, k // group_size, generator=gen) * 0.01 + 0.001,
                              -torch.rand(n, k // group_size, generator=gen) * 0.3], -1)
        params = params.to(param_dtype).contiguous()
        p = params.double()
        deq = (codes.double().view(n, -1, group_size) * p[..., :1] + p[..., 1:]).view(n, k)
    kernel = quant_matmul.QuantizedMatmul(kind, codes, params, group_size or k, bias)
    # the few-rows kernel: K % 32 == 0 and groups of 16, 32, a multiple of 64 or K
    few = k % 32 == 0 and ((group_size or k) in (16, 32, k) or (group_size or k) % 64 == 0)
    assert kernel.takes_few_rows() == few
    # every row count of the few-rows kernel (the compiled loops run 1-3 rows as shipped)
    monkeypatch.setattr(quant_matmul, "FEW_LOOP_DOT_ROWS", 1)
    for rows in sorted(set(DOT_ROWS + (FEW_ROWS if few else ()))):
        assert kernel.runs_dot(rows, torch.bfloat16)
        expected = x[:rows].double() @ deq.T
        out = kernel(x[:rows], add_bias=False)
        assert out.dtype == torch.bfloat16
        check_close(out, expected)
        check_close(kernel(x[:rows]), expected + bias.double())
        # the CPU decode plan's calls, at every row count, in the workspace given
        into = torch.empty(rows, n, dtype=torch.bfloat16)
        floats = kernel.dot_workspace_floats(rows)
        workspace = torch.empty(floats)  # held here: the call keeps only its pointer
        kernel.prepared(x[:rows], into, workspace)()
        assert torch.equal(into, out)
        with pytest.raises(ValueError, match=f"a workspace of {floats - 1} floats; the "
                                             f"product of {rows} rows needs {floats}"):
            kernel.prepared(x[:rows], into, torch.empty(floats - 1))
    # from LOOP_DOT_ROWS where the compiled loops run otherwise, DOT_ROWS instead of torch's
    # (FEW_LOOP_DOT_ROWS and FEW_DOT_ROWS where the few-rows kernel takes the weight)
    monkeypatch.undo()
    loops, torchs = ((quant_matmul.FEW_LOOP_DOT_ROWS, quant_matmul.FEW_DOT_ROWS) if few else
                     (quant_matmul.LOOP_DOT_ROWS, quant_matmul.DOT_ROWS))
    assert kernel.runs_dot(loops, torch.bfloat16)
    assert not kernel.runs_dot(loops - 1, torch.bfloat16)
    assert not kernel.runs_dot(torchs - 1, torch.bfloat16, instead_of_torch=True)
    assert kernel.runs_dot(torchs, torch.bfloat16, instead_of_torch=True)
    assert not kernel.runs_dot(max(DOT_ROWS), torch.float32)
    # the rows are repacked a bounded number at a time: a long prompt needs no more
    assert kernel.dot_workspace_floats(1 << 16) == kernel.dot_workspace_floats(1 << 20)


def test_dot_products_leave_odd_widths_and_int8_activations_to_the_other_paths():
    """Per-channel int8 of an odd K has no whole pairs to multiply: the float loops (or the
    dequantized GEMM) run it, to the same reference; with int8 activations the integer
    products run, at every row count."""
    weight, x = inputs(24, 45, torch.bfloat16, 32)
    q, scale = int8_quantize(weight, torch.bfloat16)
    kernel = quant_matmul.QuantizedMatmul("int8", q, scale, 45)
    assert not kernel.runs_dot(32, torch.bfloat16)
    check_close(kernel(x), x.double() @ (q.double() * scale.double()[:, None]).T)
    weight, x = inputs(24, 64, torch.bfloat16, 40)
    q, scale = int8_quantize(weight, torch.bfloat16)
    kernel = quant_matmul.QuantizedMatmul("int8", q, scale, 64)
    kernel.int8_activations = True
    assert kernel.integer() and not kernel.runs_dot(40, torch.bfloat16)
    check_close(kernel(x), quant_matmul.quantize_activations(x).double()
                @ (q.double() * scale.double()[:, None]).T)


def test_dot_products_take_strided_rows():
    """Rows with a row stride (a view of wider rows) and [batch, tokens, K]: as given."""
    needs_dot_products()
    weight, x = inputs(40, 64, torch.bfloat16, 48)
    q, scale, zero = int4_quantize(weight, 32, torch.bfloat16)
    params = torch.stack([scale, zero], -1).bfloat16().contiguous()
    kernel = quant_matmul.QuantizedMatmul("int4", quant_matmul.pack_int4(q), params, 32)
    p = params.double()
    deq = ((q.double().view(40, -1, 32) - 8) * p[..., :1] + p[..., 1:]).view(40, 64)
    expected = x.double() @ deq.T
    wide = torch.cat([x, torch.ones(48, 8, dtype=torch.bfloat16)], 1)[:, :64]
    check_close(kernel(wide), expected)
    check_close(kernel(x.view(2, 24, 64)), expected.view(2, 24, 40))


def test_layers_on_torch_kernels_take_the_dot_products_from_their_rows(monkeypatch):
    """Where torch's int4 / int8 kernels are preferred (CPUs with AVX-512), the layers run
    the AVX512-BF16 products from FEW_DOT_ROWS bfloat16 rows on (DOT_ROWS for weights the
    few-rows kernel does not take): the float64 reference of their
    dequantized weights, torch_product None there (the CPU decode plan then calls forward);
    below that, float32 rows and with int8 activations, what they ran before."""
    needs_dot_products()
    monkeypatch.setattr(quant_matmul, "preferred", lambda: False)
    weight, x = inputs(48, 128, torch.bfloat16, 40, seed=5)
    int4 = Int4Weight.quantize(weight, 32, torch.bfloat16)
    int8 = Int8Weight.quantize(weight, torch.bfloat16)
    assert not int4.compiled and not int8.compiled
    assert int4.nbytes == (int4.packed.nbytes + int4.row_codes.nbytes
                           + 2 * int4.scale_and_zero.nbytes)
    assert torch.equal(int4.codes(), int4_quantize(weight, 32, torch.bfloat16)[0])
    for layer in (int4, int8):
        deq = layer.dequantized().double()
        # the few-rows kernel takes these weights: from FEW_DOT_ROWS rows
        assert layer.kernel.takes_few_rows()
        for rows in (quant_matmul.FEW_DOT_ROWS, max(quant_matmul.FEW_DOT_ROWS,
                                                    quant_matmul.DOT_ROWS - 1),
                     quant_matmul.DOT_ROWS, 40):
            assert layer.torch_product(x[:rows]) is None
            out = layer(x[:rows])
            assert torch.equal(out, layer.kernel(x[:rows]))
            check_close(out, x[:rows].double() @ deq.T)
        few = x[:quant_matmul.FEW_DOT_ROWS - 1]
        assert torch.equal(layer(few), layer.torch_product(few)())
        assert not layer.kernel.runs_dot(40, torch.float32)
    int4.int8_activations = True  # the compiled integer products, as before
    assert int4.compiled and not hasattr(int4, "row_codes")
    check_close(int4(x), quant_matmul.quantize_activations(x).double()
                @ int4.dequantized().double().T)


@pytest.mark.parametrize("kind", ["int4", "int8", "int8_zero"])
def test_dot_products_keep_a_nan_row_to_itself(kind, monkeypatch):
    """A NaN in one row of x makes that row's outputs NaN (as the float64 product of the
    dequantized weight) and leaves the other rows of its block of 16 and tile exact."""
    needs_dot_products()
    weight, x = inputs(24, 64, torch.bfloat16, 40, seed=3)
    if kind == "int4":
        q, scale, zero = int4_quantize(weight, 32, torch.bfloat16)
        params = torch.stack([scale, zero], -1).bfloat16().contiguous()
        kernel = quant_matmul.QuantizedMatmul("int4", quant_matmul.pack_int4(q), params, 32)
        p = params.double()
        deq = ((q.double().view(24, -1, 32) - 8) * p[..., :1] + p[..., 1:]).view(24, 64)
    else:
        q, scale = int8_quantize(weight.reshape(-1, 32), torch.bfloat16)
        q, scale = q.view(24, 64), scale.view(24, 2)
        params = scale if kind == "int8" else torch.stack([scale, -3 * scale], -1).contiguous()
        kernel = quant_matmul.QuantizedMatmul(kind, q, params, 32)
        p = params.double().view(24, 2, -1)  # (scale) or (scale, zero) per group
        deq = q.double().view(24, 2, 32) * p[..., :1] + (p[..., 1:] if kind != "int8" else 0)
        deq = deq.view(24, 64)
    x[7, 20] = float("nan")
    assert kernel.runs_dot(40, torch.bfloat16)
    out = kernel(x)
    assert out[7].isnan().all()
    keep = torch.arange(40) != 7
    check_close(out[keep], x[keep].double() @ deq.T)
    # the few-rows kernel (on every CPU here): row 7 in the second tile of 4 rows
    monkeypatch.setattr(quant_matmul, "FEW_LOOP_DOT_ROWS", 1)
    assert kernel.takes_few_rows() and kernel.runs_dot(9, torch.bfloat16)
    out = kernel(x[:9])
    assert out[7].isnan().all()
    check_close(out[keep[:9]], x[:9][keep[:9]].double() @ deq.T)
