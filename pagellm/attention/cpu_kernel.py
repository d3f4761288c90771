"""A compiled decode-attention kernel for the CPU, built on first use with the system C compiler.

Why: a decode step must read every cached K/V of every sequence once. The pure-torch path
(torch_backend.decode_attention) first gathers the context through the block tables into a
contiguous copy and then attends over it, so K/V cross memory three times; this kernel reads
them in place, once, in ascending physical-block order (see the C source below). It is an
accelerator, not a requirement: without a C compiler, on other devices, for float16, or with
``PAGELLM_CPU_KERNELS=0`` the torch path runs, and the tests hold both to the same reference.

The shared library is compiled with ``-march=native -fopenmp`` into
``$PAGELLM_CACHE_DIR`` (default ``~/.cache/pagellm``)/kernels, keyed by a hash of the source,
the flags, the compiler and the CPU, and loaded with ctypes. Its OpenMP runtime is the one
torch already loaded (same ``libgomp.so.1`` soname), so it follows ``torch.set_num_threads``
and shares torch's worker threads instead of competing with them.
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

import torch

logger = logging.getLogger("pagellm")

_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-fno-math-errno",
          "-fno-trapping-math", "-fassociative-math", "-fno-signed-zeros"]
_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}


class _DecodeArgs(ctypes.Structure):
    _fields_ = ([(name, ctypes.c_void_p) for name in (
        "q", "k_cache", "v_cache", "out", "pair_seq", "pair_block", "pair_phys", "seq_lens",
        "workspace")]
        + [(name, ctypes.c_int64) for name in (
            "num_pairs", "num_seqs", "num_heads", "num_kv_heads", "head_dim", "block_size",
            "max_seq_len", "window")]
        + [("scale", ctypes.c_float)])


class _Kernel:
    """The loaded library (or None after a failed build) and a reusable float32 workspace."""

    def __init__(self) -> None:
        self.library: ctypes.CDLL | None = None
        self.tried = False
        self.workspace = torch.empty(0)

    def load(self) -> ctypes.CDLL | None:
        if not self.tried:
            self.tried = True
            if os.environ.get("PAGELLM_CPU_KERNELS", "1") != "0":
                self.library = _build_and_load()
        return self.library

    def scratch(self, numel: int) -> torch.Tensor:
        """Grow-only, so that steps do not page-fault a fresh buffer in every layer."""
        if self.workspace.numel() < numel:
            self.workspace = torch.empty(int(numel * 1.25) + 1024)
        return self.workspace


_KERNEL = _Kernel()


def available() -> bool:
    """True when the kernel is built and loaded (building it on the first call)."""
    return _KERNEL.load() is not None


def supports(query: torch.Tensor) -> bool:
    return query.device.type == "cpu" and query.dtype in _SUFFIX and available()


def paged_decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           pairs: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                           seq_lens: torch.Tensor, max_seq_len: int, scale: float,
                           sliding_window: int | None = None) -> torch.Tensor:
    """query [num_seqs, num_heads, D] (one token each) -> output of the same shape.

    ``pairs`` = (sequence, logical block, physical block) of every block the batch reads,
    sorted by physical block (DecodeMetadata.block_pairs). Caller guarantees supports(query).
    """
    library = _KERNEL.load()
    num_seqs, num_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()
            and k_cache.dtype == v_cache.dtype == query.dtype):
        raise ValueError("paged_decode_attention needs contiguous caches of the query dtype")
    query = query.contiguous()
    out = torch.empty_like(query)
    pair_seq, pair_block, pair_phys = pairs
    workspace = _KERNEL.scratch(num_seqs * num_heads * (2 * head_dim + max_seq_len + 1))
    args = _DecodeArgs(
        query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
        pair_seq.data_ptr(), pair_block.data_ptr(), pair_phys.data_ptr(), seq_lens.data_ptr(),
        workspace.data_ptr(), len(pair_seq), num_seqs, num_heads, num_kv_heads, head_dim,
        block_size, max_seq_len, sliding_window or 0, scale)
    getattr(library, "paged_decode_attention_" + _SUFFIX[query.dtype])(ctypes.byref(args))
    return out


def _build_and_load() -> ctypes.CDLL | None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        logger.info("no C compiler found: CPU decode attention uses the torch path")
        return None
    key = hashlib.sha256("\n".join([_SOURCE, " ".join(_FLAGS), compiler, _cpu_id()])
                         .encode()).hexdigest()[:16]
    cache = Path(os.environ.get("PAGELLM_CACHE_DIR", "~/.cache/pagellm")).expanduser()
    target = cache / "kernels" / f"paged_decode_{key}.so"
    try:
        if not target.exists():
            _compile(compiler, target)
        library = ctypes.CDLL(str(target))
        for suffix in _SUFFIX.values():
            getattr(library, "paged_decode_attention_" + suffix).argtypes = [
                ctypes.POINTER(_DecodeArgs)]
        return library
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", b"") or b""
        logger.warning("could not build the CPU decode attention kernel (%s %s); using the "
                       "torch path", exc, detail.decode(errors="replace")[-500:])
        return None


def _compile(compiler: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        source, library = Path(tmp) / "paged_decode.c", Path(tmp) / "paged_decode.so"
        source.write_text(_SOURCE)
        subprocess.run([compiler, *_FLAGS, str(source), "-o", str(library)], check=True,
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


_SOURCE = r"""/* Paged decode attention on the CPU: one query token per sequence, K/V read in place through
   the block tables, without a gathered copy of the context.

   Memory order: the (sequence, logical block) pairs of the batch arrive sorted by physical
   block id; both passes walk them in that order and each block row by row, so the cache
   streams in ascending addresses wherever the allocator put the blocks (1.3-1.7x faster than
   walking each sequence's table, head by head). A thread owns whole sequences, or
   (sequence, KV head) items when there are fewer sequences than threads, and does every step
   for what it owns: no locks, no partial sums to merge.

   For each owned (sequence s, KV head h) and each of its G query heads g:
     pass 1:  score[j] = (q_g . k_j) * scale        for j in [start, len), float32 sums
     softmax: p[j] = exp(score[j] - max), 1 / sum   (float32)
     pass 2:  out_g = (sum_j round(p[j]) v_j) / sum
   where round() is to the cache dtype: with bfloat16 the weights are rounded before the
   weighted sum, as torch's flash attention does, so that greedy tokens follow transformers'
   bfloat16 runs closely (greedy tokens agree on 91% of positions before the first divergence
   with the rounding, 78% without; tests/model/test_bfloat16.py).
   with start = len - window under a sliding window, else 0. head_dim 64 and 128 and group
   sizes 1, 2, 3, 4, 8 are compiled with constant trip counts (several times faster inner
   loops); other shapes take the generic instance. */
