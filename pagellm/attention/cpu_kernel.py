"""A compiled decode-attention kernel for the CPU, built on first use with the system C compiler.

Why: a decode step must read every cached K/V of every sequence once. The pure-torch path
(torch_backend.decode_attention) first gathers the context through the block tables into a
contiguous copy and then attends over it, so K/V cross memory three times; this kernel reads
them in place, once, in ascending physical-block order, with AVX-512 inner loops (bfloat16 dot
products where the CPU has them), AVX2 ones on CPUs without AVX-512, and plain-C ones
elsewhere. Its C source is paged_decode.c, next to this file. It is an accelerator, not a
requirement: without a C compiler, on other devices, for float16, or with
``PAGELLM_CPU_KERNELS=0`` the torch path runs, and the tests hold all three to one reference.

It is compiled for the ISA level of pagellm.native (``-march=native`` unless
``$PAGELLM_CPU_ISA`` says otherwise) with ``-fopenmp`` and cached by pagellm.native, which says
where and how; its OpenMP threads are torch's. Which inner loops a build has depends on the
instructions the compiler was allowed: AVX-512 (``__AVX512F__``) for float32, AVX-512 with
``avx512_bf16`` for bfloat16 dot products, AVX2 + FMA + F16C (x86-64-v3) for what those
leave out, plain C (auto-vectorised for whatever the level has: SSE, NEON) otherwise.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from pagellm import native
from pagellm.attention.kv_quant import KVFormat, QuantizedKVCache


_FLAGS = ["-O3", "-fopenmp", "-fPIC", "-shared", "-fno-math-errno",
          "-fno-trapping-math", "-fassociative-math", "-fno-signed-zeros"]
_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}
_SOURCE = Path(__file__).with_name("paged_decode.c")  # the kernel's C source
_WHAT = "CPU decode attention kernel"
# paged_decode.c compiles as three objects side by side (float32, bfloat16 and 8-bit kernels:
# 27-35 s each with gcc -O3 on a 2-core EPYC, against 67 s for the whole file at once)
_PARTS = 3


class _DecodeArgs(ctypes.Structure):
    _fields_ = ([(name, ctypes.c_void_p) for name in (
        "q", "k_cache", "v_cache", "out", "new_k", "new_v", "new_slots", "pair_seq",
        "pair_block", "pair_phys", "seq_lens", "workspace")]
        + [(name, ctypes.c_int64) for name in (
            "num_pairs", "num_seqs", "num_heads", "num_kv_heads", "head_dim", "block_size",
            "max_seq_len", "window", "num_threads", "new_stride")]
        + [("scale", ctypes.c_float), ("lut", ctypes.c_void_p)])


class _Kernel(native.KernelLibrary):
    """paged_decode.c loaded (or None after a failed build) and a reusable float32 workspace.

    ``level`` is the ISA level built for (pagellm.native.ISA_LEVELS; None: native.isa_level());
    ``portable`` builds the plain-C inner loops only (no AVX-512 intrinsics), as a CPU
    without them, or another architecture, runs.
    """

    def __init__(self, level: str | None = None, portable: bool = False) -> None:
        super().__init__(level)
        self.portable = portable

    def build(self) -> ctypes.CDLL | None:
        return _build_and_load(self.level, self.portable)


_KERNEL = _Kernel()


def available() -> bool:
    """True when the kernel is built and loaded (building it on the first call)."""
    return _KERNEL.load() is not None


def supports(query: torch.Tensor) -> bool:
    # twice per layer and step: is_cpu and a dict lookup before the (cached) load
    return query.is_cpu and query.dtype in _SUFFIX and available()


def vector_paths() -> dict[str, str]:
    """The inner loops the loaded build runs per cache dtype (head_dim % 32 == 0, at most
    256; other shapes take the plain-C loops): ``AVX-512`` (bfloat16: ``AVX-512 BF16``, its
    dot-product instructions), else ``AVX2`` where the CPU has it, else ``plain C``.
    ``8-bit`` is the int8 / fp8 caches' (kv_quant.py): ``AVX-512 VBMI`` where the codes are
    converted by byte-table lookups (bfloat16 queries, head_dim % 64 == 0), ``AMX`` where
    the dot products of those run on the tile registers as well (at most 16 query heads per
    KV head; see use_amx), either followed by ``, int8 by AVX512-VNNI`` where int8 caches
    take the integer-product kernel instead (see use_vnni_int8)."""
    library = _KERNEL.load()
    features = library.paged_decode_features() if library is not None else 0
    avx2 = "AVX2" if features & 8 else "plain C"
    q8 = "AVX-512 VBMI" if features & 16 else "AVX-512" if features & 4 else avx2
    if use_amx():
        q8 = "AMX"
    if use_vnni_int8():  # built only beside the tables (bit 16)
        q8 += ", int8 by AVX512-VNNI"
    return {"float32": "AVX-512" if features & 1 else avx2,
            "bfloat16": "AVX-512 BF16" if features & 2 else avx2,
            "8-bit": q8}


def use_amx(on: bool | None = None) -> bool:
    """Whether the 8-bit caches' table kernels run their dot products on AMX tiles: only in
    a build for a CPU with AMX-BF16, and only once Linux grants the process the tile registers
    (asked on the first call). ``on`` False turns them off (the vector table kernels run
    instead), True back on where they can; None only asks."""
    library = _KERNEL.load()
    if library is None or not hasattr(library, "paged_decode_amx"):
        return False
    return bool(library.paged_decode_amx(-1 if on is None else int(on)))


def use_vnni_int8(on: bool | None = None) -> bool:
    """Whether int8 caches (bfloat16 queries, head_dim % 64 == 0) take the AVX512-VNNI
    kernel, which multiplies the codes as stored, as integers, for the scores and the
    weighted sum, in one pass over the context (see paged_decode.c): the query
    heads in 16-bit fixed point of their largest element, the softmax weights times the value
    rows' scales in 15-bit fixed point of each (block, head)'s largest.
    On by default where the build has it, also where the AMX kernels run (it is faster than
    their bfloat16 products on an AMX Xeon: docs/BENCHMARKS.md). ``on`` False turns it off
    (the AMX or table kernels run), True back on, None only asks."""
    library = _KERNEL.load()
    if library is None or not hasattr(library, "paged_decode_vnni_int8"):
        return False
    return bool(library.paged_decode_vnni_int8(-1 if on is None else int(on)))


def use_near_prefetch(on: bool | None = None) -> bool:
    """Whether the int8 (AVX512-VNNI) and AMX kernels bring the next block of their K/V
    into L1 while they work on one, in place of the prefetch into L2 further ahead that
    every other kernel issues. On by default on Intel CPUs, where it makes them 6-9% faster
    than the far prefetch alone with the K/V read from memory, as a model step reads them
    (docs/BENCHMARKS.md, "The near prefetch"), and the two together are 2-7% slower than it
    alone ("The far prefetch beside the near one"); off elsewhere, where it was not measured
    to pay. No result changes. ``on`` False turns it off, True on, None only asks."""
    library = _KERNEL.load()
    if library is None or not hasattr(library, "paged_decode_near_prefetch"):
        return False
    return bool(library.paged_decode_near_prefetch(-1 if on is None else int(on)))


def describe() -> str:
    """One line for humans: which decode attention path runs on the CPU, and why."""
    library = _KERNEL.load()
    if library is None:
        return f"torch (gather + scaled_dot_product_attention; kernel {native.status()[_WHAT]})"
    loops = ", ".join(f"{dtype} {kind}" for dtype, kind in vector_paths().items())
    return f"compiled paged kernel, {native.status()[_WHAT]}; {loops}"


def paged_decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           pairs: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                           seq_lens: torch.Tensor, max_seq_len: int, scale: float,
                           sliding_window: int | None = None,
                           new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
                           ) -> torch.Tensor:
    """query [num_seqs, num_heads, D] (one token each) -> output of the same shape.

    ``pairs`` = (sequence, logical block, physical block) of every block the batch reads,
    sorted by physical block (DecodeMetadata.block_pairs). ``new_kv`` = (key, value
    [num_seqs, num_kv_heads, D], slots [num_seqs], -1 = not written): the step's K/V, stored by
    the kernel before it attends; without it they must be in the cache already. Caller
    guarantees supports(query).
    """
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()
            and k_cache.dtype == v_cache.dtype == query.dtype):
        raise ValueError("paged_decode_attention needs contiguous caches of the query dtype")
    query = query.contiguous()
    out = torch.empty_like(query)
    new_k = new_v = new_slots = None
    if new_kv is not None:
        new_k, new_v, new_slots = _rows(new_kv[0]), _rows(new_kv[1]), new_kv[2].contiguous()
        if new_k.stride(0) != new_v.stride(0):  # the kernel takes one stride for both
            new_k, new_v = new_k.contiguous(), new_v.contiguous()
        shape = (num_seqs, num_kv_heads, head_dim)
        if not (new_k.shape == new_v.shape == shape and new_slots.shape == (num_seqs,)
                and new_k.dtype == new_v.dtype == k_cache.dtype
                and new_slots.dtype == torch.int64):
            raise ValueError(f"paged_decode_attention: new K/V must be {list(shape)} of the "
                             f"cache dtype and slots [{num_seqs}] int64")
    call = prepared_decode_attention(query, k_cache, v_cache, out, new_k, new_v, scale,
                                     sliding_window)
    set_step(call, pairs, seq_lens, max_seq_len, new_slots,
             decode_workspace(num_seqs, num_heads, head_dim, max_seq_len))
    call()
    return out


def prepared_decode_attention(query: torch.Tensor, k_cache: torch.Tensor,
                              v_cache: torch.Tensor, out: torch.Tensor,
                              new_k: torch.Tensor | None, new_v: torch.Tensor | None,
                              scale: float, sliding_window: int | None
                              ) -> native.PreparedCall:
    """The decode kernel's call into ``out``, for a query [rows, heads, D], out and new K/V
    (token rows of one stride; None: the step's K/V are in the cache already) that stay where
    they are. The step's fields (pairs, seq_lens, slots, workspace, max_seq_len, num_seqs) are
    set on its args before each call (set_step). Caller checks supports(query) and contiguous
    caches of the query dtype."""
    num_seqs, num_heads, head_dim = query.shape
    args = _DecodeArgs(
        query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
        _pointer(new_k), _pointer(new_v), None, None, None, None, None, None, 0, num_seqs,
        num_heads, k_cache.shape[2], head_dim, k_cache.shape[1], 0, sliding_window or 0,
        torch.get_num_threads(), 0 if new_k is None else new_k.stride(0), scale)
    library = _KERNEL.load()
    return native.PreparedCall(getattr(library, "paged_decode_attention_"
                                       + _SUFFIX[query.dtype]), args,
                               (query, k_cache, v_cache, out, new_k, new_v))


def set_step(call: native.PreparedCall, pairs: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
             seq_lens: torch.Tensor, max_seq_len: int, slots: torch.Tensor | None,
             workspace: torch.Tensor) -> None:
    """The step's fields of a prepared_decode_attention call (the workspace from
    decode_workspace, which every layer of a step may share)."""
    args = call.args
    args.pair_seq, args.pair_block, args.pair_phys = (pairs[0].data_ptr(), pairs[1].data_ptr(),
                                                      pairs[2].data_ptr())
    args.num_pairs, args.num_seqs = len(pairs[0]), len(seq_lens)
    args.seq_lens, args.new_slots, args.max_seq_len = (seq_lens.data_ptr(), _pointer(slots),
                                                       max_seq_len)
    args.workspace = workspace.data_ptr()
    call.step = (pairs, seq_lens, slots, workspace)


# set_step's fields but max_seq_len lie together in _DecodeArgs: new_slots .. num_seqs
_STEP_START = _DecodeArgs.new_slots.offset
_STEP_BYTES = _DecodeArgs.num_heads.offset - _STEP_START


def set_steps(calls: list[native.PreparedCall],
              pairs: tuple[torch.Tensor, torch.Tensor, torch.Tensor], seq_lens: torch.Tensor,
              max_seq_len: int, slots: torch.Tensor | None, workspace: torch.Tensor) -> None:
    """set_step with the same step on every one of ``calls`` (a step's layers): the first's
    fields set, then copied into each other's by one memmove: 19 against 53 us for 30
    layers' calls."""
    if not calls:
        return
    first = calls[0]
    set_step(first, pairs, seq_lens, max_seq_len, slots, workspace)
    source = ctypes.addressof(first.args) + _STEP_START
    for call in calls[1:]:
        ctypes.memmove(ctypes.addressof(call.args) + _STEP_START, source, _STEP_BYTES)
        call.args.max_seq_len = max_seq_len
        call.step = first.step


def decode_workspace(num_seqs: int, num_heads: int, head_dim: int, max_seq_len: int
                     ) -> torch.Tensor:
    """The float32 workspace paged_decode_attention takes for such a step, of the size the
    library computes (paged_decode_workspace_floats): per query row its scores, one partial
    sum per thread, and the query's dimension pairs (the AMX kernels') or its bytes and their
    two constants (the AVX512-VNNI kernel's); then, in a build with the AMX kernels, each
    thread's decoded tiles, on 64-byte lines."""
    floats = _KERNEL.load().paged_decode_workspace_floats(
        num_seqs, num_heads, head_dim, max_seq_len, torch.get_num_threads())
    return _KERNEL.scratch(floats)


def supports_quantized(query: torch.Tensor, cache: QuantizedKVCache) -> bool:
    """Whether the kernel reads this 8-bit cache for this query (head_dim <= 256)."""
    return supports(query) and cache.head_dim <= 256


def paged_decode_attention_quantized(query: torch.Tensor, cache: QuantizedKVCache,
                                     pairs: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                                     seq_lens: torch.Tensor, max_seq_len: int, scale: float,
                                     sliding_window: int | None = None) -> torch.Tensor:
    """paged_decode_attention over an 8-bit cache (kv_quant.QuantizedKVCache: rows of
    head_dim bytes and a bfloat16 scale), dequantized row by row in the kernel; the step's
    K/V must be in the cache already. Caller guarantees supports_quantized(query, cache)."""
    num_seqs, num_heads, head_dim = query.shape
    if not (cache.key.is_contiguous() and cache.value.is_contiguous()
            and cache.key.dtype == cache.value.dtype == torch.uint8
            and head_dim == cache.head_dim):
        raise ValueError("paged_decode_attention_quantized needs contiguous uint8 rows of "
                         f"head_dim + 2 = {head_dim + 2} bytes")
    query = query.contiguous()
    out = torch.empty_like(query)
    call = prepared_decode_attention_quantized(query, cache, out, scale, sliding_window)
    set_step(call, pairs, seq_lens, max_seq_len, None,
             decode_workspace(num_seqs, num_heads, head_dim, max_seq_len))
    call()
    return out


def prepared_decode_attention_quantized(query: torch.Tensor, cache: QuantizedKVCache,
                                        out: torch.Tensor, scale: float,
                                        sliding_window: int | None) -> native.PreparedCall:
    """paged_decode_attention_quantized's call into ``out``, for a query [rows, heads, D]
    and out that stay where they are, the step's fields set by set_step before each call
    (the step's K/V stored in the cache already). Caller checks what
    paged_decode_attention_quantized checks."""
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = cache.key.shape[1], cache.key.shape[2]
    args = _DecodeArgs(
        query.data_ptr(), cache.key.data_ptr(), cache.value.data_ptr(), out.data_ptr(),
        None, None, None, None, None, None, None, None, 0, num_seqs, num_heads, num_kv_heads,
        head_dim, block_size, 0, sliding_window or 0, torch.get_num_threads(), 0, scale,
        _lut(cache.format).data_ptr())
    decoding = {"int8": "int8", "fp8_e4m3": "e4m3", "fp8_e5m2": "e5m2"}[cache.format.name]
    library = _KERNEL.load()
    return native.PreparedCall(getattr(
        library, f"paged_decode_attention_q8_{_SUFFIX[query.dtype]}_{decoding}"), args,
        (query, cache.key, cache.value, out, _lut(cache.format)))


class _StoreArgs(ctypes.Structure):
    _fields_ = ([(name, ctypes.c_void_p) for name in
                 ("key", "value", "slots", "k_cache", "v_cache")]
                + [(name, ctypes.c_int64) for name in
                   ("stride", "num_tokens", "num_kv_heads", "head_dim")]
                + [("bf16", ctypes.c_int32), ("format", ctypes.c_int32),
                   ("num_threads", ctypes.c_int64)])


_STORE_FORMATS = {"int8": 0, "fp8_e4m3": 1, "fp8_e5m2": 2}


def store_quantized(key: torch.Tensor, value: torch.Tensor, cache: QuantizedKVCache,
                    slots: torch.Tensor) -> None:
    """kv_quant.write_to_kv_cache in one compiled pass: the step's key/value [num_tokens,
    num_kv_heads, head_dim] (float32 or bfloat16) quantized as kv_quant.quantize does, bit
    for bit, and stored at ``slots`` (negative: padding, skipped). Caller checks
    supports_quantized for a query of key's dtype."""
    key, value = _rows(key), _rows(value)
    if key.stride(0) != value.stride(0):
        key, value = key.contiguous(), value.contiguous()
    slots = slots.to(torch.int64).contiguous()  # the C side reads int64
    call = _store_call(key, value, cache)
    set_store_slots(call, slots)
    call()


def prepared_store_quantized(key: torch.Tensor, value: torch.Tensor,
                             cache: QuantizedKVCache) -> native.PreparedCall:
    """store_quantized as a prepared call on key/value that stay where they are (token rows
    of one stride, each row contiguous, as the projections' views are); the step's slots
    (one per token) are set before each call (set_store_slots)."""
    if key is not _rows(key) or value is not _rows(value) or key.stride(0) != value.stride(0):
        raise ValueError("prepared_store_quantized: key and value need contiguous token rows "
                         "of one stride")
    return _store_call(key, value, cache)


def set_store_slots(call: native.PreparedCall, slots: torch.Tensor) -> None:
    """The step's slots (int64, contiguous) of a store call, kept alive with it."""
    call.args.slots, call.step = slots.data_ptr(), (slots,)


def _store_call(key: torch.Tensor, value: torch.Tensor, cache: QuantizedKVCache
                ) -> native.PreparedCall:
    num_tokens, num_kv_heads, head_dim = key.shape
    if not (value.shape == key.shape and key.dtype == value.dtype and key.dtype in _SUFFIX
            and head_dim == cache.head_dim <= 256 and cache.key.is_contiguous()
            and cache.value.is_contiguous() and num_kv_heads == cache.key.shape[2]):
        raise ValueError(f"store_quantized: key/value {list(key.shape)} "
                         f"{str(key.dtype).removeprefix('torch.')} do not fit a cache of "
                         f"{cache.key.shape[2]} KV heads x head_dim {cache.head_dim} (<= 256), "
                         "float32 or bfloat16 rows")
    args = _StoreArgs(key.data_ptr(), value.data_ptr(), None, cache.key.data_ptr(),
                      cache.value.data_ptr(), key.stride(0), num_tokens, num_kv_heads,
                      head_dim, key.dtype == torch.bfloat16, _STORE_FORMATS[cache.format.name],
                      torch.get_num_threads())
    return native.PreparedCall(_KERNEL.load().paged_store_q8, args,
                               (key, value, cache.key, cache.value))


_LUTS: dict[str, torch.Tensor] = {}


def _lut(fmt: KVFormat) -> torch.Tensor:
    """The format's byte -> float32 table, kept alive for the kernel's pointer."""
    if fmt.name not in _LUTS:
        _LUTS[fmt.name] = fmt.lut().contiguous()
    return _LUTS[fmt.name]


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[num_seqs, num_kv_heads, D] with each token's row contiguous (the projections' views
    already are); only the stride between tokens may be anything."""
    return x if x.stride(2) == 1 and x.stride(1) == x.shape[2] else x.contiguous()


def _pointer(x: torch.Tensor | None) -> int | None:
    return None if x is None else x.data_ptr()


def _build_and_load(level: str | None, portable: bool) -> ctypes.CDLL | None:
    flags = _FLAGS + (["-DPAGELLM_PORTABLE"] if portable else [])
    variant = ", ".join([level] * bool(level) + ["portable"] * portable)
    library = native.build_and_load(_SOURCE, flags, _WHAT + (f" [{variant}]" if variant else ""),
                                    level, parts=_PARTS)
    if library is not None:
        for suffix in _SUFFIX.values():
            for name in ("", "q8_"):
                for decoding in ("",) if name == "" else ("_int8", "_e4m3", "_e5m2"):
                    getattr(library, f"paged_decode_attention_{name}{suffix}{decoding}"
                            ).argtypes = [ctypes.POINTER(_DecodeArgs)]
        library.paged_decode_features.restype = ctypes.c_int
        if hasattr(library, "paged_decode_workspace_floats"):  # not in older sources
            library.paged_decode_workspace_floats.argtypes = [ctypes.c_int64] * 5
            library.paged_decode_workspace_floats.restype = ctypes.c_int64
        if hasattr(library, "paged_decode_amx"):  # not in older sources (--rev builds of
            library.paged_decode_amx.argtypes = [ctypes.c_int]  # decode_kernel_variants.py)
            library.paged_decode_amx.restype = ctypes.c_int
        if hasattr(library, "paged_decode_vnni_int8"):
            library.paged_decode_vnni_int8.argtypes = [ctypes.c_int]
            library.paged_decode_vnni_int8.restype = ctypes.c_int
        if hasattr(library, "paged_decode_near_prefetch"):
            library.paged_decode_near_prefetch.argtypes = [ctypes.c_int]
            library.paged_decode_near_prefetch.restype = ctypes.c_int
            library.paged_decode_near_prefetch(int(native.cpu_vendor() == "GenuineIntel"))
        library.paged_store_q8.argtypes = [ctypes.POINTER(_StoreArgs)]
        library.paged_store_q8.restype = None
    return library
