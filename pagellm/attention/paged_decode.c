/* Paged decode attention on the CPU: one query token per sequence, K/V read in place through
   the block tables, without a gathered copy of the context.

   With G query heads per KV head, for each sequence and query head g:
     pass 1:  score[j] = (q_g . k_j) * scale
     softmax: p[j] = exp(score[j] - max), 1 / sum   (float32)
     pass 2:  out_g = (sum_j round(p[j]) v_j) / sum
   where round() is to the cache dtype: with bfloat16 the weights are rounded before the
   weighted sum, as torch's flash attention does, so that greedy tokens follow transformers'
   bfloat16 runs closely (tests/model/test_bfloat16.py). j runs over [len - window, len) under
   a sliding window, else [0, len).

   Memory order: decode attention is bound by reading K/V, so the passes walk the batch's
   (sequence, logical block) pairs sorted by physical block, each thread one contiguous range
   of them: every thread streams the cache in ascending addresses, whatever the block tables
   look like, and prefetches (into L2) the block two pairs ahead for where the batch's blocks
   leave gaps. A sequence's blocks may fall to several threads: scores land in disjoint
   places of its row, and pass 2 accumulates into one partial sum per thread, added up at the
   end. Barriers separate pass 1, the softmax (by rows), pass 2 and the final sum.
   The 8-bit caches' kernels run in a single pass instead (DEFINE_Q8_ONLINE_KERNEL): each
   (block, KV head) step's scores become its weights against a running maximum at once, and
   each thread's rows are merged at the end.

   Inner loops, chosen at compile time:
   - AVX-512 (head_dim a multiple of 32, at most 256): 16 keys' dot products at a time,
     reduced together by a transposing add tree (one horizontal sum per key costs more than
     the dot product); bfloat16 uses the CPU's bfloat16 dot-product instruction where it has
     one (AVX512-BF16: products exact, sums in float32), two keys per instruction in pass 2;
   - AVX2 + FMA + F16C without AVX-512, and for bfloat16 on AVX-512 CPUs without
     AVX512-BF16 (same shapes): each K/V row converted to float32 in registers once for up
     to 3 query heads, float32 FMAs (see "AVX2 inner loops");
   - portable C otherwise (any head_dim; -DPAGELLM_PORTABLE forces it, so tests cover both);
   - and for the 8-bit caches with bfloat16 queries, on CPUs with AMX-BF16 where Linux grants
     the tile registers, the dot products of scores and weighted sum on the tiles ("AMX"
     below).
   head_dim 64 and 128 and group sizes 1, 2, 3, 4 and 8 are compiled with constant trip
   counts; other shapes take a generic instance. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#if defined(__AVX512F__) && !defined(PAGELLM_PORTABLE)
#include <immintrin.h>
#define USE_AVX512 1
#if defined(__AVX512BF16__)
#define USE_AVX512_BF16 1
#if defined(__AVX512VBMI__)
#define USE_Q8_PLANES 1 /* the 8-bit caches' table lookups ("AVX512-VBMI" below) */
#if defined(__AVX512VNNI__)
#define USE_Q8_VNNI 1   /* and int8's integer products ("AVX512-VNNI" below) */
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define USE_Q8_AMX 1    /* and their tile products ("AMX" below) */
#include <sys/syscall.h>
#include <unistd.h>
#endif
#endif
#endif
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(PAGELLM_PORTABLE)
#include <immintrin.h>
#define USE_AVX2 1
#ifndef USE_AVX512
#define USE_AVX2_F32 1  /* float32 and 8-bit caches: without AVX-512 */
#endif
#ifndef USE_AVX512_BF16
#define USE_AVX2_BF16 1 /* bfloat16: without AVX512-BF16 */
#endif
#endif

/* Split builds: the library is linked from three objects compiled side by side
   (pagellm.native.build_and_load, parts=3), -DPAGELLM_PART=k compiling part k's instances:
   0 the float32 kernels (and what the library needs once: paged_decode_features, the 8-bit
   store), 1 the bfloat16 ones, 2 the 8-bit caches'. Without PAGELLM_PART, all of them. */
#if !defined(PAGELLM_PART) || PAGELLM_PART == 0
#define PART_F32 1
#endif
#if !defined(PAGELLM_PART) || PAGELLM_PART == 1
#define PART_BF16 1
#endif
#if !defined(PAGELLM_PART) || PAGELLM_PART == 2
#define PART_Q8 1
#endif

#define INLINE static inline __attribute__((always_inline))
#define TILE_KEYS 32 /* the 8-bit kernels' keys per (block, KV head) step */

typedef uint16_t bf16_t;

INLINE float load_f32(float x) { return x; }
INLINE float store_f32(float x) { return x; }
INLINE float load_bf16(bf16_t x) {
  union { uint32_t u; float f; } c;
  c.u = (uint32_t)x << 16;
  return c.f;
}
INLINE bf16_t store_bf16(float x) { /* round to nearest even, as torch does */
  union { uint32_t u; float f; } c;
  c.f = x;
  if ((c.u & 0x7fffffffu) > 0x7f800000u) return (bf16_t)((c.u >> 16) | 0x40u); /* NaN */
  c.u += 0x7fffu + ((c.u >> 16) & 1u);
  return (bf16_t)(c.u >> 16);
}

/* The softmax's exp follows torch's CPU flash attention (what transformers' sdpa runs), so that
   the bfloat16-rounded weights agree with it as often as possible: 16 values at a time by the
   range reduction and degree-5 polynomial of torch's vectorised exp_u20 (x = n ln2 + r with
   n = floor(x log2e + 1/2); exp(r) by the polynomial; times 2^n, zero below ln(FLT_MIN)), the
   last (length mod 16) values of a row by libm's expf. Measured effect: greedy agreement with
   transformers in tests/model/test_bfloat16.py rises from 89.3% to 90.6%. */
#define LN_FLT_MIN -87.3365448f
#define EXP_POLY(FMA, R)                                                                     \
  FMA(R, FMA(R, FMA(R, FMA(R, FMA(R, K(0.00828929059f), K(0.0418978221f)),                    \
  K(0.166676521f)), K(0.499991506f)), K(0.999999701f)), K(1.0f))
INLINE float exp_u20(float x) {
#define K(c) (c)
  if (x < LN_FLT_MIN) return 0.0f;
  const float n = __builtin_floorf(__builtin_fmaf(x, 1.44269502f, 0.5f));
  const float r = __builtin_fmaf(-n, 0.693147182f, x);
  const float p = EXP_POLY(__builtin_fmaf, r);
  union { uint32_t u; float f; } two_n_minus_1;
  two_n_minus_1.u = (uint32_t)((int32_t)n - 1 + 127) << 23;
  return p * two_n_minus_1.f * 2.0f;
#undef K
}

typedef struct {
  const void* q;             /* [num_seqs, num_heads, head_dim] */
  void* k_cache;             /* [num_blocks, block_size, num_kv_heads, head_dim] */
  void* v_cache;
  void* out;                 /* [num_seqs, num_heads, head_dim] */
  const void* new_k;         /* the step's K/V rows [num_seqs, num_kv_heads, head_dim], row */
  const void* new_v;         /* stride new_stride, written to new_slots first; NULL: written */
  const int64_t* new_slots;  /* [num_seqs] cache slot of each row, -1 = padding, not written */
  const int64_t* pair_seq;   /* [num_pairs], pairs sorted by physical block */
  const int64_t* pair_block; /* [num_pairs] logical block index within its sequence */
  const int64_t* pair_phys;  /* [num_pairs] physical block id */
  const int64_t* seq_lens;   /* [num_seqs] */
  float* workspace;          /* workspace_floats() */
  int64_t num_pairs, num_seqs, num_heads, num_kv_heads, head_dim, block_size, max_seq_len;
  int64_t window;            /* sliding window, 0 = none */
  int64_t num_threads;       /* at most this many threads (one partial sum each) */
  int64_t new_stride;
  float scale;
  const float* lut;          /* 8-bit caches in a table format (fp8): the value of each byte */
} decode_args;

/* Store the step's K/V rows of sequences [begin, end) in their slots (before attending: a
   sequence's newest key is part of its context). */
#define DEFINE_WRITE(NAME, T)                                                                \
INLINE void NAME(const decode_args* a, int64_t begin, int64_t end, const int64_t D) {        \
  const int64_t row = a->num_kv_heads * D;                                                   \
  for (int64_t s = begin; s < end; s++) {                                                    \
    const int64_t slot = a->new_slots[s];                                                    \
    if (slot < 0) continue;                                                                  \
    memcpy((T*)a->k_cache + slot * row, (const T*)a->new_k + s * a->new_stride,              \
           row * sizeof(T));                                                                 \
    memcpy((T*)a->v_cache + slot * row, (const T*)a->new_v + s * a->new_stride,              \
           row * sizeof(T));                                                                 \
  }                                                                                          \
}
DEFINE_WRITE(write_float, float)
DEFINE_WRITE(write_bf16_t, bf16_t)

/* Workspace: per (sequence, query head) row, scores [max_seq_len] float32 (by position), the
   rounded bfloat16 weights [max_seq_len] and 1 / softmax sum, padded to whole 64-byte lines;
   then num_threads partial output sums [num_seqs * num_heads, head_dim] float32. With the
   rows on line boundaries (cpu_kernel.decode_workspace's buffer is 64-byte aligned), a block
   of 16 keys' scores is one line of its own: no line is split between blocks, which the
   threads take in physical order, not by sequence, and would otherwise write side by side.
   The single-pass kernels keep no scores: a row holds their threads' running maxima and sums
   instead, a line per thread (online_state), so a row has at least 16 floats per thread. */
INLINE int64_t row_floats(const decode_args* a) {
  const int64_t scores = a->max_seq_len + (a->max_seq_len + 1) / 2 + 1;
  return ((scores > 16 * a->num_threads ? scores : 16 * a->num_threads) + 15) / 16 * 16;
}
INLINE float* partial_sum(const decode_args* a, int64_t t, int64_t row) {
  const int64_t rows = a->num_seqs * a->num_heads;
  return a->workspace + rows * row_floats(a) + (t * rows + row) * a->head_dim;
}
/* After the partial sums: the query areas of the AMX and AVX512-VNNI kernels (head_dim / 2
   + 2 floats per row), then (AMX) each thread's state from the next 64-byte line. */
INLINE float* query_area(const decode_args* a) {
  return partial_sum(a, a->num_threads, 0);
}

/* ---- portable inner loops ------------------------------------------------------------- */

/* out[i] = scale * (q . k_i) for the n rows k_i = k + i * ks. */
#define DEFINE_PORTABLE_SCORE(NAME, T, LOAD)                                                 \
INLINE void NAME(const T* restrict q, const T* restrict k, int64_t ks, int64_t n,            \
                 float scale, float* restrict out, const int64_t D) {                         \
  for (int64_t i = 0; i < n; i++) {                                                          \
    const T* restrict kr = k + i * ks;                                                       \
    float dot = 0.0f;                                                                        \
    for (int64_t d = 0; d < D; d++) dot += LOAD(q[d]) * LOAD(kr[d]);                         \
    out[i] = dot * scale;                                                                    \
  }                                                                                          \
}

/* acc_g += sum_i w_g[i] v_i for g < G, the n rows v_i = v + i * vs; w_g = w + g * ws and
   acc_g = acc + g * D. */
#define DEFINE_PORTABLE_VALUE(NAME, T, W, LOAD, LOADW)                                       \
INLINE void NAME(const W* w, int64_t ws, const T* restrict v, int64_t vs, int64_t n,         \
                 float* restrict acc, const int64_t D, const int64_t G) {                    \
  for (int64_t i = 0; i < n; i++) {                                                          \
    const T* restrict vr = v + i * vs;                                                       \
    for (int64_t g = 0; g < G; g++) {                                                        \
      const float wg = LOADW(w[g * ws + i]);                                                 \
      for (int64_t d = 0; d < D; d++) acc[g * D + d] += wg * LOAD(vr[d]);                    \
    }                                                                                        \
  }                                                                                          \
}

DEFINE_PORTABLE_SCORE(score_f32_portable, float, load_f32)
DEFINE_PORTABLE_SCORE(score_bf16_portable, bf16_t, load_bf16)
DEFINE_PORTABLE_VALUE(value_f32_portable, float, float, load_f32, load_f32)
DEFINE_PORTABLE_VALUE(value_bf16_portable, bf16_t, bf16_t, load_bf16, load_bf16)

/* ---- the prefetch cursor ----------------------------------------------------------------- */
/* The software prefetches of the block PREFETCH_AHEAD pairs ahead (see "the kernel") are
   issued a line at a time from inside the AVX-512 loops, interleaved with the arithmetic,
   not as one burst per (pair, KV head): a burst of a head's 16-33 lines fills the core's fill
   buffers, and the loops' own L2 hits then wait behind it. Measured on an AMX Xeon (K/V from
   memory, 64 x 512, one thread): bfloat16 1.3x and int8 1.1x faster per key than the bursts
   (docs/BENCHMARKS.md, "Prefetches spread over the loops"). The kernel starts the cursor on
   a (pair, KV head)'s share with prefetch_start; the loops over cache rows call
   prefetch_step once per 64 bytes they read (not over the 8-bit kernels' tiles, which are in
   L1); prefetch_flush, after each head's work, issues what they left. The portable and AVX2
   loops take no steps, so they issue each share as one burst after the head's work: steps in
   the AVX2 loops made them slower on the same Xeon built without AVX-512 (8-bit from memory
   1.1-1.2x, all dtypes with the K/V in L2 1.4x). One cursor per thread.
   The cursor's second range (prefetch_near, the 8-bit AVX-512 kernels on Intel CPUs: see
   "near prefetch" in the kernel) is brought into L1 (prefetcht0), a line at each step
   beside the first range's. */
typedef struct { const char *next, *end, *near, *near_end; } prefetch_cursor;
static __thread prefetch_cursor prefetch_at __attribute__((tls_model("initial-exec")));
INLINE void prefetch_step(void) {
  if (prefetch_at.next < prefetch_at.end) {
    __builtin_prefetch(prefetch_at.next, 0, 1); /* prefetcht2 ("the kernel" says why) */
    prefetch_at.next += 64;
  }
  if (prefetch_at.near < prefetch_at.near_end) {
    __builtin_prefetch(prefetch_at.near, 0, 3); /* prefetcht0 */
    prefetch_at.near += 64;
  }
}
INLINE void prefetch_flush(void) {
  while (prefetch_at.next < prefetch_at.end || prefetch_at.near < prefetch_at.near_end)
    prefetch_step();
}
INLINE void prefetch_start(const char* from, int64_t bytes) {
  while (prefetch_at.next < prefetch_at.end) prefetch_step();
  prefetch_at.next = from;
  prefetch_at.end = from + bytes;
}
INLINE void prefetch_near(const char* from, int64_t bytes) {
  prefetch_at.near = from;
  prefetch_at.near_end = from + bytes;
}
/* The steps of a row of D elements of T read by one loop iteration: one per 64 bytes. */
#define PREFETCH_STEPS(D, T)                                                                 \
  for (int64_t s_ = 0; s_ < (D) * (int64_t)sizeof(T); s_ += 64) prefetch_step()

/* ---- AVX-512 inner loops ------------------------------------------------------------- */
#ifdef USE_AVX512
/* r[i] = horizontal sum of x[i], for 16 vectors at once: 45 instructions instead of 16
   separate reductions of about 9 each. */
