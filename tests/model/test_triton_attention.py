"""Triton paged attention (attention/triton_backend.py) against the plain float64 reference.

The kernels run on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1 must be set
before the kernels are defined, hence at the top of this module), which executes each program
with numpy: the same indexing, masks and online softmax as on a GPU, at a few milliseconds a
program, so the shapes stay small. What the interpreter does not check (types the GPU compiler
rejects, register pressure) is covered by compiling the kernels for sm_90 in a subprocess.

Batches mix every kind of sequence a step can hold: whole prompts, chunks continuing earlier
chunks, prompts after a prefix-cache hit, and single-token decodes, over shuffled physical blocks.
"""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton_backend defines its kernels

import pytest  # noqa: E402
import torch  # noqa: E402
from helpers import assert_compiles  # noqa: E402
from attention_steps import MIXED_BATCH, make_step, store_rows  # noqa: E402

pytest.importorskip("triton")

from pagellm import LLM, SamplingParams  # noqa: E402
from pagellm.attention import AttentionMetadata  # noqa: E402
from pagellm.attention import layer as attention_layer  # noqa: E402
from pagellm.attention import torch_backend  # noqa: E402
from pagellm.attention import triton_backend  # noqa: E402
from pagellm.attention.torch_backend import reference_paged_attention  # noqa: E402
from pagellm.bench.random_model import build_random_model  # noqa: E402

if not triton_backend.INTERPRETED:
    pytest.skip("triton_backend was imported before TRITON_INTERPRET=1 was set",
                allow_module_level=True)

# The smallest tiles tl.dot allows: short test sequences still span several query blocks and
# key tiles, and the sliding window skips whole tiles.
SMALL_TILES = triton_backend.LaunchConfig(16, 16, 4, 16, 4)


def run_and_reference(batch, block_size, dtype, sliding_window=None, **shape):
    q, k, v, k_cache, v_cache, metadata, tables, seq_lens = make_step(batch, block_size, dtype,
                                                                       **shape)
    scale = q.shape[-1] ** -0.5
    out = triton_backend.paged_attention(q, k, v, k_cache, v_cache, metadata, scale,
                                         sliding_window)
    # The reference reads the step's K/V from the cache, where the write kernel put them.
    expected = reference_paged_attention(q, k_cache, v_cache, [n for _, n in batch], seq_lens,
                                         tables, scale, sliding_window)
    assert out.shape == q.shape and out.dtype == q.dtype
    return out, expected


@pytest.fixture
def small_tiles(monkeypatch):
    monkeypatch.setattr(triton_backend, "launch_config", lambda dtype, head_dim: SMALL_TILES)


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("sliding_window", [None, 10])
@pytest.mark.parametrize("tiles", ["small", "default"])
def test_mixed_batch_matches_reference(block_size, sliding_window, tiles, monkeypatch):
    if tiles == "small":
        monkeypatch.setattr(triton_backend, "launch_config", lambda *_: SMALL_TILES)
    out, expected = run_and_reference(MIXED_BATCH, block_size, torch.float32, sliding_window)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("which", ["prefills", "decodes"])
@pytest.mark.parametrize("sliding_window", [None, 3])
def test_prefill_only_and_decode_only_steps(which, sliding_window, small_tiles):
    batch = [(c, n) for c, n in MIXED_BATCH if (n > 1) == (which == "prefills")]
    out, expected = run_and_reference(batch, 4, torch.float32, sliding_window)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 4), (8, 2), (12, 4), (32, 1)])
@pytest.mark.parametrize("head_dim", [16, 40])  # 40: not a power of two, masked lanes
def test_head_layouts(num_heads, num_kv_heads, head_dim, small_tiles):
    """Multi-head, grouped-query (group 3 pads the decode tile's rows) and multi-query."""
    batch = [(5, 20), (0, 1), (40, 1)]
    out, expected = run_and_reference(batch, 4, torch.float32, 12, num_heads=num_heads,
                                      num_kv_heads=num_kv_heads, head_dim=head_dim)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_close_to_float64_reference(dtype, small_tiles):
    out, expected = run_and_reference(MIXED_BATCH, 16, dtype, head_dim=32)
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)


def test_agrees_with_torch_backend():
    """Same inputs through both backends: same outputs and the same caches afterwards."""
    q, k, v, k_cache, v_cache, metadata, _, _ = make_step(MIXED_BATCH, 4, torch.float32)
    caches = (k_cache.clone(), v_cache.clone())
    out = triton_backend.paged_attention(q, k, v, k_cache, v_cache, metadata, 0.3, 20)
    expected = torch_backend.paged_attention(q, k, v, *caches, metadata, 0.3, 20)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)
    assert torch.equal(k_cache, caches[0]) and torch.equal(v_cache, caches[1])