#include <stdint.h>
#include <omp.h>

typedef uint16_t bf16_t;

static inline float load_f32(float x) { return x; }
static inline float store_f32(float x) { return x; }
static inline float load_bf16(bf16_t x) {
  union { uint32_t u; float f; } c;
  c.u = (uint32_t)x << 16;
  return c.f;
}
static inline bf16_t store_bf16(float x) { /* round to nearest even, as torch does */
  union { uint32_t u; float f; } c;
  c.f = x;
  if ((c.u & 0x7fffffffu) > 0x7f800000u) return (bf16_t)((c.u >> 16) | 0x40u); /* NaN */
  c.u += 0x7fffu + ((c.u >> 16) & 1u);
  return (bf16_t)(c.u >> 16);
}

/* exp(x) for x <= 0: 2^(x log2 e) as an integer power of two times a degree-6 polynomial on
   [0, 1); relative error < 2e-7. Plain arithmetic, so that the softmax loop vectorises. */
static inline float exp_nonpositive(float x) {
  x = x < -87.0f ? -87.0f : x;
  const float t = x * 1.4426950408889634f;
  const float fi = __builtin_floorf(t);
  const float f = t - fi;
  const float p = 1.0f + f * (0.69314718f + f * (0.24022652f + f * (0.05550411f
                  + f * (0.00961813f + f * (0.00133336f + f * 0.00015404f)))));
  union { uint32_t u; float f; } c;
  c.u = (uint32_t)((int32_t)fi + 127) << 23;
  return p * c.f;
}