INLINE __m512 sum16(const __m512* x) {
  __m512 two[8], four[4], eight[2];
  for (int i = 0; i < 8; i++)  /* lane-wise: (x0+x2, y0+y2, x1+x3, y1+y3) */
    two[i] = _mm512_add_ps(_mm512_unpacklo_ps(x[2 * i], x[2 * i + 1]),
                           _mm512_unpackhi_ps(x[2 * i], x[2 * i + 1]));
  for (int i = 0; i < 4; i++) { /* lane-wise sums of four vectors */
    const __m512d a = _mm512_castps_pd(two[2 * i]), b = _mm512_castps_pd(two[2 * i + 1]);
    four[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                            _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  for (int i = 0; i < 2; i++)  /* fold 128-bit lanes 0+1 and 2+3 */
    eight[i] = _mm512_add_ps(_mm512_shuffle_f32x4(four[2 * i], four[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(four[2 * i], four[2 * i + 1], 0xdd));
  return _mm512_add_ps(_mm512_shuffle_f32x4(eight[0], eight[1], 0x88),
                       _mm512_shuffle_f32x4(eight[0], eight[1], 0xdd));
}

/* The dot-product skeleton shared by both dtypes: DOT(q registers, row) -> 16 partial sums;
   STEPS (1 or 0) whether each row read takes its prefetch steps (cache rows do, the 8-bit
   kernels' tiles in L1 do not). */
#define DEFINE_AVX512_SCORE(NAME, T, QREG, QLOAD, DOT, STEPS)                                \
INLINE void NAME(const T* restrict q, const T* restrict k, int64_t ks, int64_t n,            \
                 float scale, float* restrict out, const int64_t D) {                         \
  QREG qv[16];                                                                               \
  for (int64_t c = 0; c < D / (64 / (int64_t)sizeof(T)); c++) qv[c] = QLOAD(q, c);           \
  const __m512 sv = _mm512_set1_ps(scale);                                                   \
  int64_t i = 0;                                                                             \
  for (; i + 16 <= n; i += 16) {                                                             \
    __m512 dots[16];                                                                         \
    _Pragma("GCC unroll 16")                                                                 \
    for (int u = 0; u < 16; u++) {                                                           \
      if (STEPS) PREFETCH_STEPS(D, T);                                                       \
      dots[u] = DOT(qv, k + (i + u) * ks, D);                                                \
    }                                                                                        \
    _mm512_storeu_ps(out + i, _mm512_mul_ps(sum16(dots), sv));                               \
  }                                                                                          \
  for (; i < n; i++) out[i] = _mm512_reduce_add_ps(DOT(qv, k + i * ks, D)) * scale;          \
}

/* The weighted-sum skeleton: 32 dimensions at a time, so that the 2 x (up to 8) accumulators
   of a group of query heads stay in registers. STEP(rows i.., dims dc..) updates a0, a1. */
#define DEFINE_AVX512_VALUE(NAME, T, W, STEP, KEYS)                                          \
INLINE void NAME(const W* w, int64_t ws, const T* restrict v, int64_t vs, int64_t n,         \
                 float* restrict acc, const int64_t D, const int64_t G) {                    \
  for (int64_t g0 = 0; g0 < G; g0 += 8) {                                                    \
    const int64_t gn = G - g0 < 8 ? G - g0 : 8;                                              \
    for (int64_t dc = 0; dc < D; dc += 32) {                                                 \
      __m512 a0[8], a1[8];                                                                   \
      for (int64_t g = 0; g < gn; g++) {                                                     \
        a0[g] = _mm512_loadu_ps(acc + (g0 + g) * D + dc);                                    \
        a1[g] = _mm512_loadu_ps(acc + (g0 + g) * D + dc + 16);                               \
      }                                                                                      \
      for (int64_t i = 0; i < n; i += KEYS)                                                  \
        STEP(w + g0 * ws, ws, v + i * vs + dc, vs, i, n, a0, a1, gn);                         \
      for (int64_t g = 0; g < gn; g++) {                                                     \
        _mm512_storeu_ps(acc + (g0 + g) * D + dc, a0[g]);                                    \
        _mm512_storeu_ps(acc + (g0 + g) * D + dc + 16, a1[g]);                               \
      }                                                                                      \
    }                                                                                        \
  }                                                                                          \
}

INLINE __m512 qload_f32(const float* q, int64_t c) { return _mm512_loadu_ps(q + 16 * c); }
INLINE __m512 dot_f32(const __m512* qv, const float* k, const int64_t D) {
  __m512 x = _mm512_mul_ps(qv[0], _mm512_loadu_ps(k));
  for (int64_t c = 1; c < D / 16; c++) x = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(k + 16 * c), x);
  return x;
}
/* One key: a += w_g[i] * v_i[dc .. dc + 32). */
INLINE void step_f32(const float* w, int64_t ws, const float* v, int64_t vs, int64_t i,
                     int64_t n, __m512* a0, __m512* a1, const int64_t gn) {
  (void)vs; (void)n;
  const __m512 x0 = _mm512_loadu_ps(v), x1 = _mm512_loadu_ps(v + 16);
  for (int64_t g = 0; g < gn; g++) {
    const __m512 wg = _mm512_set1_ps(w[g * ws + i]);
    a0[g] = _mm512_fmadd_ps(wg, x0, a0[g]);
    a1[g] = _mm512_fmadd_ps(wg, x1, a1[g]);
  }
}
DEFINE_AVX512_SCORE(score_f32_avx512, float, __m512, qload_f32, dot_f32, 1)
DEFINE_AVX512_SCORE(score_f32_tile_avx512, float, __m512, qload_f32, dot_f32, 0)
DEFINE_AVX512_VALUE(value_f32_avx512, float, float, step_f32, 1)
#endif

#ifdef USE_AVX512_BF16
INLINE __m512bh qload_bf16(const bf16_t* q, int64_t c) {
  return (__m512bh)_mm512_loadu_si512(q + 32 * c);
}
INLINE __m512 dot_bf16(const __m512bh* qv, const bf16_t* k, const int64_t D) {
  __m512 x = _mm512_setzero_ps();
  for (int64_t c = 0; c < D / 32; c++)
    x = _mm512_dpbf16_ps(x, qv[c], (__m512bh)_mm512_loadu_si512(k + 32 * c));
  return x;
}
/* (w[0], w[1]) broadcast as one little-endian word; (w[0], 0) without a pair. */
INLINE __m512bh weight_pair(const bf16_t* w, int pair) {
  uint32_t both;
  memcpy(&both, w, sizeof both);
  return (__m512bh)_mm512_set1_epi32((int32_t)(pair ? both : both & 0xffffu));
}
/* Keys i and i + 1 in one instruction: their rows interleaved element by element against
   (w_g[i], w_g[i + 1]) broadcast as a pair. */
INLINE void step_bf16(const bf16_t* w, int64_t ws, const bf16_t* v, int64_t vs, int64_t i,
                      int64_t n, __m512* a0, __m512* a1, const int64_t gn) {
  const __m512i lo_index = _mm512_set_epi16(
      47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
      39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi_index = _mm512_add_epi16(lo_index, _mm512_set1_epi16(16));
  const int pair = i + 1 < n;
  PREFETCH_STEPS(64, bf16_t); /* the two keys' 32 dimensions */
  const __m512i x = _mm512_loadu_si512(v);
  const __m512i y = pair ? _mm512_loadu_si512(v + vs) : _mm512_setzero_si512();
  const __m512bh lo = (__m512bh)_mm512_permutex2var_epi16(x, lo_index, y);
  const __m512bh hi = (__m512bh)_mm512_permutex2var_epi16(x, hi_index, y);
  for (int64_t g = 0; g < gn; g++) {
    const __m512bh wg = weight_pair(w + g * ws + i, pair);
    a0[g] = _mm512_dpbf16_ps(a0[g], wg, lo);
    a1[g] = _mm512_dpbf16_ps(a1[g], wg, hi);
  }
}
DEFINE_AVX512_SCORE(score_bf16_avx512, bf16_t, __m512bh, qload_bf16, dot_bf16, 1)
DEFINE_AVX512_SCORE(score_bf16_tile_avx512, bf16_t, __m512bh, qload_bf16, dot_bf16, 0)
DEFINE_AVX512_VALUE(value_bf16_avx512, bf16_t, bf16_t, step_bf16, 2)
#endif

#ifdef USE_AVX512
/* The first n of 16 lanes (none for n <= 0). */
INLINE __mmask16 first_lanes(int64_t n) {
  return n >= 16 ? (__mmask16)0xffff : n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1);
}
INLINE __m512 exp512_u20(__m512 x) { /* exp_u20, 16 at a time */
#define K(c) _mm512_set1_ps(c)
  const __mmask16 underflow = _mm512_cmp_ps_mask(x, K(LN_FLT_MIN), _CMP_LT_OS);
  x = _mm512_max_ps(K(LN_FLT_MIN), x); /* x second: a NaN stays NaN (max returns it) */
  const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, K(1.44269502f), K(0.5f)),
                                        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fnmadd_ps(n, K(0.693147182f), x);
  const __m512 p = EXP_POLY(_mm512_fmadd_ps, r);
  const __m512i e = _mm512_slli_epi32(
      _mm512_add_epi32(_mm512_cvtps_epi32(_mm512_sub_ps(n, K(1.0f))), _mm512_set1_epi32(127)), 23);
  const __m512 two_n_minus_1 = _mm512_maskz_mov_ps((__mmask16)~underflow, _mm512_castsi512_ps(e));
  return _mm512_mul_ps(_mm512_mul_ps(p, two_n_minus_1), K(2.0f));
#undef K
}
#endif

/* ---- AVX2 inner loops ------------------------------------------------------------------
   For CPUs with AVX2, FMA and F16C but no AVX-512, and for the bfloat16 cache where AVX-512
   lacks AVX512-BF16 (head_dim a multiple of 32, at most 256).
   Each key row is converted to float32 eight values at a time in registers (bfloat16 by a
   shift, int8 by sign extension, fp8 through float16 as below) and used there for up to 3
   query heads of its KV head (head_chunk): no tile, no copy. Products of bfloat16 (or 8-bit)
   values are exact in float32 and the sums are float32, as in the AVX-512 loops.
   - Scores: 4 keys x (up to) 3 heads of 8-lane partial sums, reduced 4 keys at a time by a
     transposing add tree (sum4).
   - Weighted sum: 32 dimensions x (up to) 3 heads of accumulators, one FMA chain each (12
     independent chains), each weight broadcast from float32 once per 32 dimensions: the
     bfloat16 kernel rounds its weights in place (softmax_rows), the 8-bit ones take them
     times the rows' scales. */
#ifdef USE_AVX2
INLINE __m256 cvt8_f32(const float* r, int64_t c) { return _mm256_loadu_ps(r + 8 * c); }
INLINE __m256 cvt8_bf16(const bf16_t* r, int64_t c) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(
      _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(r + 8 * c))), 16));
}
INLINE __m128i load8(const uint8_t* r, int64_t c) {
  return _mm_loadl_epi64((const __m128i*)(r + 8 * c));
}
INLINE __m256 cvt8_int8(const uint8_t* r, int64_t c) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(load8(r, c)));
}
INLINE __m256 cvt8_e5m2(const uint8_t* r, int64_t c) { /* the high byte of a float16 */
  return _mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(load8(r, c)), 8));
}
INLINE __m256 cvt8_e4m3(const uint8_t* r, int64_t c) { /* the value times 2^-8 (cvt_e4m3) */
  const __m128i x = _mm_slli_epi16(_mm_cvtepi8_epi16(load8(r, c)), 7);
  return _mm256_cvtph_ps(_mm_and_si128(x, _mm_set1_epi16((short)0xBF80)));
}
INLINE float hsum8(__m256 x) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
/* The horizontal sums of a0..a3. */
INLINE __m128 sum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  /* per 128-bit half: (a0, a1) lane pairs summed, then (a2, a3), then the halves */
  const __m256 s01 = _mm256_add_ps(_mm256_unpacklo_ps(a0, a1), _mm256_unpackhi_ps(a0, a1));
  const __m256 s23 = _mm256_add_ps(_mm256_unpacklo_ps(a2, a3), _mm256_unpackhi_ps(a2, a3));
  const __m256d x = _mm256_castps_pd(s01), y = _mm256_castps_pd(s23);
  const __m256 h = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(x, y)),
                                 _mm256_castpd_ps(_mm256_unpackhi_pd(x, y)));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}
INLINE float no_row_scale(const void* row, int64_t D) { (void)row; (void)D; return 1.0f; }
/* Query heads per chunk of the AVX2 loops, for the `left` heads not done yet: 3 (the most
   whose accumulators fit the 16 registers), but 2 + 2 rather than 3 + 1. */
INLINE int64_t head_chunk(int64_t left) { return left >= 3 && left != 4 ? 3 : left < 2 ? 1 : 2; }

/* out_g[i] = scale * rs_i * (qf_g . k_i) for GN (<= 3) float32 query rows qf_g = qf + g * D
   and the n rows k_i = k + i * ks with scales rs_i = RSCALE(k_i); out_g = out + g * os. */
#define DEFINE_AVX2_SCORE_HEADS(NAME, T, CVT, RSCALE)                                        \
INLINE void NAME(const float* restrict qf, const T* restrict k, int64_t ks, int64_t n,       \
                 float scale, float* restrict out, int64_t os, const int64_t D,              \
                 const int64_t GN) {                                                         \
  int64_t i = 0;                                                                             \
  for (; i + 4 <= n; i += 4) {                                                               \
    __m256 acc[3][4];                                                                        \
    for (int64_t g = 0; g < GN; g++)                                                         \
      for (int u = 0; u < 4; u++) acc[g][u] = _mm256_setzero_ps();                           \
    _Pragma("GCC unroll 8")                                                                  \
    for (int64_t c = 0; c < D / 8; c++) {                                                    \
      __m256 qc[3];                                                                          \
      for (int64_t g = 0; g < GN; g++) qc[g] = _mm256_loadu_ps(qf + g * D + 8 * c);         \
      for (int u = 0; u < 4; u++) {                                                          \
        const __m256 x = CVT(k + (i + u) * ks, c);                                           \
        for (int64_t g = 0; g < GN; g++) acc[g][u] = _mm256_fmadd_ps(qc[g], x, acc[g][u]);   \
      }                                                                                      \
    }                                                                                        \
    const __m128 s = _mm_mul_ps(_mm_set1_ps(scale), _mm_setr_ps(                             \
        RSCALE(k + i * ks, D), RSCALE(k + (i + 1) * ks, D), RSCALE(k + (i + 2) * ks, D),     \
        RSCALE(k + (i + 3) * ks, D)));                                                       \
    for (int64_t g = 0; g < GN; g++)                                                         \
      _mm_storeu_ps(out + g * os + i,                                                        \
                    _mm_mul_ps(sum4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]), s));        \
  }                                                                                          \
  for (; i < n; i++) {                                                                       \
    __m256 acc[3];                                                                           \
    for (int64_t g = 0; g < GN; g++) acc[g] = _mm256_setzero_ps();                           \
    for (int64_t c = 0; c < D / 8; c++) {                                                    \
      const __m256 x = CVT(k + i * ks, c);                                                   \
      for (int64_t g = 0; g < GN; g++)                                                       \
        acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(qf + g * D + 8 * c), x, acc[g]);            \
    }                                                                                        \
    for (int64_t g = 0; g < GN; g++)                                                         \
      out[g * os + i] = hsum8(acc[g]) * (scale * RSCALE(k + i * ks, D));                     \
  }                                                                                          \
}

/* The same for G query heads of query dtype QT (rows q + g * D), head_chunk() at a time: each
   chunk's rows converted to float32 once (QCVT), then HEADS with a literal head count. */
#define DEFINE_AVX2_SCORE(NAME, QT, QCVT, T, HEADS)                                          \
INLINE void NAME(const QT* restrict q, const T* restrict k, int64_t ks, int64_t n,           \
                 float scale, float* restrict out, int64_t os, const int64_t D,              \
                 const int64_t G) {                                                          \
  float qf[3 * 256];                                                                         \
  for (int64_t g0 = 0, gn; g0 < G; g0 += gn) {                                              \
    gn = head_chunk(G - g0);                                                                 \
    for (int64_t g = 0; g < gn; g++)                                                         \
      for (int64_t c = 0; c < D / 8; c++)                                                    \
        _mm256_storeu_ps(qf + g * D + 8 * c, QCVT(q + (g0 + g) * D, c));                     \
    if (gn == 3) HEADS(qf, k, ks, n, scale, out + g0 * os, os, D, 3);                        \
    else if (gn == 2) HEADS(qf, k, ks, n, scale, out + g0 * os, os, D, 2);                   \
    else HEADS(qf, k, ks, n, scale, out + g0 * os, os, D, 1);                                \
  }                                                                                          \
}

/* acc_g += sum_i w_g[i] v_i for GN (<= 3) heads: w_g = w + g * ws (float32), the n rows
   v_i = v + i * vs, acc_g = acc + g * D; 32 dimensions at a time: 12 accumulators, the GN
   weights of a key broadcast once for its 4 vectors (16 registers in all). */
#define DEFINE_AVX2_VALUE_HEADS(NAME, T, CVT)                                                \
INLINE void NAME(const float* restrict w, int64_t ws, const T* restrict v, int64_t vs,       \
                 int64_t n, float* restrict acc, const int64_t D, const int64_t GN) {        \
  for (int64_t dc = 0; dc < D; dc += 32) {                                                   \
    __m256 a[3][4];                                                                          \
    for (int64_t g = 0; g < GN; g++)                                                         \
      for (int u = 0; u < 4; u++) a[g][u] = _mm256_loadu_ps(acc + g * D + dc + 8 * u);       \
    for (int64_t i = 0; i < n; i++) {                                                        \
      const T* r = v + i * vs;                                                               \
      __m256 wg[3];                                                                          \
      for (int64_t g = 0; g < GN; g++) wg[g] = _mm256_broadcast_ss(w + g * ws + i);          \
      for (int u = 0; u < 4; u++) {                                                          \
        const __m256 x = CVT(r, dc / 8 + u);                                                 \
        for (int64_t g = 0; g < GN; g++) a[g][u] = _mm256_fmadd_ps(wg[g], x, a[g][u]);       \
      }                                                                                      \
    }                                                                                        \
    for (int64_t g = 0; g < GN; g++)                                                         \
      for (int u = 0; u < 4; u++) _mm256_storeu_ps(acc + g * D + dc + 8 * u, a[g][u]);       \
  }                                                                                          \
}
/* For G heads, head_chunk() at a time. With SCALED (8-bit rows) the weights are first taken
   times their row's scale (RSCALE), at most TILE_KEYS rows per call. */
#define DEFINE_AVX2_VALUE(NAME, T, RSCALE, SCALED, HEADS)                                    \
INLINE void NAME(const float* restrict w, int64_t ws, const T* restrict v, int64_t vs,       \
                 int64_t n, float* restrict acc, const int64_t D, const int64_t G) {         \
  for (int64_t g0 = 0, gn; g0 < G; g0 += gn) {                                              \
    gn = head_chunk(G - g0);                                                                 \
    const float* wg = w + g0 * ws;                                                           \
    int64_t wgs = ws;                                                                        \
    float wt[SCALED ? 3 * TILE_KEYS : 1];                                                    \
    if (SCALED) {                                                                            \
      float rs[TILE_KEYS];                                                                   \
      for (int64_t i = 0; i < n; i++) rs[i] = RSCALE(v + i * vs, D);                         \
      for (int64_t g = 0; g < gn; g++)                                                       \
        for (int64_t i = 0; i < n; i++) wt[g * TILE_KEYS + i] = wg[g * ws + i] * rs[i];      \
      wg = wt;                                                                               \
      wgs = TILE_KEYS;                                                                       \
    }                                                                                        \
    float* ag = acc + g0 * D;                                                                \
    if (gn == 3) HEADS(wg, wgs, v, vs, n, ag, D, 3);                                         \
    else if (gn == 2) HEADS(wg, wgs, v, vs, n, ag, D, 2);                                    \
    else HEADS(wg, wgs, v, vs, n, ag, D, 1);                                                 \
  }                                                                                          \
}
#endif

#ifdef USE_AVX2
INLINE __m256 exp256_u20(__m256 x) { /* exp_u20, 8 at a time, the same operations */
#define K(c) _mm256_set1_ps(c)
  const __m256 underflow = _mm256_cmp_ps(x, K(LN_FLT_MIN), _CMP_LT_OS);
  x = _mm256_max_ps(K(LN_FLT_MIN), x); /* x second: a NaN stays NaN (max returns it) */
  const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, K(1.44269502f), K(0.5f)));
  const __m256 r = _mm256_fnmadd_ps(n, K(0.693147182f), x);
  const __m256 p = EXP_POLY(_mm256_fmadd_ps, r);
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(_mm256_sub_ps(n, K(1.0f))), _mm256_set1_epi32(127)), 23);
  const __m256 two_n_minus_1 = _mm256_andnot_ps(underflow, _mm256_castsi256_ps(e));
  return _mm256_mul_ps(_mm256_mul_ps(p, two_n_minus_1), K(2.0f));