def test_query_view_of_a_fused_projection(small_tiles):
    """The model passes q/k/v as column slices of one qkv matmul: strided, not contiguous."""
    q, k, v, k_cache, v_cache, metadata, _, _ = make_step(MIXED_BATCH, 16, torch.float32)
    num_tokens = q.shape[0]
    fused = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1)  # [T, (H + 2KVH) D]
    q_view, k_view, v_view = fused.split([q[0].numel(), k[0].numel(), v[0].numel()], dim=1)
    q_view, k_view, v_view = (t.view(num_tokens, -1, 16) for t in (q_view, k_view, v_view))
    assert not q_view.is_contiguous()
    caches = (k_cache.clone(), v_cache.clone())
    out = triton_backend.paged_attention(q_view, k_view, v_view, k_cache, v_cache, metadata, 0.25)
    expected = triton_backend.paged_attention(q, k, v, *caches, metadata, 0.25)
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
    assert torch.equal(k_cache, caches[0]) and torch.equal(v_cache, caches[1])


def test_step_kv_lands_in_its_slots_and_nowhere_else():
    q, k, v, k_cache, v_cache, metadata, _, _ = make_step(MIXED_BATCH, 4, torch.float32)
    slot_mapping = metadata.slot_mapping.clone()
    slot_mapping[[3, 40]] = -1  # padding tokens: not written
    padded = AttentionMetadata.build([n for _, n in MIXED_BATCH],
                                     metadata.seq_lens.tolist(), metadata.block_tables.tolist(),
                                     4, slot_mapping=slot_mapping)
    v = torch.cat([v, torch.zeros_like(v)], dim=-1)[..., :v.shape[-1]]  # strides unlike k's
    before = (k_cache.clone(), v_cache.clone())
    triton_backend.write_to_kv_cache(k, v, k_cache, v_cache, padded.slot_mapping)
    written = slot_mapping >= 0
    for cache, old, new in ((k_cache, before[0], k), (v_cache, before[1], v)):
        flat, flat_before = cache.flatten(0, 1), old.flatten(0, 1)  # [slots, KVH, D]
        assert torch.equal(flat[slot_mapping[written]], new[written])
        untouched = torch.ones(len(flat), dtype=torch.bool)
        untouched[slot_mapping[written]] = False
        assert torch.equal(flat[untouched], flat_before[untouched])
        assert torch.equal(flat[metadata.slot_mapping[[3, 40]]],
                           flat_before[metadata.slot_mapping[[3, 40]]])


def test_dispatch(monkeypatch):
    cpu_query = torch.zeros(1, 4, 16)
    monkeypatch.delenv("PAGELLM_ATTENTION_BACKEND", raising=False)
    assert attention_layer.select_backend(cpu_query) is torch_backend.paged_attention
    monkeypatch.setenv("PAGELLM_ATTENTION_BACKEND", "triton")
    assert attention_layer.select_backend(cpu_query) is triton_backend.paged_attention
    monkeypatch.setenv("PAGELLM_ATTENTION_BACKEND", "torch")
    assert attention_layer.select_backend(cpu_query) is torch_backend.paged_attention
    monkeypatch.setenv("PAGELLM_ATTENTION_BACKEND", "cuda")
    with pytest.raises(ValueError, match="PAGELLM_ATTENTION_BACKEND='cuda'"):
        attention_layer.select_backend(cpu_query)


