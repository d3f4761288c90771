"""Paged attention (vectorised torch path and compiled CPU decode kernel) against the plain
per-sequence float64 reference.

Random caches and block tables (shuffled physical blocks), one batch mixing every kind of
sequence a step can hold: a whole prompt, a chunk continuing earlier chunks, a prompt after a
prefix-cache hit, and single-token decodes of different context lengths.
"""
from __future__ import annotations

import gc
import weakref

import pytest
import torch
from attention_steps import make_step as make_attention_step

from pagellm import native
from pagellm.attention import AttentionMetadata, cpu_kernel, kv_quant
from pagellm.attention.torch_backend import paged_attention, reference_paged_attention
from kernel_builds import KERNEL_BUILDS, kernel_build

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 6, 2, 16
# (tokens already in the cache, tokens computed this step), prefills first
MIXED_BATCH = [
    (0, 37),  # whole prompt
    (21, 7),  # chunk continuing two earlier chunks
    (32, 9),  # prompt after a 32-token prefix-cache hit
    (0, 2),  # shortest prefill
    (0, 1),  # one-token prompt: a decode
    (15, 1),  # decode whose new token starts a block (block_size 16: position 15 ends one)
    (16, 1),  # decode at the first slot of a new block
    (70, 1),  # long decode
]


def make_step(batch, block_size, dtype):
    return make_attention_step(batch, block_size, dtype, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM,
                               spare_entry=True)


@pytest.fixture(params=[*KERNEL_BUILDS, "torch"])
def decode_path(request, monkeypatch):
    """Run decodes through a build of the compiled CPU kernel (kernel_builds.py: this CPU's
    vector loops, the plain-C ones, or those of an older x86 ISA level), or force the
    pure-torch path."""
    if request.param == "torch":
        monkeypatch.setattr(cpu_kernel, "supports", lambda query: False)
    else:
        monkeypatch.setattr(cpu_kernel, "_KERNEL", kernel_build(request.param))
    return request.param


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("sliding_window", [None, 10])
@pytest.mark.parametrize("which", ["mixed", "prefills", "decodes", "one_prompt"])
def test_vectorised_matches_reference(block_size, sliding_window, which, decode_path):
    batch = {"mixed": MIXED_BATCH, "prefills": MIXED_BATCH[:4], "decodes": MIXED_BATCH[4:],
             "one_prompt": MIXED_BATCH[:1]}[which]  # one whole prompt: plain causal path
    q, k, v, k_cache, v_cache, metadata, tables, seq_lens = make_step(batch, block_size,
                                                                       torch.float32)
    scale = HEAD_DIM ** -0.5
    out = paged_attention(q, k, v, k_cache, v_cache, metadata, scale, sliding_window)
    # The reference reads the step's K/V from the cache, where paged_attention wrote them.
    expected = reference_paged_attention(q, k_cache, v_cache, [n for _, n in batch], seq_lens,
                                         tables, scale, sliding_window)
    assert out.shape == q.shape
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)