#undef K
}
#endif

/* Softmax numerators of scores [start, len) in place; returns 1 / sum. */
INLINE float softmax_row(float* restrict sc, int64_t start, int64_t len) {
  const int64_t vec_end = start + (len - start) / 16 * 16; /* exp_u20 before, expf after */
  float mx = -__builtin_inff(), sum = 0.0f;
  int64_t j = start;
#ifdef USE_AVX512
  __m512 vmx = _mm512_set1_ps(mx);
  for (; j < vec_end; j += 16) vmx = _mm512_max_ps(vmx, _mm512_loadu_ps(sc + j));
  mx = _mm512_reduce_max_ps(vmx);
#elif defined(USE_AVX2)
  __m256 vmx = _mm256_set1_ps(mx);
  for (; j < vec_end; j += 8) vmx = _mm256_max_ps(vmx, _mm256_loadu_ps(sc + j));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vmx), _mm256_extractf128_ps(vmx, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  mx = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
#endif
  for (; j < len; j++) mx = sc[j] > mx ? sc[j] : mx;
  j = start;
#ifdef USE_AVX512
  const __m512 m = _mm512_set1_ps(mx);
  __m512 vsum = _mm512_setzero_ps();
  for (; j < vec_end; j += 16) {
    const __m512 e = exp512_u20(_mm512_sub_ps(_mm512_loadu_ps(sc + j), m));
    _mm512_storeu_ps(sc + j, e);
    vsum = _mm512_add_ps(vsum, e);
  }
  sum = _mm512_reduce_add_ps(vsum);
#elif defined(USE_AVX2)
  const __m256 m = _mm256_set1_ps(mx);
  __m256 vsum = _mm256_setzero_ps();
  for (; j < vec_end; j += 8) {
    const __m256 e = exp256_u20(_mm256_sub_ps(_mm256_loadu_ps(sc + j), m));
    _mm256_storeu_ps(sc + j, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  sum = hsum8(vsum);
#else
  for (; j < vec_end; j++) {
    const float e = exp_u20(sc[j] - mx);
    sc[j] = e;
    sum += e;
  }
#endif
  for (; j < len; j++) {
    const float e = __builtin_expf(sc[j] - mx);
    sc[j] = e;
    sum += e;
  }
  return 1.0f / sum;
}

INLINE void round_weights(const float* restrict sc, bf16_t* restrict w, int64_t start,
                          int64_t len) {
  int64_t j = start;
#ifdef USE_AVX512_BF16
  for (; j + 16 <= len; j += 16)
    _mm256_storeu_si256((__m256i*)(w + j), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(sc + j)));
#endif
  for (; j < len; j++) w[j] = store_bf16(sc[j]);
}

#ifdef USE_AVX2
INLINE __m128i store8_bf16(__m256 x) { /* store_bf16 of 8 values */
  const __m256i u = _mm256_castps_si256(x);
  const __m256i high = _mm256_srli_epi32(u, 16);
  const __m256i odd = _mm256_and_si256(high, _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(
      _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd)), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_or_si256(high, _mm256_set1_epi32(0x40)), nan);
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08));
}
#endif

/* sc[j] = the float32 value of store_bf16(sc[j]) (the AVX2 value loop reads float32). */
INLINE void round_in_place(float* restrict sc, int64_t start, int64_t len) {
  int64_t j = start;
#ifdef USE_AVX2
  for (; j + 8 <= len; j += 8)
    _mm256_storeu_ps(sc + j, _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_cvtepu16_epi32(store8_bf16(_mm256_loadu_ps(sc + j))), 16)));
#endif
  for (; j < len; j++) sc[j] = load_bf16(store_bf16(sc[j]));
}

/* Between the passes, on every thread: the softmax of every (sequence, query head) row, its
   weights rounded to bfloat16 where the value loop reads them so (rounded: 1 into the
   bfloat16 array after the scores, 2 in place as float32), and the rows' partial sums
   zeroed. */
INLINE void softmax_rows(const decode_args* a, int64_t nt, int rounded) {
  const int64_t H = a->num_heads, rf = row_floats(a);
  _Pragma("omp barrier")
  _Pragma("omp for schedule(static)")
  for (int64_t r = 0; r < a->num_seqs * H; r++) {
    const int64_t len = a->seq_lens[r / H];
    const int64_t start = a->window > 0 && len > a->window ? len - a->window : 0;
    float* row = a->workspace + r * rf;
    row[rf - 1] = softmax_row(row, start, len);
    if (rounded == 1) round_weights(row, (bf16_t*)(row + a->max_seq_len), start, len);
    if (rounded == 2) round_in_place(row, start, len);
    for (int64_t u = 0; u < nt; u++) memset(partial_sum(a, u, r), 0, a->head_dim * sizeof(float));
  }
}

/* Row r of the output (bfloat16 or float32): x[0, head_dim) times f. */
INLINE void store_out_row(const decode_args* a, int64_t r, const float* x, float f,
                          int bf16_out) {
  const int64_t D = a->head_dim;
  int64_t d = 0;
#ifdef USE_AVX2
  for (; d + 8 <= D; d += 8) { /* as below, 8 at a time */
    const __m256 y = _mm256_mul_ps(_mm256_loadu_ps(x + d), _mm256_set1_ps(f));
    if (bf16_out) _mm_storeu_si128((__m128i*)((bf16_t*)a->out + r * D + d), store8_bf16(y));
    else _mm256_storeu_ps((float*)a->out + r * D + d, y);
  }
#endif
  for (; d < D; d++) {
    if (bf16_out) ((bf16_t*)a->out)[r * D + d] = store_bf16(x[d] * f);
    else ((float*)a->out)[r * D + d] = x[d] * f;
  }
}
/* After pass 2, on every thread: each row's output (bfloat16 or float32), its threads' partial
   sums added up and divided by the softmax sum. */
INLINE void reduce_rows(const decode_args* a, int64_t nt, int bf16_out) {
  const int64_t rf = row_floats(a), D = a->head_dim;
  _Pragma("omp barrier")
  _Pragma("omp for schedule(static)")
  for (int64_t r = 0; r < a->num_seqs * a->num_heads; r++) {
    float x[D]; /* any head_dim (the float kernels have no bound) */
    memcpy(x, partial_sum(a, 0, r), D * sizeof(float));
    for (int64_t u = 1; u < nt; u++) {
      const float* restrict p = partial_sum(a, u, r);
      for (int64_t d = 0; d < D; d++) x[d] += p[d];
    }
    store_out_row(a, r, x, a->workspace[r * rf + rf - 1], bf16_out);
  }
}

/* ---- the kernel ------------------------------------------------------------------------ */

/* Software prefetch into L2 (prefetcht2: prefetcht0 stalls on the L1 fill buffers) of the
   block PREFETCH_AHEAD pairs ahead, each KV head's step of a block issuing that head's share
   through the prefetch cursor (above), so that the requests spread over the block's work.
   Blocks of more than SLICE_KEYS keys (twice that in the 16-bit AVX2 kernels, DEFINE_KERNEL's
   SLICE) are worked that many keys at a time instead, each slice starting the cursor on its
   part of the share: a whole share at once (64 lines and more from 64 keys) is more requests
   than the core keeps in flight, and the ones it cannot take arrive late or not at all (K/V
   read from memory, 128-key blocks against 16, both as bursts: bfloat16 1.4x and int8 1.3x
   slower per key on a Zen 4 EPYC, int8 1.5x on a Zen 3). */
#define PREFETCH_AHEAD 2
#define SLICE_KEYS 16
/* Start the cursor on keys [k0, k1) of KV head `part`'s share of the block (the whole share
   where k0 = 0 and k1 = bs), for blocks of bs keys. */
INLINE void prefetch_keys(const char* block, int64_t bytes, int64_t part, int64_t parts,
                          int64_t bs, int64_t k0, int64_t k1) {
  const int64_t share = bytes / parts, key_bytes = share / bs;
  prefetch_start(block + part * share + k0 * key_bytes, (k1 - k0) * key_bytes);
}

/* Prefetch (into L1) the workspace lines pair pa's KV head h touches in this pass: the G rows'
   scores of its block (pass 0, written), or their weights (float32, or bfloat16 after the
   scores where ROUNDED is 1) and the G partial sums (pass 1). The pairs go in physical block
   order, so these lines jump from sequence to sequence; with more rows than fit in L2
   (128 x 512: 4.7 MB of scores) each would otherwise be an L3 or memory miss the pair waits
   on. */
/* Every 64-byte line of [p, p + bytes), for writing (RW 1) or reading (0). */
#define PREFETCH_LINES(p, bytes, RW)                                                         \
  for (const char *l_ = (const char*)((uintptr_t)(p) & ~(uintptr_t)63),                      \
                  *e_ = (const char*)(p) + (bytes); l_ < e_; l_ += 64)                       \
    __builtin_prefetch(l_, RW, 3)
INLINE void prefetch_rows(const decode_args* a, int64_t pa, int64_t h, int64_t G, int pass,
                          int rounded, int64_t t) {
  const int64_t H = a->num_heads, rf = row_floats(a), bs = a->block_size;
  const int64_t r0 = a->pair_seq[pa] * H + h * G, pos = a->pair_block[pa] * bs;
  const float* row = a->workspace + r0 * rf;
  for (int64_t g = 0; g < G; g++) {
    if (pass == 0) {
      PREFETCH_LINES(row + g * rf + pos, bs * (int64_t)sizeof(float), 1);
    } else if (rounded == 1) {
      PREFETCH_LINES((const bf16_t*)(row + g * rf + a->max_seq_len) + pos,
                     bs * (int64_t)sizeof(bf16_t), 0);
    } else {
      PREFETCH_LINES(row + g * rf + pos, bs * (int64_t)sizeof(float), 0);
    }
  }
  if (pass == 1) {
    const char* acc = (const char*)partial_sum(a, t, r0);
    for (int64_t b = 0; b < G * a->head_dim * (int64_t)sizeof(float); b += 64)
      __builtin_prefetch(acc + b, 1, 3);
  }
}

/* Keys [lo, hi) of pair p's block that its sequence attends to, as offsets in the block. */
INLINE int64_t pair_keys(const decode_args* a, int64_t p, int64_t* lo) {
  const int64_t bs = a->block_size, len = a->seq_lens[a->pair_seq[p]];
  const int64_t first = a->pair_block[p] * bs;
  const int64_t start = a->window > 0 && len > a->window ? len - a->window : 0;
  *lo = start > first ? start - first : 0;
  return len - first < bs ? len - first : bs;
}

/* SCORE for G query heads (rows q + g * D, scores out + g * os) from a one-head ONE. */
#define DEFINE_HEADS(NAME, T, ONE)                                                           \
INLINE void NAME(const T* q, const T* k, int64_t ks, int64_t n, float scale, float* out,     \
                 int64_t os, const int64_t D, const int64_t G) {                             \
  for (int64_t g = 0; g < G; g++) ONE(q + g * D, k, ks, n, scale, out + g * os, D);          \
}
DEFINE_HEADS(heads_f32_portable, float, score_f32_portable)
DEFINE_HEADS(heads_bf16_portable, bf16_t, score_bf16_portable)
#ifdef USE_AVX512
DEFINE_HEADS(heads_f32_avx512, float, score_f32_avx512)
#endif
#ifdef USE_AVX512_BF16
DEFINE_HEADS(heads_bf16_avx512, bf16_t, score_bf16_avx512)
#endif
#ifdef USE_AVX2_F32
DEFINE_AVX2_SCORE_HEADS(score_f32_avx2_heads, float, cvt8_f32, no_row_scale)
DEFINE_AVX2_SCORE(score_f32_avx2, float, cvt8_f32, float, score_f32_avx2_heads)
DEFINE_AVX2_VALUE_HEADS(value_f32_avx2_heads, float, cvt8_f32)
DEFINE_AVX2_VALUE(value_f32_avx2, float, no_row_scale, 0, value_f32_avx2_heads)
#endif
#ifdef USE_AVX2_BF16
DEFINE_AVX2_SCORE_HEADS(score_bf16_avx2_heads, bf16_t, cvt8_bf16, no_row_scale)
DEFINE_AVX2_SCORE(score_bf16_avx2, bf16_t, cvt8_bf16, bf16_t, score_bf16_avx2_heads)
DEFINE_AVX2_VALUE_HEADS(value_bf16_avx2_heads, bf16_t, cvt8_bf16)
DEFINE_AVX2_VALUE(value_bf16_avx2, bf16_t, no_row_scale, 0, value_bf16_avx2_heads)
#endif

/* What one thread of the parallel region does, for one (dtype, inner loops). It is inlined
   inside each instance's parallel region below, where D and G are literals (OpenMP outlines
   the region before constants propagate into it). */
#define DEFINE_KERNEL(NAME, T, W, SCORE, VALUE, ROUNDED, SLICE)                              \
INLINE void NAME(const decode_args* a, const int64_t D, const int64_t G) {                   \
  const int64_t KVH = a->num_kv_heads, H = a->num_heads, S = a->num_seqs;                    \
  const int64_t bs = a->block_size, rf = row_floats(a), L = a->max_seq_len;                  \
  const int64_t block_elems = bs * KVH * D, block_bytes = block_elems * (int64_t)sizeof(T);  \
  const int sliced = bs > (SLICE); /* else the block is one slice */                         \
  float* rows = a->workspace;                                                                \
  {                                                                                          \
    const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();                      \
    const int64_t pb = a->num_pairs * t / nt, pe = a->num_pairs * (t + 1) / nt;              \
    if (a->new_slots) {                                                                      \
      write_##T(a, S * t / nt, S * (t + 1) / nt, D);                                         \
      _Pragma("omp barrier")                                                                 \
    }                                                                                        \
    for (int pass = 0; pass < 2; pass++) {                                                   \
      const T* cache = (const T*)(pass == 0 ? a->k_cache : a->v_cache);                      \
      for (int64_t p = pb; p < pe; p++) {                                                    \
        const char* ahead = p + PREFETCH_AHEAD < pe                                          \
            ? (const char*)(cache + a->pair_phys[p + PREFETCH_AHEAD] * block_elems) : 0;     \
        int64_t lo;                                                                          \
        const int64_t hi = pair_keys(a, p, &lo), s = a->pair_seq[p];                         \
        const int64_t pos = a->pair_block[p] * bs + lo; /* position of key lo */             \
        const T* block = cache + a->pair_phys[p] * block_elems + lo * KVH * D;               \
        for (int64_t h = 0; h < KVH; h++) {                                                  \
          if (ahead) {                                                                       \
            if (!sliced) prefetch_keys(ahead, block_bytes, h, KVH, bs, 0, bs);               \
            prefetch_rows(a, p + PREFETCH_AHEAD, h, G, pass, ROUNDED, t);                    \
          }                                                                                  \
          float* row = rows + (s * H + h * G) * rf; /* query head h * G, then G - 1 more */  \
          for (int64_t j = 0; j < bs; j += (SLICE)) { /* one slice unless sliced */          \
            const int64_t k0 = sliced && j > lo ? j : lo;                                    \
            const int64_t k1 = sliced && j + (SLICE) < hi ? j + (SLICE) : hi;                \
            if (ahead && sliced) prefetch_keys(ahead, block_bytes, h, KVH, bs, j,            \
                                               j + (SLICE) < bs ? j + (SLICE) : bs);         \
            if (k0 < k1 && pass == 0) {                                                      \
              SCORE((const T*)a->q + (s * H + h * G) * D, block + ((k0 - lo) * KVH + h) * D, \
                    KVH * D, k1 - k0, a->scale, row + pos + k0 - lo, rf, D, G);              \
            } else if (k0 < k1) {                                                            \
              const W* w = ROUNDED == 1 ? (const W*)(row + L) : (const W*)row;               \
              VALUE(w + pos + k0 - lo, ROUNDED == 1 ? 2 * rf : rf,                           \
                    block + ((k0 - lo) * KVH + h) * D, KVH * D, k1 - k0,                     \
                    partial_sum(a, t, s * H + h * G), D, G);                                 \
            }                                                                                \
            if (!sliced) break;                                                              \
          }                                                                                  \
          prefetch_flush(); /* what the loops left of this head's share */                   \
        }                                                                                    \
      }                                                                                      \
      if (pass == 0) softmax_rows(a, nt, ROUNDED);                                           \
    }                                                                                        \
    reduce_rows(a, nt, sizeof(T) == 2);                                                      \
  }                                                                                          \
}

/* SLICE: the keys per slice of larger blocks (SLICE_KEYS); 32 for the AVX2 loops, which
   convert the query rows once per call: at 16 keys a call that cost more than the longer
   bursts (bfloat16 on a Zen 3 EPYC, blocks of 32: 1.06x slower in 16-key slices). */
DEFINE_KERNEL(kernel_f32_portable, float, float, heads_f32_portable, value_f32_portable, 0,
              SLICE_KEYS)
DEFINE_KERNEL(kernel_bf16_portable, bf16_t, bf16_t, heads_bf16_portable, value_bf16_portable, 1,
              SLICE_KEYS)
#ifdef USE_AVX512
DEFINE_KERNEL(kernel_f32_avx512, float, float, heads_f32_avx512, value_f32_avx512, 0, SLICE_KEYS)
#endif
#ifdef USE_AVX512_BF16
DEFINE_KERNEL(kernel_bf16_avx512, bf16_t, bf16_t, heads_bf16_avx512, value_bf16_avx512, 1,
              SLICE_KEYS)
#endif
#ifdef USE_AVX2_F32
DEFINE_KERNEL(kernel_f32_avx2, float, float, score_f32_avx2, value_f32_avx2, 0, 2 * SLICE_KEYS)
#endif
#ifdef USE_AVX2_BF16
DEFINE_KERNEL(kernel_bf16_avx2, bf16_t, float, score_bf16_avx2, value_bf16_avx2, 2,
              2 * SLICE_KEYS)
#endif

