"""8-bit KV caches (attention/kv_quant.py): the quantizer, and every KV dtype through every
attention path (the chunked torch path, the compiled CPU decode kernel in each build)
against the float64 reference attention over the dequantized cache.

The Triton kernels' 8-bit paths are tested in test_triton_attention.py (they need
TRITON_INTERPRET=1 before import).
"""
from __future__ import annotations

import pytest
import torch
from attention_steps import MIXED_BATCH, make_step, store_rows
from kernel_builds import KERNEL_BUILDS, kernel_build

from pagellm import native
from pagellm.attention import cpu_kernel, kv_quant, quantized_backend
from pagellm.attention.kv_quant import FORMATS, QuantizedKVCache
from pagellm.attention.torch_backend import reference_paged_attention

FORMAT_NAMES = list(FORMATS)


def quantized_step(batch, block_size, dtype, fmt_name, **shape):
    """make_step's step with its random caches quantized into an 8-bit cache."""
    q, k, v, k_cache, v_cache, metadata, tables, seq_lens = make_step(
        batch, block_size, dtype, **shape)
    fmt = FORMATS[fmt_name]
    cache = QuantizedKVCache(kv_quant.quantize(k_cache, fmt), kv_quant.quantize(v_cache, fmt),
                             fmt)
    return q, k, v, cache, metadata, tables, seq_lens


def reference(q, cache, batch, seq_lens, tables, scale, window):
    k_ref, v_ref = kv_quant.dequantized_cache(cache)  # float64, after the step's store
    return reference_paged_attention(q.double(), k_ref, v_ref, [n for _, n in batch],
                                     seq_lens, tables, scale, window)


@pytest.mark.parametrize("fmt_name", FORMAT_NAMES)
def test_quantize_round_trip_bounds(fmt_name):
    """Each row's error is within half a step of its scale (int8) or the format's relative
    precision (fp8); all-zero rows stay zero; the scale is bfloat16 and q * scale is exact."""
    fmt = FORMATS[fmt_name]
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(64, 3, 32, generator=gen) * torch.logspace(-3, 3, 64)[:, None, None]
    x[5, 1] = 0.0
    raw = kv_quant.quantize(x, fmt)
    assert raw.shape == (64, 3, 34) and raw.dtype == torch.uint8
    back = kv_quant.dequantize(raw, fmt)
    scale = kv_quant.scales(raw).float()[..., None]
    assert torch.equal(back[5, 1], torch.zeros(32))
    amax = x.abs().amax(-1, keepdim=True)
    if fmt_name == "int8":
        assert ((back - x).abs() <= 0.5 * scale + 1e-6 * amax).all()
    else:
        mantissa_bits = {"fp8_e4m3": 3, "fp8_e5m2": 2}[fmt_name]
        # relative rounding error 2^-(m+1) of normal values; subnormals: half a step
        step = 2.0 ** -(mantissa_bits + 1)
        bound = torch.maximum(x.abs() * step, scale * 2.0 ** -9)
        assert ((back - x).abs() <= bound * 1.001 + 1e-6 * amax).all()
    assert (back.abs().amax(-1, keepdim=True) <= amax * 1.01 + 1e-30).all()


@pytest.mark.parametrize("fmt_name", FORMAT_NAMES)
def test_non_finite_rows_quantize_to_nan_rows(fmt_name):
    """A row with a NaN, an infinity or a -infinity is stored with scale NaN and codes 0 and
    reads back all NaN (with scale 1, as amax's NaN gave before, its other values came back
    as codes of the wrong scale); the other rows are untouched by it."""
    fmt = FORMATS[fmt_name]
    x = torch.randn(4, 2, 32, generator=torch.Generator().manual_seed(2))
    x[0, 0, 3], x[1, 1, 0], x[2, 0, 31] = float("nan"), float("inf"), float("-inf")
    raw = kv_quant.quantize(x, fmt)
    bad = torch.zeros(4, 2, dtype=torch.bool)
    bad[0, 0] = bad[1, 1] = bad[2, 0] = True
    assert (raw[bad][:, :32] == 0).all()
    assert kv_quant.scales(raw)[bad].isnan().all()
    back = kv_quant.dequantize(raw, fmt)
    assert back[bad].isnan().all()
    assert torch.equal(raw[~bad], kv_quant.quantize(x[~bad], fmt))
    assert back[~bad].isfinite().all()