typedef struct {
  const void* q;             /* [num_seqs, num_heads, head_dim] */
  const void* k_cache;       /* [num_blocks, block_size, num_kv_heads, head_dim] */
  const void* v_cache;
  void* out;                 /* [num_seqs, num_heads, head_dim] */
  const int64_t* pair_seq;   /* [num_pairs], pairs sorted by physical block */
  const int64_t* pair_block; /* [num_pairs] logical block index within its sequence */
  const int64_t* pair_phys;  /* [num_pairs] physical block id */
  const int64_t* seq_lens;   /* [num_seqs] */
  float* workspace;          /* num_seqs * num_heads * (2 * head_dim + 1 + max_seq_len) */
  int64_t num_pairs, num_seqs, num_heads, num_kv_heads, head_dim, block_size, max_seq_len;
  int64_t window;            /* sliding window, 0 = none */
  float scale;
} decode_args;

static inline int owns(int by_seq, int64_t s, int64_t h, int64_t kv_heads, int64_t nt,
                       int64_t tid) {
  return (by_seq ? s : s * kv_heads + h) % nt == tid;
}

static inline int64_t window_start(const decode_args* a, int64_t len) {
  return a->window > 0 && len > a->window ? len - a->window : 0;
}

/* Pass 1 for one pair: scores of the block's tokens for the owned heads of its sequence. */
#define DEFINE_SCORE_PAIR(NAME, T, LOAD)                                                     \
static inline void NAME(const decode_args* a, const float* restrict qf, float* restrict sc,  \
                        int64_t p, int by_seq, int64_t nt, int64_t tid, const int64_t D,     \
                        const int64_t G) {                                                   \
  const int64_t KVH = a->num_kv_heads, H = a->num_heads, bs = a->block_size;                 \
  const int64_t L = a->max_seq_len, s = a->pair_seq[p], len = a->seq_lens[s];                \
  const int64_t first = a->pair_block[p] * bs, start = window_start(a, len);                 \
  const int64_t lo = start > first ? start - first : 0;                                      \
  const int64_t hi = len - first < bs ? len - first : bs;                                    \
  const T* kb = (const T*)a->k_cache + a->pair_phys[p] * bs * KVH * D;                       \
  for (int64_t o = lo; o < hi; o++) {                                                        \
    for (int64_t h = 0; h < KVH; h++) {                                                      \
      if (!owns(by_seq, s, h, KVH, nt, tid)) continue;                                       \
      const T* restrict kr = kb + (o * KVH + h) * D;                                         \
      for (int64_t g = 0; g < G; g++) {                                                      \
        const float* restrict qg = qf + (s * H + h * G + g) * D;                             \
        float dot = 0.0f;                                                                    \
        for (int64_t d = 0; d < D; d++) dot += qg[d] * LOAD(kr[d]);                          \
        sc[(s * H + h * G + g) * L + first + o] = dot * a->scale;                            \
      }                                                                                      \
    }                                                                                        \
  }                                                                                          \
}