/* Instances with literal head_dim (64, 128) and group size (1, 2, 3, 4, 8), so that inner
   trip counts are compile-time constants, and a generic one. */
#define PARALLEL(KERNEL, D, G)                                                               \
  { _Pragma("omp parallel num_threads(a->num_threads)") KERNEL(a, D, G); return; }
#define GROUPS(KERNEL, D)                                                                    \
  switch (a->num_heads / a->num_kv_heads) {                                                  \
    case 1: PARALLEL(KERNEL, D, 1)                                                           \
    case 2: PARALLEL(KERNEL, D, 2)                                                           \
    case 3: PARALLEL(KERNEL, D, 3)                                                           \
    case 4: PARALLEL(KERNEL, D, 4)                                                           \
    case 8: PARALLEL(KERNEL, D, 8)                                                           \
    default: PARALLEL(KERNEL, D, a->num_heads / a->num_kv_heads)                             \
  }
#define DISPATCH(NAME, KERNEL)                                                               \
static void NAME(const decode_args* a) {                                                     \
  if (a->head_dim == 64) GROUPS(KERNEL, 64)                                                  \
  if (a->head_dim == 128) GROUPS(KERNEL, 128)                                                \
  GROUPS(KERNEL, a->head_dim)                                                                \
}
INLINE int vector_shape(const decode_args* a) {
  return a->head_dim % 32 == 0 && a->head_dim <= 256;
}

#ifdef PART_F32
DISPATCH(run_f32_portable, kernel_f32_portable)
#ifdef USE_AVX512
DISPATCH(run_f32_avx512, kernel_f32_avx512)
#endif
#ifdef USE_AVX2_F32
DISPATCH(run_f32_avx2, kernel_f32_avx2)
#endif
void paged_decode_attention_f32(const decode_args* a) {
#ifdef USE_AVX512
  if (vector_shape(a)) { run_f32_avx512(a); return; }
#endif
#ifdef USE_AVX2_F32
  if (vector_shape(a)) { run_f32_avx2(a); return; }
#endif
  run_f32_portable(a);
}
#endif

#ifdef PART_BF16
DISPATCH(run_bf16_portable, kernel_bf16_portable)
#ifdef USE_AVX512_BF16
DISPATCH(run_bf16_avx512, kernel_bf16_avx512)
#endif
#ifdef USE_AVX2_BF16
DISPATCH(run_bf16_avx2, kernel_bf16_avx2)
#endif
void paged_decode_attention_bf16(const decode_args* a) {
#ifdef USE_AVX512_BF16
  if (vector_shape(a)) { run_bf16_avx512(a); return; }
#endif
#ifdef USE_AVX2_BF16
  if (vector_shape(a)) { run_bf16_avx2(a); return; }
#endif
  run_bf16_portable(a);
}
#endif

/* ---- 8-bit caches (kv_quant.py) ------------------------------------------------------
   A cache row is head_dim one-byte values, then the row's bfloat16 scale: element d of the
   row is value(byte d) * scale. The same pair-sorted passes as above; for each (pair, KV
   head) the kernel decodes up to TILE_KEYS of the block's rows into a tile on the stack
   (L1-resident), then runs the inner loops above over it for the G query heads: each byte is
   converted once, whatever G, and no dequantized copy of any context is made. Two kinds of
   tile: float32 (the values times their scales, exact in float32: the float32 attention over
   the dequantized cache, float32 softmax weights), and, for bfloat16 queries on AVX512-BF16
   CPUs, bfloat16 (the unscaled values, exact in bfloat16; the scales applied to the scores
   and to the softmax weights, which are rounded to bfloat16 as the bfloat16 kernel rounds
   them). The step's K/V are quantized and stored by the caller before the call.

   Without AVX-512, the AVX2 loops read the rows in place instead of through a tile (see
   "AVX2 inner loops" and Q8_AVX2_FORMAT below).

   Conversion: the portable loops read fp8 (e4m3, e5m2) from the 256-entry table a->lut and
   convert int8; the AVX-512 (AVX2) ones convert 16 (8) bytes at a time: int8 sign-extends;
   e5m2 is the high byte of a float16; e4m3 (bias 7) sign-extended and shifted into float16's
   bit positions reads as the value times 2^-8, so its rows' scales are taken times 2^8
   (exact). With AVX512-VBMI and bfloat16 queries, 64 bytes at a time by table lookups
   instead ("AVX512-VBMI" below).
   The quantizer never stores e4m3's NaN code (it clamps to +-448). */
INLINE float row_scale(const uint8_t* row, int64_t D) {
  bf16_t s;
  memcpy(&s, row + D, sizeof s);
  return load_bf16(s);
}

/* tile[i * D + d] = value(row_i[d]) * scale_i for the n rows row_i = rows + i * stride. */
#define DEFINE_DEQUANT_PORTABLE(NAME, LOAD8)                                                 \
INLINE void NAME(const uint8_t* restrict rows, int64_t stride, int64_t n,                    \
                 const float* restrict lut, float* restrict tile, float* restrict sc,        \
                 const int64_t D) {                                                          \
  (void)sc;                                                                                  \
  for (int64_t i = 0; i < n; i++) {                                                          \
    const uint8_t* restrict r = rows + i * stride;                                           \
    const float s = row_scale(r, D);                                                         \
    for (int64_t d = 0; d < D; d++) tile[i * D + d] = LOAD8(lut, r[d]) * s;                  \
  }                                                                                          \
}
#define LOAD_INT8(lut, x) ((float)(int8_t)(x))
#define LOAD_LUT(lut, x) ((lut)[(x)])
DEFINE_DEQUANT_PORTABLE(dequant_int8_portable, LOAD_INT8)
DEFINE_DEQUANT_PORTABLE(dequant_lut_portable, LOAD_LUT)

#ifdef USE_AVX512
#define USE_Q8_AVX512 1
INLINE __m512 cvt_int8(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
}
INLINE __m512 cvt_e5m2(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(
      _mm_loadu_si128((const __m128i*)p)), 8));
}
INLINE __m512 cvt_e4m3(const uint8_t* p) {
  /* sign-extended, shifted by 7: the sign in bits 15 and 14, exponent and mantissa in bits
     13..7; clearing bit 14 leaves a float16 of the value times 2^-8 */
  const __m256i x = _mm256_slli_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)p)), 7);
  return _mm512_cvtph_ps(_mm256_and_si256(x, _mm256_set1_epi16((short)0xBF80)));
}
#define DEFINE_DEQUANT_AVX512(NAME, CVT, FACTOR)                                             \
INLINE void NAME(const uint8_t* restrict rows, int64_t stride, int64_t n,                    \
                 const float* restrict lut, float* restrict tile, float* restrict sc,        \
                 const int64_t D) {                                                          \
  (void)lut; (void)sc;                                                                       \
  for (int64_t i = 0; i < n; i++) {                                                          \
    const uint8_t* restrict r = rows + i * stride;                                           \
    const __m512 s = _mm512_set1_ps((FACTOR) * row_scale(r, D));                             \
    for (int64_t d = 0; d < D; d += 16)                                                      \
      _mm512_storeu_ps(tile + i * D + d, _mm512_mul_ps(CVT(r + d), s));                      \
  }                                                                                          \
}
DEFINE_DEQUANT_AVX512(dequant_int8_avx512, cvt_int8, 1.0f)
DEFINE_DEQUANT_AVX512(dequant_e5m2_avx512, cvt_e5m2, 1.0f)
DEFINE_DEQUANT_AVX512(dequant_e4m3_avx512, cvt_e4m3, 256.0f)
#endif

/* Float32 tiles: the query row converted to float32, then the float32 inner loops. */
#define DEFINE_F32_TILE_OPS(SUFFIX, QT, QLOAD, SCORE, VALUE)                                 \
INLINE void score_tile_##SUFFIX(const QT* q, const float* tile, const float* sc, int64_t n,  \
                                float scale, float* out, const int64_t D) {                  \
  float qf[256];                                                                             \
  (void)sc;                                                                                  \
  for (int64_t d = 0; d < D; d++) qf[d] = QLOAD(q[d]);                                       \
  SCORE(qf, tile, D, n, scale, out, D);                                                      \
}                                                                                            \
INLINE void value_tile_##SUFFIX(float* w, int64_t ws, const float* tile, const float* sc,    \
                                int64_t n, float* acc, const int64_t D, const int64_t G) {   \
  (void)sc;                                                                                  \
  VALUE(w, ws, tile, D, n, acc, D, G);                                                       \
}

#ifdef USE_AVX512_BF16
/* bfloat16 query, bfloat16 tiles: the rows' values unscaled (8-bit values are exact in
   bfloat16), their scales beside (sc); scores by the bfloat16 dot products, times the key's
   scale after; the softmax weights times the value's scale, rounded to bfloat16 as the
   bfloat16 kernel rounds them, by the bfloat16 value loop. At most BF16_TILE_GROUP query
   heads per KV head (the weights' tile); larger groups take the float32 tiles. */
#define BF16_TILE_GROUP 64
#define DEFINE_DEQUANT_BF16(NAME, CVT, FACTOR)                                               \
INLINE void NAME(const uint8_t* restrict rows, int64_t stride, int64_t n,                    \
                 const float* restrict lut, bf16_t* restrict tile, float* restrict sc,       \
                 const int64_t D) {                                                          \
  (void)lut;                                                                                 \
  for (int64_t i = 0; i < n; i++) {                                                          \
    const uint8_t* restrict r = rows + i * stride;                                           \
    sc[i] = (FACTOR) * row_scale(r, D);                                                      \
    for (int64_t d = 0; d < D; d += 32) /* whole 64-byte stores: the dot products' loads */  \
      _mm512_storeu_si512(tile + i * D + d, /* forward from them, not from two halves */    \
                          (__m512i)_mm512_cvtne2ps_pbh(CVT(r + d + 16), CVT(r + d)));        \
  }                                                                                          \
}
DEFINE_DEQUANT_BF16(dequant_int8_bf16, cvt_int8, 1.0f)
DEFINE_DEQUANT_BF16(dequant_e5m2_bf16, cvt_e5m2, 1.0f)
DEFINE_DEQUANT_BF16(dequant_e4m3_bf16, cvt_e4m3, 256.0f)
INLINE void score_tile_bf16(const bf16_t* q, const bf16_t* tile, const float* sc, int64_t n,
                            float scale, float* out, const int64_t D) {
  score_bf16_tile_avx512(q, tile, D, n, scale, out, D);
  for (int64_t i = 0; i < n; i += 16) { /* vector loads of the vector stores just made */
    const __mmask16 m = first_lanes(n - i);
    _mm512_mask_storeu_ps(out + i, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, out + i),
                                                    _mm512_maskz_loadu_ps(m, sc + i)));
  }
}
/* wt[g * TILE_KEYS + i] = bfloat16(w[g * ws + i] * sc[i]) for the n keys of G heads. */
INLINE void scaled_weights_bf16(const float* w, int64_t ws, const float* sc, int64_t n,
                                const int64_t G, bf16_t* wt) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = first_lanes(n - i);
    const __m512 scales = _mm512_maskz_loadu_ps(m, sc + i);
    for (int64_t g = 0; g < G; g++) /* unmasked: the value loop's loads forward from it */
      _mm256_storeu_si256((__m256i*)(wt + g * TILE_KEYS + i), (__m256i)_mm512_cvtneps_pbh(
          _mm512_mul_ps(_mm512_maskz_loadu_ps(m, w + g * ws + i), scales)));
  }
}
INLINE void value_tile_bf16(float* w, int64_t ws, const bf16_t* tile, const float* sc,
                            int64_t n, float* acc, const int64_t D, const int64_t G) {
  bf16_t wt[BF16_TILE_GROUP * TILE_KEYS + 2]; /* + 2: the pair read past a tile's last key */
  scaled_weights_bf16(w, ws, sc, n, G, wt);
  value_bf16_avx512(wt, TILE_KEYS, tile, D, n, acc, D, G);
}
#endif

#if defined(USE_Q8_PLANES) && defined(PART_Q8)
/* AVX512-VBMI (head_dim a multiple of 64): 8-bit codes to bfloat16 by table lookups,
   64 at a time, instead of sign extension (or float16 decoding), float32 conversion and
   rounding to bfloat16 16 at a time. The bfloat16 values of the 128 magnitudes of a format
   are stored as two 128-byte planes, their low bytes and their high bytes; one byte permute
   (vpermi2b: a 7-bit index into two registers) looks each plane up, the code's sign goes
   into bit 7 of the high byte, and one more permute per 32 values interleaves the planes
   into bfloat16 words. int8 looks up |x|: the quantizers clamp to +-127, so -128 never
   occurs (it would read as -0). The values are those of the conversions above (fp8 e4m3 at
   its true scale, not times 2^-8), so the kernels below give the tile kernels' results bit
   for bit. Formats: 0 int8, 1 e4m3, 2 e5m2. */
static uint8_t q8_planes[3][2][128] __attribute__((aligned(64)));
__attribute__((constructor)) static void init_q8_planes(void) {
  for (int c = 0; c < 128; c++) {
    const float v[3] = {(float)c, 256.0f * _cvtsh_ss((unsigned short)((c << 7) & 0xBF80)),
                        _cvtsh_ss((unsigned short)(c << 8))};
    for (int f = 0; f < 3; f++) {
      uint32_t bits;
      memcpy(&bits, &v[f], sizeof bits);
      q8_planes[f][0][c] = (uint8_t)(bits >> 16);
      q8_planes[f][1][c] = (uint8_t)(bits >> 24);
    }
  }
}
typedef struct { __m512i lo0, lo1, hi0, hi1; } q8_lut;
INLINE q8_lut q8_lut_load(int f) {
  const q8_lut t = {_mm512_load_si512(q8_planes[f][0]), _mm512_load_si512(q8_planes[f][0] + 64),
                    _mm512_load_si512(q8_planes[f][1]), _mm512_load_si512(q8_planes[f][1] + 64)};
  return t;
}
/* Byte k of x then byte k of y, for k in [0, 32) (the index vector of vpermt2b; + 32 for
   [32, 64)). */
INLINE __m512i interleave_index(void) {
  return _mm512_set_epi8(
      95, 31, 94, 30, 93, 29, 92, 28, 91, 27, 90, 26, 89, 25, 88, 24,
      87, 23, 86, 22, 85, 21, 84, 20, 83, 19, 82, 18, 81, 17, 80, 16,
      79, 15, 78, 14, 77, 13, 76, 12, 75, 11, 74, 10, 73, 9, 72, 8,
      71, 7, 70, 6, 69, 5, 68, 4, 67, 3, 66, 2, 65, 1, 64, 0);
}
/* The 64 codes z of format F as bfloat16: *a the first 32, *b the last 32 (exact). */
INLINE void q8_lut_cvt(const q8_lut* t, __m512i z, const int F, __m512i* a, __m512i* b) {
  const __m512i m = F == 0 ? _mm512_abs_epi8(z) : z; /* the index's bit 7 is ignored */
  const __m512i lo = _mm512_permutex2var_epi8(t->lo0, m, t->lo1);
  const __m512i hi = _mm512_ternarylogic_epi32( /* hi | (z & 0x80) */
      _mm512_permutex2var_epi8(t->hi0, m, t->hi1), z, _mm512_set1_epi8((char)0x80), 0xF8);
  const __m512i index = interleave_index();
  *a = _mm512_permutex2var_epi8(lo, index, hi);
  *b = _mm512_permutex2var_epi8(lo, _mm512_add_epi8(index, _mm512_set1_epi8(32)), hi);
}
/* Whether none of the 64 fp8 codes x (F 1 e4m3, 2 e5m2) has a zero exponent field (zeros
   and subnormals, which the tables take): the bit moves below apply. */
INLINE int fp8_all_normal(__m512i x, const int F) {
  return !_mm512_testn_epi8_mask(x, _mm512_set1_epi8(F == 1 ? 0x78 : 0x7C));
}
/* Words that hold an fp8 code's sign at bit 15 and its other 7 bits from bit 4 (e4m3) or 5
   (e5m2) as bfloat16: the bits around them masked off, the exponent rebiased (e4m3 by 120,
   e5m2 by 112). */
INLINE __m512i fp8_rebias(__m512i w, const int F) {
  const __m512i keep = _mm512_set1_epi16((short)(F == 1 ? 0x87F0 : 0x8FE0));
  return _mm512_add_epi16(_mm512_and_si512(w, keep),
                          _mm512_set1_epi16((short)((F == 1 ? 120 : 112) << 7)));
}
/* 64 fp8 codes at r as bfloat16 by bit moves where fp8_all_normal: sign-extended to 16 bits,
   shifted into bfloat16's places, fp8_rebias: the tables' values, in fewer shuffles. Returns
   0 where it does not apply. */
INLINE int fp8_shift_cvt(const uint8_t* r, const int F, __m512i* a, __m512i* b) {
  if (!fp8_all_normal(_mm512_loadu_si512(r), F)) return 0;
  const int shift = F == 1 ? 4 : 5;
  const __m512i lo = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)r));
  const __m512i hi = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(r + 32)));
  *a = fp8_rebias(_mm512_slli_epi16(lo, shift), F);
  *b = fp8_rebias(_mm512_slli_epi16(hi, shift), F);
  return 1;
}
/* The value rows x, y (keys i, i + 1; 64 fp8 codes each) as the 4 registers of
   (x_d, y_d) bfloat16 pairs, by bit moves: each code into the high byte of its word by one
   masked byte permute, an arithmetic shift, a mask and the rebias; 0 where a code of either
   row has a zero exponent field (the tables take those). */