# head_dim 64, 128: specialised; 32, 96, 256: generic vector loops; 16, 40: plain C only.
# Group sizes 1, 4, 3 are specialised, 16 generic (and more than the 8 accumulators per pass
# of the AVX-512 loops; the AVX2 ones take it 3 heads at a time, then 2 + 2).
@pytest.mark.parametrize("head_dim", [16, 32, 64, 96, 128, 256, 40])
@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 4), (8, 2), (12, 4), (16, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_decode_kernel_shapes(head_dim, num_heads, num_kv_heads, dtype, decode_path):
    """Decode-only steps of many sequences: every head layout, both dtypes, with and without
    a sliding window, against the float64 reference."""
    check_decode_step(head_dim, num_heads, num_kv_heads, dtype, 8, [1, 5, 16, 17, 64, 130],
                      (None, 12))


# Blocks of more than 16 keys (32 in the AVX2 loops) are worked in slices of that many keys
# (paged_decode.c's SLICE_KEYS); 40: a last slice of 8; windows that start inside a slice, on
# its edge, and in an earlier block.
@pytest.mark.parametrize("block_size", [32, 40])
@pytest.mark.parametrize("head_dim", [16, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_decode_kernel_large_blocks(block_size, head_dim, dtype, decode_path):
    check_decode_step(head_dim, 12, 4, dtype, block_size, [1, 5, 17, 33, 40, 41, 100, 130],
                      (None, 12, 20, 75))


@pytest.mark.parametrize("head_dim", [16, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_non_finite_cache_entries_reach_only_their_heads(head_dim, dtype, decode_path):
    """A NaN key element, or an infinite query one, in a decode makes the outputs of the
    query heads that read it NaN, as the reference's (no exp or max may drop it), a NaN
    value element their outputs' element of that dimension; every other output stays as it
    was bit for bit, also where the NaN sits in a block other sequences' padding entries
    name, or in a slot past its sequence's end (the torch path reads both with weight 0)."""
    batch = [(0, 1), (4, 1), (15, 1), (16, 1), (40, 1)]
    q, k, v, k_cache, v_cache, metadata, tables, seq_lens = make_attention_step(
        batch, 16, dtype, 6, 2, head_dim, seed=5)
    scale = head_dim ** -0.5
    clean = paged_attention(q, k, v, k_cache, v_cache, metadata, scale, None)
    bad_q = q.clone()
    bad_q[2, 4, 1] = float("inf")
    k_cache[tables[3][0], 0, 1, 3] = float("nan")  # sequence 3's token 0, KV head 1
    assert tables[4][1] == 0  # block 0, which every sequence's padding entries name too
    v_cache[tables[4][1], 7, 0, 0] = float("nan")  # sequence 4's token 23, KV head 0
    k_cache[tables[3][1], 3, 0, 0] = float("nan")  # past sequence 3's 17 tokens: unread
    out = paged_attention(bad_q, k, v, k_cache, v_cache, metadata, scale, None)
    hit = torch.zeros(out.shape, dtype=torch.bool)
    hit[2, 4] = hit[3, 3:6] = hit[4, 0:3, 0] = True
    assert torch.isfinite(clean).all()
    assert out[hit].isnan().all()
    assert torch.equal(out[~hit], clean[~hit])


def check_decode_step(head_dim, num_heads, num_kv_heads, dtype, block_size, seq_lens, windows):
    """One decode step over these context lengths (shuffled physical blocks), under each
    window, against the float64 reference."""
    gen = torch.Generator().manual_seed(head_dim + num_heads)
    tables, next_block = [], 0
    order = torch.randperm(200, generator=gen).tolist()
    for n in seq_lens:
        tables.append(order[next_block:next_block + -(-n // block_size)])
        next_block += len(tables[-1])
    shape = (200, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=gen).to(dtype)
    kv = torch.randn(len(seq_lens), num_kv_heads, head_dim, generator=gen).to(dtype)
    metadata = AttentionMetadata.build([1] * len(seq_lens), seq_lens, tables, block_size)
    tolerance = {"atol": 1e-5, "rtol": 1e-4} if dtype == torch.float32 else \
        {"atol": 2e-2, "rtol": 2e-2}
    for window in windows:
        out = paged_attention(q, kv, kv, k_cache, v_cache, metadata, head_dim ** -0.5, window)
        expected = reference_paged_attention(q, k_cache, v_cache, [1] * len(seq_lens),
                                             seq_lens, tables, head_dim ** -0.5, window)
        torch.testing.assert_close(out.float(), expected.float(), **tolerance)


@pytest.mark.parametrize("which", ["mixed", "decodes"])  # decodes: the kernel writes K/V
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_step_kv_lands_in_its_slots_and_nowhere_else(which, dtype, decode_path):
    batch = MIXED_BATCH if which == "mixed" else MIXED_BATCH[4:]
    q, k, v, k_cache, v_cache, metadata, tables, seq_lens = make_step(batch, 16, dtype)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    paged_attention(q, k, v, k_cache, v_cache, metadata, 1.0)
    slots = metadata.slot_mapping
    for cache, before, new in ((k_cache, k_before, k), (v_cache, v_before, v)):
        flat_before, flat_after = before.flatten(0, 1), cache.flatten(0, 1)
        assert torch.equal(flat_after[slots], new)
        untouched = torch.ones(len(flat_after), dtype=torch.bool)
        untouched[slots] = False
        assert torch.equal(flat_after[untouched], flat_before[untouched])
    # slot_mapping agrees with the block tables: position p -> table[p // bs] * bs + p % bs
    expected = []
    for (context, query_len), table in zip(batch, tables):
        expected += [table[p // 16] * 16 + p % 16 for p in range(context, context + query_len)]
    assert slots.tolist() == expected


def test_decode_kv_from_strided_projections(decode_path):
    """K/V arrive as column slices of one fused qkv projection (rows strided): what the
    kernel stores and attends over must be the same as for contiguous tensors."""
    q, k, v, k_cache, v_cache, metadata, tables, seq_lens = make_step(MIXED_BATCH[4:], 16,
                                                                       torch.float32)
    fused = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1)
    q_size, kv_size = q[0].numel(), k[0].numel()
    k_view = fused[:, q_size:q_size + kv_size].view(k.shape)
    v_view = fused[:, q_size + kv_size:].view(v.shape)
    out = paged_attention(q, k_view, v_view, k_cache, v_cache, metadata, HEAD_DIM ** -0.5)
    assert torch.equal(k_cache.flatten(0, 1)[metadata.slot_mapping], k)
    assert torch.equal(v_cache.flatten(0, 1)[metadata.slot_mapping], v)
    expected = reference_paged_attention(q, k_cache, v_cache, [1] * len(seq_lens), seq_lens,
                                         tables, HEAD_DIM ** -0.5)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)


def test_set_steps_gives_every_call_set_step_s_fields():
    """cpu_kernel.set_steps (one set_step, then a copy of its bytes into the others) leaves
    each call's arguments as set_step on each would, its own fields (query, caches, output)
    untouched, and each call holding the step's tensors."""
    if not cpu_kernel.available():
        pytest.skip("no compiled CPU kernel")
    q, k, v, k_cache, v_cache, metadata, _, seq_lens = make_step(MIXED_BATCH[4:], 16,
                                                                 torch.float32)
    decode = metadata.decode
    outs = [torch.empty_like(q) for _ in range(4)]
    calls = [cpu_kernel.prepared_decode_attention(q, k_cache, v_cache, out, k, v,
                                                  HEAD_DIM ** -0.5, None) for out in outs]
    workspace = cpu_kernel.decode_workspace(len(seq_lens), NUM_HEADS, HEAD_DIM,
                                            decode.max_seq_len)
    step = (decode.block_pairs(), decode.seq_lens, decode.max_seq_len,
            metadata.slot_mapping.contiguous(), workspace)
    cpu_kernel.set_step(calls[0], *step)
    cpu_kernel.set_steps(calls[1:], *step)
    fields = [name for name, _ in type(calls[0].args)._fields_]
    for call, out in zip(calls[1:], outs[1:]):
        assert call.args.out == out.data_ptr()
        assert all(getattr(call.args, name) == getattr(calls[0].args, name)
                   for name in fields if name != "out"), fields
        assert call.step[1] is decode.seq_lens and call.step[3] is workspace
    assert calls[1].args.max_seq_len == decode.max_seq_len > 0 and calls[1].args.num_pairs > 0


def test_prepared_calls_keep_their_buffers_alive():
    """A prepared decode call holds the tensors its pointers point into (native.PreparedCall
    keep / step): its output and the step's workspace outlive the caller's references and a
    growth of the kernel's shared scratch past them, and the call still stores the step's
    K/V and writes the reference's output there; the 8-bit caches' call holds its output
    too."""
    if not cpu_kernel.available():
        pytest.skip("no compiled CPU kernel")
    q, k, v, k_cache, v_cache, metadata, tables, seq_lens = make_step(MIXED_BATCH[4:], 16,
                                                                       torch.float32)
    decode = metadata.decode
    out = torch.empty_like(q)
    call = cpu_kernel.prepared_decode_attention(q, k_cache, v_cache, out, k, v,
                                                HEAD_DIM ** -0.5, None)
    workspace = cpu_kernel.decode_workspace(len(seq_lens), NUM_HEADS, HEAD_DIM,
                                            decode.max_seq_len)
    cpu_kernel.set_step(call, decode.block_pairs(), decode.seq_lens, decode.max_seq_len,
                        metadata.slot_mapping.contiguous(), workspace)
    alive = [weakref.ref(x) for x in (out, workspace)]
    del out, workspace
    cpu_kernel._KERNEL.scratch(cpu_kernel._KERNEL.workspace.numel() + 1)  # a new buffer
    gc.collect()
    assert all(ref() is not None for ref in alive)
    call()
    expected = reference_paged_attention(q, k_cache, v_cache, [1] * len(seq_lens), seq_lens,
                                         tables, HEAD_DIM ** -0.5)
    torch.testing.assert_close(alive[0](), expected, atol=1e-5, rtol=1e-4)
    fmt = kv_quant.FORMATS["int8"]
    cache = kv_quant.QuantizedKVCache(kv_quant.quantize(k_cache, fmt),
                                      kv_quant.quantize(v_cache, fmt), fmt)
    out = torch.empty_like(q)
    call = cpu_kernel.prepared_decode_attention_quantized(q, cache, out, 1.0, None)
    alive = weakref.ref(out)
    del out
    gc.collect()
    assert alive() is not None


def test_padding_slots_are_not_written(decode_path):
    q, k, v, k_cache, v_cache, metadata, _, _ = make_step(MIXED_BATCH[4:], 16, torch.float32)
    slot_mapping = metadata.slot_mapping.clone()
    slot_mapping[1] = -1
    padded = AttentionMetadata.build([1] * 4, [1, 16, 17, 71],
                                     metadata.block_tables.tolist(), 16,
                                     slot_mapping=slot_mapping)
    before = k_cache.clone()
    paged_attention(q, k, v, k_cache, v_cache, padded, 1.0)
    changed = (k_cache != before).flatten(0, 1).any(-1).any(-1)
    assert changed.sum() == 3 and not changed[metadata.slot_mapping[1]]


def test_bfloat16_close_to_float64_reference(decode_path):
    q, k, v, k_cache, v_cache, metadata, tables, seq_lens = make_step(MIXED_BATCH, 16,
                                                                       torch.bfloat16)
    out = paged_attention(q, k, v, k_cache, v_cache, metadata, HEAD_DIM ** -0.5)
    expected = reference_paged_attention(q, k_cache, v_cache, [n for _, n in MIXED_BATCH],
                                         seq_lens, tables, HEAD_DIM ** -0.5)
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)


def test_decode_only_metadata_is_the_general_build_s():
    """A step of decodes only is built from the lists in Python (metadata._build_decodes):
    every field equals the general build's (given the same slots, which it then takes as
    they are), and each slot is its sequence's last position in its block table, for block
    tables longer than needed, ragged lengths, several block sizes, and blocks shared by
    several sequences (a cached prefix: the block pairs' ties)."""
    gen = torch.Generator().manual_seed(5)
    for block_size in (1, 4, 16):
        for num_seqs in (1, 3, 17):
            seq_lens = torch.randint(1, 90, (num_seqs,), generator=gen).tolist()
            tables = [torch.randperm(400, generator=gen)[:-(-n // block_size) + 2].tolist()
                      for n in seq_lens]
            for t in tables[1::2]:  # every other sequence starts on the first one's blocks
                shared = min(len(t), len(tables[0])) // 2
                t[:shared] = tables[0][:shared]
            fast = AttentionMetadata.build([1] * num_seqs, seq_lens, tables, block_size)
            general = AttentionMetadata.build([1] * num_seqs, seq_lens, tables, block_size,
                                              slot_mapping=fast.slot_mapping.clone())
            for name in ("slot_mapping", "positions", "block_tables", "seq_lens",
                         "query_start_loc"):
                want = getattr(general, name)
                assert torch.equal(getattr(fast, name), want), name
                assert getattr(fast, name).dtype == want.dtype, name
            for name in ("num_prefills", "num_prefill_tokens", "num_decode_tokens",
                         "max_query_len", "max_seq_len", "block_size", "prefill",
                         "write_index"):
                assert getattr(fast, name) == getattr(general, name), name
            assert torch.equal(fast.decode.block_tables, general.decode.block_tables)
            assert torch.equal(fast.decode.seq_lens, general.decode.seq_lens)
            assert fast.decode.max_seq_len == general.decode.max_seq_len
            assert [p.tolist() for p in fast.decode.block_pairs()] == [
                p.tolist() for p in general.decode.block_pairs()]
            slots = [t[(n - 1) // block_size] * block_size + (n - 1) % block_size
                     for t, n in zip(tables, seq_lens)]
            assert fast.slot_mapping.tolist() == slots


def test_prefills_must_precede_decodes():
    with pytest.raises(ValueError, match="precede"):
        AttentionMetadata.build([1, 5], [1, 5], [[0], [1]], 16)


@pytest.mark.parametrize("build", KERNEL_BUILDS)
def test_each_build_has_the_inner_loops_its_isa_allows(build):
    """Each build uses the vector loops its instruction set has, so that the tests above
    exercise the loops each kind of CPU runs: native ones where this CPU has AVX-512 (with
    its bfloat16 dot products, and with AVX512-VBMI the 8-bit caches' table lookups, with AMX
    their tile products, with AVX512-VNNI int8's integer products) or
    AVX2, AVX-512 float32 and 8-bit loops with AVX2 bfloat16 ones at x86-64-v4, AVX2 loops at
    x86-64-v3, plain C in the portable build."""
    library = kernel_build(build).load()
    features = library.paged_decode_features()
    level = native.isa_level() if build == "native" else build  # $PAGELLM_CPU_ISA may be set
    flags = native.cpu_flags() if level == "native" else native.ISA_LEVELS.get(level,
                                                                               ("", set()))[1]
    assert bool(features & 1) == ("avx512f" in flags)
    assert bool(features & 2) == ("avx512f" in flags and "avx512_bf16" in flags)
    assert bool(features & 4) == ("avx512f" in flags)
    assert bool(features & 16) == ({"avx512f", "avx512_bf16", "avx512vbmi"} <= flags)
    assert bool(features & 32) == ({"avx512f", "avx512_bf16", "avx512vbmi", "amx_tile",
                                    "amx_bf16"} <= flags)
    assert bool(features & 128) == ({"avx512f", "avx512_bf16", "avx512vbmi",
                                     "avx512_vnni"} <= flags)
    assert bool(features & 8) == ({"avx2", "fma", "f16c"} <= flags  # AVX2 loops for some
                                  and not {"avx512f", "avx512_bf16"} <= flags)