/* Pass 2 for one pair: acc += p * v over the block's tokens for the owned heads. */
#define DEFINE_VALUE_PAIR(NAME, T, LOAD, STORE)                                              \
static inline void NAME(const decode_args* a, const float* restrict sc, float* restrict acc, \
                        int64_t p, int by_seq, int64_t nt, int64_t tid, const int64_t D,     \
                        const int64_t G) {                                                   \
  const int64_t KVH = a->num_kv_heads, H = a->num_heads, bs = a->block_size;                 \
  const int64_t L = a->max_seq_len, s = a->pair_seq[p], len = a->seq_lens[s];                \
  const int64_t first = a->pair_block[p] * bs, start = window_start(a, len);                 \
  const int64_t lo = start > first ? start - first : 0;                                     \
  const int64_t hi = len - first < bs ? len - first : bs;                                    \
  const T* vb = (const T*)a->v_cache + a->pair_phys[p] * bs * KVH * D;                       \
  for (int64_t o = lo; o < hi; o++) {                                                        \
    for (int64_t h = 0; h < KVH; h++) {                                                      \
      if (!owns(by_seq, s, h, KVH, nt, tid)) continue;                                       \
      const T* restrict vr = vb + (o * KVH + h) * D;                                         \
      for (int64_t g = 0; g < G; g++) {                                                      \
        const float w = LOAD(STORE(sc[(s * H + h * G + g) * L + first + o]));                \
        float* restrict ag = acc + (s * H + h * G + g) * D;                                  \
        for (int64_t d = 0; d < D; d++) ag[d] += w * LOAD(vr[d]);                            \
      }                                                                                      \
    }                                                                                        \
  }                                                                                          \
}

/* Softmax numerators of a row in place; returns 1 / sum. */
static inline float softmax_row(float* restrict sc, int64_t start, int64_t len) {
  float mx = sc[start];
  for (int64_t j = start + 1; j < len; j++) mx = sc[j] > mx ? sc[j] : mx;
  float sum = 0.0f;
  for (int64_t j = start; j < len; j++) {
    const float e = exp_nonpositive(sc[j] - mx);
    sc[j] = e;
    sum += e;
  }
  return 1.0f / sum;
}

/* The whole kernel for one (dtype, head_dim, group size); trip counts are literals inside the
   parallel region so that they stay compile-time constants after OpenMP outlining. */
#define DEFINE_KERNEL(NAME, T, LOAD, STORE, HEAD_DIM, GROUP)                                 \
static void NAME(const decode_args* a) {                                                     \
  _Pragma("omp parallel")                                                                    \
  {                                                                                          \
    const int64_t D = HEAD_DIM, G = GROUP, KVH = a->num_kv_heads, H = a->num_heads;          \
    const int64_t S = a->num_seqs, L = a->max_seq_len;                                       \
    const int64_t nt = omp_get_num_threads(), tid = omp_get_thread_num();                    \
    const int by_seq = S >= nt;                                                              \
    float* qf = a->workspace;            /* [S, H, D] query as float */                      \
    float* acc = qf + S * H * D;         /* [S, H, D] */                                     \
    float* inv_sum = acc + S * H * D;    /* [S, H] */                                        \
    float* sc = inv_sum + S * H;         /* [S, H, L] */                                     \
    for (int64_t s = 0; s < S; s++)                                                          \
      for (int64_t h = 0; h < KVH; h++) {                                                    \
        if (!owns(by_seq, s, h, KVH, nt, tid)) continue;                                     \
        const T* qs = (const T*)a->q + (s * H + h * G) * D;                                  \
        for (int64_t i = 0; i < G * D; i++) {                                                \
          qf[(s * H + h * G) * D + i] = LOAD(qs[i]);                                         \
          acc[(s * H + h * G) * D + i] = 0.0f;                                               \
        }                                                                                    \
      }                                                                                      \
    for (int64_t p = 0; p < a->num_pairs; p++)                                               \
      if (!by_seq || a->pair_seq[p] % nt == tid)                                             \
        score_pair_##T(a, qf, sc, p, by_seq, nt, tid, HEAD_DIM, GROUP);                      \
    for (int64_t s = 0; s < S; s++)                                                          \
      for (int64_t h = 0; h < KVH; h++) {                                                    \
        if (!owns(by_seq, s, h, KVH, nt, tid)) continue;                                     \
        const int64_t len = a->seq_lens[s], start = window_start(a, len);                    \
        for (int64_t g = 0; g < G; g++)                                                      \
          inv_sum[s * H + h * G + g] = softmax_row(sc + (s * H + h * G + g) * L, start, len); \
      }                                                                                      \
    for (int64_t p = 0; p < a->num_pairs; p++)                                               \
      if (!by_seq || a->pair_seq[p] % nt == tid)                                             \
        value_pair_##T(a, sc, acc, p, by_seq, nt, tid, HEAD_DIM, GROUP);                     \
    for (int64_t s = 0; s < S; s++)                                                          \
      for (int64_t h = 0; h < KVH; h++) {                                                    \
        if (!owns(by_seq, s, h, KVH, nt, tid)) continue;                                     \
        T* os = (T*)a->out + (s * H + h * G) * D;                                            \
        for (int64_t g = 0; g < G; g++) {                                                    \
          const float inv = inv_sum[s * H + h * G + g];                                      \
          for (int64_t d = 0; d < D; d++)                                                    \
            os[g * D + d] = STORE(acc[(s * H + h * G + g) * D + d] * inv);                   \
        }                                                                                    \
      }                                                                                      \
  }                                                                                          \
}