def test_fake_quantize_is_idempotent_on_values():
    fmt = FORMATS["int8"]
    x = torch.randn(10, 2, 16, generator=torch.Generator().manual_seed(2))
    once = kv_quant.fake_quantize(x, fmt)
    assert torch.allclose(kv_quant.fake_quantize(once, fmt), once, rtol=0, atol=1e-6)


@pytest.mark.parametrize("fmt_name", FORMAT_NAMES)
def test_decode_values_is_torch_s_conversion_for_every_code(fmt_name):
    """decode_values (float16 bit moves for fp8) gives torch's own value of each of the 256
    codes, bit for bit: NaN codes NaN, -0 as -0; in a strided view of rows as the caches
    hold them."""
    fmt = FORMATS[fmt_name]
    codes = torch.arange(256, dtype=torch.uint8).view(4, 64)
    raw = torch.cat([codes, torch.zeros(4, kv_quant.SCALE_BYTES, dtype=torch.uint8)], 1)
    got = kv_quant.decode_values(raw, fmt)
    want = codes.view(fmt.storage).float()
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got[~got.isnan()].view(torch.int32), want[~want.isnan()].view(torch.int32))
    assert torch.equal(got.signbit(), want.signbit())


def test_unknown_kv_cache_dtype_names_the_supported():
    with pytest.raises(ValueError, match="int8.*fp8_e5m2"):
        kv_quant.kv_format("int4")
    assert kv_quant.kv_format("auto") is None
    assert kv_quant.kv_format("fp8") is FORMATS["fp8_e4m3"]


@pytest.fixture(params=[*KERNEL_BUILDS, "torch"])
def decode_path(request, monkeypatch):
    """Decodes through a build of the compiled CPU kernel, or the chunked torch path (which
    then takes the prefills too, in place of the flash-attention calls)."""
    if request.param == "torch":
        monkeypatch.setattr(cpu_kernel, "supports", lambda query: False)
        monkeypatch.setattr(quantized_backend, "_flash_prefill", lambda query: False)
    else:
        monkeypatch.setattr(cpu_kernel, "_KERNEL", kernel_build(request.param))
    return request.param