INLINE int fp8_pair_cvt(__m512i x, __m512i y, const int F, __m512i* r) {
  if (!fp8_all_normal(x, F) || !fp8_all_normal(y, F)) return 0;
  /* lane j: byte 1 <- x[16 c + j], byte 3 <- y[16 c + j] (indices from 64: y's) */
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i from_y = _mm512_add_epi32(lane, _mm512_set1_epi32(64));
  const __m512i base = _mm512_or_si512(_mm512_slli_epi32(lane, 8), _mm512_slli_epi32(from_y, 24));
  for (int c = 0; c < 4; c++) { /* the low bytes zero: the shift and mask drop them */
    const __m512i index = _mm512_add_epi8(base, _mm512_set1_epi32(16 * c << 8 | 16 * c << 24));
    const __m512i w = _mm512_maskz_permutex2var_epi8((__mmask64)0xAAAAAAAAAAAAAAAAull, x,
                                                     index, y);
    r[c] = fp8_rebias(_mm512_srai_epi16(w, F == 1 ? 4 : 3), F);
  }
  return 1;
}
/* As DEFINE_DEQUANT_BF16 (the key rows' tile for the scores), by the tables (fp8: by bit
   moves where fp8_shift_cvt applies). */
#define DEFINE_DEQUANT_PLANES(NAME, F)                                                       \
INLINE void NAME(const uint8_t* restrict rows, int64_t stride, int64_t n,                    \
                 const float* restrict lut, bf16_t* restrict tile, float* restrict sc,       \
                 const int64_t D) {                                                          \
  (void)lut;                                                                                 \
  const q8_lut t = q8_lut_load(F);                                                           \
  for (int64_t i = 0; i < n; i++) {                                                          \
    const uint8_t* restrict r = rows + i * stride;                                           \
    sc[i] = row_scale(r, D);                                                                 \
    for (int64_t d = 0; d < D; d += 64) {                                                    \
      prefetch_step();                                                                       \
      __m512i x, y;                                                                          \
      if (F == 0 || !fp8_shift_cvt(r + d, F, &x, &y))                                        \
        q8_lut_cvt(&t, _mm512_loadu_si512(r + d), F, &x, &y);                                \
      _mm512_storeu_si512(tile + i * D + d, x);                                              \
      _mm512_storeu_si512(tile + i * D + d + 32, y);                                         \
    }                                                                                        \
  }                                                                                          \
}
/* The value rows in place, no tile: acc_g += sum_i wt_g[i] v_i for the G heads (bfloat16
   weights wt_g = wt + g * TILE_KEYS), keys i and i + 1 in one instruction as step_bf16 does,
   their codes interleaved byte by byte before the lookups (fp8: by fp8_pair_cvt's bit moves
   where it applies, 4 shuffles instead of 10 per key pair: on an AMX Xeon with AMX off 1-4%
   faster with one thread, 1-2% from memory with two); 64 dimensions x up to 4 heads of
   accumulators. */
#define DEFINE_VALUE_PLANES(NAME, F)                                                         \
INLINE void NAME(const bf16_t* wt, const uint8_t* restrict v, int64_t vs, int64_t n,         \
                 float* restrict acc, const int64_t D, const int64_t G) {                    \
  const q8_lut t = q8_lut_load(F);                                                           \
  const __m512i lo_index = interleave_index();                                               \
  const __m512i hi_index = _mm512_add_epi8(lo_index, _mm512_set1_epi8(32));                  \
  for (int64_t g0 = 0; g0 < G; g0 += 4) {                                                    \
    const int64_t gn = G - g0 < 4 ? G - g0 : 4;                                              \
    for (int64_t dc = 0; dc < D; dc += 64) {                                                 \
      __m512 a[4][4];                                                                        \
      float* ag = acc + g0 * D + dc;                                                         \
      for (int64_t g = 0; g < gn; g++)                                                       \
        for (int c = 0; c < 4; c++) a[g][c] = _mm512_loadu_ps(ag + g * D + 16 * c);         \
      for (int64_t i = 0; i < n; i += 2) {                                                   \
        const int pair = i + 1 < n;                                                          \
        PREFETCH_STEPS(128, uint8_t); /* the two keys' 64 dimensions */                      \
        const __m512i x = _mm512_loadu_si512(v + i * vs + dc);                               \
        const __m512i y = pair ? _mm512_loadu_si512(v + (i + 1) * vs + dc)                   \
                               : _mm512_setzero_si512();                                     \
        __m512i r[4]; /* (key i, key i + 1) bfloat16 pairs of dimensions dc + 16 c.. */      \
        if (F == 0 || !fp8_pair_cvt(x, y, F, r)) {                                           \
          q8_lut_cvt(&t, _mm512_permutex2var_epi8(x, lo_index, y), F, &r[0], &r[1]);         \
          q8_lut_cvt(&t, _mm512_permutex2var_epi8(x, hi_index, y), F, &r[2], &r[3]);         \
        }                                                                                    \
        for (int64_t g = 0; g < gn; g++) {                                                   \
          const __m512bh wg = weight_pair(wt + (g0 + g) * TILE_KEYS + i, pair);              \
          for (int c = 0; c < 4; c++) a[g][c] = _mm512_dpbf16_ps(a[g][c], wg, (__m512bh)r[c]); \
        }                                                                                    \
      }                                                                                      \
      for (int64_t g = 0; g < gn; g++)                                                       \
        for (int c = 0; c < 4; c++) _mm512_storeu_ps(ag + g * D + 16 * c, a[g][c]);         \
    }                                                                                        \
  }                                                                                          \
}                                                                                            \
INLINE void value_rows_##NAME(const decode_args* a, const uint8_t* v, int64_t vs, int64_t n, \
                              float* w, int64_t rf, float* acc, const int64_t D,             \
                              const int64_t G) {                                             \
  (void)a;                                                                                   \
  bf16_t wt[BF16_TILE_GROUP * TILE_KEYS + 2]; /* + 2: the pair read past the last key */     \
  float sc[TILE_KEYS];                                                                       \
  for (int64_t i = 0; i < n; i++) sc[i] = row_scale(v + i * vs, D);                          \
  scaled_weights_bf16(w, rf, sc, n, G, wt);                                                  \
  NAME(wt, v, vs, n, acc, D, G);                                                             \
}
DEFINE_DEQUANT_PLANES(dequant_int8_planes, 0)
DEFINE_DEQUANT_PLANES(dequant_e4m3_planes, 1)
DEFINE_DEQUANT_PLANES(dequant_e5m2_planes, 2)
DEFINE_VALUE_PLANES(value_int8_planes, 0)
DEFINE_VALUE_PLANES(value_e4m3_planes, 1)
DEFINE_VALUE_PLANES(value_e5m2_planes, 2)
#endif

/* The single-pass ("online") form of DEFINE_KERNEL for the 8-bit caches, whose value loops
   take any weights (times the rows' scales, rounded or in fixed point per step by the loops
   themselves). Each (block, KV head) step computes its KEYS keys' scores into a buffer on
   the stack, turns them into weights exp(score - m) against the thread's running maximum m
   of the row (rescaling the row's partial sum and running sum by exp(m_old - m) where the
   maximum grew), and adds the weighted value rows at once: the scores never go to the
   workspace, and the softmax pass between two passes, with its barrier and its reads and
   writes of every row's scores, is not needed. Each thread's rows end with (m, sum, partial
   sum); reduce_rows_online merges them. The K and V blocks of a pair are read one after the
   other, each with its own far and near prefetches. On an AMX Xeon, 64 x 512 over 12 layers
   of caches from memory: int8 0.58x -> 0.45x of bfloat16's time (one thread), fp8 0.65x ->
   0.58x (docs/BENCHMARKS.md, "A single pass"). */
/* Thread t's state of row r, a 64-byte line: [0] the running maximum, [1] -1 until the row
   is touched (then 0), [8, 16) the running sum in 8 lanes (added up at the end, not per
   step); in the rows' place, each thread's lines side by side (a line written by both cores, or two
   neighbouring ones, cost a fifth of the time with two threads there). */
INLINE float* online_state(const decode_args* a, int64_t t, int64_t r) {
  return a->workspace + 16 * (t * a->num_seqs * a->num_heads + r);
}
#ifdef USE_AVX2
INLINE float hmax256(__m256 x) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
}
#endif
/* The larger of old and the n scores w[0, n) (NaN if one is; the scores' own maximum only
   where one is above old, the horizontal reduction skipped otherwise), and block_weights:
   their weights exp(w - m) in place, lanes past n zero up to the next 16, their sum added
   into the 8 lanes sum8 (no horizontal sum per step). */
INLINE float block_max(const float* w, int64_t n, float old) {
#if defined(USE_AVX512)
  const __m512 o = _mm512_set1_ps(old);
  __m512 mx = o;
  __mmask16 nan = 0, above = 0;
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 k = first_lanes(n - i);
    const __m512 x = _mm512_maskz_loadu_ps(k, w + i);
    nan |= _mm512_mask_cmp_ps_mask(k, x, x, _CMP_UNORD_Q);
    above |= _mm512_mask_cmp_ps_mask(k, x, o, _CMP_GT_OQ);
    mx = _mm512_mask_max_ps(mx, k, mx, x);
  }
  return nan ? __builtin_nanf("") : above ? _mm512_reduce_max_ps(mx) : old;
#elif defined(USE_AVX2)
  const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 o = _mm256_set1_ps(old);
  __m256 mx = o;
  int nan = 0, above = 0;
  for (int64_t i = 0; i < n; i += 8) {
    const __m256 in = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32((int)(n - i)),
                                                             iota));
    const __m256 x = _mm256_blendv_ps(o, _mm256_loadu_ps(w + i), in);
    nan |= _mm256_movemask_ps(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    above |= _mm256_movemask_ps(_mm256_cmp_ps(x, o, _CMP_GT_OQ));
    mx = _mm256_max_ps(mx, x);
  }
  return nan ? __builtin_nanf("") : above ? hmax256(mx) : old;
#else
  float mx = old;
  for (int64_t i = 0; i < n; i++) {
    if (w[i] != w[i]) return __builtin_nanf("");
    mx = w[i] > mx ? w[i] : mx;
  }
  return mx;
#endif
}
INLINE void block_weights(float* w, int64_t n, float m, float* restrict sum8) {
  const int64_t end = (n + 15) / 16 * 16;
#if defined(USE_AVX512)
  __m512 sum = _mm512_setzero_ps();
  for (int64_t i = 0; i < end; i += 16) {
    const __mmask16 k = first_lanes(n - i);
    const __m512 e = _mm512_maskz_mov_ps(k, exp512_u20(_mm512_sub_ps(
        _mm512_maskz_loadu_ps(k, w + i), _mm512_set1_ps(m))));
    _mm512_storeu_ps(w + i, e);
    sum = _mm512_add_ps(sum, e);
  }
  _mm256_storeu_ps(sum8, _mm256_add_ps(_mm256_loadu_ps(sum8), _mm256_add_ps(
      _mm512_castps512_ps256(sum), _mm256_castpd_ps(
      _mm512_extractf64x4_pd(_mm512_castps_pd(sum), 1)))));
#elif defined(USE_AVX2)
  const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  __m256 sum = _mm256_setzero_ps();
  for (int64_t i = 0; i < end; i += 8) {
    const __m256 in = _mm256_castsi256_ps(_mm256_cmpgt_epi32(
        _mm256_set1_epi32((int)(n - i < 0 ? 0 : n - i)), iota));
    const __m256 e = _mm256_and_ps(in, exp256_u20(_mm256_sub_ps(
        _mm256_blendv_ps(_mm256_set1_ps(m), _mm256_loadu_ps(w + i), in), _mm256_set1_ps(m))));
    _mm256_storeu_ps(w + i, e);
    sum = _mm256_add_ps(sum, e);
  }
  _mm256_storeu_ps(sum8, _mm256_add_ps(_mm256_loadu_ps(sum8), sum));
#else
  float sum = 0.0f;
  for (int64_t i = 0; i < end; i++) {
    w[i] = i < n ? exp_u20(w[i] - m) : 0.0f;
    sum += w[i];
  }
  sum8[0] += sum;
#endif
}
/* The scores w[g * KEYS + i] (i < n) of G rows r0.. into weights against each row's running
   maximum m (taking in the new scores), their sum added to the running sum, the rows'
   partial sums acc (G x D) rescaled where m grew, or zeroed on a first touch. A NaN score
   makes the row's maximum NaN, and so its output. */
INLINE void online_weights(const decode_args* a, int64_t t, int64_t r0, float* w,
                           const int64_t KEYS, int64_t n, float* acc, const int64_t D,
                           const int64_t G) {
  for (int64_t g = 0; g < G; g++) {
    float* st = online_state(a, t, r0 + g);
    float* wg = w + g * KEYS;
    float* restrict ag = acc + g * D;
    const float old = st[0], m = block_max(wg, n, old);
    if (st[1] < 0.0f) { /* first touch: nothing to rescale */
      memset(ag, 0, D * sizeof(float));
      memset(st + 8, 0, 8 * sizeof(float));
      st[1] = 0.0f;
    } else if (m > old) {
      const float f = exp_u20(old - m);
      for (int64_t d = 0; d < D; d++) ag[d] *= f;
      for (int i = 8; i < 16; i++) st[i] *= f;
    }
    st[0] = m;
    block_weights(wg, n, m, st + 8);
  }
}
/* After the single pass, on every thread: each row's threads' (m_t, sum_t, partial sum_t)
   merged, out = sum_t exp(m_t - M) acc_t / sum_t exp(m_t - M) sum_t with M = max m_t (an
   untouched thread's partial sum is not even read). */
INLINE void reduce_rows_online(const decode_args* a, int64_t nt, int bf16_out) {
  const int64_t D = a->head_dim;
  _Pragma("omp barrier")
  _Pragma("omp for schedule(static)")
  for (int64_t r = 0; r < a->num_seqs * a->num_heads; r++) {
    float top = -__builtin_inff(), total = 0.0f, x[D];
    for (int64_t u = 0; u < nt; u++) {
      const float* st = online_state(a, u, r);
      if (st[1] < 0.0f) continue;
      top = st[0] != st[0] || top != top ? __builtin_nanf("") : st[0] > top ? st[0] : top;
    }
    memset(x, 0, D * sizeof(float));
    for (int64_t u = 0; u < nt; u++) {
      const float* st = online_state(a, u, r);
      if (st[1] < 0.0f) continue;
      const float f = exp_u20(st[0] - top);
      const float* restrict p = partial_sum(a, u, r);
      float sum = 0.0f;
      for (int i = 8; i < 16; i++) sum += st[i];
      total += f * sum;
      for (int64_t d = 0; d < D; d++) x[d] += p[d] * f;
    }
    store_out_row(a, r, x, 1.0f / total, bf16_out);
  }
}
/* NEAR (1 or 0): the near prefetch, where paged_decode_near_prefetch turns it on. While a
   (pair, KV head) is worked, its share of the next pair's block is brought into L1
   (prefetcht0) through the cursor's second range: by the end of a pair the next one's block
   is in L1. Measured on an AMX Xeon (docs/BENCHMARKS.md, "The near prefetch"), the K/V read
   from memory as a model step reads them, on top of the far prefetch into L2 of the block
   PREFETCH_AHEAD pairs ahead: int8 (AVX512-VNNI) 6-9% faster per key, fp8 (AMX) 3-6%; with
   the K/V in L2 or L3, within 2%; bfloat16 gains nothing from it. Since the single pass the
   far prefetch on top of it costs there (fp8 3-7% with two threads, 4% with one; int8 2-3%:
   "The far prefetch beside the near one"), so where the near prefetch runs it is the only
   one; without either the kernels take twice the time. Only the VNNI and AMX kernels (those
   measured) take it. PHASE(a, k, D, G) runs in each thread before (k = 0) and after (k = 1)
   its share of the pairs. */
#ifdef PART_Q8
static int near_prefetch_wanted = 0;
#endif
/* A slice's keys are one step (its scores, then its weights, in one buffer). */
_Static_assert(SLICE_KEYS <= TILE_KEYS, "a slice of more keys than a step");
#define DEFINE_Q8_ONLINE_KERNEL(NAME, QT, KEYS, PHASE, SCORE_ROWS, VALUE_ROWS, NEAR)         \
INLINE void NAME(const decode_args* a, const int64_t D, const int64_t G) {                   \
  const int64_t KVH = a->num_kv_heads, H = a->num_heads;                                     \
  const int64_t bs = a->block_size, R = D + 2, block_bytes = bs * KVH * R;                   \
  const int sliced = bs > SLICE_KEYS; /* else the block is one slice */                      \
  const int near = (NEAR) && near_prefetch_wanted;                                           \
  const uint8_t* kc = (const uint8_t*)a->k_cache;                                            \
  const uint8_t* vc = (const uint8_t*)a->v_cache;                                            \
  const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();                       \
  const int64_t pb = a->num_pairs * t / nt, pe = a->num_pairs * (t + 1) / nt;                \
  float w[(G) * (KEYS)] __attribute__((aligned(64))); /* the step's scores, then weights */  \
  PHASE(a, 0, D, G);                                                                         \
  for (int64_t r = 0; r < a->num_seqs * H; r++) {                                            \
    float* st = online_state(a, t, r);                                                       \
    st[0] = -__builtin_inff();                                                               \
    st[1] = -1.0f;                                                                           \
  }                                                                                          \
  for (int64_t p = pb; p < pe; p++) {                                                        \
    const int64_t off = a->pair_phys[p] * block_bytes;                                       \
    const int64_t ahead = !near && p + PREFETCH_AHEAD < pe                                   \
        ? a->pair_phys[p + PREFETCH_AHEAD] * block_bytes : -1;                               \
    const int64_t next = p + 1 < pe ? a->pair_phys[p + 1] * block_bytes : -1;                \
    int64_t lo;                                                                              \
    const int64_t hi = pair_keys(a, p, &lo), s = a->pair_seq[p];                             \
    for (int64_t h = 0; h < KVH; h++) {                                                      \
      const int64_t r0 = s * H + h * G;                                                      \
      float* acc = partial_sum(a, t, r0);                                                    \
      for (int64_t j = 0; j < bs; j += SLICE_KEYS) { /* one slice unless sliced */           \
        const int64_t k0s = sliced && j > lo ? j : lo;                                       \
        const int64_t k1s = sliced && j + SLICE_KEYS < hi ? j + SLICE_KEYS : hi;             \
        const int64_t j0 = sliced ? j : 0;                                                   \
        const int64_t j1 = !sliced ? bs : j + SLICE_KEYS < bs ? j + SLICE_KEYS : bs;         \
        for (int kv = 0; kv < 2; kv++) { /* the slice's K, then its V */                     \
          const uint8_t* cache = kv ? vc : kc;                                               \
          if (ahead >= 0)                                                                    \
            prefetch_keys((const char*)cache + ahead, block_bytes, h, KVH, bs, j0, j1);      \
          if (near && next >= 0 && j == 0)                                                   \
            prefetch_near((const char*)cache + next + h * bs * R, bs * R);                   \
          for (int64_t k0 = k0s; k0 < k1s; k0 += KEYS) {                                     \
            const int64_t n = k1s - k0 < KEYS ? k1s - k0 : KEYS;                             \
            const uint8_t* rows = cache + off + (k0 * KVH + h) * R;                          \
            if (kv == 0) {                                                                   \
              SCORE_ROWS(a, rows, KVH * R, n, r0, w, KEYS, D, G);                            \
              online_weights(a, t, r0, w, KEYS, n, acc, D, G);                               \
            } else {                                                                         \
              VALUE_ROWS(a, rows, KVH * R, n, w, KEYS, acc, D, G);                           \
            }                                                                                \
          }                                                                                  \
          prefetch_flush(); /* what the loops left of this share */                          \
        }                                                                                    \
        if (!sliced) break;                                                                  \
      }                                                                                      \
    }                                                                                        \
  }                                                                                          \
  PHASE(a, 1, D, G);                                                                         \
  reduce_rows_online(a, nt, sizeof(QT) == 2);                                                \
}
INLINE void no_phase(const decode_args* a, int phase, const int64_t D, const int64_t G) {
  (void)a; (void)phase; (void)D; (void)G;
}
/* The tile kernels' row passes: DEQUANT decodes the rows into a tile (on the stack), then the
   inner loops SCORE (per query head) or VALUE (all G) run over it. */