#define DEFINE_GROUPS(SUFFIX, T, LOAD, STORE, HEAD_DIM, DIM_NAME)                            \
DEFINE_KERNEL(decode_##SUFFIX##_##DIM_NAME##_g1, T, LOAD, STORE, HEAD_DIM, 1)                \
DEFINE_KERNEL(decode_##SUFFIX##_##DIM_NAME##_g2, T, LOAD, STORE, HEAD_DIM, 2)                \
DEFINE_KERNEL(decode_##SUFFIX##_##DIM_NAME##_g3, T, LOAD, STORE, HEAD_DIM, 3)                \
DEFINE_KERNEL(decode_##SUFFIX##_##DIM_NAME##_g4, T, LOAD, STORE, HEAD_DIM, 4)                \
DEFINE_KERNEL(decode_##SUFFIX##_##DIM_NAME##_g8, T, LOAD, STORE, HEAD_DIM, 8)                \
DEFINE_KERNEL(decode_##SUFFIX##_##DIM_NAME##_gn, T, LOAD, STORE, HEAD_DIM,                   \
              a->num_heads / a->num_kv_heads)                                                \
static void decode_##SUFFIX##_##DIM_NAME(const decode_args* a) {                             \
  switch (a->num_heads / a->num_kv_heads) {                                                  \
    case 1: decode_##SUFFIX##_##DIM_NAME##_g1(a); break;                                     \
    case 2: decode_##SUFFIX##_##DIM_NAME##_g2(a); break;                                     \
    case 3: decode_##SUFFIX##_##DIM_NAME##_g3(a); break;                                     \
    case 4: decode_##SUFFIX##_##DIM_NAME##_g4(a); break;                                     \
    case 8: decode_##SUFFIX##_##DIM_NAME##_g8(a); break;                                     \
    default: decode_##SUFFIX##_##DIM_NAME##_gn(a);                                           \
  }                                                                                          \
}

#define DEFINE_DTYPE(SUFFIX, T, LOAD, STORE)                                                 \
DEFINE_SCORE_PAIR(score_pair_##T, T, LOAD)                                                   \
DEFINE_VALUE_PAIR(value_pair_##T, T, LOAD, STORE)                                            \
DEFINE_GROUPS(SUFFIX, T, LOAD, STORE, 64, 64)                                                \
DEFINE_GROUPS(SUFFIX, T, LOAD, STORE, 128, 128)                                              \
DEFINE_GROUPS(SUFFIX, T, LOAD, STORE, a->head_dim, any)                                      \
void paged_decode_attention_##SUFFIX(const decode_args* a) {                                 \
  if (a->head_dim == 64) decode_##SUFFIX##_64(a);                                            \
  else if (a->head_dim == 128) decode_##SUFFIX##_128(a);                                     \
  else decode_##SUFFIX##_any(a);                                                             \
}

DEFINE_DTYPE(f32, float, load_f32, store_f32)
DEFINE_DTYPE(bf16, bf16_t, load_bf16, store_bf16)
"""