# Compiles the kernels for an H100/H200 (sm_90) as a launch with these arguments would,
# without a GPU: Triton's frontend and ptxas check what the interpreter lets through (dtypes
# of tl.dot operands, constexpr branches, early returns). Runs where TRITON_INTERPRET is unset.
COMPILE_FOR_SM90 = r"""
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource
from pagellm.attention import triton_backend as tb
from pagellm.attention import triton_store as ts

try:
    get_ptxas(90).path
except Exception as error:
    raise SystemExit(f"SKIP: no ptxas ({error})")
INDEX_POINTERS = {"slot_mapping_ptr", "block_tables_ptr", "seq_lens_ptr", "query_start_loc_ptr"}

def compile_kernel(fn, dtype, constexprs, num_warps, cache_dtype=None):
    # cache_dtype: the 8-bit caches' element type (QUANT 1: i8, 2: u8 bytes read by table)
    pointers = {"k_scale_ptr": "*bf16", "v_scale_ptr": "*bf16", "lut_ptr": "*fp32"}
    if cache_dtype:
        pointers.update(k_cache_ptr="*" + cache_dtype, v_cache_ptr="*" + cache_dtype)
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
            continue
        if name.endswith("_ptr"):
            signature[name] = ("*i64" if name in INDEX_POINTERS
                               else pointers.get(name, "*" + dtype))
        else:
            signature[name] = "fp32" if name in ("scale_log2", "qmax") else "i32"
        if name.endswith("_ptr") or name.startswith("stride") or name == "head_dim":
            attrs[(i,)] = [["tt.divisibility", 16]]  # as a launch specialises aligned values
    return triton.compile(ASTSource(fn, signature, constexprs, attrs),
                          target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})

for torch_dtype, dtype in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
    config = tb.launch_config(torch_dtype, 128)
    common = dict(QUERIES_PER_KV=3, BLOCK_D=128, USE_WINDOW=True,
                  DOT_PRECISION=tb._dot_precision(torch_dtype), UPCAST_DOT=False, QUANT=0)
    compile_kernel(ts._write_kv_kernel, dtype, dict(BLOCK_H=4, BLOCK_D=128), 4)
    for store_format in (0, 1, 2):  # the 8-bit store: int8, e4m3, e5m2 into uint8 rows
        ptx = compile_kernel(ts._write_kv_quantized_kernel, dtype,
                             dict(FORMAT=store_format, BLOCK_H=4, BLOCK_D=128), 4, "u8").asm["ptx"]
        # the quantizer's bytes need IEEE divisions (div.rn), not div.full / div.approx
        assert "div.rn.f32" in ptx and "div.full" not in ptx and "div.approx" not in ptx
    compile_kernel(tb._prefill_kernel, dtype, dict(common, BLOCK_M=config.prefill_block_m,
                   BLOCK_N=config.prefill_block_n), config.prefill_warps)
    compile_kernel(tb._decode_kernel, dtype, dict(common, BLOCK_G=16,
                   BLOCK_N=config.decode_block_n), config.decode_warps)
    for quant, cache_dtype in ((1, "i8"), (2, "u8")):  # 8-bit caches: float32 tiles
        config = tb.launch_config(torch.float32, 128)
        quantized = dict(common, QUANT=quant, DOT_PRECISION="ieee")
        compile_kernel(tb._prefill_kernel, dtype, dict(quantized, BLOCK_M=config.prefill_block_m,
                       BLOCK_N=config.prefill_block_n), config.prefill_warps, cache_dtype)
        compile_kernel(tb._decode_kernel, dtype, dict(quantized, BLOCK_G=16,
                       BLOCK_N=config.decode_block_n), config.decode_warps, cache_dtype)
print("compiled")
"""


def test_kernels_compile_for_sm90():
    assert_compiles(COMPILE_FOR_SM90)


@pytest.fixture(scope="module")
def sliding_model(tmp_path_factory):
    """Tiny Mistral (4 query heads over 2 KV heads, head_dim 16) with a 12-token window."""
    return build_random_model(tmp_path_factory.mktemp("triton") / "model",
                              "MistralForCausalLM", seed=3, sliding_window=12)


def test_llm_generate_same_greedy_tokens_as_torch(sliding_model, monkeypatch):
    """The whole engine on both backends: block size 4, a 16-token step budget (prompts run
    in chunks beside decodes), then the same prompts again (prefix-cache hits)."""
    gen = torch.Generator().manual_seed(0)
    shared = torch.randint(3, 512, (9,), generator=gen).tolist()
    prompts = [shared + torch.randint(3, 512, (n,), generator=gen).tolist() for n in (3, 14, 25)]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)

    def generate(backend: str, repeats: int = 1):
        monkeypatch.setenv("PAGELLM_ATTENTION_BACKEND", backend)
        llm = LLM(str(sliding_model), dtype="float32", device="cpu", block_size=4,
                  max_model_len=64, max_num_batched_tokens=16, num_gpu_blocks_override=64,
                  swap_space=0.001)
        runs = [llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                             use_tqdm=False) for _ in range(repeats)]
        tokens = [[list(o.outputs[0].token_ids) for o in run] for run in runs]
        return tokens, llm.llm_engine.get_stats()

    (expected,), _ = generate("torch")
    assert len({t for tokens in expected for t in tokens}) > 10, "the model should not collapse"
    launches = []
    choose_tiles = triton_backend.launch_config
    monkeypatch.setattr(triton_backend, "launch_config",
                        lambda *args: launches.append(args) or choose_tiles(*args))
    tokens, stats = generate("triton", repeats=2)
    assert tokens == [expected, expected]
    assert stats.prefix_cache_hits > 0
    assert len(launches) > 2 * 20  # every layer of every step ran the Triton kernels