#define DEFINE_TILE_ROWS(NAME, QT, TT, DEQUANT, SCORE, VALUE)                                \
INLINE void score_rows_##NAME(const decode_args* a, const uint8_t* k, int64_t ks, int64_t n, \
                              int64_t r0, float* out, int64_t rf, const int64_t D,           \
                              const int64_t G) {                                             \
  TT tile[TILE_KEYS * 256];                                                                  \
  float sc[TILE_KEYS];                                                                       \
  DEQUANT(k, ks, n, a->lut, tile, sc, D);                                                    \
  for (int64_t g = 0; g < G; g++)                                                            \
    SCORE((const QT*)a->q + (r0 + g) * D, tile, sc, n, a->scale, out + g * rf, D);           \
}                                                                                            \
INLINE void value_rows_##NAME(const decode_args* a, const uint8_t* v, int64_t vs, int64_t n, \
                              float* w, int64_t rf, float* acc, const int64_t D,             \
                              const int64_t G) {                                             \
  TT tile[TILE_KEYS * 256];                                                                  \
  float sc[TILE_KEYS];                                                                       \
  DEQUANT(v, vs, n, a->lut, tile, sc, D);                                                    \
  VALUE(w, rf, tile, sc, n, acc, D, G);                                                      \
}
/* Instances: literal head_dim only (any group size; the 16-bit kernels' G literals would
   double the compile time), portable ones generic. */
#define DISPATCH_Q8(NAME, KERNEL)                                                            \
static void NAME(const decode_args* a) {                                                     \
  const int64_t G = a->num_heads / a->num_kv_heads;                                          \
  if (a->head_dim == 64) PARALLEL(KERNEL, 64, G)                                             \
  if (a->head_dim == 128) PARALLEL(KERNEL, 128, G)                                           \
  PARALLEL(KERNEL, a->head_dim, G)                                                           \
}
#define Q8_INSTANCE(NAME, QT, TT, DEQUANT, OPS)                                              \
  DEFINE_TILE_ROWS(NAME, QT, TT, DEQUANT, score_tile_##OPS, value_tile_##OPS)                \
  DEFINE_Q8_ONLINE_KERNEL(kernel_##NAME, QT, TILE_KEYS, no_phase, score_rows_##NAME,          \
                          value_rows_##NAME, 0)                                              \
  DISPATCH_Q8(run_##NAME, kernel_##NAME)
#ifdef PART_Q8
typedef bf16_t bf16;
typedef float f32;
DEFINE_F32_TILE_OPS(f32_portable, float, load_f32, score_f32_portable, value_f32_portable)
DEFINE_F32_TILE_OPS(bf16_portable, bf16_t, load_bf16, score_f32_portable, value_f32_portable)
Q8_INSTANCE(q8_f32_int8, f32, float, dequant_int8_portable, f32_portable)
Q8_INSTANCE(q8_f32_lut, f32, float, dequant_lut_portable, f32_portable)
Q8_INSTANCE(q8_bf16_int8, bf16, float, dequant_int8_portable, bf16_portable)
Q8_INSTANCE(q8_bf16_lut, bf16, float, dequant_lut_portable, bf16_portable)
#ifdef USE_Q8_AVX512
DEFINE_F32_TILE_OPS(f32_avx512, float, load_f32, score_f32_tile_avx512, value_f32_avx512)
DEFINE_F32_TILE_OPS(bf16_avx512, bf16_t, load_bf16, score_f32_tile_avx512, value_f32_avx512)
Q8_INSTANCE(q8_f32_int8_avx512, f32, float, dequant_int8_avx512, f32_avx512)
Q8_INSTANCE(q8_f32_e4m3_avx512, f32, float, dequant_e4m3_avx512, f32_avx512)
Q8_INSTANCE(q8_f32_e5m2_avx512, f32, float, dequant_e5m2_avx512, f32_avx512)
Q8_INSTANCE(q8_bf16_int8_avx512, bf16, float, dequant_int8_avx512, bf16_avx512)
Q8_INSTANCE(q8_bf16_e4m3_avx512, bf16, float, dequant_e4m3_avx512, bf16_avx512)
Q8_INSTANCE(q8_bf16_e5m2_avx512, bf16, float, dequant_e5m2_avx512, bf16_avx512)
#endif
#ifdef USE_AVX512_BF16
Q8_INSTANCE(q8_bf16_int8_bf16dp, bf16, bf16_t, dequant_int8_bf16, bf16)
Q8_INSTANCE(q8_bf16_e4m3_bf16dp, bf16, bf16_t, dequant_e4m3_bf16, bf16)
Q8_INSTANCE(q8_bf16_e5m2_bf16dp, bf16, bf16_t, dequant_e5m2_bf16, bf16)
#ifdef USE_Q8_PLANES
/* The table kernels: the key tile by the tables, the value rows in place. */
#define Q8_PLANES_INSTANCE(FMT)                                                              \
  DEFINE_TILE_ROWS(q8_bf16_##FMT##_planes, bf16, bf16_t, dequant_##FMT##_planes,             \
                   score_tile_bf16, value_tile_bf16)                                         \
  DEFINE_Q8_ONLINE_KERNEL(kernel_q8_bf16_##FMT##_planes, bf16, TILE_KEYS, no_phase,           \
                          score_rows_q8_bf16_##FMT##_planes, value_rows_value_##FMT##_planes, 0) \
  DISPATCH_Q8(run_q8_bf16_##FMT##_planes, kernel_q8_bf16_##FMT##_planes)
Q8_PLANES_INSTANCE(int8)
Q8_PLANES_INSTANCE(e4m3)
Q8_PLANES_INSTANCE(e5m2)
/* Lanes of x that are NaN or infinite: not |x| < inf (x * 0 != 0 would not do: the build's
   float flags let the compiler fold x * 0 to 0). */
INLINE __mmask16 non_finite(__m512 x) {
  return _mm512_cmp_ps_mask(_mm512_abs_ps(x), _mm512_set1_ps(__builtin_inff()), _CMP_NLT_UQ);
}
/* The step of weights x0, x1 (>= 0, lanes past the keys zero) in fixed point of their largest
   mx: full / mx into *to_codes (taking them to codes up to full), mx / full returned (taking
   the codes' sums back), NaN if a weight is NaN or infinite (a value row's scale, say), which
   the codes would round to some integer: so the head's output is NaN, as the float kernels'. */
INLINE float weight_step(__m512 x0, __m512 x1, float full, float* to_codes) {
  const float mx = _mm512_reduce_max_ps(_mm512_max_ps(x0, x1));
  *to_codes = mx > 0.0f ? full / mx : 0.0f;
  return non_finite(x0) | non_finite(x1) ? __builtin_nanf("") : mx > 0.0f ? mx / full : 0.0f;
}
#ifdef USE_Q8_VNNI
/* AVX512-VNNI, int8 caches (bfloat16 queries, head_dim a multiple of 64): both products
   multiply the codes as they are stored, as integers, instead of their bfloat16 values: no
   decoding, and the scores' keys in lanes instead of a reduction tree.
   Scores: each query head in 16-bit fixed point of its largest |q|, q16 = round(q * 32639 /
   max|q|) = 256 qh + ql with qh, ql signed bytes (laid out once per call, vnni_queries), and
   the key codes k as unsigned bytes k + 128: VPDPBUSD sums four dimensions of 16 keys at a
   time (the key rows' 4-byte groups transposed, 16 x 16, so that lane j is key j), hi and lo
   separately; 256 hi + lo - 128 sum(q16) = sum(q16 k), exact in int32 (wrapping in between).
   The score is that times the key row's scale and max|q| / 32639; each query element is off
   by at most max|q| / 65278 where the bfloat16 query is exact.
   Values: the scaled weights x_i = w_i * sc_i (>= 0) of a head in 15-bit fixed point of their
   maximum m over the (block, head) step, u = round(x * 32767 / m), key pairs (u_i, u_i+1)
   against the two keys' codes widened to 16 bits (VPDPWSSD), sums exact in int32 (at most
   32 keys * 32767 * 127), then out += (m / 32767) sum. Each weight is off by at most
   m / 65534 where a bfloat16 one is off by up to 2^-9 of itself. */
INLINE int8_t* vnni_query(const decode_args* a, int64_t r) { /* qh[D], ql[D], C, factor */
  return (int8_t*)(query_area(a) + r * (a->head_dim / 2 + 2));
}
INLINE __m512 load16_bf16(const bf16_t* p) { /* 16 bfloat16 values as float32 */
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
INLINE void vnni_queries(const decode_args* a, int phase, const int64_t D, const int64_t G) {
  (void)G;
  if (phase != 0) return;
  _Pragma("omp for schedule(static)")
  for (int64_t r = 0; r < a->num_seqs * a->num_heads; r++) {
    const bf16_t* q = (const bf16_t*)a->q + r * D;
    int8_t* out = vnni_query(a, r);
    __m512 mx = _mm512_setzero_ps();
    __mmask16 bad = 0;
    for (int64_t d = 0; d < D; d += 16) {
      const __m512 x = load16_bf16(q + d);
      mx = _mm512_max_ps(mx, _mm512_abs_ps(x));
      bad |= non_finite(x);
    }
    const float m = _mm512_reduce_max_ps(mx);
    const __m512 f = _mm512_set1_ps(m > 0.0f ? 32639.0f / m : 0.0f);
    __m512i total = _mm512_setzero_si512();
    for (int64_t d = 0; d < D; d += 16) {
      /* |q16| <= 32639 */
      const __m512i q16 = _mm512_cvtps_epi32(_mm512_mul_ps(load16_bf16(q + d), f));
      const __m512i hi = _mm512_srai_epi32(_mm512_add_epi32(q16, _mm512_set1_epi32(128)), 8);
      _mm_storeu_si128((__m128i*)(out + d), _mm512_cvtepi32_epi8(hi));
      _mm_storeu_si128((__m128i*)(out + D + d),
                       _mm512_cvtepi32_epi8(_mm512_sub_epi32(q16, _mm512_slli_epi32(hi, 8))));
      total = _mm512_add_epi32(total, q16);
    }
    const int32_t c = 128 * _mm512_reduce_add_epi32(total);
    /* NaN for a NaN or infinite element: the head's scores and output NaN, as the float
       kernels' (the fixed point would round it to some integer) */
    const float factor = bad ? __builtin_nanf("") : m > 0.0f ? a->scale * m / 32639.0f : 0.0f;
    memcpy(out + 2 * D, &c, sizeof c);
    memcpy(out + 2 * D + 4, &factor, sizeof factor);
  }
}
/* Lane j of t[m] = lane m of r[j] (16 x 16 int32). */
INLINE void transpose16(const __m512i* r, __m512i* t) {
  __m512i x[16], y[16];
  for (int i = 0; i < 8; i++) {
    x[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    x[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; i++) { /* y[4i + k], lane L: element 4L + k of rows 4i.. 4i + 3 */
    y[4 * i] = _mm512_unpacklo_epi64(x[4 * i], x[4 * i + 2]);
    y[4 * i + 1] = _mm512_unpackhi_epi64(x[4 * i], x[4 * i + 2]);
    y[4 * i + 2] = _mm512_unpacklo_epi64(x[4 * i + 1], x[4 * i + 3]);
    y[4 * i + 3] = _mm512_unpackhi_epi64(x[4 * i + 1], x[4 * i + 3]);
  }
  for (int k = 0; k < 4; k++) {
    const __m512i a0 = _mm512_shuffle_i32x4(y[k], y[4 + k], 0x44);
    const __m512i a1 = _mm512_shuffle_i32x4(y[k], y[4 + k], 0xEE);
    const __m512i b0 = _mm512_shuffle_i32x4(y[8 + k], y[12 + k], 0x44);
    const __m512i b1 = _mm512_shuffle_i32x4(y[8 + k], y[12 + k], 0xEE);
    t[k] = _mm512_shuffle_i32x4(a0, b0, 0x88);
    t[4 + k] = _mm512_shuffle_i32x4(a0, b0, 0xDD);
    t[8 + k] = _mm512_shuffle_i32x4(a1, b1, 0x88);
    t[12 + k] = _mm512_shuffle_i32x4(a1, b1, 0xDD);
  }
}
/* The bfloat16 scales of rows [0, n) (n <= 16, lanes past n zero) as float32: one gather of
   each row's last two code bytes and its scale (nothing read past the row). */
INLINE __m512 row_scales16(const uint8_t* rows, int64_t stride, int64_t n, const int64_t D) {
  const __mmask16 m = first_lanes(n);
  const __m512i at = _mm512_mullo_epi32(
      _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
      _mm512_set1_epi32((int)stride));
  const __m512i x = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), m, at,
                                                rows + D - 2, 1);
  return _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32((int)0xffff0000u)));
}
INLINE __m512i bcast4(const int8_t* p) {
  int32_t x;
  memcpy(&x, p, sizeof x);
  return _mm512_set1_epi32(x);
}
INLINE void score_rows_int8_vnni(const decode_args* a, const uint8_t* k, int64_t ks, int64_t n,
                                 int64_t r0, float* out, int64_t rf, const int64_t D,
                                 const int64_t G) {
  __m512i sums[BF16_TILE_GROUP]; /* per head, over the chunks of 64 dimensions */
  for (int64_t i0 = 0; i0 < n; i0 += 16) {
    const int64_t nn = n - i0 < 16 ? n - i0 : 16;
    const __mmask16 m = first_lanes(nn);
    for (int64_t dc = 0; dc < D; dc += 64) {
      __m512i r[16], t[16];
      for (int64_t j = 0; j < 16; j++) {
        if (j < nn) prefetch_step();
        r[j] = j < nn ? _mm512_xor_si512(_mm512_loadu_si512(k + (i0 + j) * ks + dc),
                                         _mm512_set1_epi8((char)0x80))
                      : _mm512_setzero_si512();
      }
      transpose16(r, t);
      for (int64_t g = 0; g < G; g++) {
        const int8_t* qg = vnni_query(a, r0 + g) + dc;
        /* two sums each for hi and lo (odd and even u): chains of 8 products, not 16 */
        __m512i hi0 = _mm512_setzero_si512(), lo0 = _mm512_setzero_si512();
        __m512i hi1 = _mm512_setzero_si512(), lo1 = _mm512_setzero_si512();
        for (int u = 0; u < 16; u += 2) {
          hi0 = _mm512_dpbusd_epi32(hi0, t[u], bcast4(qg + 4 * u));
          lo0 = _mm512_dpbusd_epi32(lo0, t[u], bcast4(qg + D + 4 * u));
          hi1 = _mm512_dpbusd_epi32(hi1, t[u + 1], bcast4(qg + 4 * u + 4));
          lo1 = _mm512_dpbusd_epi32(lo1, t[u + 1], bcast4(qg + D + 4 * u + 4));
        }
        const __m512i hi = _mm512_add_epi32(hi0, hi1), lo = _mm512_add_epi32(lo0, lo1);
        const __m512i s = _mm512_add_epi32(_mm512_slli_epi32(hi, 8), lo);
        sums[g] = dc == 0 ? s : _mm512_add_epi32(sums[g], s);
      }
    }
    const __m512 scales = row_scales16(k + i0 * ks, ks, nn, D);
    for (int64_t g = 0; g < G; g++) {
      const int8_t* qg = vnni_query(a, r0 + g);
      int32_t c;
      float factor;
      memcpy(&c, qg + 2 * D, sizeof c);
      memcpy(&factor, qg + 2 * D + 4, sizeof factor);
      const __m512 dot = _mm512_cvtepi32_ps(_mm512_sub_epi32(sums[g], _mm512_set1_epi32(c)));
      _mm512_mask_storeu_ps(out + g * rf + i0, m, _mm512_mul_ps(
          _mm512_mul_ps(dot, scales), _mm512_set1_ps(factor)));
    }
  }
}
/* The 15-bit weights of G heads for n keys: wq[g * TILE_KEYS + i] (zeros up to the next even
   i), their scales wf[g]. */
INLINE void vnni_weights(const uint8_t* v, int64_t vs, int64_t n, const float* w, int64_t rf,
                         const int64_t D, const int64_t G, int16_t* wq, float* wf) {
  const __mmask16 m0 = first_lanes(n), m1 = first_lanes(n - 16);
  const __m512 s0 = row_scales16(v, vs, n, D);
  const __m512 s1 = n > 16 ? row_scales16(v + 16 * vs, vs, n - 16, D) : _mm512_setzero_ps();
  for (int64_t g = 0; g < G; g++) {
    const __m512 x0 = _mm512_mul_ps(_mm512_maskz_loadu_ps(m0, w + g * rf), s0);
    const __m512 x1 = n > 16 ? _mm512_mul_ps(_mm512_maskz_loadu_ps(m1, w + g * rf + 16), s1)
                             : _mm512_setzero_ps();
    float to_codes;
    wf[g] = weight_step(x0, x1, 32767.0f, &to_codes);
    const __m512 f = _mm512_set1_ps(to_codes);
    _mm256_storeu_si256((__m256i*)(wq + g * TILE_KEYS),
                        _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(x0, f))));
    if (n > 16)
      _mm256_storeu_si256((__m256i*)(wq + g * TILE_KEYS + 16),
                          _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(x1, f))));
  }
}
INLINE void value_rows_int8_vnni(const decode_args* a, const uint8_t* v, int64_t vs, int64_t n,
                                 float* w, int64_t rf, float* acc, const int64_t D,
                                 const int64_t G) {
  (void)a;
  int16_t wq[BF16_TILE_GROUP * TILE_KEYS];
  float wf[BF16_TILE_GROUP];
  vnni_weights(v, vs, n, w, rf, D, G, wq, wf);
  /* The sums s[g][c] of a chunk of 64 dimensions: lane 4 L + t of s[g][2 h] (s[g][2 h + 1])
     holds dimension 32 h + 8 L + t (+ 4), t < 4 (the unpacks work within 128-bit lanes);
     lo_dims and hi_dims put a pair of them back in order, dimensions 32 h.. + 15, + 16.. */
  const __m512i lo_dims = _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4,
                                           19, 18, 17, 16, 3, 2, 1, 0);
  const __m512i hi_dims = _mm512_add_epi32(lo_dims, _mm512_set1_epi32(8));
  for (int64_t dc = 0; dc < D; dc += 64) {
    for (int64_t g0 = 0; g0 < G; g0 += 4) {
      const int64_t gn = G - g0 < 4 ? G - g0 : 4;
      __m512i s[4][4];
      for (int64_t g = 0; g < gn; g++)
        for (int c = 0; c < 4; c++) s[g][c] = _mm512_setzero_si512();
      for (int64_t i = 0; i < n; i += 2) {
        if (g0 == 0) PREFETCH_STEPS(128, uint8_t); /* the two keys' 64 dimensions */
        const __m512i x = _mm512_loadu_si512(v + i * vs + dc);
        const __m512i y = i + 1 < n ? _mm512_loadu_si512(v + (i + 1) * vs + dc)
                                    : _mm512_setzero_si512();
        const __m512i x0 = _mm512_cvtepi8_epi16(_mm512_castsi512_si256(x));
        const __m512i x1 = _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(x, 1));
        const __m512i y0 = _mm512_cvtepi8_epi16(_mm512_castsi512_si256(y));
        const __m512i y1 = _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(y, 1));
        const __m512i p[4] = {_mm512_unpacklo_epi16(x0, y0), _mm512_unpackhi_epi16(x0, y0),
                              _mm512_unpacklo_epi16(x1, y1), _mm512_unpackhi_epi16(x1, y1)};
        for (int64_t g = 0; g < gn; g++) {
          int32_t pair;
          memcpy(&pair, wq + (g0 + g) * TILE_KEYS + i, sizeof pair);
          const __m512i wp = _mm512_set1_epi32(pair);
          for (int c = 0; c < 4; c++) s[g][c] = _mm512_dpwssd_epi32(s[g][c], p[c], wp);
        }
      }
      for (int64_t g = 0; g < gn; g++) {
        float* ag = acc + (g0 + g) * D + dc;
        const __m512 f = _mm512_set1_ps(wf[g0 + g]);
        for (int h = 0; h < 2; h++) { /* dims 32 h.. 32 h + 31 */
          const __m512i a0 = _mm512_permutex2var_epi32(s[g][2 * h], lo_dims, s[g][2 * h + 1]);
          const __m512i a1 = _mm512_permutex2var_epi32(s[g][2 * h], hi_dims, s[g][2 * h + 1]);
          float* ah = ag + 32 * h;
          _mm512_storeu_ps(ah, _mm512_fmadd_ps(_mm512_cvtepi32_ps(a0), f, _mm512_loadu_ps(ah)));
          _mm512_storeu_ps(ah + 16, _mm512_fmadd_ps(_mm512_cvtepi32_ps(a1), f,
                                                    _mm512_loadu_ps(ah + 16)));
        }
      }
    }
  }
}
DEFINE_Q8_ONLINE_KERNEL(kernel_q8_bf16_int8_vnni, bf16, TILE_KEYS, vnni_queries,
                        score_rows_int8_vnni, value_rows_int8_vnni, 1)