@pytest.mark.parametrize("fmt_name", FORMAT_NAMES)
@pytest.mark.parametrize("block_size, sliding_window, head_dim",
                         [(4, None, 16), (16, 10, 32), (1, None, 16), (16, None, 64),
                          (40, 10, 64), (32, 20, 32)])  # 40, 32: blocks worked in slices
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_step_matches_dequantized_reference(fmt_name, block_size, sliding_window,
                                                  head_dim, dtype, decode_path, monkeypatch):
    """A step mixing prompts, chunks, prefix hits and decodes; small chunks so that contexts
    span several of them (the online softmax merges). head_dim 32 and 64: the kernel's
    AVX-512 or AVX2 loops where the build has them; 16: its portable loops."""
    monkeypatch.setattr(quantized_backend, "CHUNK_BLOCKS", 2)
    monkeypatch.setattr(quantized_backend.chunked_attention, "__defaults__",
                        (None, 2, False))
    q, k, v, cache, metadata, tables, seq_lens = quantized_step(MIXED_BATCH, block_size, dtype,
                                                                fmt_name, head_dim=head_dim)
    scale = q.shape[-1] ** -0.5
    out = quantized_backend.paged_attention(q, k, v, cache, metadata, scale, sliding_window)
    expected = reference(q, cache, MIXED_BATCH, seq_lens, tables, scale, sliding_window)
    assert out.dtype == dtype and out.shape == q.shape
    tol = dict(atol=1e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(out.double(), expected.double(), **tol)


@pytest.mark.parametrize("fmt_name", FORMAT_NAMES)
@pytest.mark.parametrize("sliding_window", [None, 10, 3])
def test_prefill_over_context_chunks(fmt_name, sliding_window, decode_path, monkeypatch):
    """A 30-token chunk after 40 cached tokens, context chunks of 8 keys: under a window,
    chunks no query sees are skipped, and the late queries see nothing of a chunk the early
    ones still see (their part must weigh nothing in the merge). The query is a view whose
    tokens are its innermost dimension, as a product's output can be."""
    monkeypatch.setattr(quantized_backend, "CHUNK_BLOCKS", 2)
    batch = [(40, 30), (5, 12)]
    q, k, v, cache, metadata, tables, seq_lens = quantized_step(batch, 4, torch.float32,
                                                                fmt_name, seed=7)
    q = q.permute(1, 2, 0).contiguous().permute(2, 0, 1)  # [T, H, D], strides (1, D*T, T)
    scale = q.shape[-1] ** -0.5
    out = quantized_backend.paged_attention(q, k, v, cache, metadata, scale, sliding_window)
    expected = reference(q, cache, batch, seq_lens, tables, scale, sliding_window)
    torch.testing.assert_close(out.double(), expected.double(), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("fmt_name", FORMAT_NAMES)
@pytest.mark.parametrize("head_dim, num_heads, num_kv_heads",
                         [(64, 12, 4), (128, 8, 8), (40, 16, 1), (64, 9, 3), (256, 8, 2),
                          (64, 16, 2)])
@pytest.mark.parametrize("batch", [
    [(0, 1), (4, 1), (15, 1), (16, 1), (40, 1), (99, 1)],  # decodes only
    [(0, 37), (21, 7), (40, 20), (9, 1)]], ids=["decodes", "prefills"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_head_shapes(fmt_name, head_dim, num_heads, num_kv_heads, batch, dtype, decode_path):
    """Specialised and generic head_dim / group sizes: decode-only steps (the kernel's
    loops: with bfloat16 queries its bfloat16 dot products, or table lookups where the CPU
    has AVX512-VBMI, from 1 to 8 query heads per KV head), and prompts, a chunk and a
    prompt after a prefix hit (the flash-attention prefill, or chunked_attention)."""
    q, k, v, cache, metadata, tables, seq_lens = quantized_step(
        batch, 8, dtype, fmt_name, num_heads=num_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim, seed=head_dim)
    scale = head_dim ** -0.5
    out = quantized_backend.paged_attention(q, k, v, cache, metadata, scale, None)
    expected = reference(q, cache, batch, seq_lens, tables, scale, None)
    tol = dict(atol=1e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(out.double(), expected.double(), **tol)


def test_step_store_writes_quantized_rows():
    """The store quantizes exactly the step's rows into their slots, nothing else."""
    batch = [(3, 5), (0, 1)]
    q, k, v, cache, metadata, tables, seq_lens = quantized_step(batch, 4, torch.float32, "int8")
    before = cache.key.clone()
    quantized_backend.paged_attention(q, k, v, cache, metadata, 0.25)
    slots = metadata.slot_mapping
    flat = cache.key.flatten(0, 1)
    assert torch.equal(flat[slots], kv_quant.quantize(k, cache.format))
    untouched = torch.ones(flat.shape[0], dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(flat[untouched], before.flatten(0, 1)[untouched])


def test_cache_engine_moves_scales_with_their_blocks():
    """copy_blocks (copy-on-write) and swap out / in move whole rows: values and scales."""
    from types import SimpleNamespace

    from pagellm.worker.cache_engine import CacheEngine

    config = SimpleNamespace(num_hidden_layers=2, num_key_value_heads=2, num_attention_heads=4,
                             hidden_size=64, head_dim=16, model_type="llama")
    fmt = FORMATS["int8"]
    engine = CacheEngine(config, 6, 4, 4, torch.float32, "cpu", fmt)
    assert engine.device_cache.dtype == torch.uint8 and engine.device_cache.shape[-1] == 18
    assert engine.block_bytes == 4 * 2 * 2 * 2 * 18
    rows = torch.randn(2, 2, 4, 2, 16, generator=torch.Generator().manual_seed(4))
    for layer, cache in enumerate(engine.kv_caches):
        assert isinstance(cache, QuantizedKVCache) and cache.format is fmt
        cache.key[1] = kv_quant.quantize(rows[layer, 0], fmt)
        cache.value[1] = kv_quant.quantize(rows[layer, 1], fmt)
    block = engine.device_cache[:, :, 1].clone()
    engine.copy_blocks([(1, 4)])
    engine.swap_out([(1, 3)])
    engine.device_cache[:, :, 1] = 0
    engine.swap_in([(3, 5)])
    for target in (4, 5):
        assert torch.equal(engine.device_cache[:, :, target], block)
    k_ref, _ = kv_quant.dequantized_cache(engine.kv_caches[0])
    torch.testing.assert_close(k_ref[5].float(), rows[0, 0], atol=0.05, rtol=0.02)


@pytest.mark.parametrize("build", KERNEL_BUILDS)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("head_dim", [64, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt_name", FORMAT_NAMES)
def test_compiled_store_writes_the_quantizer_s_bytes(fmt_name, dtype, head_dim, threads, build,
                                                     monkeypatch):
    """cpu_kernel.store_quantized (the CPU paths' store) writes exactly kv_quant.quantize's
    bytes at the slots, skipping padding (-1), on store_rows' rows (ten decades, zeros, -0.0,
    NaN and infinite entries, every tie between neighbouring codes, clamped rows), in every
    build (AVX-512 ones quantize 16 values at a time where head_dim allows: 64, not 40),
    with its tokens on one thread or two."""
    monkeypatch.setattr(cpu_kernel, "_KERNEL", kernel_build(build))
    fmt = FORMATS[fmt_name]
    key, value, slots = store_rows(fmt, dtype)
    key, value = key[..., :head_dim], value[..., :head_dim]
    heads = key.shape[1]
    caches = [QuantizedKVCache(torch.zeros(10, 4, heads, head_dim + 2, dtype=torch.uint8),
                               torch.zeros(10, 4, heads, head_dim + 2, dtype=torch.uint8), fmt)
              for _ in range(2)]
    kv_quant.write_to_kv_cache(key, value, caches[0], slots, torch.nonzero(slots >= 0)[:, 0])
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        cpu_kernel.store_quantized(key, value, caches[1], slots)
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(caches[0].key, caches[1].key)
    assert torch.equal(caches[0].value, caches[1].value)
    assert caches[1].key.flatten(0, 1)[slots[slots >= 0]].any()


def int8_step_both_ways(switch, path, after, head_dim, num_heads, num_kv_heads, block_size,
                        window=None):
    """A bfloat16 decode step over an int8 cache with a kernel switch on, then off (the
    first call stores the step's rows, the second again), vector_paths naming ``path`` only
    while on; the switch is left at ``after``. Returns the query, the cache, the two outputs
    and the float64 reference."""
    batch = [(0, 1), (4, 1), (15, 1), (16, 1), (40, 1), (99, 1), (33, 1)]
    q, k, v, cache, metadata, tables, seq_lens = quantized_step(
        batch, block_size, torch.bfloat16, "int8", num_heads=num_heads,
        num_kv_heads=num_kv_heads, head_dim=head_dim, seed=block_size)
    scale = head_dim ** -0.5
    outs = []
    try:
        for on in (True, False):
            switch(on)
            assert (path in cpu_kernel.vector_paths()["8-bit"]) == on
            outs.append(quantized_backend.paged_attention(q, k, v, cache, metadata, scale,
                                                          window))
    finally:
        switch(after)
    return q, cache, outs, reference(q, cache, batch, seq_lens, tables, scale, window)


@pytest.fixture
def amx():
    """The 8-bit kernels' AMX products on (skipped where the build or the OS has none), and
    on again after the test whatever it turned off."""
    if not cpu_kernel.available() or not cpu_kernel.use_amx(True):
        pytest.skip("no AMX products here: the build has none (no AMX-BF16 on this CPU) or "
                    "Linux did not grant the tile registers")
    yield
    cpu_kernel.use_amx(True)


@pytest.mark.parametrize("fmt_name", FORMAT_NAMES)
@pytest.mark.parametrize("head_dim, num_heads, num_kv_heads, block_size",
                         [(64, 12, 4, 16), (128, 8, 8, 1), (256, 8, 2, 32), (64, 16, 1, 40),
                          (128, 32, 2, 16), (64, 17, 1, 16)])  # 17 per KV head: no AMX
def test_amx_products_match_the_table_kernels(fmt_name, head_dim, num_heads, num_kv_heads,
                                              block_size, amx):
    """Where the CPU has AMX, bfloat16 decodes over 8-bit caches (head_dim a multiple of
    64, up to 16 query heads per KV head) take their dot products on the tile registers:
    the float64 reference's results, and the vector table kernels' up to the order of the
    float32 sums (one bfloat16 rounding step). Blocks of 1, 16, 32 and 40 keys (worked in
    slices), partial blocks, 1 to 16 query heads per KV head."""
    batch = [(0, 1), (4, 1), (15, 1), (16, 1), (40, 1), (99, 1), (33, 1)]
    q, k, v, cache, metadata, tables, seq_lens = quantized_step(
        batch, block_size, torch.bfloat16, fmt_name, num_heads=num_heads,
        num_kv_heads=num_kv_heads, head_dim=head_dim, seed=block_size)
    scale = head_dim ** -0.5
    outs = {}
    vnni = cpu_kernel.use_vnni_int8()
    cpu_kernel.use_vnni_int8(False)  # the table kernels, not int8's VNNI one
    try:
        for on in (True, False):  # the first call stores the step's rows, the second again
            cpu_kernel.use_amx(on)
            assert (cpu_kernel.vector_paths()["8-bit"] == "AMX") == on
            outs[on] = quantized_backend.paged_attention(q, k, v, cache, metadata, scale, None)
    finally:
        cpu_kernel.use_vnni_int8(vnni)
    expected = reference(q, cache, batch, seq_lens, tables, scale, None)
    for out in outs.values():
        torch.testing.assert_close(out.double(), expected, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(outs[True].float(), outs[False].float(), atol=1e-3, rtol=2 ** -7)


@pytest.mark.parametrize("fmt_name", ["int8", "fp8_e4m3"])
def test_amx_kernels_keep_within_their_workspace(fmt_name, amx, monkeypatch):
    """The AMX kernels keep each thread's decoded tiles in the workspace, its last part
    (nothing allocated per thread): with a workspace of exactly decode_workspace's size and a
    guard after it, the guard is untouched and the output is the one of the shared
    workspace."""
    batch = [(0, 1), (40, 1), (99, 1)]
    q, k, v, cache, metadata, tables, seq_lens = quantized_step(
        batch, 16, torch.bfloat16, fmt_name, num_heads=12, num_kv_heads=4, head_dim=64, seed=3)
    vnni = cpu_kernel.use_vnni_int8()
    cpu_kernel.use_vnni_int8(False)  # int8 too on the AMX kernel
    try:
        shared = quantized_backend.paged_attention(q, k, v, cache, metadata, 0.125, None)
        buffers = []

        def exact(numel):
            buffers.append((numel, torch.full((numel + 4096,), 7.0)))
            return buffers[-1][1]
        monkeypatch.setattr(cpu_kernel._KERNEL, "scratch", exact)
        guarded = quantized_backend.paged_attention(q, k, v, cache, metadata, 0.125, None)
        path = cpu_kernel.vector_paths()["8-bit"]
    finally:
        cpu_kernel.use_vnni_int8(vnni)
    assert buffers and path == "AMX"
    for numel, buffer in buffers:
        assert (buffer[numel:] == 7.0).all()
    assert torch.equal(guarded, shared)


@pytest.mark.parametrize("head_dim, num_heads, num_kv_heads, block_size, window",
                         [(64, 12, 4, 16, None), (128, 8, 8, 1, None), (256, 8, 2, 32, 20),
                          (64, 8, 1, 40, None), (128, 16, 2, 16, 7), (64, 17, 1, 16, None)])
def test_vnni_int8_matches_the_reference(head_dim, num_heads, num_kv_heads, block_size,
                                         window):
    """Where the build has AVX512-VNNI (on AMX CPUs too), bfloat16 decodes over
    an int8 cache multiply the codes as integers (use_vnni_int8): the queries in 16-bit fixed
    point of their largest element (each off by at most max|q| / 65278, so each score by at
    most head_dim x max|k| x max|q| x scale / 65278 and each output by about twice that
    times max|v|), the weights times the rows' scales in 15-bit fixed point of their (block,
    head)'s largest (the outputs off by at most 32 keys x 127 x the largest row scale /
    65534). Within those bounds of the float64 reference rounded to bfloat16, no further
    from it on average than the table or AMX kernels (bfloat16 weights, exact bfloat16
    queries), whose results the switch brings back. 1 to 17 query heads per KV head (in fours),
    blocks of 1 to 40 keys, partial blocks, sliding windows."""
    if not cpu_kernel.available() or not cpu_kernel.use_vnni_int8():
        pytest.skip("no AVX512-VNNI int8 kernel in this build")
    q, cache, outs, expected = int8_step_both_ways(
        cpu_kernel.use_vnni_int8, "AVX512-VNNI", True, head_dim, num_heads, num_kv_heads,
        block_size, window)
    errors = [(out.double() - expected).abs() for out in outs]
    assert (errors[0] <= vnni_int8_bound(q, cache, head_dim, expected)).all()
    assert errors[0].mean() <= errors[1].mean()


def vnni_int8_bound(q, cache, head_dim, expected):
    """How far the AVX512-VNNI int8 kernel's bfloat16 outputs may be from the float64
    reference ``expected`` (test_vnni_int8_matches_the_reference says why), per element."""
    keys, values = kv_quant.dequantized_cache(cache)
    largest_key, largest_value = keys.abs().max().item(), values.abs().max().item()
    score_error = head_dim * largest_key * q.abs().max().item() * head_dim ** -0.5 / 65278
    row_scales = cache.value[..., head_dim:].contiguous().view(torch.bfloat16).double()
    bound = (2.1 * score_error * largest_value + 32 * 127 * row_scales.max().item() / 65534
             + 2 ** -16 * largest_value)  # the last: the float32 scores and exp
    return 2.0 ** (torch.floor(torch.log2(expected.abs() + bound)) - 8) + bound


@pytest.mark.parametrize("threads", [1, 3, 20])
@pytest.mark.parametrize("batch", [[(0, 1), (1, 1), (2, 1)],
                                   [(0, 1), (40, 1), (99, 1), (300, 1), (511, 1)]])
def test_vnni_int8_single_pass_merges_its_threads(threads, batch, monkeypatch):
    """The AVX512-VNNI int8 kernel runs in one pass: each thread keeps a running maximum,
    sum and partial sum per row (the maximum and sum in a line per thread and row, in the
    rows' place in the workspace, which has room for them even where the contexts are
    shorter), merged after. With 1, 3 and 20 threads (a sequence's blocks on several of them), short
    contexts and long ones, and a workspace of exactly decode_workspace's size with a guard
    after it: the guard is untouched, and the outputs are within the kernel's bound of the
    float64 reference and as the one-thread outputs up to the merge's float rounding."""
    if not cpu_kernel.available() or not cpu_kernel.use_vnni_int8():
        pytest.skip("no AVX512-VNNI int8 kernel in this build")
    q, k, v, cache, metadata, tables, seq_lens = quantized_step(
        batch, 16, torch.bfloat16, "int8", num_heads=12, num_kv_heads=4, head_dim=64, seed=5)
    scale = 64 ** -0.5
    one = quantized_backend.paged_attention(q, k, v, cache, metadata, scale, None)
    buffers = []

    def exact(numel):
        buffers.append((numel, torch.full((numel + 4096,), 7.0)))
        return buffers[-1][1]
    monkeypatch.setattr(cpu_kernel._KERNEL, "scratch", exact)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = quantized_backend.paged_attention(q, k, v, cache, metadata, scale, None)
        path = cpu_kernel.vector_paths()["8-bit"]
    finally:
        torch.set_num_threads(previous)
    assert "VNNI" in path and buffers
    for numel, buffer in buffers:
        assert (buffer[numel:] == 7.0).all()
    expected = reference(q, cache, batch, seq_lens, tables, scale, None)
    assert ((out.double() - expected).abs() <= vnni_int8_bound(q, cache, 64, expected)).all()
    torch.testing.assert_close(out.float(), one.float(), atol=1e-3, rtol=2 ** -7)


@pytest.fixture(scope="module")
def tile_kernels_build():
    """The native build without AVX512-VBMI: its 8-bit kernels decode fp8 through float16
    (the tile kernels), not by the tables or bit moves; skipped where the native build has no
    table kernels to compare with."""
    flags = native.cpu_flags()
    if not cpu_kernel.available() or native.isa_level() != "native":
        pytest.skip("the native CPU decode kernel is not built here")
    if not {"avx512f", "avx512_bf16", "avx512vbmi"} <= flags:
        pytest.skip("no table kernels here (AVX512-BF16 and VBMI)")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cpu_kernel, "_FLAGS", [*cpu_kernel._FLAGS, "-mno-avx512vbmi"])
        kernel = cpu_kernel._Kernel()
        assert kernel.load() is not None, native.status()
    return kernel


@pytest.mark.parametrize("fmt_name", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_rows_by_bit_moves_are_the_tables_values(fmt_name, tile_kernels_build, monkeypatch):
    """The table kernels decode fp8 codes by bit moves where none has a zero exponent field
    (64 key codes at a time; a value row pair's 2 x 64), else by the tables. Over every finite
    code, in key and value rows that take the bit moves and rows that do not (zeros and
    subnormals among their codes), the output is the tile kernels' (a build without
    AVX512-VBMI) bit for bit."""
    fmt = FORMATS[fmt_name]
    batch = [(40, 1), (77, 1), (15, 1)]
    q, k, v, cache, metadata, tables, seq_lens = quantized_step(
        batch, 16, torch.bfloat16, fmt_name, num_heads=8, num_kv_heads=2, head_dim=64, seed=7)
    codes = torch.arange(256, dtype=torch.int32)
    values = kv_quant.decode_values(
        torch.cat([codes, torch.zeros(kv_quant.SCALE_BYTES, dtype=torch.int32)]).to(torch.uint8),
        fmt).double()
    exponent = (codes >> (3 if fmt_name == "fp8_e4m3" else 2)) & (15 if fmt_name == "fp8_e4m3"
                                                                   else 31)
    normal = codes[values.isfinite() & (exponent > 0)]
    subnormal = codes[(exponent == 0) & (values != 0)]
    gen = torch.Generator().manual_seed(0)
    for rows in (cache.key.flatten(0, 2), cache.value.flatten(0, 2)):
        # [rows, 64 codes + the scale's 2 bytes], (block, key, KV head) order; per two keys of
        # a head: all normal (bit moves); all subnormal; normal but for one zero; half and half
        kind = torch.arange(len(rows)) // 4 % 4
        pick = [pool[torch.randint(len(pool), (len(rows), 64), generator=gen)]
                for pool in (normal, subnormal)]
        chosen = torch.where((kind == 1)[:, None], pick[1], pick[0])
        zeros = int((kind == 2).sum())
        chosen[kind == 2, torch.randint(64, (zeros,), generator=gen)] = torch.tensor(
            [0x00, 0x80], dtype=torch.int32).repeat(zeros)[:zeros]  # +0 and -0
        chosen[kind == 3, 32:] = pick[1][kind == 3, 32:]
        rows[:, :64] = chosen.to(torch.uint8)
        # scales that bring each row's largest value to about 1, so that the small codes weigh
        largest = values[chosen.long()].abs().amax(dim=1)
        rows[:, 64:] = (1.0 / largest).to(torch.bfloat16).view(torch.int16)[:, None].view(
            torch.uint8).view(len(rows), 2)
    assert len(rows) > 100
    outs = []
    for kernel in (cpu_kernel._KERNEL, tile_kernels_build):
        monkeypatch.setattr(cpu_kernel, "_KERNEL", kernel)
        amx = cpu_kernel.use_amx()
        cpu_kernel.use_amx(False)
        try:
            outs.append(quantized_backend.paged_attention(q, k, v, cache, metadata, 0.125, None))
            paths = cpu_kernel.vector_paths()["8-bit"]
        finally:
            cpu_kernel.use_amx(amx)
        outs.append(paths)
    assert outs[1] != outs[3]  # the two kernels ran
    assert torch.isfinite(outs[0]).all()
    assert torch.equal(outs[0], outs[2])


def test_near_prefetch_is_on_by_default_on_intel_cpus_only():
    """cpu_kernel.use_near_prefetch: on where /proc/cpuinfo names an Intel CPU (where it was
    measured to pay), off elsewhere, in every build that has the switch."""
    if not cpu_kernel.available():
        pytest.skip("no compiled CPU kernel")
    assert cpu_kernel.use_near_prefetch() == (native.cpu_vendor() == "GenuineIntel")


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("fmt_name", FORMAT_NAMES)
@pytest.mark.parametrize("path", ["tables", "vnni", "amx"])
@pytest.mark.parametrize("head_dim, num_heads, num_kv_heads, block_size",
                         [(64, 12, 4, 16), (128, 8, 2, 1), (64, 8, 1, 40)])
def test_near_prefetch_changes_no_result(path, fmt_name, threads, head_dim, num_heads,
                                         num_kv_heads, block_size):
    """The near prefetch (the next pair's block into L1, use_near_prefetch) moves no bit of
    any 8-bit kernel's output: on and off give the same bytes, with one thread and two
    (each thread's last pair has no next one), blocks of 1, 16 and 40 keys (worked in
    slices), on the table, AVX512-VNNI and AMX kernels where they run."""
    if not cpu_kernel.available():
        pytest.skip("no compiled CPU kernel")
    if path == "amx" and not cpu_kernel.use_amx(True):
        pytest.skip("no AMX products here")
    if path == "vnni" and (fmt_name != "int8" or not cpu_kernel.use_vnni_int8(True)):
        pytest.skip("the AVX512-VNNI kernel: int8 caches, where the build has it")
    batch = [(0, 1), (4, 1), (15, 1), (16, 1), (40, 1), (99, 1), (33, 1)]
    q, k, v, cache, metadata, tables, seq_lens = quantized_step(
        batch, block_size, torch.bfloat16, fmt_name, num_heads=num_heads,
        num_kv_heads=num_kv_heads, head_dim=head_dim, seed=block_size)
    near, amx, vnni = (cpu_kernel.use_near_prefetch(), cpu_kernel.use_amx(),
                       cpu_kernel.use_vnni_int8())
    outs, previous = [], torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        cpu_kernel.use_amx(path == "amx")
        cpu_kernel.use_vnni_int8(path == "vnni")
        for on in (True, False, True):  # the first call stores the step's rows, later ones again
            cpu_kernel.use_near_prefetch(on)
            outs.append(quantized_backend.paged_attention(q, k, v, cache, metadata,
                                                          head_dim ** -0.5, None))
    finally:
        torch.set_num_threads(previous)
        cpu_kernel.use_near_prefetch(near)
        cpu_kernel.use_amx(amx)
        cpu_kernel.use_vnni_int8(vnni)
    assert torch.isfinite(outs[0]).all()
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[1], outs[2])
    expected = reference(q, cache, batch, seq_lens, tables, head_dim ** -0.5, None)
    torch.testing.assert_close(outs[0].double(), expected, atol=2e-2, rtol=2e-2)


KERNEL_PATHS = {  # vector_paths()["8-bit"] under each: (AMX, VNNI int8)
    "tables": (False, False), "vnni": (False, True), "amx": (True, False),
    "amx_vnni": (True, True), "torch": (False, False)}  # torch: chunked_attention


@pytest.mark.parametrize("fmt_name", FORMAT_NAMES)
@pytest.mark.parametrize("path", list(KERNEL_PATHS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_non_finite_queries_and_rows_reach_only_their_heads(dtype, path, fmt_name,
                                                            monkeypatch):
    """A NaN or infinite query element makes that head's output NaN, as in the reference,
    on every 8-bit kernel path (the fixed-point ones too, whose integer codes would round it
    to some finite value), and so does a NaN key or value row scale for the query heads over
    that KV head; every other head's output stays as it was bit for bit, also with NaN rows
    in block 0 (which the table padding names) and in a slot past a sequence's end."""
    amx, vnni = KERNEL_PATHS[path]
    if path == "torch":
        monkeypatch.setattr(cpu_kernel, "supports_quantized", lambda query, cache: False)
    elif not cpu_kernel.available():
        pytest.skip("no compiled CPU kernel")
    if amx and not cpu_kernel.use_amx(True):
        pytest.skip("no AMX products here")
    if vnni and not cpu_kernel.use_vnni_int8(True):
        pytest.skip("no AVX512-VNNI int8 kernel in this build")
    batch = [(0, 1), (4, 1), (15, 1), (16, 1), (40, 1)]
    q, k, v, cache, metadata, tables, seq_lens = quantized_step(
        batch, 16, dtype, fmt_name, num_heads=12, num_kv_heads=4, head_dim=64, seed=3)
    bad = q.clone()
    bad[1, 0, 3] = float("nan")  # sequence 1's head 0, a KV head shared with heads 1 and 2
    bad[2, 5, 0] = float("inf")
    bad[4, 11, 63] = float("-inf")
    corrupt = QuantizedKVCache(cache.key.clone(), cache.value.clone(), cache.format)
    nan = torch.tensor([0x7FC0], dtype=torch.int16).view(torch.uint8)  # a bfloat16 NaN
    corrupt.value[tables[4][0], 2, 1, 64:] = nan  # sequence 4's token 2, KV head 1
    corrupt.key[tables[3][0], 0, 0, 64:] = nan  # sequence 3's token 0, KV head 0
    assert all(0 not in table for table in tables)  # block 0: only the padding entries'
    corrupt.key[0, ..., 64:] = corrupt.value[0, ..., 64:] = nan
    corrupt.value[tables[3][1], 3, 2, 64:] = nan  # past sequence 3's 17 tokens: unread
    try:
        cpu_kernel.use_amx(amx)
        cpu_kernel.use_vnni_int8(vnni)
        clean = quantized_backend.paged_attention(q, k, v, cache, metadata, 64 ** -0.5, None)
        out = quantized_backend.paged_attention(bad, k, v, cache, metadata, 64 ** -0.5, None)
        rows = quantized_backend.paged_attention(q, k, v, corrupt, metadata, 64 ** -0.5, None)
    finally:
        cpu_kernel.use_amx(True)
        cpu_kernel.use_vnni_int8(True)
    assert torch.isfinite(clean).all()
    hit = ~torch.isfinite(bad).all(dim=-1)
    assert out[hit].isnan().all()
    assert torch.equal(out[~hit], clean[~hit])
    hit = torch.zeros_like(hit)
    hit[4, 3:6] = hit[3, 0:3] = True  # the query heads over those KV heads
    assert rows[hit].isnan().all(), rows[hit].isnan().all(dim=-1)
    assert torch.equal(rows[~hit], clean[~hit])