@pytest.mark.parametrize("fmt_name", ["int8", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("dtype, sliding_window", [(torch.float32, None),
                                                   (torch.bfloat16, 10)])
def test_8bit_cache_matches_dequantized_reference(fmt_name, dtype, sliding_window,
                                                  small_tiles):
    """The kernels over an 8-bit cache (kv_quant.py): bytes decoded per tile, row scales
    folded in, against the float64 reference over the dequantized cache."""
    from pagellm.attention import kv_quant

    q, k, v, k_cache, v_cache, metadata, tables, seq_lens = make_step(MIXED_BATCH, 4, dtype)
    fmt = kv_quant.FORMATS[fmt_name]
    cache = kv_quant.QuantizedKVCache(kv_quant.quantize(k_cache, fmt),
                                      kv_quant.quantize(v_cache, fmt), fmt)
    scale = q.shape[-1] ** -0.5
    out = triton_backend.paged_attention_quantized(q, k, v, cache, metadata, scale,
                                                   sliding_window)
    k_ref, v_ref = kv_quant.dequantized_cache(cache)
    expected = reference_paged_attention(q.double(), k_ref, v_ref,
                                         [n for _, n in MIXED_BATCH], seq_lens, tables, scale,
                                         sliding_window)
    assert out.dtype == dtype
    tol = dict(atol=1e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(out.double(), expected, **tol)


@pytest.mark.parametrize("cache_dtype", ["auto", "int8", "fp8_e4m3"])
def test_decodes_do_not_read_values_outside_the_window(cache_dtype, small_tiles):
    """A NaN value (an 8-bit cache: a NaN row scale) in a decode's key tile but before its
    sliding window changes nothing (the kernel does not read it: its weight is 0, but 0 x NaN
    is NaN); one inside the window makes the output of the query heads over that KV head NaN,
    as the reference's. (In a prefill tile a key some rows see is read for all of them.)"""
    from pagellm.attention import kv_quant

    batch = [(19, 1), (40, 1)]  # the first decode (position 19) sees keys 17-19 under window 3
    q, k, v, k_cache, v_cache, metadata, tables, seq_lens = make_step(batch, 4, torch.float32)
    scale = q.shape[-1] ** -0.5

    def run(v_cache):
        if cache_dtype == "auto":
            return triton_backend.paged_attention(q, k, v, k_cache.clone(), v_cache, metadata,
                                                  scale, 3)
        fmt = kv_quant.FORMATS[cache_dtype]
        cache = kv_quant.QuantizedKVCache(kv_quant.quantize(k_cache, fmt),
                                          kv_quant.quantize(v_cache, fmt), fmt)
        return triton_backend.paged_attention_quantized(q, k, v, cache, metadata, scale, 3)

    clean = run(v_cache.clone())
    assert torch.isfinite(clean).all()
    before = v_cache.clone()
    before[tables[0][4], 0, 0, 0] = float("nan")  # key 16: the tile of keys 16-31, unseen
    assert torch.equal(run(before), clean)
    inside = v_cache.clone()
    inside[tables[0][4], 1, 0, 0] = float("nan")  # key 17: seen
    out = run(inside)
    group = q.shape[1] // k_cache.shape[2]
    assert out[0, :group].isnan().any(-1).all()
    out[0, :group] = clean[0, :group]
    assert torch.equal(out, clean)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt_name", ["int8", "fp8_e4m3", "fp8_e5m2"])
def test_8bit_store_writes_the_quantizer_s_bytes(fmt_name, dtype):
    """The Triton store of an 8-bit cache writes exactly kv_quant.quantize's bytes at the
    slots, skipping padding (-1), on store_rows' rows (ten decades, zeros, -0.0, NaN and
    infinite entries, every tie between neighbouring codes, clamped rows); a strided view of a fused projection's output
    reads as its values."""
    from pagellm.attention import kv_quant

    fmt = kv_quant.FORMATS[fmt_name]
    key, value, slots = store_rows(fmt, dtype)
    heads, head_dim = key.shape[1:]
    fused = torch.cat([key, value], dim=1)  # [tokens, 2 * heads, D]: key and value are views
    key, value = fused[:, :heads], fused[:, heads:]
    caches = [kv_quant.QuantizedKVCache(
        torch.zeros(10, 4, heads, head_dim + 2, dtype=torch.uint8),
        torch.zeros(10, 4, heads, head_dim + 2, dtype=torch.uint8), fmt) for _ in range(2)]
    kv_quant.write_to_kv_cache(key, value, caches[0], slots, torch.nonzero(slots >= 0)[:, 0])
    triton_backend.write_to_kv_cache_quantized(key, value, caches[1], slots)
    assert torch.equal(caches[0].key, caches[1].key)
    assert torch.equal(caches[0].value, caches[1].value)
    assert caches[1].key.flatten(0, 1)[slots[slots >= 0]].any()