DISPATCH_Q8(run_q8_bf16_int8_vnni, kernel_q8_bf16_int8_vnni)
static int vnni_int8_wanted = 1;
#endif
#ifdef USE_Q8_AMX
/* AMX (the tile instructions and their bfloat16 products, Sapphire Rapids and later; head_dim
   a multiple of 64, at most 16 query heads per KV head): the table kernels' decoding, and the
   dot products of the scores and the weighted sum by TDPBF16PS, 16 keys at a time, in place of the vector dot
   products, the reduction tree of the scores and the value loop's broadcasts, in the single
   pass (DEFINE_Q8_ONLINE_KERNEL). The products are exact and summed in float32, as by the
   vector instructions, in another order.
   Scores: [16 keys x G] = K tile [16 keys x 32 dims] . Q pairs [16 dim pairs x G], over the
   head_dim in chunks of 32, the key tile decoded by the tables and the query heads'
   dimension pairs laid out once per call (query_pairs).
   Values: out[G x 16 dims] += weights [G x 16 keys] . V pairs [8 key pairs x 16 dims], 32
   dimensions at a time, the V pairs decoded by the tables straight into the layout the
   products read (step_bf16's).
   One tile configuration serves both (amx_configure). The decoded rows go to memory, where
   the tile loads read them; a tile load does not take its data from stores still in flight,
   so a step's value products run in the next step, between its key rows' decoding and its
   score products (amx_state), not right after their own decoding. Linux lends the tile
   registers to a process only on request (amx_permitted); without them the table kernels
   run. */
typedef struct {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
} amx_config;
/* tmm0 scores, tmm1 keys, tmm2 query pairs; tmm3-4 outputs, tmm5 weights, tmm6-7 value
   pairs. */
INLINE void amx_configure(const int64_t G) {
  static const uint8_t rows[8] = {16, 16, 16, 0, 0, 0, 8, 8};
  static const uint16_t colsb[8] = {0, 64, 0, 64, 64, 32, 64, 64};
  amx_config c;
  memset(&c, 0, sizeof c);
  c.palette = 1;
  for (int i = 0; i < 8; i++) {
    c.rows[i] = i >= 3 && i <= 5 ? (uint8_t)G : rows[i];
    c.colsb[i] = i == 0 || i == 2 ? (uint16_t)(4 * G) : colsb[i];
  }
  _tile_loadconfig(&c);
}
/* The query heads' dimension pairs, for all sequences, after the partial sums in the
   workspace (decode_workspace counts them): those of the G heads from workspace row r0 at
   query_pairs(a, r0), [D / 2 pairs][G heads] word pairs. */
INLINE uint32_t* query_pairs(const decode_args* a, int64_t r0) {
  return (uint32_t*)query_area(a) + r0 * (a->head_dim / 2);
}
/* A thread's decoded rows: a step's key rows, and the value pairs whose products are
   pending; in the workspace (amx_state_of), so the kernel allocates nothing. */
typedef struct {
  bf16_t tile[TILE_KEYS * 256];     /* the key rows */
  float sc[TILE_KEYS];              /* and their scales */
  __m512i vp[16][TILE_KEYS / 2];    /* [chunk of 16 dims][key pair] value pairs */
  bf16_t wt[16 * TILE_KEYS];        /* and the scaled weights */
  float* out;                       /* their partial sums */
  int64_t n;                        /* and their keys */
  int pending;
} amx_state;
static __thread amx_state* amx_at __attribute__((tls_model("initial-exec")));
/* Thread t's state: the workspace's last part, after the rows' query areas, AMX_STATE_FLOATS
   for each thread on 64-byte lines (counted by paged_decode_workspace_floats). */
#define AMX_STATE_FLOATS ((int64_t)(sizeof(amx_state) + 63) / 64 * 16)
INLINE amx_state* amx_state_of(const decode_args* a, int64_t t) {
  const int64_t at = (query_area(a) - a->workspace
                      + a->num_seqs * a->num_heads * (a->head_dim / 2 + 2) + 15) / 16 * 16;
  return (amx_state*)(a->workspace + at + t * AMX_STATE_FLOATS);
}
/* The scores of the n decoded key rows against the G query heads' pairs qp, times the rows'
   scales and a->scale, into out[g * os + i]. */
INLINE void amx_scores(const decode_args* a, const uint32_t* qp, int64_t n, float* out,
                       int64_t os, const int64_t D, const int64_t G) {
  amx_state* st = amx_at;
  float s[16 * 16] __attribute__((aligned(64)));
  const __m512i rows = _mm512_mullo_epi32(
      _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
      _mm512_set1_epi32((int)G));
  for (int64_t i = 0; i < n; i += 16) {
    const bf16_t* ki = st->tile + i * D;
    _tile_zero(0);
    for (int64_t c = 0; c < D / 32; c++) {
      _tile_loadd(1, ki + 32 * c, D * 2);
      _tile_loadd(2, qp + 16 * c * G, G * 4);
      _tile_dpbf16ps(0, 1, 2);
    }
    _tile_stored(0, s, G * 4);
    const __mmask16 m = first_lanes(n - i);
    const __m512 f = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, st->sc + i),
                                   _mm512_set1_ps(a->scale));
    for (int64_t g = 0; g < G; g++) { /* the scores [keys][G] to the rows [G][keys] */
      const __m512i at = _mm512_add_epi32(rows, _mm512_set1_epi32((int)g)); /* key j: G j + g */
      __m512 dot = _mm512_setzero_ps();
      for (int64_t c = 0; c < G; c += 2) { /* by permutes of s's floats 16 c.. 16 c + 31 */
        const __m512i local = _mm512_sub_epi32(at, _mm512_set1_epi32((int)(16 * c)));
        const __mmask16 here = _mm512_cmplt_epu32_mask(local, _mm512_set1_epi32(32));
        dot = _mm512_mask_blend_ps(here, dot, _mm512_permutex2var_ps(
            _mm512_load_ps(s + 16 * c), local, _mm512_load_ps(s + 16 * c + 16)));
      }
      _mm512_mask_storeu_ps(out + g * os + i, m, _mm512_mul_ps(dot, f));
    }
  }
}
/* The pending value products, if any: their partial sums += weights . value pairs. */
INLINE void amx_values(const int64_t D) {
  amx_state* st = amx_at;
  if (!st->pending) return;
  for (int64_t dc = 0; dc < D; dc += 32) {
    float* ad = st->out + dc;
    __m512i(*vp)[TILE_KEYS / 2] = st->vp + dc / 16;
    _tile_loadd(3, ad, D * 4);
    _tile_loadd(4, ad + 16, D * 4);
    for (int64_t i0 = 0; i0 < st->n; i0 += 16) {
      _tile_loadd(5, st->wt + i0, TILE_KEYS * 2);
      _tile_loadd(6, vp[0] + i0 / 2, 64);
      _tile_dpbf16ps(3, 5, 6);
      _tile_loadd(7, vp[1] + i0 / 2, 64);
      _tile_dpbf16ps(4, 5, 7);
    }
    _tile_stored(3, ad, D * 4);
    _tile_stored(4, ad + 16, D * 4);
  }
  st->pending = 0;
}
/* PHASE for the AMX kernels: before the pass (0) the query pairs, shared out by (sequence,
   KV head), and the tiles configured; after it (1) the last value products. */
INLINE void amx_phase(const decode_args* a, int phase, const int64_t D, const int64_t G) {
  if (phase == 0) {
    _Pragma("omp for schedule(static)")
    for (int64_t r0 = 0; r0 < a->num_seqs * a->num_heads; r0 += G) {
      uint32_t* qp = query_pairs(a, r0);
      for (int64_t g = 0; g < G; g++) {
        const uint32_t* qg = (const uint32_t*)((const bf16_t*)a->q + (r0 + g) * D);
        for (int64_t r = 0; r < D / 2; r++) qp[r * G + g] = qg[r];
      }
    }
    amx_at = amx_state_of(a, omp_get_thread_num());
    amx_at->pending = 0;
    amx_configure(G);
  } else {
    amx_values(D);
    _tile_release();
  }
}
#define DEFINE_AMX_ROWS(FMT, F)                                                       \
INLINE void score_rows_amx_##FMT(const decode_args* a, const uint8_t* k, int64_t ks,         \
                                 int64_t n, int64_t r0, float* out, int64_t os,              \
                                 const int64_t D, const int64_t G) {                         \
  amx_state* st = amx_at;                                                                    \
  dequant_##FMT##_planes(k, ks, n, a->lut, st->tile, st->sc, D);                             \
  amx_values(D); /* the last step's, while this step's rows reach the cache */              \
  amx_scores(a, query_pairs(a, r0), n, out, os, D, G);                                       \
}                                                                                            \
INLINE void value_rows_amx_##FMT(const decode_args* a, const uint8_t* v, int64_t vs,         \
                                 int64_t n, float* w, int64_t ws, float* acc,                \
                                 const int64_t D, const int64_t G) {                         \
  (void)a;                                                                                   \
  amx_state* st = amx_at;                                                                    \
  float sc[TILE_KEYS];                                                                       \
  for (int64_t i = 0; i < n; i++) sc[i] = row_scale(v + i * vs, D);                          \
  scaled_weights_bf16(w, ws, sc, n, G, st->wt);                                              \
  const q8_lut t = q8_lut_load(F);                                                           \
  const __m512i lo_index = interleave_index();                                               \
  const __m512i hi_index = _mm512_add_epi8(lo_index, _mm512_set1_epi8(32));                  \
  const int64_t pairs = (n + 15) / 16 * 8; /* whole chunks of 16 keys, zeros past n */       \
  for (int64_t dc = 0; dc < D; dc += 64) {                                                   \
    __m512i(*vp)[TILE_KEYS / 2] = st->vp + dc / 16;                                          \
    for (int64_t p = 0; p < pairs; p++) {                                                    \
      const int64_t i = 2 * p;                                                               \
      if (i >= n) {                                                                          \
        for (int c = 0; c < 4; c++) vp[c][p] = _mm512_setzero_si512();                       \
        continue;                                                                            \
      }                                                                                      \
      PREFETCH_STEPS(128, uint8_t); /* the two keys' 64 dimensions */                        \
      const __m512i x = _mm512_loadu_si512(v + i * vs + dc);                                 \
      const __m512i y = i + 1 < n ? _mm512_loadu_si512(v + (i + 1) * vs + dc)                \
                                  : _mm512_setzero_si512();                                  \
      q8_lut_cvt(&t, _mm512_permutex2var_epi8(x, lo_index, y), F, &vp[0][p], &vp[1][p]);     \
      q8_lut_cvt(&t, _mm512_permutex2var_epi8(x, hi_index, y), F, &vp[2][p], &vp[3][p]);     \
    }                                                                                        \
  }                                                                                          \
  st->out = acc;                                                                             \
  st->n = n;                                                                                 \
  st->pending = 1;                                                                           \
}                                                                                            \
DEFINE_Q8_ONLINE_KERNEL(kernel_q8_bf16_##FMT##_amx, bf16, TILE_KEYS, amx_phase,              \
                        score_rows_amx_##FMT, value_rows_amx_##FMT, 1)                       \
DISPATCH_Q8(run_q8_bf16_##FMT##_amx, kernel_q8_bf16_##FMT##_amx)
DEFINE_AMX_ROWS(int8, 0)
DEFINE_AMX_ROWS(e4m3, 1)
DEFINE_AMX_ROWS(e5m2, 2)
/* Whether the kernels may use the tile registers: Linux (5.16 and later) grants them to a
   process on request, once (arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA);
   paged_decode_amx(0) turns them off (the table kernels run), (1) on where granted; -1 only
   asks. Returns whether they are used. */
static int amx_granted = -1, amx_wanted = 1;
static int amx_permitted(void) {
  if (amx_granted < 0) amx_granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return amx_granted && amx_wanted;
}
int paged_decode_amx(int on) {
  if (on >= 0) amx_wanted = on;
  return amx_permitted();
}
#define AMX(FMT, a)                                                                          \
  if (a->num_heads / a->num_kv_heads <= 16 && amx_permitted()) {                             \
    run_q8_bf16_##FMT##_amx(a); return;                                                      \
  }
#else
#define AMX(FMT, a)
#endif
#ifdef USE_Q8_VNNI
#define VNNI(FMT, a)                                                                         \
  if (FMT##_is_int8 && vnni_int8_wanted) { run_q8_bf16_int8_vnni(a); return; }
#else
#define VNNI(FMT, a)
#endif
#define PLANES(FMT, a)                                                                       \
  if (a->head_dim % 64 == 0) {                                                               \
    VNNI(FMT, a)                                                                             \
    AMX(FMT, a)                                                                              \
    run_q8_bf16_##FMT##_planes(a); return;                                                   \
  }
#else
#define PLANES(FMT, a)
#endif
#define BF16DP(QT, FMT, a)                                                                   \
  if (QT##_is_bf16 && a->num_heads / a->num_kv_heads <= BF16_TILE_GROUP) {                   \
    PLANES(FMT, a)                                                                           \
    run_q8_bf16_##FMT##_bf16dp(a); return;                                                   \
  }
#else
#define BF16DP(QT, FMT, a)
#endif
#ifdef USE_AVX2_F32
/* The AVX2 loops read the 8-bit rows directly (no tile): the scores times each key row's
   scale, the softmax weights times each value row's scale (e4m3's times 2^8 as above). */
INLINE float rs_8bit(const uint8_t* r, int64_t D) { return row_scale(r, D); }
INLINE float rs_e4m3(const uint8_t* r, int64_t D) { return 256.0f * row_scale(r, D); }
#define Q8_AVX2_FORMAT(FMT, RS)                                                              \
  DEFINE_AVX2_SCORE_HEADS(score_##FMT##_avx2_heads, uint8_t, cvt8_##FMT, RS)                 \
  DEFINE_AVX2_SCORE(score_f32_##FMT##_avx2, float, cvt8_f32, uint8_t,                        \
                    score_##FMT##_avx2_heads)                                                \
  DEFINE_AVX2_SCORE(score_bf16_##FMT##_avx2, bf16_t, cvt8_bf16, uint8_t,                     \
                    score_##FMT##_avx2_heads)                                                \
  DEFINE_AVX2_VALUE_HEADS(value_##FMT##_avx2_heads, uint8_t, cvt8_##FMT)                     \
  DEFINE_AVX2_VALUE(value_##FMT##_avx2, uint8_t, RS, 1, value_##FMT##_avx2_heads)
#define Q8_AVX2_INSTANCE(QT, FMT)                                                            \
INLINE void score_rows_##QT##_##FMT##_avx2(const decode_args* a, const uint8_t* k,           \
                                           int64_t ks, int64_t n, int64_t r0, float* out,    \
                                           int64_t rf, const int64_t D, const int64_t G) {   \
  score_##QT##_##FMT##_avx2((const QT*)a->q + r0 * D, k, ks, n, a->scale, out, rf, D, G);    \
}                                                                                            \
INLINE void value_rows_##QT##_##FMT##_avx2(const decode_args* a, const uint8_t* v,           \
                                           int64_t vs, int64_t n, float* w, int64_t rf,      \
                                           float* acc, const int64_t D, const int64_t G) {   \
  (void)a;                                                                                   \
  value_##FMT##_avx2(w, rf, v, vs, n, acc, D, G);                                            \
}                                                                                            \
DEFINE_Q8_ONLINE_KERNEL(kernel_q8_##QT##_##FMT##_avx2, QT, TILE_KEYS, no_phase,               \
                        score_rows_##QT##_##FMT##_avx2, value_rows_##QT##_##FMT##_avx2, 0)   \
DISPATCH_Q8(run_q8_##QT##_##FMT##_avx2, kernel_q8_##QT##_##FMT##_avx2)
Q8_AVX2_FORMAT(int8, rs_8bit)
Q8_AVX2_FORMAT(e4m3, rs_e4m3)
Q8_AVX2_FORMAT(e5m2, rs_8bit)
Q8_AVX2_INSTANCE(f32, int8)
Q8_AVX2_INSTANCE(f32, e4m3)
Q8_AVX2_INSTANCE(f32, e5m2)
Q8_AVX2_INSTANCE(bf16, int8)
Q8_AVX2_INSTANCE(bf16, e4m3)
Q8_AVX2_INSTANCE(bf16, e5m2)
#endif
enum { f32_is_bf16 = 0, bf16_is_bf16 = 1, int8_is_int8 = 1, e4m3_is_int8 = 0, e5m2_is_int8 = 0 };
#ifdef USE_Q8_AVX512
#define Q8_ENTRY(QT, FMT, PORTABLE)                                                          \
  void paged_decode_attention_q8_##QT##_##FMT(const decode_args* a) {                        \
    if (vector_shape(a)) {                                                                   \
      BF16DP(QT, FMT, a)                                                                     \
      run_q8_##QT##_##FMT##_avx512(a); return;                                               \
    }                                                                                        \
    run_##PORTABLE(a);                                                                       \
  }
#elif defined(USE_AVX2_F32)
#define Q8_ENTRY(QT, FMT, PORTABLE)                                                          \
  void paged_decode_attention_q8_##QT##_##FMT(const decode_args* a) {                        \
    if (vector_shape(a)) { run_q8_##QT##_##FMT##_avx2(a); return; }                          \
    run_##PORTABLE(a);                                                                       \
  }
#else
#define Q8_ENTRY(QT, FMT, PORTABLE)                                                          \
  void paged_decode_attention_q8_##QT##_##FMT(const decode_args* a) { run_##PORTABLE(a); }
#endif
/* Entry points: query dtype (f32, bf16) x format (int8, e4m3, e5m2); head_dim <= 256. */
Q8_ENTRY(f32, int8, q8_f32_int8)
Q8_ENTRY(f32, e4m3, q8_f32_lut)
Q8_ENTRY(f32, e5m2, q8_f32_lut)
Q8_ENTRY(bf16, int8, q8_bf16_int8)
Q8_ENTRY(bf16, e4m3, q8_bf16_lut)
Q8_ENTRY(bf16, e5m2, q8_bf16_lut)
/* The workspace's size in floats for a step of these dimensions (cpu_kernel.decode_workspace
   allocates it; 64-byte aligned): the rows (row_floats), num_threads partial sums per row,
   the query areas, and with the AMX kernels in the build each thread's state. */
int64_t paged_decode_workspace_floats(int64_t num_seqs, int64_t num_heads, int64_t head_dim,
                                      int64_t max_seq_len, int64_t num_threads) {
  decode_args a;
  memset(&a, 0, sizeof a);
  a.num_seqs = num_seqs, a.num_heads = num_heads, a.head_dim = head_dim;
  a.max_seq_len = max_seq_len, a.num_threads = num_threads;
  const int64_t rows = num_seqs * num_heads;
  const int64_t floats = (rows * row_floats(&a) + num_threads * rows * head_dim
                          + rows * (head_dim / 2 + 2) + 15) / 16 * 16;
#ifdef USE_Q8_AMX
  return floats + num_threads * AMX_STATE_FLOATS;
#else
  return floats;
#endif
}
#ifndef USE_Q8_AMX
int paged_decode_amx(int on) { (void)on; return 0; }
#endif
/* Whether int8 caches take the AVX512-VNNI kernel (where the build has it; before the AMX
   kernels, which it outruns on an AMX Xeon: docs/BENCHMARKS.md, "The AVX512-VNNI int8
   kernel before the AMX ones"): paged_decode_vnni_int8(0) turns it off (the AMX or table
   kernels run), (1) on; -1 only asks. On by default. */
int paged_decode_vnni_int8(int on) {
#ifdef USE_Q8_VNNI
  if (on >= 0) vnni_int8_wanted = on;
  return vnni_int8_wanted;
#else
  (void)on;
  return 0;
#endif
}
/* Whether the kernels that have it take the near prefetch (DEFINE_Q8_ONLINE_KERNEL): (1)
   on, (0) off, -1 only asks. Off until turned on (cpu_kernel.py turns it on for Intel CPUs). The
   prefetches change no result. */
int paged_decode_near_prefetch(int on) {
  if (on >= 0) near_prefetch_wanted = on;
  return near_prefetch_wanted;
}

#endif

#ifdef PART_F32 /* once per library */
/* Which inner loops this build has: bit 0 float32 AVX-512, bit 1 bfloat16 AVX512-BF16,
   bit 2 8-bit caches AVX-512, bit 3 AVX2 (for what the AVX-512 bits leave out), bit 4 the
   8-bit caches' AVX512-VBMI tables (bfloat16 queries, head_dim a multiple of 64), bit 5 their
   AMX products (used where the OS grants the tiles: paged_decode_amx; bit 6 is no longer
   set), bit 7 the int8 caches' AVX512-VNNI kernel (used before the AMX ones, unless
   paged_decode_vnni_int8 turns it off). */
int paged_decode_features(void) {
  int f = 0;
#ifdef USE_AVX512
  f |= 1;
#endif
#ifdef USE_AVX512_BF16
  f |= 2;
#endif
#ifdef USE_Q8_AVX512
  f |= 4;
#endif
#if defined(USE_AVX2_F32) || defined(USE_AVX2_BF16)
  f |= 8;
#endif
#ifdef USE_Q8_PLANES
  f |= 16;
#endif
#ifdef USE_Q8_AMX
  f |= 32;
#endif
#ifdef USE_Q8_VNNI
  f |= 128;
#endif
  return f;
}

/* ---- the 8-bit caches' store ----------------------------------------------------------- */

/* float32 -> fp8 code, round to nearest even with torch's (c10's) bit operations, so that the
   store writes the bytes kv_quant.quantize writes (the caller clamps to the format's range).
   ``sign``: the sign bit to set (0x80000000 or 0), taken by the caller from the unscaled
   value's bits, which -fno-signed-zeros leaves alone (a zero's sign after the division and
   the clamp is the compiler's choice). */
/* The conversion's constants per format (e5m2 1, e4m3 0), on float32 bits: from FP8_MAX_BITS
   the inf / NaN codes, below FP8_MIN_NORMAL the subnormal ones (rounded by adding
   FP8_DENORM as a float), else the rounded bits shifted by FP8_SHIFT after adding
   FP8_REBIAS (the exponent's rebias and half a step less one). */
#define FP8_MAX_BITS(e5m2) ((e5m2) ? 143u << 23 : 1087u << 20)
#define FP8_DENORM(e5m2) ((e5m2) ? 134u << 23 : 141u << 23)
#define FP8_MIN_NORMAL(e5m2) ((e5m2) ? 113u << 23 : 121u << 23)
#define FP8_SHIFT(e5m2) ((e5m2) ? 21 : 20)
#define FP8_REBIAS(e5m2) \
  (((uint32_t)(((e5m2) ? 15 : 7) - 127) << 23) + ((1u << (FP8_SHIFT(e5m2) - 1)) - 1u))
INLINE uint8_t fp8_code(float f, uint32_t sign, int e5m2) {
  union { uint32_t u; float f; } c, d;
  c.f = f;
  uint32_t bits = c.u & 0x7fffffffu;
  const int shift = FP8_SHIFT(e5m2);
  uint8_t code;
  if (bits >= FP8_MAX_BITS(e5m2)) {
    code = e5m2 ? (bits > 0x7f800000u ? 0x7f : 0x7c) : 0x7f;
  } else if (bits < FP8_MIN_NORMAL(e5m2)) { /* subnormal: let the float adder round */
    c.u = bits;
    d.u = FP8_DENORM(e5m2);
    c.f += d.f;
    code = (uint8_t)(c.u - FP8_DENORM(e5m2));
  } else {
    const uint32_t odd = (bits >> shift) & 1u;
    bits += FP8_REBIAS(e5m2) + odd;
    code = (uint8_t)(bits >> shift);
  }
  return code | (uint8_t)(sign >> 24);
}

/* Quantize the step's K/V rows (float32 or bfloat16, num_kv_heads * head_dim per token, rows
   ``stride`` elements apart) into the 8-bit caches at their slots (negative: padding, not
   written), row by row as kv_quant.quantize: scale = bfloat16(amax / qmax) (1 for an all-zero
   row), codes = x / scale clamped to +-qmax, rounded to nearest even (int8) or to the fp8
   format (a row with a NaN or an infinity: scale NaN, codes 0); each row's head_dim (<= 256)
   codes, then its scale's two bytes. format: 0 int8, 1 e4m3, 2 e5m2. The tokens are shared
   out over num_threads threads (from 8 tokens); each prefetches the cache rows it writes two
   tokens ahead (random slots: each row's lines would otherwise be a miss the store waits on).
   With AVX-512 and head_dim a multiple of 16 the rows are quantized 16 values at a time, by
   the same operations in the same order (the bytes are the scalar loop's, tested against
   kv_quant.quantize's in every build). */
typedef struct {
  const void* key;
  const void* value;
  const int64_t* slots;
  uint8_t* k_cache;
  uint8_t* v_cache;
  int64_t stride, num_tokens, num_kv_heads, head_dim;
  int32_t bf16, format;
  int64_t num_threads;
} store_args;

#ifdef USE_AVX512
/* fp8_code for 16 values: |y| bits and the signs, as codes in the low byte of each lane. */
INLINE __m512i fp8_codes16(__m512 y, __m512i sign, int e5m2) {
  const __m512i bits = _mm512_and_si512(_mm512_castps_si512(y), _mm512_set1_epi32(0x7fffffff));
  const __m512i denorm = _mm512_set1_epi32((int)FP8_DENORM(e5m2));
  const int shift = FP8_SHIFT(e5m2);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, shift), _mm512_set1_epi32(1));
  const __m512i normal = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(bits, odd),
      _mm512_set1_epi32((int)FP8_REBIAS(e5m2))), shift);
  const __m512i sub = _mm512_sub_epi32(_mm512_castps_si512(_mm512_add_ps(
      _mm512_castsi512_ps(bits), _mm512_castsi512_ps(denorm))), denorm);
  __m512i code = _mm512_mask_blend_epi32(
      _mm512_cmplt_epu32_mask(bits, _mm512_set1_epi32((int)FP8_MIN_NORMAL(e5m2))), normal, sub);
  const __mmask16 big = _mm512_cmpge_epu32_mask(bits,
                                                _mm512_set1_epi32((int)FP8_MAX_BITS(e5m2)));
  const __m512i big_code = e5m2 ? _mm512_mask_blend_epi32(
      _mm512_cmpgt_epu32_mask(bits, _mm512_set1_epi32(0x7f800000)), _mm512_set1_epi32(0x7c),
      _mm512_set1_epi32(0x7f)) : _mm512_set1_epi32(0x7f);
  code = _mm512_mask_blend_epi32(big, code, big_code);
  return _mm512_or_si512(_mm512_and_si512(code, _mm512_set1_epi32(0xff)),
                         _mm512_srli_epi32(sign, 24));
}
#endif

/* A row's scale from its largest |x| (finite: no NaN or infinity in it): its two bytes
   after the row's D codes in out, and *scale its value; a row that is not finite gets the
   NaN scale and zero codes, and 0 is returned (no codes left to write). */
INLINE int q8_row_scale(float amax, int finite, float qmax, int64_t D, uint8_t* out,
                        float* scale) {
  const bf16_t scale_bits = finite ? store_bf16(amax > 0 ? amax / qmax : 1.0f) : 0x7FC0;
  memcpy(out + D, &scale_bits, 2);
  *scale = load_bf16(scale_bits);
  if (!finite) memset(out, 0, D);
  return finite;
}
#ifdef USE_AVX512
/* store_row_q8 16 values at a time (D a multiple of 16): the same operations in order. */
INLINE void store_row_q8_avx512(const float* x, int64_t D, int format, float qmax,
                                uint8_t* out) {
  __m512 m = _mm512_setzero_ps();
  __mmask16 ok = 0xffff;
  for (int64_t d = 0; d < D; d += 16) {
    const __m512 a = _mm512_abs_ps(_mm512_loadu_ps(x + d));
    ok &= _mm512_cmp_ps_mask(a, _mm512_set1_ps(__builtin_inff()), _CMP_LT_OQ); /* NaN: 0 */
    m = _mm512_max_ps(m, a);
  }
  float scale;
  if (!q8_row_scale(_mm512_reduce_max_ps(m), ok == 0xffff, qmax, D, out, &scale)) return;
  const __m512 sv = _mm512_set1_ps(scale), hi = _mm512_set1_ps(qmax), lo = _mm512_set1_ps(-qmax);
  for (int64_t d = 0; d < D; d += 16) {
    const __m512 v = _mm512_loadu_ps(x + d);
    const __m512 y = _mm512_min_ps(_mm512_max_ps(_mm512_div_ps(v, sv), lo), hi);
    const __m512i code = format == 0
        ? _mm512_cvtps_epi32(_mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT
                                                        | _MM_FROUND_NO_EXC))
        : fp8_codes16(y, _mm512_and_si512(_mm512_castps_si512(v),
                                          _mm512_set1_epi32((int)0x80000000u)),
                      format == 2);
    _mm_storeu_si128((__m128i*)(out + d), _mm512_cvtepi32_epi8(code));
  }
}
#endif
/* One row of D values (x, float32) into out: D codes, then the scale's two bytes. */
INLINE void store_row_q8(const float* x, int64_t D, int format, float qmax, uint8_t* out) {
#ifdef USE_AVX512
  if (D % 16 == 0) {
    store_row_q8_avx512(x, D, format, qmax, out);
    return;
  }
#endif
  float amax = 0.0f, scale;
  int finite = 1;
  for (int64_t d = 0; d < D; d++) {
    const float m = x[d] < 0 ? -x[d] : x[d];
    amax = m > amax ? m : amax;
    finite &= m < __builtin_inff(); /* false for NaN */
  }
  if (!q8_row_scale(amax, finite, qmax, D, out, &scale)) return;
  for (int64_t d = 0; d < D; d++) {
    float y = x[d] / scale;
    y = y < -qmax ? -qmax : y > qmax ? qmax : y;
    union { float f; uint32_t u; } in = {x[d]};
    out[d] = format == 0 ? (uint8_t)(int8_t)__builtin_nearbyintf(y)
                         : fp8_code(y, in.u & 0x80000000u, format == 2);
  }
}

void paged_store_q8(const store_args* a) {
  const float qmax = a->format == 0 ? 127.0f : a->format == 1 ? 448.0f : 57344.0f;
  const int64_t D = a->head_dim, raw = D + 2, row_bytes = a->num_kv_heads * raw;
  const int64_t T = a->num_tokens;
  _Pragma("omp parallel for schedule(static) if(T >= 8) num_threads(a->num_threads > 0 ? a->num_threads : 1)")
  for (int64_t t = 0; t < T; t++) {
    if (t + 2 < T && a->slots[t + 2] >= 0) { /* the rows two tokens ahead, for writing */
      PREFETCH_LINES(a->k_cache + a->slots[t + 2] * row_bytes, row_bytes, 1);
      PREFETCH_LINES(a->v_cache + a->slots[t + 2] * row_bytes, row_bytes, 1);
    }
    if (a->slots[t] < 0) continue;
    for (int kv = 0; kv < 2; kv++) {
      const void* rows = kv ? a->value : a->key;
      uint8_t* cache = (kv ? a->v_cache : a->k_cache) + a->slots[t] * row_bytes;
      for (int64_t h = 0; h < a->num_kv_heads; h++) {
        const int64_t first = t * a->stride + h * D;
        float x[256];
        for (int64_t d = 0; d < D; d++)
          x[d] = a->bf16 ? load_bf16(((const bf16_t*)rows)[first + d])
                         : ((const float*)rows)[first + d];
        store_row_q8(x, D, a->format, qmax, cache + h * raw);
      }
    }
  }
}
#endif
