/* Weight-only int4 / int8 matrix products for the CPU: out[M, N] = x[M, K] @ W[N, K]^T, with W
 * held as small integers and group-wise float parameters, dequantized in registers.
 *
 * Why not torch's _weight_int4pack_mm_for_cpu / _weight_int8pack_mm: on CPUs without AVX-512
 * they run scalar code for float32 activations (2.5 ms for a 1536 x 576 projection of one row)
 * and, for bfloat16, read the weight at ~2.4 GB/s; a batch-1 decode step is that read. Here
 * each weight is widened once per tile of rows and used by every row of the tile from a
 * register.
 *
 * Arithmetic, all in float32 and rounded once to the output dtype at the end, so that the
 * result is the float64 product with the dequantized weight (the layer's dequantized()
 * reference) up to the order of float32 additions:
 *     int4: w = (q - 8) * scale + zero,  q in [0, 15], scale and zero per (row, group)
 *     int8: w = q * scale,               q in [-127, 127], scale per (row, group)
 *     int8_zero: w = q * scale + zero,   q in [-128, 127], scale and zero per (row, group)
 *                (GGUF's blocks with a min, Q4_1 / Q4_K / Q5_1 / Q5_K / Q2_K, as they are)
 * Tiles of 1-4 rows (decode) sum the codes times x per group and add scale times that sum
 * (int4: plus (zero - 8 scale) times the group's sum of x, from group_sums; int8_zero: plus
 * zero times it); tiles of 8 rows
 * (AVX2 builds, batched decode) dequantize each weight once in a register and add it times x
 * into one sum per row. The plain-C loops dequantize each weight per tile.
 *
 * Layouts (made by quantized_linear.py):
 *   int4 codes [N, K / 2] uint8: in each run of 32 columns, byte j holds column j in its low
 *        nibble and column j + 16 in its high nibble (as GGML's Q4 blocks), so that one
 *        16-byte load and two masks give 32 codes in column order;
 *   int4 params [N, K / group_size, 2] (scale, zero), float32 or bfloat16;
 *   int8 codes [N, K] int8; params [N, K / group_size] scale, float32, bfloat16 or float16
 *        (int8 and int8_zero: float16 where a GGUF file's fp16 block scales hold them exactly);
 *   int8_zero codes [N, K] int8; params [N, K / group_size, 2] (scale, zero), as int4's;
 *   bf16 "codes" [N, K]: a bfloat16 weight as it is (no parameters; group_size K), for CPUs
 *        where oneDNN has no bfloat16 matmul and torch's makes a pass over W per row.
 * group_size is a multiple of 32 (int4) or of 8 (int8, bf16: K % 8 == 0) and divides K.
 *
 * int4_a8_matmul (int8 activations, opt-in): x is first rounded per row and block of 32
 * columns to int8 codes times a float32 scale (quantize_activations, as llama.cpp's Q8
 * blocks), and each block's codes times the int4 codes are summed in integers (vpmaddubsw),
 * exactly; the result is the float64 product of those rounded activations with the
 * dequantized weight, up to the order of float32 additions. It trades the activations'
 * rounding (up to 1/254 of each block's largest magnitude) for fewer instructions per weight:
 * 32 products in 3 instead of ~12 widening and 4 FMAs. With AVX512-VNNI, eight blocks at a
 * time, two per vpdpbusd (int4_a8_column_vnni; the activation codes are then stored a pair of
 * blocks in the codes' lane order). int4_panel_a8_matmul, what the layers use with int8
 * activations on AVX512-VNNI builds, reads the codes in panels of 16 output columns instead
 * (layout at its definition): one vpdpbusd adds 4 products into each of 16 columns' own lanes,
 * so a block of 32 columns takes 8 of them for 16 columns and no horizontal sums.
 *
 * x and out are float32 or bfloat16 (x_bf16); bfloat16 x is widened into the caller's
 * workspace (M * K floats, then the group sums of int4 and int8_zero; int4_a8_matmul: the
 * activations' scales, group sums and codes) once per call. Output columns are split across
 * OpenMP threads (torch's, see pagellm/native.py).
 */
#include <stdint.h>
#include <math.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define QMM_AVX2 1
#else
#define QMM_AVX2 0
#endif

#if QMM_AVX2 && defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define QMM_VNNI 1 /* int8 activations: int4_a8_column_vnni */
#endif
#define TILE_ROWS 4
#define WIDE_ROWS 8 /* AVX2 builds: batches of 8 rows and more */

typedef uint16_t bf16_t;
#define INLINE static inline __attribute__((always_inline)) /* so that constants propagate */

static inline float bf16_to_f32(bf16_t v) {
  uint32_t u = (uint32_t)v << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

/* float16 -> float32, exactly (normals, subnormals, zeros, infinities, NaN). */
static inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  uint32_t u;
  if (exp == 0x1f) {
    u = sign | 0x7f800000u | (man << 13);
  } else if (exp) {
    u = sign | ((exp + 112) << 23) | (man << 13);
  } else { /* zero or subnormal: man * 2^-24, exact in float32 */
    float f = (float)man * 5.9604644775390625e-8f;
    memcpy(&u, &f, 4);
    u |= sign;
  }
  float f;
  memcpy(&f, &u, 4);
  return f;
}

static inline bf16_t f32_to_bf16(float f) { /* round to nearest even, as torch */
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffff) > 0x7f800000) return (bf16_t)((u >> 16) | 0x40); /* quiet NaN */
  return (bf16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

typedef struct {
  const void *x;          /* [M, K], row stride x_stride elements */
  const void *codes;      /* int4: [N, K / 2] uint8; int8: [N, K] int8 */
  const void *params;     /* int4: [N, K / group_size, 2]; int8: [N, K / group_size] */
  void *out;              /* [M, N] contiguous, x's dtype */
  float *workspace;       /* M * K floats (used when x is bfloat16) */
  int64_t rows, out_features, in_features, group_size, x_stride, num_threads;
  int32_t x_bf16, params_dtype; /* params_dtype: PARAMS_F32, PARAMS_BF16 or PARAMS_F16 */
  const float *bias;      /* [N] added to every row before the rounding, or NULL */
} qmm_args;

enum { PARAMS_F32 = 0, PARAMS_BF16 = 1, PARAMS_F16 = 2 };

static inline float param(const void *p, int64_t i, int dtype) {
  return dtype == PARAMS_BF16 ? bf16_to_f32(((const bf16_t *)p)[i])
         : dtype == PARAMS_F16 ? f16_to_f32(((const uint16_t *)p)[i])
                               : ((const float *)p)[i];
}

/* Software prefetch (into L2) of output column n + QMM_AHEAD's weight row: its code_bytes of
 * codes and its params_per_row parameters. The columns' loops read each weight row once per
 * product; with the weights in memory (a model's step streams them all), the hardware
 * prefetchers alone left the vocabulary projection of SmolLM2 (49152 x 576 int8, one row) at
 * 7-9 ms from memory against 2.9 ms in cache; 8 columns ahead took it to 4.1-4.5 ms (4 and 16:
 * 4.4 and 5.0 ms; docs/BENCHMARKS.md, "Weight rows prefetched ahead"). Called once per column
 * (by its first tile of rows). */
#define QMM_AHEAD 8
/* INLINE, not static inline: GCC 12 judged an out-of-line copy free of side effects (only
 * prefetches) and dropped the calls to it. */
INLINE void prefetch_column(const qmm_args *a, int64_t n, int64_t code_bytes,
                            int64_t params_per_row) {
  if (n + QMM_AHEAD >= a->out_features) return;
  const char *codes = (const char *)a->codes + (n + QMM_AHEAD) * code_bytes;
  for (int64_t b = 0; b < code_bytes; b += 64) __builtin_prefetch(codes + b, 0, 1);
  const int64_t param_bytes = params_per_row * (a->params_dtype == PARAMS_F32 ? 4 : 2);
  const char *params = (const char *)a->params + (n + QMM_AHEAD) * param_bytes;
  for (int64_t b = 0; b < param_bytes; b += 64) __builtin_prefetch(params + b, 0, 1);
}

/* The float32 rows of x: x itself, or its bfloat16 values widened into the workspace. */
static const float *float_rows(const qmm_args *a, int64_t *stride) {
  if (!a->x_bf16) {
    *stride = a->x_stride;
    return (const float *)a->x;
  }
  const bf16_t *x = (const bf16_t *)a->x;
  const int64_t K = a->in_features;
  for (int64_t m = 0; m < a->rows; m++)
    for (int64_t k = 0; k < K; k++) a->workspace[m * K + k] = bf16_to_f32(x[m * a->x_stride + k]);
  *stride = K;
  return a->workspace;
}

/* For int4 and int8_zero: each row's (offset * group sum, group sum) pairs, [rows,
 * 2 * groups], after the widened rows in the workspace; their dot product with a column's
 * (scale, zero) pairs is the column's sum over groups of (zero + offset * scale) * (group sum
 * of x): offset -8 for int4's (q - 8) * scale + zero, 0 for int8_zero's q * scale + zero. */
static const float *group_sums(const qmm_args *a, const float *x, int64_t xs, float offset) {
  const int64_t K = a->in_features, gs = a->group_size, groups = K / gs;
  float *xw = a->workspace + (a->x_bf16 ? a->rows * K : 0);
  for (int64_t m = 0; m < a->rows; m++)
    for (int64_t g = 0; g < groups; g++) {
      float sum = 0;
      for (int64_t k = g * gs; k < (g + 1) * gs; k++) sum += x[m * xs + k];
      xw[(m * groups + g) * 2] = offset * sum;
      xw[(m * groups + g) * 2 + 1] = sum;
    }
  return xw;
}

static inline void store(const qmm_args *a, int64_t m, int64_t n, float v) {
  if (a->bias) v += a->bias[n];
  if (a->x_bf16)
    ((bf16_t *)a->out)[m * a->out_features + n] = f32_to_bf16(v);
  else
    ((float *)a->out)[m * a->out_features + n] = v;
}

/* int8 activations (QuantizedMatmul's int8_activations): per row and block of 32 columns,
 * d = amax / 127 and q = x * (127 / amax) rounded to nearest even (q = 0, d = 0 for a block of
 * zeros; d = NaN for a block with a NaN or infinity, whose outputs torch's rounding makes NaN),
 * as quant_matmul.quantize_activations computes them in torch; and per row and weight
 * group, the pair (-8 S, S) with S the group's sum over blocks of d * (sum of q), for the
 * zero terms; and each block's sum of q. In the caller's workspace: d, the pairs, the sums,
 * then q. */
typedef struct {
  const int8_t *q; /* [M, K] */
  const float *d;  /* [M, K / 32] */
  const float *pairs; /* [M, 2 * K / group_size] */
  const int32_t *s; /* [M, K / 32] each block's sum of codes (int8 weights' offset terms) */
} act8;

/* One block of 32 activations, from element i of x (bfloat16 or float32): its codes into q,
 * its scale into *d; returns the sum of the codes. */
static inline int quantize_block(const void *x, int64_t i, int bf16, int8_t *q, float *d);

static act8 quantize_activations(const qmm_args *a) {
  const int64_t M = a->rows, K = a->in_features, blocks = K / 32, groups = K / a->group_size;
  float *d = a->workspace, *pairs = d + M * blocks;
  int32_t *sums = (int32_t *)(pairs + M * 2 * groups);
  int8_t *q = (int8_t *)(sums + M * blocks);
  for (int64_t m = 0; m < M; m++) {
    for (int64_t g = 0; g < groups; g++) pairs[(m * groups + g) * 2 + 1] = 0;
    for (int64_t b = 0; b < blocks; b++) {
      const int sum = quantize_block(a->x, m * a->x_stride + b * 32, a->x_bf16,
                                     q + m * K + b * 32, d + m * blocks + b);
      sums[m * blocks + b] = sum;
      pairs[(m * groups + b * 32 / a->group_size) * 2 + 1] += d[m * blocks + b] * (float)sum;
    }
#ifdef QMM_VNNI
    for (int64_t b = 0; b + 1 < blocks; b += 2) { /* each pair of blocks in the codes' order */
      int8_t *pair = q + m * K + b * 32, middle[16];
      memcpy(middle, pair + 16, 16);
      memcpy(pair + 16, pair + 32, 16);
      memcpy(pair + 32, middle, 16);
    }
#endif
    for (int64_t g = 0; g < groups; g++)
      pairs[(m * groups + g) * 2] = -8.0f * pairs[(m * groups + g) * 2 + 1];
  }
  const act8 x = {q, d, pairs, sums};
  return x;
}

#if QMM_AVX2
static inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

/* 8 parameters from i on as floats (bfloat16 widened by a shift, float16 by F16C). Also
 * loads 8 bfloat16 activations (PARAMS_BF16). */
static inline __m256 load_params(const void *p, int64_t i, int dtype) {
  if (dtype == PARAMS_F32) return _mm256_loadu_ps((const float *)p + i);
  const __m128i half = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i));
  if (dtype == PARAMS_F16) {
#ifdef __F16C__
    return _mm256_cvtph_ps(half);
#else
    float f[8];
    for (int j = 0; j < 8; j++) f[j] = f16_to_f32(((const uint16_t *)p)[i + j]);
    return _mm256_loadu_ps(f);
#endif
  }
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}

/* zsum[r] = sum over groups of (zero + offset * scale) * (group sum of row r of x): the dot
 * product of column n's (scale, zero) pairs with the row's pairs from group_sums. */
static inline void zero_terms(const qmm_args *a, const float *xw, int64_t groups, int64_t n,
                              int T, float *zsum) {
  const int64_t len = 2 * groups;
  __m256 acc[TILE_ROWS];
  for (int r = 0; r < T; r++) acc[r] = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= len; i += 8) {
    const __m256 p = load_params(a->params, n * len + i, a->params_dtype);
    for (int r = 0; r < T; r++)
      acc[r] = _mm256_fmadd_ps(p, _mm256_loadu_ps(xw + r * len + i), acc[r]);
  }
  for (int r = 0; r < T; r++) {
    zsum[r] = hsum8(acc[r]);
    for (int64_t j = i; j < len; j++)
      zsum[r] += param(a->params, n * len + j, a->params_dtype) * xw[r * len + j];
  }
}

/* Per row: the sum of the current group in CHAINS partial sums (so that FMA latencies
 * overlap: 2 for one or two rows, 1 for three or four) and the running total of the scaled
 * group sums; 8 accumulators at most, of AVX2's 16 registers. Chain indices are constants
 * after unrolling, so the accumulators stay in registers. */
#define CHAINS(T) ((T) <= 2 ? 2 : 1)

static inline void store_sums(const qmm_args *a, const __m256 *total, const float *zsum,
                              int64_t m0, int T, int64_t n) {
  for (int r = 0; r < T; r++) store(a, m0 + r, n, hsum8(total[r]) + zsum[r]);
}

/* 32 int4 codes from 16 bytes (byte j: column j in the low nibble, j + 16 in the high one)
 * as four vectors of 8 floats in column order: the bytes in both 128-bit halves, each
 * half's 4 bytes spread to the low bytes of its 32-bit lanes (vpshufb, -1: zero). */
static inline void widen_codes(const uint8_t *p, __m256 w[4]) {
  const __m256i low = _mm256_set1_epi8(0x0f);
  const __m256i spread0 = _mm256_setr_epi8(0, -1, -1, -1, 1, -1, -1, -1, 2, -1, -1, -1, 3, -1, -1,
                                           -1, 4, -1, -1, -1, 5, -1, -1, -1, 6, -1, -1, -1, 7, -1,
                                           -1, -1);
  const __m256i spread1 = _mm256_add_epi8(spread0, _mm256_set1_epi32(8));
  const __m256i raw = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)p));
  const __m256i lo = _mm256_and_si256(raw, low);
  const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
  w[0] = _mm256_cvtepi32_ps(_mm256_shuffle_epi8(lo, spread0));
  w[1] = _mm256_cvtepi32_ps(_mm256_shuffle_epi8(lo, spread1));
  w[2] = _mm256_cvtepi32_ps(_mm256_shuffle_epi8(hi, spread0));
  w[3] = _mm256_cvtepi32_ps(_mm256_shuffle_epi8(hi, spread1));
}

/* A column's groups for T rows, each added into one accumulator per row by
 * GROUP(g, scale, acc) with the group's scale broadcast (SCALE(g): its index in params):
 * even and odd groups alternate between `even` and `odd` for one or two rows, so that their
 * FMA latencies overlap (more rows overlap by themselves, and two accumulators each would not
 * fit the 16 registers). Declares even[] and odd[]; the sum of a row is sum_rows(r). */
#define EACH_GROUP(groups, SCALE, GROUP)                                                   \
  __m256 even[TILE_ROWS], odd[TILE_ROWS];                                                 \
  for (int r = 0; r < T; r++) even[r] = odd[r] = _mm256_setzero_ps();                     \
  {                                                                                       \
    int64_t g = 0;                                                                        \
    for (; g + 2 <= (groups); g += 2) {                                                   \
      GROUP(g, _mm256_set1_ps(param(a->params, SCALE(g), a->params_dtype)), even);         \
      GROUP(g + 1, _mm256_set1_ps(param(a->params, SCALE(g + 1), a->params_dtype)),        \
            T <= 2 ? odd : even);                                                         \
    }                                                                                     \
    if (g < (groups))                                                                     \
      GROUP(g, _mm256_set1_ps(param(a->params, SCALE(g), a->params_dtype)), even);         \
  }
#define sum_rows(r) hsum8(T <= 2 ? _mm256_add_ps(even[r], odd[r]) : even[r])

/* One group of gs columns from k0 on, for T rows: the sums of the codes (widened to float in
 * registers) times x, on CHAINS(T) chains per row, times the group's scale, added into
 * total. */
INLINE void int4_group(const uint8_t *q, const float *x, int64_t xs, int64_t k0, int64_t gs,
                       __m256 scale, int T, __m256 *total) {
  __m256 sum[TILE_ROWS][2];
  for (int64_t k = k0; k < k0 + gs; k += 32) {
    __m256 w[4];
    widen_codes(q + k / 2, w);
    for (int p = 0; p < 4; p++)
      for (int r = 0; r < T; r++) {
        const int c = p % CHAINS(T);
        const __m256 part = _mm256_loadu_ps(x + r * xs + k + 8 * p);
        sum[r][c] = k == k0 && p < CHAINS(T) ? _mm256_mul_ps(w[p], part)
                                              : _mm256_fmadd_ps(w[p], part, sum[r][c]);
      }
  }
  for (int r = 0; r < T; r++) {
    const __m256 s = CHAINS(T) == 2 ? _mm256_add_ps(sum[r][0], sum[r][1]) : sum[r][0];
    total[r] = _mm256_fmadd_ps(s, scale, total[r]);
  }
}

/* One output column n for T rows of a format with zeros: int4, 32 columns per 16-byte load
 * (int8_zero: 8 per load, int8_group). Per group g,
 *   sum_k w[k] x[k] = scale * sum_k q[k] x[k] + (zero + offset * scale) * sum_k x[k],
 * the first sum over codes widened to float in registers (GROUP), the second from the rows'
 * group sums (zero_terms); the groups by EACH_GROUP. gs: the group size, a constant where the
 * caller knows it (the loops then unroll), else a->group_size. */
#define PAIR_SCALE(g) (n * groups + (g)) * 2
#define INT4_GROUP(g, scale, acc) int4_group(q, x, xs, (g) * gs, gs, scale, T, acc)
#define DEFINE_COLUMN_WITH_ZEROS(NAME, CODE_T, ROW_BYTES, GROUP)                          \
  INLINE void NAME(const qmm_args *a, const float *x, int64_t xs, const float *xw,        \
                   int64_t m0, int T, int64_t n, int64_t gs) {                            \
    const int64_t K = a->in_features, groups = K / gs;                                    \
    const CODE_T *q = (const CODE_T *)a->codes + n * (ROW_BYTES);                         \
    if (m0 == 0) prefetch_column(a, n, (ROW_BYTES) * (int64_t)sizeof(CODE_T), 2 * groups); \
    EACH_GROUP(groups, PAIR_SCALE, GROUP)                                                 \
    float zsum[TILE_ROWS];                                                                \
    zero_terms(a, xw, groups, n, T, zsum);                                                \
    for (int r = 0; r < T; r++) store(a, m0 + r, n, sum_rows(r) + zsum[r]);              \
  }
DEFINE_COLUMN_WITH_ZEROS(int4_column_gs, uint8_t, K / 2, INT4_GROUP)

INLINE void int4_column(const qmm_args *a, const float *x, int64_t xs, const float *xw,
                        int64_t m0, int T, int64_t n) {
  if (a->group_size == 32)
    int4_column_gs(a, x, xs, xw, m0, T, n, 32);
  else
    int4_column_gs(a, x, xs, xw, m0, T, n, a->group_size);
}

/* One group of gs columns (a multiple of 8) from k0 on, for T rows: int8, 8 columns per
 * load; the sums of the codes times x on CHAINS(T) chains per row, times the group's scale,
 * added into total. */
INLINE void int8_group(const int8_t *q, const float *x, int64_t xs, int64_t k0, int64_t gs,
                       __m256 scale, int T, __m256 *total) {
  __m256 sum[TILE_ROWS][2];
  for (int r = 0; r < T; r++) sum[r][0] = sum[r][1] = _mm256_setzero_ps();
  int64_t k = k0;
  for (; k + 16 <= k0 + gs; k += 16)
    for (int p = 0; p < 2; p++) {
      const __m128i raw = _mm_loadl_epi64((const __m128i *)(q + k + 8 * p));
      const __m256 w = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw));
      for (int r = 0; r < T; r++) {
        const int c = p % CHAINS(T);
        sum[r][c] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + r * xs + k + 8 * p), sum[r][c]);
      }
    }
  if (k < k0 + gs) { /* a group of 8 * odd columns: its last 8 */
    const __m256 w =
        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + k))));
    for (int r = 0; r < T; r++)
      sum[r][0] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + r * xs + k), sum[r][0]);
  }
  for (int r = 0; r < T; r++) {
    const __m256 s = CHAINS(T) == 2 ? _mm256_add_ps(sum[r][0], sum[r][1]) : sum[r][0];
    total[r] = _mm256_fmadd_ps(s, scale, total[r]);
  }
}

/* One output column n for T rows: int8, per group scale times the sum of the codes times x
 * (EACH_GROUP). */
INLINE void int8_column_gs(const qmm_args *a, const float *x, int64_t xs, int64_t m0, int T,
                           int64_t n, int64_t gs) {
  const int64_t K = a->in_features, groups = K / gs;
  const int8_t *q = (const int8_t *)a->codes + n * K;
  if (m0 == 0) prefetch_column(a, n, K, groups);
#define INT8_SCALE(g) n * groups + (g)
#define INT8_GROUP(g, scale, acc) int8_group(q, x, xs, (g) * gs, gs, scale, T, acc)
  EACH_GROUP(groups, INT8_SCALE, INT8_GROUP)
  for (int r = 0; r < T; r++) store(a, m0 + r, n, sum_rows(r));
}

INLINE void int8_column(const qmm_args *a, const float *x, int64_t xs, const float *xw,
                        int64_t m0, int T, int64_t n) {
  (void)xw;
  if (a->group_size == 32)
    int8_column_gs(a, x, xs, m0, T, n, 32);
  else
    int8_column_gs(a, x, xs, m0, T, n, a->group_size);
}

DEFINE_COLUMN_WITH_ZEROS(int8_zero_column_gs, int8_t, K, INT8_GROUP)

INLINE void int8_zero_column(const qmm_args *a, const float *x, int64_t xs, const float *xw,
                             int64_t m0, int T, int64_t n) {
  if (a->group_size == 32)
    int8_zero_column_gs(a, x, xs, xw, m0, T, n, 32);
  else if (a->group_size == 16)
    int8_zero_column_gs(a, x, xs, xw, m0, T, n, 16);
  else
    int8_zero_column_gs(a, x, xs, xw, m0, T, n, a->group_size);
}

/* Eight rows at once (batched decode): each weight dequantized once in a register,
 *   w = q * scale + (zero - 8 scale)   (int4),   w = q * scale   (int8),
 * and added into one running sum per row: 8 accumulators, where the group sums of the
 * narrower tiles would need 16. */
static inline void int4_wide(const qmm_args *a, const float *x, int64_t xs, int64_t m0,
                             int64_t n) {
  const int64_t K = a->in_features, gs = a->group_size, groups = K / gs;
  const uint8_t *q = (const uint8_t *)a->codes + n * (K / 2);
  __m256 acc[WIDE_ROWS];
  for (int r = 0; r < WIDE_ROWS; r++) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; g++) {
    const float s = param(a->params, (n * groups + g) * 2, a->params_dtype);
    const __m256 scale = _mm256_set1_ps(s);
    const __m256 zero = _mm256_set1_ps(param(a->params, (n * groups + g) * 2 + 1,
                                             a->params_dtype) - 8.0f * s);
    for (int64_t k = g * gs; k < (g + 1) * gs; k += 32) {
      __m256 codes[4];
      widen_codes(q + k / 2, codes);
      for (int p = 0; p < 4; p++) {
        const __m256 w = _mm256_fmadd_ps(codes[p], scale, zero);
        for (int r = 0; r < WIDE_ROWS; r++)
          acc[r] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + r * xs + k + 8 * p), acc[r]);
      }
    }
  }
  for (int r = 0; r < WIDE_ROWS; r++) store(a, m0 + r, n, hsum8(acc[r]));
}

/* int8 (zeros 0) and int8_zero (zeros 1: (scale, zero) pairs, w = q * scale + zero). */
INLINE void int8_wide_rows(const qmm_args *a, const float *x, int64_t xs, int64_t m0, int64_t n,
                           const int zeros) {
  const int64_t K = a->in_features, gs = a->group_size, groups = K / gs;
  const int8_t *q = (const int8_t *)a->codes + n * K;
  __m256 acc[WIDE_ROWS];
  for (int r = 0; r < WIDE_ROWS; r++) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; g++) {
    const int64_t i = zeros ? (n * groups + g) * 2 : n * groups + g;
    const __m256 scale = _mm256_set1_ps(param(a->params, i, a->params_dtype));
    const __m256 zero = zeros ? _mm256_set1_ps(param(a->params, i + 1, a->params_dtype))
                              : _mm256_setzero_ps();
    for (int64_t k = g * gs; k < (g + 1) * gs; k += 8) {
      const __m128i raw = _mm_loadl_epi64((const __m128i *)(q + k));
      const __m256 codes = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw));
      const __m256 w = zeros ? _mm256_fmadd_ps(codes, scale, zero) : _mm256_mul_ps(codes, scale);
      for (int r = 0; r < WIDE_ROWS; r++)
        acc[r] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + r * xs + k), acc[r]);
    }
  }
  for (int r = 0; r < WIDE_ROWS; r++) store(a, m0 + r, n, hsum8(acc[r]));
}
static inline void int8_wide(const qmm_args *a, const float *x, int64_t xs, int64_t m0,
                             int64_t n) { int8_wide_rows(a, x, xs, m0, n, 0); }
static inline void int8_zero_wide(const qmm_args *a, const float *x, int64_t xs, int64_t m0,
                                  int64_t n) { int8_wide_rows(a, x, xs, m0, n, 1); }

/* bfloat16 weights (codes [N, K] bfloat16, no parameters): each widened exactly by a shift.
 * The float32 sums of x times the weights, as the int8 loops without scales. */
static inline __m256 load_bf16(const bf16_t *p) {
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

static inline void bf16_column(const qmm_args *a, const float *x, int64_t xs, const float *xw,
                               int64_t m0, int T, int64_t n) {
  (void)xw;
  const int64_t K = a->in_features;
  const bf16_t *w = (const bf16_t *)a->codes + n * K;
  __m256 sum[TILE_ROWS][2];
  for (int r = 0; r < T; r++) sum[r][0] = sum[r][1] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16)
    for (int p = 0; p < 2; p++) {
      const __m256 wv = load_bf16(w + k + 8 * p);
      for (int r = 0; r < T; r++) {
        const int c = p % CHAINS(T);
        sum[r][c] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + r * xs + k + 8 * p), sum[r][c]);
      }
    }
  for (; k < K; k += 8) {
    const __m256 wv = load_bf16(w + k);
    for (int r = 0; r < T; r++)
      sum[r][0] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + r * xs + k), sum[r][0]);
  }
  for (int r = 0; r < T; r++)
    store(a, m0 + r, n, hsum8(CHAINS(T) == 2 ? _mm256_add_ps(sum[r][0], sum[r][1]) : sum[r][0]));
}

static inline void bf16_wide(const qmm_args *a, const float *x, int64_t xs, int64_t m0,
                             int64_t n) {
  const int64_t K = a->in_features;
  const bf16_t *w = (const bf16_t *)a->codes + n * K;
  __m256 acc[WIDE_ROWS];
  for (int r = 0; r < WIDE_ROWS; r++) acc[r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    const __m256 wv = load_bf16(w + k);
    for (int r = 0; r < WIDE_ROWS; r++)
      acc[r] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + r * xs + k), acc[r]);
  }
  for (int r = 0; r < WIDE_ROWS; r++) store(a, m0 + r, n, hsum8(acc[r]));
}

/* amax over the block (the sign bits masked off), then x * (127 / amax) clamped to
 * [-127, 127] and rounded to nearest even (vroundps): 4 x 8 int32 packed to bytes (the packs
 * interleave the 128-bit halves; the permute puts them back in order). */
static inline int quantize_block(const void *x, int64_t i, int bf16, int8_t *q, float *d) {
  __m256 v[4];
  for (int p = 0; p < 4; p++)
    v[p] = bf16 ? load_params(x, i + 8 * p, PARAMS_BF16)
                : _mm256_loadu_ps((const float *)x + i + 8 * p);
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 m = _mm256_max_ps(_mm256_and_ps(v[0], abs_mask), _mm256_and_ps(v[1], abs_mask));
  m = _mm256_max_ps(m, _mm256_max_ps(_mm256_and_ps(v[2], abs_mask), _mm256_and_ps(v[3], abs_mask)));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  const float amax = _mm_cvtss_f32(m4);
  int finite = 1; /* else d = NaN: the rows' outputs NaN, as torch's (max drops NaN) */
  for (int p = 0; p < 4; p++)
    finite &= !_mm256_movemask_ps(_mm256_cmp_ps(_mm256_and_ps(v[p], abs_mask),
                                                _mm256_set1_ps(__builtin_inff()), _CMP_NLT_UQ));
  *d = finite ? amax / 127.0f : __builtin_nanf("");
  const __m256 scale = _mm256_set1_ps(amax > 0 ? 127.0f / amax : 0.0f);
  const __m256 hi = _mm256_set1_ps(127.0f), lo = _mm256_set1_ps(-127.0f);
  __m256i c[4];
  for (int p = 0; p < 4; p++) {
    const __m256 y = _mm256_min_ps(hi, _mm256_max_ps(lo, _mm256_mul_ps(v[p], scale)));
    c[p] = _mm256_cvtps_epi32(_mm256_round_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  const __m256i sums = _mm256_add_epi32(_mm256_add_epi32(c[0], c[1]), _mm256_add_epi32(c[2], c[3]));
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]),
                                           _mm256_packs_epi32(c[2], c[3]));
  _mm256_storeu_si256((__m256i *)q, _mm256_permutevar8x32_epi32(
                                        bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sums), _mm256_extracti128_si256(sums, 1));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
  return _mm_cvtsi128_si32(s4);
}

/* int4 codes times int8 activations: 32 codes as 32 unsigned bytes in column order (the
 * low nibbles, then the high ones). */
INLINE __m256i codes_u8(const uint8_t *p) {
  const __m128i raw = _mm_loadu_si128((const __m128i *)p);
  const __m256i both = _mm256_inserti128_si256(_mm256_castsi128_si256(raw),
                                               _mm_srli_epi16(raw, 4), 1);
  return _mm256_and_si256(both, _mm256_set1_epi8(0x0f));
}

/* Group g of one output column for T rows: per block of 32 columns, the integer sum of the
 * codes times the row's int8 activations in 8 lanes (vpmaddubsw: unsigned codes times signed
 * bytes, adjacent pairs summed in 16 bits, at most 2 * 15 * 127; vpmaddwd by ones: pairs of
 * those in 32 bits), exact, times the block's activation scale; summed over the group's
 * blocks, times the weight's scale, added into total. (AVX512-VNNI builds take
 * int4_a8_column_vnni below instead.) */
INLINE void int4_a8_group(const uint8_t *q, const int8_t *xq, const float *xd,
                                 int64_t K, int64_t b0, int64_t bpg, __m256 scale, int T,
                                 __m256 *total) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 sum[TILE_ROWS];
  for (int64_t b = b0; b < b0 + bpg; b++) {
    const __m256i w = codes_u8(q + b * 16);
    for (int r = 0; r < T; r++) {
      const __m256i qx = _mm256_loadu_si256((const __m256i *)(xq + r * K + b * 32));
      const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(w, qx), ones);
      const __m256 part = _mm256_mul_ps(_mm256_cvtepi32_ps(dot),
                                        _mm256_broadcast_ss(xd + r * (K / 32) + b));
      sum[r] = b == b0 ? part : _mm256_add_ps(sum[r], part);
    }
  }
  for (int r = 0; r < T; r++) total[r] = _mm256_fmadd_ps(sum[r], scale, total[r]);
}

/* One output column n for T rows: the groups (EACH_GROUP), then the zero terms. */
INLINE void int4_a8_column(const qmm_args *a, const act8 *x, int64_t m0, int T,
                           int64_t n, int64_t bpg) {
  const int64_t K = a->in_features, groups = K / a->group_size;
  const uint8_t *q = (const uint8_t *)a->codes + n * (K / 2);
  if (m0 == 0) prefetch_column(a, n, K / 2, 2 * groups);
  const int8_t *xq = x->q + m0 * K;
  const float *xd = x->d + m0 * (K / 32);
#define A8_GROUP(g, scale, acc) int4_a8_group(q, xq, xd, K, (g) * bpg, bpg, scale, T, acc)
  EACH_GROUP(groups, PAIR_SCALE, A8_GROUP)
  float zsum[TILE_ROWS];
  zero_terms(a, x->pairs + m0 * 2 * groups, groups, n, T, zsum);
  for (int r = 0; r < T; r++) store(a, m0 + r, n, sum_rows(r) + zsum[r]);
}

#ifdef QMM_VNNI
/* AVX512-VNNI builds: the sums of int4_a8_column eight blocks of 32 at a time. Two blocks'
 * 32 code bytes widen to one 512-bit register (128-bit lanes: block b columns 0-15, b + 1
 * columns 0-15, b columns 16-31, b + 1 columns 16-31), against the activations stored in the
 * same order (quantize_activations), and one vpdpbusd makes 16 exact int32 sums of 4
 * products (unsigned codes times signed bytes, at most 4 * 15 * 127). Adding the 256-bit
 * halves and two rounds of vphaddd leaves each of the eight blocks' integer sum in one lane
 * (blocks 0, 2, 4, 6, 1, 3, 5, 7), so that the float32 work, the conversion and the
 * products with the blocks' activation scales and their groups' weight scales, is done once
 * for eight blocks instead of once per block. The last blocks (fewer than eight) go a pair
 * and then one at a time. The zero terms as in int4_a8_column. */
INLINE __m512i codes_pair_u8(const uint8_t *p) {
  const __m256i raw = _mm256_loadu_si256((const __m256i *)p);
  return _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(raw),
                                             _mm256_srli_epi16(raw, 4), 1),
                          _mm512_set1_epi8(0x0f));
}
INLINE __m256i pair_sums(__m512i w, const int8_t *x) { /* lanes 0-3: block b, 4-7: b + 1 */
  const __m512i z = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w,
                                        _mm512_loadu_si512((const void *)x));
  return _mm256_add_epi32(_mm512_castsi512_si256(z), _mm512_extracti64x4_epi64(z, 1));
}
/* The scales of the 8 (scale, zero) pairs from params[i] on, in the order 0, 2, 4, 6, 1, 3,
 * 5, 7 (the block sums' lanes). */
INLINE __m256 scales8(const void *p, int64_t i, int dtype) {
  const __m512i pick = _mm512_setr_epi32(0, 4, 8, 12, 2, 6, 10, 14, 0, 0, 0, 0, 0, 0, 0, 0);
  __m512 pairs;
  if (dtype == PARAMS_F32) {
    pairs = _mm512_loadu_ps((const float *)p + i);
  } else {
    const __m256i half = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i));
    pairs = dtype == PARAMS_F16 ? _mm512_cvtph_ps(half)
            : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
  }
  return _mm512_castps512_ps256(_mm512_permutexvar_ps(pick, pairs));
}
INLINE void int4_a8_column_vnni(const qmm_args *a, const act8 *x, int64_t m0, int T,
                                int64_t n) {
  const int64_t K = a->in_features, blocks = K / 32, bpg = a->group_size / 32;
  const int64_t groups = K / a->group_size;
  const uint8_t *q = (const uint8_t *)a->codes + n * (K / 2);
  if (m0 == 0) prefetch_column(a, n, K / 2, 2 * groups);
  const int8_t *xq = x->q + m0 * K;
  const float *xd = x->d + m0 * blocks;
  const __m256i order = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
#define WSCALE(b) param(a->params, (n * groups + (b) / bpg) * 2, a->params_dtype)
  __m256 acc[TILE_ROWS];
  for (int r = 0; r < T; r++) acc[r] = _mm256_setzero_ps();
  int64_t b = 0;
  for (; b + 8 <= blocks; b += 8) {
    __m512i w[4];
    for (int j = 0; j < 4; j++) w[j] = codes_pair_u8(q + (b + 2 * j) * 16);
    const __m256 ws = bpg == 1 ? scales8(a->params, (n * groups + b) * 2, a->params_dtype)
        : _mm256_setr_ps(WSCALE(b), WSCALE(b + 2), WSCALE(b + 4), WSCALE(b + 6),
                         WSCALE(b + 1), WSCALE(b + 3), WSCALE(b + 5), WSCALE(b + 7));
    for (int r = 0; r < T; r++) {
      __m256i y[4];
      for (int j = 0; j < 4; j++) y[j] = pair_sums(w[j], xq + r * K + (b + 2 * j) * 32);
      const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(y[0], y[1]),
                                          _mm256_hadd_epi32(y[2], y[3]));
      const __m256 xs = _mm256_permutevar8x32_ps(_mm256_loadu_ps(xd + r * blocks + b), order);
      acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(h), xs), ws, acc[r]);
    }
  }
  for (; b + 2 <= blocks; b += 2) {
    const __m512i w = codes_pair_u8(q + b * 16);
    const float s0 = WSCALE(b), s1 = WSCALE(b + 1);
    for (int r = 0; r < T; r++) {
      const __m256 scale = _mm256_set_m128(_mm_set1_ps(xd[r * blocks + b + 1] * s1),
                                           _mm_set1_ps(xd[r * blocks + b] * s0));
      const __m256 sums = _mm256_cvtepi32_ps(pair_sums(w, xq + r * K + b * 32));
      acc[r] = _mm256_fmadd_ps(sums, scale, acc[r]);
    }
  }
  if (b < blocks) { /* an odd last block, stored in column order */
    const __m256i w = codes_u8(q + b * 16);
    const float s = WSCALE(b);
    for (int r = 0; r < T; r++) {
      const __m256i dot = _mm256_dpbusd_epi32(
          _mm256_setzero_si256(), w, _mm256_loadu_si256((const __m256i *)(xq + r * K + b * 32)));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(xd[r * blocks + b] * s),
                               acc[r]);
    }
  }
#undef WSCALE
  float zsum[TILE_ROWS];
  zero_terms(a, x->pairs + m0 * 2 * groups, groups, n, T, zsum);
  for (int r = 0; r < T; r++) store(a, m0 + r, n, hsum8(acc[r]) + zsum[r]);
}

/* int8 weights (symmetric, groups of a multiple of 32 or one scale per row) times int8
 * activations, as int4_a8_column_vnni: two blocks' 64 codes per register, their 128-bit
 * lanes in the activations' order (b 0-15, b + 1 0-15, b 16-31, b + 1 16-31), made unsigned
 * by adding 128 (a xor of the sign bit) for vpdpbusd, whose sums then hold 128 times the
 * block's sum of activation codes too, taken off in int32 (exact). */
INLINE __m512i int8_pair_u8(const int8_t *p) {
  const __m512i raw = _mm512_loadu_si512((const void *)p);
  return _mm512_xor_si512(_mm512_shuffle_i64x2(raw, raw, _MM_SHUFFLE(3, 1, 2, 0)),
                          _mm512_set1_epi8((char)0x80));
}
/* params[i .. i + 8) (one per block) in the block sums' lane order 0, 2, 4, 6, 1, 3, 5, 7. */
INLINE __m256 scales8_contiguous(const void *p, int64_t i, int dtype) {
  return _mm256_permutevar8x32_ps(load_params(p, i, dtype),
                                  _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7));
}
INLINE void int8_a8_column_vnni(const qmm_args *a, const act8 *x, int64_t m0, int T,
                                int64_t n) {
  const int64_t K = a->in_features, blocks = K / 32, bpg = a->group_size / 32;
  const int64_t groups = K / a->group_size;
  const int8_t *q = (const int8_t *)a->codes + n * K;
  if (m0 == 0) prefetch_column(a, n, K, groups);
  const int8_t *xq = x->q + m0 * K;
  const float *xd = x->d + m0 * blocks;
  const int32_t *xs = x->s + m0 * blocks;
  const __m256i order = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
#define WSCALE(b) param(a->params, n * groups + (b) / bpg, a->params_dtype)
  const float row_scale = groups == 1 ? WSCALE(0) : 0.0f;
  __m256 acc[TILE_ROWS];
  float tail[TILE_ROWS];
  for (int r = 0; r < T; r++) acc[r] = _mm256_setzero_ps(), tail[r] = 0.0f;
  int64_t b = 0;
  for (; b + 8 <= blocks; b += 8) {
    __m512i w[4];
    for (int j = 0; j < 4; j++) w[j] = int8_pair_u8(q + (b + 2 * j) * 32);
    const __m256 ws = groups == 1 ? _mm256_set1_ps(row_scale)
        : bpg == 1 ? scales8_contiguous(a->params, n * groups + b, a->params_dtype)
        : _mm256_setr_ps(WSCALE(b), WSCALE(b + 2), WSCALE(b + 4), WSCALE(b + 6),
                         WSCALE(b + 1), WSCALE(b + 3), WSCALE(b + 5), WSCALE(b + 7));
    for (int r = 0; r < T; r++) {
      __m256i y[4];
      for (int j = 0; j < 4; j++) y[j] = pair_sums(w[j], xq + r * K + (b + 2 * j) * 32);
      const __m256i offset = _mm256_slli_epi32(_mm256_permutevar8x32_epi32(
          _mm256_loadu_si256((const __m256i *)(xs + r * blocks + b)), order), 7);
      const __m256i h = _mm256_sub_epi32(_mm256_hadd_epi32(_mm256_hadd_epi32(y[0], y[1]),
                                                           _mm256_hadd_epi32(y[2], y[3])),
                                         offset);
      const __m256 d = _mm256_permutevar8x32_ps(_mm256_loadu_ps(xd + r * blocks + b), order);
      acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(h), d), ws, acc[r]);
    }
  }
  for (; b + 2 <= blocks; b += 2) { /* the offsets of these taken off once per block */
    const __m512i w = int8_pair_u8(q + b * 32);
    const float s0 = WSCALE(b), s1 = WSCALE(b + 1);
    for (int r = 0; r < T; r++) {
      const float d0 = xd[r * blocks + b] * s0, d1 = xd[r * blocks + b + 1] * s1;
      const __m256 sums = _mm256_cvtepi32_ps(pair_sums(w, xq + r * K + b * 32));
      acc[r] = _mm256_fmadd_ps(sums, _mm256_set_m128(_mm_set1_ps(d1), _mm_set1_ps(d0)), acc[r]);
      tail[r] -= 128.0f * ((float)xs[r * blocks + b] * d0 + (float)xs[r * blocks + b + 1] * d1);
    }
  }
  if (b < blocks) { /* an odd last block, in column order */
    const __m256i w = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(q + b * 32)),
                                       _mm256_set1_epi8((char)0x80));
    const float s = WSCALE(b);
    for (int r = 0; r < T; r++) {
      const float d = xd[r * blocks + b] * s;
      const __m256i dot = _mm256_dpbusd_epi32(
          _mm256_setzero_si256(), w, _mm256_loadu_si256((const __m256i *)(xq + r * K + b * 32)));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(d), acc[r]);
      tail[r] -= 128.0f * (float)xs[r * blocks + b] * d;
    }
  }
#undef WSCALE
  for (int r = 0; r < T; r++) store(a, m0 + r, n, hsum8(acc[r]) + tail[r]);
}
#endif

#else /* plain C: the same sums with 8 partial sums per row, vectorised by the compiler */

static inline void store_lanes(const qmm_args *a, float acc[TILE_ROWS][8], int64_t m0, int T,
                               int64_t n) {
  for (int r = 0; r < T; r++) {
    float s = 0;
    for (int l = 0; l < 8; l++) s += acc[r][l];
    store(a, m0 + r, n, s);
  }
}

static inline void int4_column(const qmm_args *a, const float *x, int64_t xs, const float *xw,
                               int64_t m0, int T, int64_t n) {
  (void)xw;
  const int64_t K = a->in_features, gs = a->group_size, groups = K / gs;
  const uint8_t *q = (const uint8_t *)a->codes + n * (K / 2);
  float acc[TILE_ROWS][8] = {{0}};
  float w[32];
  for (int64_t g = 0; g < groups; g++) {
    const float scale = param(a->params, (n * groups + g) * 2, a->params_dtype);
    const float zero = param(a->params, (n * groups + g) * 2 + 1, a->params_dtype);
    for (int64_t k = g * gs; k < (g + 1) * gs; k += 32) {
      for (int j = 0; j < 16; j++) {
        const uint8_t byte = q[k / 2 + j];
        w[j] = ((float)(byte & 0x0f) - 8.0f) * scale + zero;
        w[j + 16] = ((float)(byte >> 4) - 8.0f) * scale + zero;
      }
      for (int r = 0; r < T; r++)
        for (int j = 0; j < 32; j++) acc[r][j % 8] += w[j] * x[r * xs + k + j];
    }
  }
  store_lanes(a, acc, m0, T, n);
}

/* int8 (zeros 0) and int8_zero (zeros 1), each weight dequantized per tile. */
INLINE void int8_rows(const qmm_args *a, const float *x, int64_t xs, int64_t m0, int T,
                      int64_t n, const int zeros) {
  const int64_t K = a->in_features, gs = a->group_size, groups = K / gs;
  const int8_t *q = (const int8_t *)a->codes + n * K;
  float acc[TILE_ROWS][8] = {{0}};
  for (int64_t g = 0; g < groups; g++) {
    const int64_t i = zeros ? (n * groups + g) * 2 : n * groups + g;
    const float scale = param(a->params, i, a->params_dtype);
    const float zero = zeros ? param(a->params, i + 1, a->params_dtype) : 0.0f;
    for (int64_t k = g * gs; k < (g + 1) * gs; k += 8)
      for (int r = 0; r < T; r++)
        for (int j = 0; j < 8; j++)
          acc[r][j] += (zeros ? (float)q[k + j] * scale + zero : (float)q[k + j] * scale)
                       * x[r * xs + k + j];
  }
  store_lanes(a, acc, m0, T, n);
}
static inline void int8_column(const qmm_args *a, const float *x, int64_t xs, const float *xw,
                               int64_t m0, int T, int64_t n) {
  (void)xw;
  int8_rows(a, x, xs, m0, T, n, 0);
}
static inline void int8_zero_column(const qmm_args *a, const float *x, int64_t xs,
                                    const float *xw, int64_t m0, int T, int64_t n) {
  (void)xw;
  int8_rows(a, x, xs, m0, T, n, 1);
}

static inline void bf16_column(const qmm_args *a, const float *x, int64_t xs, const float *xw,
                               int64_t m0, int T, int64_t n) {
  (void)xw;
  const int64_t K = a->in_features;
  const bf16_t *w = (const bf16_t *)a->codes + n * K;
  float acc[TILE_ROWS][8] = {{0}};
  for (int64_t k = 0; k < K; k += 8)
    for (int r = 0; r < T; r++)
      for (int j = 0; j < 8; j++) acc[r][j] += bf16_to_f32(w[k + j]) * x[r * xs + k + j];
  store_lanes(a, acc, m0, T, n);
}

/* plain C: no 8-row tiles (the narrow tiles take every row) */
static inline void int4_wide(const qmm_args *a, const float *x, int64_t xs, int64_t m0,
                             int64_t n) { (void)a; (void)x; (void)xs; (void)m0; (void)n; }
static inline void int8_wide(const qmm_args *a, const float *x, int64_t xs, int64_t m0,
                             int64_t n) { (void)a; (void)x; (void)xs; (void)m0; (void)n; }
static inline void int8_zero_wide(const qmm_args *a, const float *x, int64_t xs, int64_t m0,
                                  int64_t n) { (void)a; (void)x; (void)xs; (void)m0; (void)n; }
static inline void bf16_wide(const qmm_args *a, const float *x, int64_t xs, int64_t m0,
                             int64_t n) { (void)a; (void)x; (void)xs; (void)m0; (void)n; }
static inline int quantize_block(const void *x, int64_t i, int bf16, int8_t *q, float *d) {
  float v[32], amax = 0;
  int finite = 1; /* else d = NaN: the rows' outputs NaN, as torch's */
  for (int j = 0; j < 32; j++) {
    v[j] = bf16 ? bf16_to_f32(((const bf16_t *)x)[i + j]) : ((const float *)x)[i + j];
    const float magnitude = fabsf(v[j]); /* (fmaxf here crashed aarch64 gcc 12's vectoriser) */
    amax = magnitude > amax ? magnitude : amax;
    finite &= magnitude < __builtin_inff();
  }
  *d = finite ? amax / 127.0f : __builtin_nanf("");
  const float inv = amax > 0 ? 127.0f / amax : 0.0f;
  int sum = 0;
  for (int j = 0; j < 32; j++) {
    const int32_t c = (int32_t)nearbyintf(fmaxf(-127.0f, fminf(127.0f, v[j] * inv)));
    q[j] = (int8_t)c;
    sum += c;
  }
  return sum;
}

INLINE void int4_a8_column(const qmm_args *a, const act8 *x, int64_t m0, int T, int64_t n,
                           int64_t bpg) {
  const int64_t K = a->in_features, groups = K / a->group_size, blocks = K / 32;
  const uint8_t *q = (const uint8_t *)a->codes + n * (K / 2);
  for (int r = 0; r < T; r++) {
    const int8_t *qx = x->q + (m0 + r) * K;
    const float *pairs = x->pairs + (m0 + r) * 2 * groups;
    float total = 0;
    for (int64_t g = 0; g < groups; g++) {
      float sum = 0;
      for (int64_t b = g * bpg; b < (g + 1) * bpg; b++) {
        int32_t codes[32], dot = 0;
        for (int j = 0; j < 16; j++) {
          codes[j] = q[b * 16 + j] & 0x0f;
          codes[j + 16] = q[b * 16 + j] >> 4;
        }
        for (int j = 0; j < 32; j++) dot += codes[j] * (int32_t)qx[b * 32 + j];
        sum += (float)dot * x->d[(m0 + r) * blocks + b];
      }
      const float scale = param(a->params, (n * groups + g) * 2, a->params_dtype);
      const float zero = param(a->params, (n * groups + g) * 2 + 1, a->params_dtype);
      total += sum * scale + scale * pairs[2 * g] + zero * pairs[2 * g + 1];
    }
    store(a, m0 + r, n, total);
  }
}
#endif

#ifndef QMM_VNNI
/* int8 weights (symmetric) times int8 activations without AVX512-VNNI: per block the exact
 * integer dot product, times the block's activation scale and the weight's scale. */
INLINE void int8_a8_column(const qmm_args *a, const act8 *x, int64_t m0, int T, int64_t n) {
  const int64_t K = a->in_features, blocks = K / 32, bpg = a->group_size / 32;
  const int64_t groups = K / a->group_size;
  const int8_t *q = (const int8_t *)a->codes + n * K;
  if (m0 == 0) prefetch_column(a, n, K, groups);
  for (int r = 0; r < T; r++) {
    const int8_t *qx = x->q + (m0 + r) * K;
    float total = 0;
    for (int64_t g = 0; g < groups; g++) {
      float sum = 0;
      for (int64_t b = g * bpg; b < (g + 1) * bpg; b++) {
        int32_t dot = 0;
        for (int j = 0; j < 32; j++) dot += (int32_t)q[b * 32 + j] * (int32_t)qx[b * 32 + j];
        sum += (float)dot * x->d[(m0 + r) * blocks + b];
      }
      total += sum * param(a->params, n * groups + g, a->params_dtype);
    }
    store(a, m0 + r, n, total);
  }
}
#endif

/* Each output column is one task: its weight row is read once per tile of rows, and the
 * tiles of x stay in the cache. */
/* All columns for the rows of one tile of T (a constant) rows. */
#define ONE_TILE(column, T)                                                               \
  do {                                                                                    \
    _Pragma("omp parallel for schedule(static) num_threads(a->num_threads)")              \
    for (int64_t n = 0; n < N; n++) column(a, x, xs, xw, 0, T, n);                        \
  } while (0)

/* sums: whether the AVX2 narrow tiles take group_sums (with offset; the plain-C loops
 * dequantize each weight instead). */
#define DEFINE_MATMUL(name, column, wide, sums, offset)                                   \
  void name(const qmm_args *a) {                                                          \
    int64_t xs;                                                                           \
    const float *x = float_rows(a, &xs);                                                  \
    const float *xw = sums ? group_sums(a, x, xs, offset) : NULL;                         \
    const int64_t M = a->rows, N = a->out_features, xw_row = 2 * (a->in_features / a->group_size); \
    switch (M) { /* one tile: its loop without the tile dispatch per column */            \
      case 1: ONE_TILE(column, 1); return;                                                \
      case 2: ONE_TILE(column, 2); return;                                                \
      case 3: ONE_TILE(column, 3); return;                                                \
      case 4: ONE_TILE(column, 4); return;                                                \
    }                                                                                     \
    _Pragma("omp parallel for schedule(static) num_threads(a->num_threads)")              \
    for (int64_t n = 0; n < N; n++) {                                                     \
      int64_t m0 = 0;                                                                     \
      if (QMM_AVX2)                                                                       \
        for (; M - m0 >= WIDE_ROWS; m0 += WIDE_ROWS) wide(a, x + m0 * xs, xs, m0, n);     \
      for (; m0 < M; m0 += TILE_ROWS) {                                                   \
        const int64_t left = M - m0;                                                      \
        const float *xt = x + m0 * xs, *wt = xw ? xw + m0 * xw_row : NULL;                \
        switch (left >= TILE_ROWS ? TILE_ROWS : left) { /* constant tiles unroll */       \
          case 4: column(a, xt, xs, wt, m0, 4, n); break;                                 \
          case 3: column(a, xt, xs, wt, m0, 3, n); break;                                 \
          case 2: column(a, xt, xs, wt, m0, 2, n); break;                                 \
          default: column(a, xt, xs, wt, m0, 1, n); break;                                \
        }                                                                                 \
      }                                                                                   \
    }                                                                                     \
  }

DEFINE_MATMUL(int4_matmul, int4_column, int4_wide, QMM_AVX2, -8.0f)
DEFINE_MATMUL(int8_matmul, int8_column, int8_wide, 0, 0.0f)
DEFINE_MATMUL(int8_zero_matmul, int8_zero_column, int8_zero_wide, QMM_AVX2, 0.0f)
DEFINE_MATMUL(bf16_matmul, bf16_column, bf16_wide, 0, 0.0f)

/* Weights times int8 activations (quantize_activations), in tiles of 1-4 rows (the layers
 * call them below quant_matmul.INTEGER_ROWS rows): int4 (group 32, GGUF's blocks, with its
 * one block per group a constant, so that its loop unrolls), and symmetric int8. */
#ifdef QMM_VNNI
#define INT4_A8_COLUMN(T, m0, n) int4_a8_column_vnni(a, &x, m0, T, n)
#define INT8_A8_COLUMN(T, m0, n) int8_a8_column_vnni(a, &x, m0, T, n)
#else
#define INT4_A8_COLUMN(T, m0, n)                                                          \
  (a->group_size == 32 ? int4_a8_column(a, &x, m0, T, n, 1)                               \
                       : int4_a8_column(a, &x, m0, T, n, a->group_size / 32))
#define INT8_A8_COLUMN(T, m0, n) int8_a8_column(a, &x, m0, T, n)
#endif
#define A8_TILE(COLUMN, T)                                                                \
  do {                                                                                    \
    _Pragma("omp parallel for schedule(static) num_threads(a->num_threads)")              \
    for (int64_t n = 0; n < N; n++) COLUMN(T, 0, n);                                      \
  } while (0)
#define DEFINE_A8_MATMUL(NAME, COLUMN)                                                    \
  void NAME(const qmm_args *a) {                                                          \
    const act8 x = quantize_activations(a);                                               \
    const int64_t M = a->rows, N = a->out_features;                                       \
    switch (M) { /* one tile: its loop without the tile dispatch per column */            \
      case 1: A8_TILE(COLUMN, 1); return;                                                 \
      case 2: A8_TILE(COLUMN, 2); return;                                                 \
      case 3: A8_TILE(COLUMN, 3); return;                                                 \
      case 4: A8_TILE(COLUMN, 4); return;                                                 \
    }                                                                                     \
    _Pragma("omp parallel for schedule(static) num_threads(a->num_threads)")              \
    for (int64_t n = 0; n < N; n++)                                                       \
      for (int64_t m0 = 0; m0 < M; m0 += TILE_ROWS) {                                     \
        switch (M - m0 >= TILE_ROWS ? TILE_ROWS : M - m0) { /* constant tiles unroll */   \
          case 4: COLUMN(4, m0, n); break;                                                \
          case 3: COLUMN(3, m0, n); break;                                                \
          case 2: COLUMN(2, m0, n); break;                                                \
          default: COLUMN(1, m0, n); break;                                               \
        }                                                                                 \
      }                                                                                   \
  }
DEFINE_A8_MATMUL(int4_a8_matmul, INT4_A8_COLUMN)
DEFINE_A8_MATMUL(int8_a8_matmul, INT8_A8_COLUMN)

#ifdef QMM_VNNI
/* int4 weights in panels of 16 output columns, for int8 activations (int4_panel_a8_matmul):
 * the codes laid out so that each 32-bit lane of a 512-bit register holds 4 consecutive codes
 * of one column, 16 columns side by side, and one vpdpbusd with the row's 4 activation codes
 * broadcast adds 4 products into each column's own lane. A block of 32 columns of x then takes
 * 8 vpdpbusd for 16 output columns and ends with each column's exact integer sum in its lane:
 * no horizontal sums, no shuffles, and the float32 work (conversion, activation and weight
 * scales, zero terms) done for 16 columns at once.
 *   codes [P = ceil(N / 16), K / 32, 4, 64] uint8 (pack_int4_panels): for panel p, block b and
 *        chunk c, byte 4 j + i holds column 16 p + j's code at k = 32 b + 4 c + i in its low
 *        nibble and at k = 32 b + 16 + 4 c + i in its high nibble;
 *   params [P, K / group_size, 2, 16]: each group's 16 scales, then its 16 zeros.
 * Columns past N (the last panel's padding) have zero codes and parameters. */
#define PANEL 16
#define PANEL_ROWS 8 /* rows per tile: each block's widened codes serve all of them */
#define PANEL_AHEAD 2048

/* The activation codes of block b's columns 0-15 (*lo) and 16-31 (*hi) in quantize_activations'
 * pair order: b 0-15, b + 1 0-15, b 16-31, b + 1 16-31 for each pair, a last odd block as it
 * is. */
INLINE void block_halves(const int8_t *xq, int64_t b, int64_t blocks, const int8_t **lo,
                         const int8_t **hi) {
  if ((blocks & 1) && b == blocks - 1) {
    *lo = xq + b * 32, *hi = xq + b * 32 + 16;
  } else if (b & 1) {
    *lo = xq + (b - 1) * 32 + 16, *hi = xq + (b - 1) * 32 + 48;
  } else {
    *lo = xq + b * 32, *hi = xq + b * 32 + 32;
  }
}

INLINE __m512 load_params16(const void *p, int64_t i, int dtype) {
  if (dtype == PARAMS_F32) return _mm512_loadu_ps((const float *)p + i);
  const __m256i half = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i));
  return dtype == PARAMS_F16 ? _mm512_cvtph_ps(half)
         : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

INLINE int32_t code4(const int8_t *p) {
  int32_t v;
  memcpy(&v, p, 4);
  return v;
}

/* Rows m0 .. m0 + T of panel p's columns (those below N) from their lanes. */
INLINE void store_panel(const qmm_args *a, const __m512 *acc, int64_t m0, int T, int64_t p) {
  const int64_t n0 = p * PANEL, N = a->out_features, count = N - n0 < PANEL ? N - n0 : PANEL;
  for (int r = 0; r < T; r++) {
    float lanes[PANEL];
    _mm512_storeu_ps(lanes, acc[r]);
    for (int64_t j = 0; j < count; j++) store(a, m0 + r, n0 + j, lanes[j]);
  }
}

/* Panel p for rows m0 .. m0 + T: per group, the blocks' integer sums times their activation
 * scales summed (t), then acc += scale * (t - 8 S) + zero * S with S the group's sum of the
 * rounded activations (act8's pairs hold -8 S and S). */
INLINE void int4_panel_tile(const qmm_args *a, const act8 *x, int64_t m0, int T, int64_t p) {
  const int64_t K = a->in_features, blocks = K / 32, bpg = a->group_size / 32;
  const int64_t groups = K / a->group_size;
  const uint8_t *codes = (const uint8_t *)a->codes + p * blocks * 256;
  const int64_t params0 = p * groups * 2 * PANEL;
  const __m512i nibble = _mm512_set1_epi8(0x0f);
  __m512 acc[PANEL_ROWS];
  for (int r = 0; r < T; r++) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; g++) {
    __m512 t[PANEL_ROWS];
    for (int64_t b = g * bpg; b < (g + 1) * bpg; b++) {
      const uint8_t *c = codes + b * 256;
      if (m0 == 0)
        for (int j = 0; j < 4; j++) __builtin_prefetch(c + PANEL_AHEAD + 64 * j, 0, 1);
      __m512i lo[4], hi[4];
      for (int j = 0; j < 4; j++) {
        const __m512i v = _mm512_loadu_si512((const void *)(c + 64 * j));
        lo[j] = _mm512_and_si512(v, nibble);
        hi[j] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
      }
      for (int r = 0; r < T; r++) {
        const int8_t *xl, *xh;
        block_halves(x->q + (m0 + r) * K, b, blocks, &xl, &xh);
        __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
        for (int j = 0; j < 4; j++) {
          s0 = _mm512_dpbusd_epi32(s0, lo[j], _mm512_set1_epi32(code4(xl + 4 * j)));
          s1 = _mm512_dpbusd_epi32(s1, hi[j], _mm512_set1_epi32(code4(xh + 4 * j)));
        }
        const __m512 sum = _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1));
        const __m512 d = _mm512_set1_ps(x->d[(m0 + r) * blocks + b]);
        t[r] = b == g * bpg ? _mm512_mul_ps(sum, d) : _mm512_fmadd_ps(sum, d, t[r]);
      }
    }
    const __m512 scale = load_params16(a->params, params0 + g * 2 * PANEL, a->params_dtype);
    const __m512 zero = load_params16(a->params, params0 + (g * 2 + 1) * PANEL,
                                      a->params_dtype);
    for (int r = 0; r < T; r++) {
      const float *pair = x->pairs + ((m0 + r) * groups + g) * 2;
      acc[r] = _mm512_fmadd_ps(_mm512_add_ps(t[r], _mm512_set1_ps(pair[0])), scale, acc[r]);
      acc[r] = _mm512_fmadd_ps(zero, _mm512_set1_ps(pair[1]), acc[r]);
    }
  }
  store_panel(a, acc, m0, T, p);
}

/* x [M, K] rounded by quantize_activations times the panels, tile by tile of PANEL_ROWS rows
 * (each panel's codes read once per tile); a switch so that each tile's row count is a
 * constant and its loops unroll. */
#define PANEL_ROWS_OF(TILE)                                                                  \
  const act8 x = quantize_activations(a);                                                    \
  const int64_t M = a->rows, panels = (a->out_features + PANEL - 1) / PANEL;                 \
  _Pragma("omp parallel for schedule(static) num_threads(a->num_threads)")                   \
  for (int64_t p = 0; p < panels; p++)                                                       \
    for (int64_t m0 = 0; m0 < M; m0 += PANEL_ROWS) {                                         \
      switch (M - m0 >= PANEL_ROWS ? PANEL_ROWS : M - m0) {                                  \
        case 8: TILE(a, &x, m0, 8, p); break;                                                \
        case 7: TILE(a, &x, m0, 7, p); break;                                                \
        case 6: TILE(a, &x, m0, 6, p); break;                                                \
        case 5: TILE(a, &x, m0, 5, p); break;                                                \
        case 4: TILE(a, &x, m0, 4, p); break;                                                \
        case 3: TILE(a, &x, m0, 3, p); break;                                                \
        case 2: TILE(a, &x, m0, 2, p); break;                                                \
        default: TILE(a, &x, m0, 1, p); break;                                               \
      }                                                                                      \
    }

/* x [M, K] times panel-packed int4 weights, x rounded by quantize_activations: each panel's
 * codes are read once per tile of PANEL_ROWS rows. No GEMM path: at 16 to 1024 rows this was
 * faster than dequantized slices through torch's float32 GEMM, and than the row layout's GEMM
 * path, on an AMX Xeon (1 and 2 threads, docs/BENCHMARKS.md "int4 in panels of 16 columns"). */
void int4_panel_a8_matmul(const qmm_args *a) {
  PANEL_ROWS_OF(int4_panel_tile)
}

/* Symmetric int8 weights in panels of 16 output columns (int8_panel_a8_matmul), groups of a
 * multiple of 32 or one scale per row, as int8_a8_column_vnni but laid out as the int4 panels:
 *   codes [P = ceil(N / 16), K / 32, 8, 64] uint8 (pack_int8_panels): for panel p, block b
 *        and chunk c, byte 4 j + i holds column 16 p + j's code at k = 32 b + 4 c + i, plus
 *        128 (unsigned for vpdpbusd; 128 times the block's sum of activation codes comes off
 *        the int32 sums, exactly);
 *   params [P, K / group_size, 16]: each group's 16 scales. */
INLINE void int8_panel_tile(const qmm_args *a, const act8 *x, int64_t m0, int T, int64_t p) {
  const int64_t K = a->in_features, blocks = K / 32, bpg = a->group_size / 32;
  const int64_t groups = K / a->group_size;
  const uint8_t *codes = (const uint8_t *)a->codes + p * blocks * 512;
  __m512 acc[PANEL_ROWS];
  for (int r = 0; r < T; r++) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; g++) {
    __m512 t[PANEL_ROWS];
    for (int64_t b = g * bpg; b < (g + 1) * bpg; b++) {
      const uint8_t *c = codes + b * 512;
      if (m0 == 0) /* as many blocks ahead as the int4 panels: twice the bytes per block */
        for (int j = 0; j < 8; j++) __builtin_prefetch(c + 2 * PANEL_AHEAD + 64 * j, 0, 1);
      __m512i w[8];
      for (int j = 0; j < 8; j++) w[j] = _mm512_loadu_si512((const void *)(c + 64 * j));
      for (int r = 0; r < T; r++) {
        const int8_t *xl, *xh;
        block_halves(x->q + (m0 + r) * K, b, blocks, &xl, &xh);
        __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
        for (int j = 0; j < 4; j++) {
          s0 = _mm512_dpbusd_epi32(s0, w[j], _mm512_set1_epi32(code4(xl + 4 * j)));
          s1 = _mm512_dpbusd_epi32(s1, w[4 + j], _mm512_set1_epi32(code4(xh + 4 * j)));
        }
        const __m512i offset = _mm512_set1_epi32(128 * x->s[(m0 + r) * blocks + b]);
        const __m512 sum = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_add_epi32(s0, s1),
                                                               offset));
        const __m512 d = _mm512_set1_ps(x->d[(m0 + r) * blocks + b]);
        t[r] = b == g * bpg ? _mm512_mul_ps(sum, d) : _mm512_fmadd_ps(sum, d, t[r]);
      }
    }
    const __m512 scale = load_params16(a->params, (p * groups + g) * PANEL, a->params_dtype);
    for (int r = 0; r < T; r++) acc[r] = _mm512_fmadd_ps(t[r], scale, acc[r]);
  }
  store_panel(a, acc, m0, T, p);
}

/* x [M, K] times panel-packed symmetric int8 weights, x rounded by quantize_activations. */
void int8_panel_a8_matmul(const qmm_args *a) {
  PANEL_ROWS_OF(int8_panel_tile)
}
#endif

/* Products of bfloat16 activations with int4 / int8 codes by AVX512-BF16 dot products
 * (vdpbf16ps), for many rows (prefill, large batches). Every code, as the layers dequantize it (int4: q - 8,
 * int8: q), is a small integer and exact in bfloat16, as are bfloat16 activations, so each
 * product is exact in float32 and summed in float32: per group, the sum of codes times x,
 * times the group's scale, plus the group's zero times the group's sum of x (int4,
 * int8_zero), as the narrow tiles compute it. The result is the float64 product with the
 * dequantized weight up to the order of float32 additions (and, as the instruction treats its
 * inputs and outputs, with float32 subnormals taken as zero).
 *
 * Rows sit in the vector lanes: x is first repacked into blocks of 16 rows, [K / 2][16] pairs
 * of columns (one 32-bit word per row and pair, the lanes of one vdpbf16ps operand), and
 * DOT_COLS output columns at a time are dequantized to bfloat16 rows of K values, whose pairs
 * are broadcast. A tile of DOT_BLOCKS blocks (48 rows) by DOT_COLS columns keeps its 24
 * groups' sums in registers; the scaled totals go through a small buffer in L1, transposed
 * from there into the output rows (dot_store). The rows are
 * repacked DOT_ROW_BYTES at a time (the threads split the blocks), so that they stay in each
 * core's L2 while every column passes over them (the threads split the columns), and the
 * workspace is bounded whatever the row count. */
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define QMM_DOT 1
#define DOT_COLS 8
#define DOT_BLOCKS 3
#define DOT_ROW_BYTES (512 * 1024)

enum { DOT_INT4 = 0, DOT_INT8 = 1, DOT_INT8_ZERO = 2 };

#ifdef _OPENMP
#include <omp.h>
static inline int dot_thread(void) { return omp_get_thread_num(); }
#else
static inline int dot_thread(void) { return 0; }
#endif

static inline int64_t dot_align(int64_t floats) { return (floats + 15) & ~(int64_t)15; }

/* Blocks of 16 rows taken at a time: DOT_ROW_BYTES of repacked rows, a whole number of tiles
 * (at least one). */
static int64_t dot_step(const qmm_args *a) {
  const int64_t step = DOT_ROW_BYTES / (a->in_features / 2 * 64) / DOT_BLOCKS * DOT_BLOCKS;
  return step < DOT_BLOCKS ? DOT_BLOCKS : step;
}

/* The workspace, in floats: one step's repacked rows and their group sums (kinds with zeros),
 * and per thread DOT_COLS dequantized weight rows with their scales and zeros; bounded by the
 * step, whatever the row count. */
static int64_t dot_workspace(const qmm_args *a, int zeros) {
  const int64_t K = a->in_features, groups = K / a->group_size, blocks = (a->rows + 15) / 16;
  const int64_t held = blocks < dot_step(a) ? blocks : dot_step(a);
  return dot_align(held * K * 8) + (zeros ? dot_align(held * groups * 16) : 0) +
         a->num_threads * (dot_align(DOT_COLS * K / 2) + 2 * dot_align(DOT_COLS * groups));
}

/* 16 x 16 32-bit words: r[i] word j -> r[j] word i. */
static inline void dot_transpose(__m512i r[16]) {
  __m512i a[16], b[16];
  for (int i = 0; i < 8; i++) {
    a[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    a[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; i++) { /* b[4 i + c], 128-bit lane L: rows 4i..4i+3, word 4L + c */
    b[4 * i] = _mm512_unpacklo_epi64(a[4 * i], a[4 * i + 2]);
    b[4 * i + 1] = _mm512_unpackhi_epi64(a[4 * i], a[4 * i + 2]);
    b[4 * i + 2] = _mm512_unpacklo_epi64(a[4 * i + 1], a[4 * i + 3]);
    b[4 * i + 3] = _mm512_unpackhi_epi64(a[4 * i + 1], a[4 * i + 3]);
  }
  for (int c = 0; c < 4; c++) {
    const __m512i lo1 = _mm512_shuffle_i32x4(b[c], b[4 + c], _MM_SHUFFLE(2, 0, 2, 0));
    const __m512i hi1 = _mm512_shuffle_i32x4(b[c], b[4 + c], _MM_SHUFFLE(3, 1, 3, 1));
    const __m512i lo2 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], _MM_SHUFFLE(2, 0, 2, 0));
    const __m512i hi2 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], _MM_SHUFFLE(3, 1, 3, 1));
    r[c] = _mm512_shuffle_i32x4(lo1, lo2, _MM_SHUFFLE(2, 0, 2, 0));
    r[8 + c] = _mm512_shuffle_i32x4(lo1, lo2, _MM_SHUFFLE(3, 1, 3, 1));
    r[4 + c] = _mm512_shuffle_i32x4(hi1, hi2, _MM_SHUFFLE(2, 0, 2, 0));
    r[12 + c] = _mm512_shuffle_i32x4(hi1, hi2, _MM_SHUFFLE(3, 1, 3, 1));
  }
}

/* Rows 16 b .. 16 b + 15 of x (zeros past the last) into block ``slot`` of xp, 16 pairs at a
 * time by a transpose, and (xs not NULL) their group sums into block ``slot`` of xs: dot
 * products with pairs of ones, so in float32 as the tiles sum. */
static void dot_pack_block(const qmm_args *a, int64_t b, int64_t slot, uint32_t *xp,
                           float *xs) {
  const int64_t K = a->in_features, pairs = K / 2, gs = a->group_size, groups = K / gs;
  const int64_t rows = a->rows - b * 16 < 16 ? a->rows - b * 16 : 16;
  const bf16_t *x = (const bf16_t *)a->x + b * 16 * a->x_stride;
  uint32_t *block = xp + slot * pairs * 16;
  int64_t p = 0;
  for (; p + 16 <= pairs; p += 16) {
    __m512i r[16];
    for (int i = 0; i < 16; i++)
      r[i] = i < rows ? _mm512_loadu_si512((const void *)(x + i * a->x_stride + 2 * p))
                      : _mm512_setzero_si512();
    dot_transpose(r);
    for (int j = 0; j < 16; j++) _mm512_storeu_si512((void *)(block + (p + j) * 16), r[j]);
  }
  for (; p < pairs; p++)
    for (int i = 0; i < 16; i++) {
      uint32_t word = 0;
      if (i < rows) memcpy(&word, x + i * a->x_stride + 2 * p, 4);
      block[p * 16 + i] = word;
    }
  if (xs) {
    const __m512bh ones = (__m512bh)_mm512_set1_epi32(0x3f803f80);
    for (int64_t g = 0; g < groups; g++) {
      __m512 sum = _mm512_setzero_ps();
      for (int64_t q = g * gs / 2; q < (g + 1) * gs / 2; q++)
        sum = _mm512_dpbf16_ps(sum, (__m512bh)_mm512_loadu_si512((const void *)(block + q * 16)),
                               ones);
      _mm512_storeu_ps(xs + (slot * groups + g) * 16, sum);
    }
  }
}

/* Output columns n0 .. n0 + DOT_COLS - 1 (zeros past the last) as bfloat16 rows of codes
 * (int4: q - 8) into w [DOT_COLS][K], their scales into sc and zeros into zr [DOT_COLS][groups]
 * (zr NULL: symmetric int8). */
static void dot_dequantize(const qmm_args *a, int kind, int64_t n0, bf16_t *w, float *sc,
                           float *zr) {
  const int64_t K = a->in_features, groups = K / a->group_size;
  for (int j = 0; j < DOT_COLS; j++) {
    const int64_t n = n0 + j;
    bf16_t *wj = w + j * K;
    if (n >= a->out_features) {
      memset(wj, 0, K * sizeof(bf16_t));
      for (int64_t g = 0; g < groups; g++) sc[j * groups + g] = 0;
      if (zr)
        for (int64_t g = 0; g < groups; g++) zr[j * groups + g] = 0;
      continue;
    }
    if (kind == DOT_INT4) {
      /* q - 8 for q = 0 .. 15 in bfloat16 (-8, -7, ..., 7), looked up 16 codes at a time */
      const __m256i values = _mm256_setr_epi16(
          (short)0xc100, (short)0xc0e0, (short)0xc0c0, (short)0xc0a0, (short)0xc080,
          (short)0xc040, (short)0xc000, (short)0xbf80, 0, 0x3f80, 0x4000, 0x4040, 0x4080,
          0x40a0, 0x40c0, 0x40e0);
      const __m256i low = _mm256_set1_epi16(0x0f);
      const uint8_t *q = (const uint8_t *)a->codes + n * (K / 2);
      for (int64_t k = 0; k < K; k += 32) { /* byte j: column j (low nibble), j + 16 (high) */
        const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(q + k / 2)));
        _mm256_storeu_si256((__m256i *)(wj + k),
                            _mm256_permutexvar_epi16(_mm256_and_si256(v, low), values));
        _mm256_storeu_si256((__m256i *)(wj + k + 16),
                            _mm256_permutexvar_epi16(_mm256_srli_epi16(v, 4), values));
      }
    } else {
      const int8_t *q = (const int8_t *)a->codes + n * K;
      int64_t k = 0;
      for (; k + 16 <= K; k += 16) {
        const __m512i v = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + k)));
        _mm256_storeu_si256((__m256i *)(wj + k),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_cvtepi32_ps(v)));
      }
      for (; k < K; k++) wj[k] = f32_to_bf16((float)q[k]);
    }
    /* params [N, groups, 2] (scale, zero), or [N, groups] (symmetric int8): one loop per
     * dtype, so that each converts without a branch per value */
    const int pair = kind != DOT_INT8;
    const int64_t first = (n * groups) << pair;
    float *scj = sc + j * groups, *zrj = zr ? zr + j * groups : NULL;
    switch (a->params_dtype) {
      case PARAMS_BF16: {
        const bf16_t *p = (const bf16_t *)a->params + first;
        for (int64_t g = 0; g < groups; g++) scj[g] = bf16_to_f32(p[g << pair]);
        if (zrj)
          for (int64_t g = 0; g < groups; g++) zrj[g] = bf16_to_f32(p[(g << 1) + 1]);
        break;
      }
      case PARAMS_F16: {
        const uint16_t *p = (const uint16_t *)a->params + first;
        for (int64_t g = 0; g < groups; g++) scj[g] = f16_to_f32(p[g << pair]);
        if (zrj)
          for (int64_t g = 0; g < groups; g++) zrj[g] = f16_to_f32(p[(g << 1) + 1]);
        break;
      }
      default: {
        const float *p = (const float *)a->params + first;
        for (int64_t g = 0; g < groups; g++) scj[g] = p[g << pair];
        if (zrj)
          for (int64_t g = 0; g < groups; g++) zrj[g] = p[(g << 1) + 1];
      }
    }
  }
}

/* One tile: R (a constant after inlining) blocks of 16 rows from xp's block b0 on times the
 * DOT_COLS dequantized columns, into out[r][j] (lane i: row 16 (b0 + r) + i), with 3 x 8
 * sums in registers. With one group: out = sums times the scale. Else out starts at the zero
 * terms (zr; or 0) and each group adds its sums times its scale there (out stays in L1). */
INLINE void dot_tile(const uint32_t *xp, const float *xs, int64_t pairs, int64_t groups,
                     int64_t gs, const bf16_t *w, const float *sc, const float *zr, int R,
                     float out[DOT_BLOCKS][DOT_COLS][16]) {
  const int64_t group_pairs = gs / 2;
  const uint32_t *wr = (const uint32_t *)w;
  __m512 acc[DOT_BLOCKS][DOT_COLS];
  const int single = groups == 1 && !zr;
  if (!single) {
#pragma GCC unroll 3
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
      for (int j = 0; j < DOT_COLS; j++) acc[r][j] = _mm512_setzero_ps();
    if (zr)
      for (int64_t g = 0; g < groups; g++)
#pragma GCC unroll 3
        for (int r = 0; r < R; r++) {
          const __m512 sums = _mm512_loadu_ps(xs + (r * groups + g) * 16);
#pragma GCC unroll 8
          for (int j = 0; j < DOT_COLS; j++)
            acc[r][j] = _mm512_fmadd_ps(sums, _mm512_set1_ps(zr[j * groups + g]), acc[r][j]);
        }
#pragma GCC unroll 3
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
      for (int j = 0; j < DOT_COLS; j++) _mm512_storeu_ps(out[r][j], acc[r][j]);
  }
  for (int64_t g = 0; g < groups; g++) {
#pragma GCC unroll 3
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
      for (int j = 0; j < DOT_COLS; j++) acc[r][j] = _mm512_setzero_ps();
    for (int64_t p = g * group_pairs; p < (g + 1) * group_pairs; p++) {
      __m512bh xv[DOT_BLOCKS];
#pragma GCC unroll 3
      for (int r = 0; r < R; r++)
        xv[r] = (__m512bh)_mm512_loadu_si512((const void *)(xp + (r * pairs + p) * 16));
#pragma GCC unroll 8
      for (int j = 0; j < DOT_COLS; j++) {
        const __m512bh wv = (__m512bh)_mm512_set1_epi32((int)wr[j * pairs + p]);
#pragma GCC unroll 3
        for (int r = 0; r < R; r++) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xv[r], wv);
      }
    }
#pragma GCC unroll 8
    for (int j = 0; j < DOT_COLS; j++) {
      const __m512 scale = _mm512_set1_ps(sc[j * groups + g]);
#pragma GCC unroll 3
      for (int r = 0; r < R; r++)
        _mm512_storeu_ps(out[r][j], single ? _mm512_mul_ps(acc[r][j], scale)
                                           : _mm512_fmadd_ps(acc[r][j], scale,
                                                             _mm512_loadu_ps(out[r][j])));
    }
  }
}

/* 16 floats to bfloat16 as f32_to_bf16 rounds them (nearest even, subnormals kept, NaN to
 * 0x7fc0). */
static inline __m256i dot_round(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), odd);
  r = _mm512_srli_epi32(r, 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q),
                            _mm512_set1_epi32(0x7fc0));
  return _mm512_cvtepi32_epi16(r);
}

/* A tile's totals (out[r][j], lane i: row 16 (b0 + r) + i, column n0 + j) into the bfloat16
 * output rows, plus the bias: per block, the 8 columns' lanes transposed to rows of 8. */
static void dot_store(const qmm_args *a, float out[DOT_BLOCKS][DOT_COLS][16], int64_t b0,
                      int R, int64_t n0) {
  const int64_t M = a->rows, N = a->out_features;
  const int cols = N - n0 < DOT_COLS ? (int)(N - n0) : DOT_COLS;
  const __mmask8 keep = (__mmask8)((1u << cols) - 1);
  const __m512 bias = a->bias ? _mm512_castps256_ps512(_mm256_maskz_loadu_ps(keep, a->bias + n0))
                              : _mm512_setzero_ps();
  bf16_t *y = (bf16_t *)a->out;
  for (int r = 0; r < R; r++) {
    __m512i t[16];
    for (int j = 0; j < 16; j++)
      t[j] = j < DOT_COLS ? _mm512_castps_si512(_mm512_loadu_ps(out[r][j]))
                          : _mm512_setzero_si512();
    dot_transpose(t); /* t[i] lanes 0..7: row 16 (b0 + r) + i, columns n0 .. n0 + 7 */
    for (int i = 0; i < 16; i++) {
      const int64_t m = (b0 + r) * 16 + i;
      if (m >= M) break;
      const __m256i h = dot_round(_mm512_add_ps(_mm512_castsi512_ps(t[i]), bias));
      _mm_mask_storeu_epi16(y + m * N + n0, keep, _mm256_castsi256_si128(h));
    }
  }
}

static void few_gemm(const qmm_args *a, int kind);
int dot_few(const qmm_args *a);

static void dot_gemm(const qmm_args *a, int kind) {
  if (dot_few(a)) {
    few_gemm(a, kind);
    return;
  }
  const int64_t M = a->rows, N = a->out_features, K = a->in_features, pairs = K / 2;
  const int64_t gs = a->group_size, groups = K / gs, blocks = (M + 15) / 16;
  const int zeros = kind != DOT_INT8;
  const int64_t step = dot_step(a), held = blocks < step ? blocks : step;
  uint32_t *xp = (uint32_t *)a->workspace;
  float *xs = zeros ? a->workspace + dot_align(held * K * 8) : NULL;
  float *own = a->workspace + dot_align(held * K * 8) +
               (zeros ? dot_align(held * groups * 16) : 0);
  const int64_t own_floats = dot_align(DOT_COLS * K / 2) + 2 * dot_align(DOT_COLS * groups);
  const int64_t chunks = (N + DOT_COLS - 1) / DOT_COLS;
#pragma omp parallel num_threads(a->num_threads)
  {
    float *mine = own + dot_thread() * own_floats;
    bf16_t *w = (bf16_t *)mine;
    float *sc = mine + dot_align(DOT_COLS * K / 2);
    float *zr = zeros ? sc + dot_align(DOT_COLS * groups) : NULL;
    float out[DOT_BLOCKS][DOT_COLS][16];
    for (int64_t b1 = 0; b1 < blocks; b1 += step) { /* one step's blocks at slots 0, 1, ... */
      const int64_t b2 = b1 + step < blocks ? b1 + step : blocks;
#pragma omp for schedule(static)
      for (int64_t b = b1; b < b2; b++) dot_pack_block(a, b, b - b1, xp, xs);
#pragma omp for schedule(static)
      for (int64_t c = 0; c < chunks; c++) {
        const int64_t n0 = c * DOT_COLS;
        dot_dequantize(a, kind, n0, w, sc, zr);
        for (int64_t b0 = b1; b0 < b2; b0 += DOT_BLOCKS) {
          const uint32_t *xt = xp + (b0 - b1) * pairs * 16;
          const float *st = zeros ? xs + (b0 - b1) * groups * 16 : NULL;
          const int R = b2 - b0 < DOT_BLOCKS ? (int)(b2 - b0) : DOT_BLOCKS;
          if (R == 3) dot_tile(xt, st, pairs, groups, gs, w, sc, zr, 3, out);
          else if (R == 2) dot_tile(xt, st, pairs, groups, gs, w, sc, zr, 2, out);
          else dot_tile(xt, st, pairs, groups, gs, w, sc, zr, 1, out);
          dot_store(a, out, b0, R, n0);
        }
      }
    }
  }
}

/* Fewer than FEW_ROWS rows (decode): per output column and chunk of 64 input columns, the
 * codes become two vectors of 32 bfloat16 values in registers and each row adds their
 * vdpbf16ps products with its own rows (rearranged once per call to the codes' order) into
 * 16 float32 lanes of its own, scaled per chunk (or group); each (row, column)'s lanes are
 * summed at the end. Blocks of 16 rows in lanes (dot_tile) would leave most lanes empty
 * below 16 rows, and dequantize each column into memory first.
 *
 * A chunk's vectors: wa = columns 64 c + [0..15, 32..47], wb = 64 c + [16..31, 48..63], the
 * order in which one 32-byte load of int4 codes (two runs of 32, byte j: column j and j + 16)
 * and two nibble masks give them; a last chunk of 32 (K % 64 == 32) has zeros in lanes 8..15.
 * So vdpbf16ps lanes 0..7 hold columns of the chunk's first 32, lanes 8..15 of its second 32:
 * with groups of 32, one scale vector per chunk (two values) scales both products, with
 * groups of a multiple of 64 one value; with groups of 16 each product takes its own. On a
 * Zen 4 EPYC one column's chunk of int4 codes takes ~8.4 cycles at one row, bound by the
 * FP pipes that the shuffles and vdpbf16ps share (docs/BENCHMARKS.md). Needs K % 32 == 0 and
 * group_size 16, 32, a multiple of 64 or K (dot_few). */
/* from here blocks of 16 rows (dot_tile): on the Zen 4 EPYC they cross between 9 and 10 rows
 * (SmolLM2's shapes, int4 and int8; a block costs about the same at 10 rows as at 16) */
#define FEW_ROWS 10
#define FEW_COLS 4 /* output columns per tile */
#define FEW_TILE 4 /* rows per tile */

/* one group; groups of 32; of 16; of a multiple of 64 */
enum { FEW_ONE = 0, FEW_PAIR = 1, FEW_HALF = 2, FEW_WIDE = 3 };

static inline int few_fits(const qmm_args *a) {
  const int64_t gs = a->group_size;
  return a->in_features % 32 == 0 &&
         (gs == 16 || gs == 32 || gs % 64 == 0 || gs == a->in_features);
}

/* Whether dot_gemm takes these rows by the few-rows kernel (else blocks of 16 rows). */
int dot_few(const qmm_args *a) { return a->rows < FEW_ROWS && few_fits(a); }

static inline int64_t few_chunks(const qmm_args *a) { return (a->in_features + 63) / 64; }

/* In floats: the rearranged rows (64 bfloat16 values a chunk), their group sums (kinds with
 * zeros), and per thread FEW_COLS columns' scales and zeros. */
static int64_t few_workspace(const qmm_args *a, int zeros) {
  const int64_t groups = dot_align(a->in_features / a->group_size);
  return dot_align(a->rows * few_chunks(a) * 32) + (zeros ? dot_align(a->rows * groups) : 0) +
         a->num_threads * 2 * FEW_COLS * groups;
}

/* Row m of x in the codes' order, chunk c at xp + (m * chunks + c) * 64 (xa, then xb); and
 * (xs not NULL) its group sums in float32, zeros past the last group. */
static void few_pack_rows(const qmm_args *a, bf16_t *xp, float *xs) {
  const int64_t K = a->in_features, chunks = few_chunks(a), gs = a->group_size;
  const int64_t groups = K / gs, padded = dot_align(groups);
  for (int64_t m = 0; m < a->rows; m++) {
    const bf16_t *x = (const bf16_t *)a->x + m * a->x_stride;
    for (int64_t c = 0; c < chunks; c++) {
      bf16_t *d = xp + (m * chunks + c) * 64;
      const int64_t k = c * 64;
      const int full = k + 64 <= K;
      memcpy(d, x + k, 32);
      memcpy(d + 32, x + k + 16, 32);
      if (full) {
        memcpy(d + 16, x + k + 32, 32);
        memcpy(d + 48, x + k + 48, 32);
      } else {
        memset(d + 16, 0, 32);
        memset(d + 48, 0, 32);
      }
    }
    if (!xs) continue;
    for (int64_t g = 0; g < padded; g++) {
      float sum = 0;
      if (g < groups)
        for (int64_t k = g * gs; k < (g + 1) * gs; k++) sum += bf16_to_f32(x[k]);
      xs[m * padded + g] = sum;
    }
  }
}

/* Column n's scales (and zeros) as float32 into s and z (groups rounded up to 16, zeros
 * past the last): 16 groups per step, one branch per dtype. */
static void few_params(const qmm_args *a, int kind, int64_t n, float *s, float *z) {
  const int64_t groups = a->in_features / a->group_size, padded = dot_align(groups);
  const int pair = kind != DOT_INT8;
  const int64_t first = (n * groups) << pair;
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26,
                                         28, 30);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  for (int64_t g = 0; g < padded; g += 16) {
    const int64_t left = groups - g < 16 ? (groups - g > 0 ? groups - g : 0) : 16;
    const __mmask16 m16 = (__mmask16)((1u << left) - 1);
    const __mmask32 m32 = (__mmask32)(((uint64_t)1 << (2 * left)) - 1);
    __m512 sv, zv = _mm512_setzero_ps();
    switch (a->params_dtype) {
      case PARAMS_BF16: {
        const bf16_t *p = (const bf16_t *)a->params + first + (g << pair);
        if (pair) {
          const __m512i v = _mm512_maskz_loadu_epi16(m32, p);
          sv = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
          zv = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xffff0000)));
        } else {
          sv = _mm512_castsi512_ps(_mm512_slli_epi32(
              _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m16, p)), 16));
        }
        break;
      }
      case PARAMS_F16: {
        const uint16_t *p = (const uint16_t *)a->params + first + (g << pair);
        if (pair) {
          const __m512i v = _mm512_maskz_loadu_epi16(m32, p);
          const __m512 lo = _mm512_cvtph_ps(_mm512_castsi512_si256(v));
          const __m512 hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(v, 1));
          sv = _mm512_permutex2var_ps(lo, even, hi);
          zv = _mm512_permutex2var_ps(lo, odd, hi);
        } else {
          sv = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m16, p));
        }
        break;
      }
      default: {
        const float *p = (const float *)a->params + first + (g << pair);
        if (pair) {
          const __m512 lo = _mm512_maskz_loadu_ps((__mmask16)m32, p);
          const __m512 hi = _mm512_maskz_loadu_ps((__mmask16)(m32 >> 16), p + 16);
          sv = _mm512_permutex2var_ps(lo, even, hi);
          zv = _mm512_permutex2var_ps(lo, odd, hi);
        } else {
          sv = _mm512_maskz_loadu_ps(m16, p);
        }
      }
    }
    _mm512_storeu_ps(s + g, sv);
    if (z) _mm512_storeu_ps(z + g, zv);
  }
}

/* Chunk c of a column's codes (q: the column's first) as wa, wb (above); ``half``: a last
 * chunk of 32 columns. */
INLINE void few_codes(const void *q, int kind, int64_t c, int half, __m512i *wa,
                      __m512i *wb) {
  if (kind == DOT_INT4) {
    /* q - 8 for q = 0 .. 15 in bfloat16, indexed by the low 5 bits of each word */
    const __m512i values = _mm512_set_epi16(
        0x40e0, 0x40c0, 0x40a0, 0x4080, 0x4040, 0x4000, 0x3f80, 0, (short)0xbf80,
        (short)0xc000, (short)0xc040, (short)0xc080, (short)0xc0a0, (short)0xc0c0,
        (short)0xc0e0, (short)0xc100, 0x40e0, 0x40c0, 0x40a0, 0x4080, 0x4040, 0x4000, 0x3f80,
        0, (short)0xbf80, (short)0xc000, (short)0xc040, (short)0xc080, (short)0xc0a0,
        (short)0xc0c0, (short)0xc0e0, (short)0xc100);
    const uint8_t *p = (const uint8_t *)q + c * 32;
    const __m256i bytes = half ? _mm256_maskz_loadu_epi8(0xffff, p)
                               : _mm256_loadu_si256((const __m256i *)p);
    const __m512i v = _mm512_cvtepu8_epi16(bytes);
    *wa = _mm512_permutexvar_epi16(_mm512_and_si512(v, _mm512_set1_epi16(0x0f)), values);
    *wb = _mm512_permutexvar_epi16(_mm512_srli_epi16(v, 4), values);
  } else {
    const int8_t *p = (const int8_t *)q + c * 64;
#define FEW_WIDEN(i) \
  _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + (i)))))
    const __m512 a0 = FEW_WIDEN(0), a1 = FEW_WIDEN(16);
    const __m512 b0 = half ? _mm512_setzero_ps() : FEW_WIDEN(32);
    const __m512 b1 = half ? _mm512_setzero_ps() : FEW_WIDEN(48);
#undef FEW_WIDEN
    *wa = (__m512i)_mm512_cvtne2ps_pbh(b0, a0);
    *wb = (__m512i)_mm512_cvtne2ps_pbh(b1, a1);
  }
}

/* Chunk c for rows m0 .. m0 + R - 1 and the tile's columns into total (R, MODE and HALF,
 * a last chunk of 32 columns, constants after inlining). */
INLINE void few_chunk(const qmm_args *a, int kind, int MODE, int R, int HALF, int64_t c,
                      int64_t m0, const bf16_t *xp, const char *const *codes, const float *s,
                      __m512 total[FEW_TILE][FEW_COLS]) {
  const int64_t chunks = few_chunks(a), gs = a->group_size;
  const int64_t padded = dot_align(a->in_features / gs);
  __m512bh xa[FEW_TILE], xb[FEW_TILE];
#pragma GCC unroll 4
  for (int r = 0; r < R; r++) {
    const bf16_t *x = xp + ((m0 + r) * chunks + c) * 64;
    xa[r] = (__m512bh)_mm512_loadu_si512((const void *)x);
    xb[r] = (__m512bh)_mm512_loadu_si512((const void *)(x + 32));
  }
  /* the scales' lanes, picked from 16 groups' scales: FEW_PAIR (groups of 32) lanes 0..7 the
   * group of column 64 c, lanes 8..15 of 64 c + 32; FEW_HALF (of 16) ia for wa's lanes, ib
   * for wb's; FEW_WIDE: one group */
  __m512i ia = _mm512_setzero_si512(), ib = ia;
  int64_t first = 0;
  if (MODE == FEW_PAIR) {
    const int g = (int)(2 * (c & 7));
    ia = _mm512_mask_blend_epi32(0xff00, _mm512_set1_epi32(g), _mm512_set1_epi32(g + 1));
    first = 16 * (c >> 3);
  } else if (MODE == FEW_HALF) {
    const int g = (int)(4 * (c & 3));
    ia = _mm512_mask_blend_epi32(0xff00, _mm512_set1_epi32(g), _mm512_set1_epi32(g + 2));
    ib = _mm512_mask_blend_epi32(0xff00, _mm512_set1_epi32(g + 1), _mm512_set1_epi32(g + 3));
    first = 16 * (c >> 2);
  } else if (MODE == FEW_WIDE) {
    first = c * 64 / gs;
  }
#pragma GCC unroll 4
  for (int j = 0; j < FEW_COLS; j++) {
    __m512i wa, wb;
    few_codes(codes[j], kind, c, HALF, &wa, &wb);
    const float *sj = s + j * padded;
    if (MODE == FEW_ONE) {
#pragma GCC unroll 4
      for (int r = 0; r < R; r++)
        total[r][j] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(total[r][j], (__m512bh)wa, xa[r]),
                                       (__m512bh)wb, xb[r]);
    } else if (MODE == FEW_HALF) {
      const __m512 sixteen = _mm512_loadu_ps(sj + first);
      const __m512 sa = _mm512_permutexvar_ps(ia, sixteen), sb = _mm512_permutexvar_ps(ib, sixteen);
#pragma GCC unroll 4
      for (int r = 0; r < R; r++) {
        total[r][j] = _mm512_fmadd_ps(
            _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)wa, xa[r]), sa, total[r][j]);
        total[r][j] = _mm512_fmadd_ps(
            _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)wb, xb[r]), sb, total[r][j]);
      }
    } else {
      const __m512 sv = MODE == FEW_PAIR ? _mm512_permutexvar_ps(ia, _mm512_loadu_ps(sj + first))
                                         : _mm512_set1_ps(sj[first]);
#pragma GCC unroll 4
      for (int r = 0; r < R; r++) {
        const __m512 t = _mm512_dpbf16_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(),
                                                           (__m512bh)wa, xa[r]),
                                          (__m512bh)wb, xb[r]);
        total[r][j] = _mm512_fmadd_ps(t, sv, total[r][j]);
      }
    }
  }
}

/* Rows m0 .. m0 + R - 1 times columns n0 .. n0 + FEW_COLS - 1 (s, z: their params from
 * few_params, each ``padded`` long), into out (plus the bias), R and MODE constants after
 * inlining. */
INLINE void few_tile(const qmm_args *a, int kind, int MODE, int R, int64_t m0, int64_t n0,
                     const bf16_t *xp, const float *xs, const float *s, const float *z) {
  const int64_t K = a->in_features, N = a->out_features, full = K / 64;
  const int64_t gs = a->group_size, padded = dot_align(K / gs);
  const int64_t row_bytes = kind == DOT_INT4 ? K / 2 : K;
  const char *codes[FEW_COLS];
  for (int j = 0; j < FEW_COLS; j++) /* columns past the last read column n0's codes */
    codes[j] = (const char *)a->codes + (n0 + j < N ? n0 + j : n0) * row_bytes;
  __m512 total[FEW_TILE][FEW_COLS];
#pragma GCC unroll 4
  for (int r = 0; r < R; r++)
#pragma GCC unroll 4
    for (int j = 0; j < FEW_COLS; j++) total[r][j] = _mm512_setzero_ps();
  for (int64_t c = 0; c < full; c++) few_chunk(a, kind, MODE, R, 0, c, m0, xp, codes, s, total);
  if (K % 64) few_chunk(a, kind, MODE, R, 1, full, m0, xp, codes, s, total);
  const int cols = N - n0 < FEW_COLS ? (int)(N - n0) : FEW_COLS;
#pragma GCC unroll 4
  for (int r = 0; r < R; r++)
#pragma GCC unroll 4
    for (int j = 0; j < FEW_COLS; j++) {
      __m512 t = total[r][j];
      if (MODE == FEW_ONE) t = _mm512_mul_ps(t, _mm512_set1_ps(s[j * padded]));
      if (z) /* the zero terms: zero times the group's sum of x, 16 groups a vector */
        for (int64_t g = 0; g < padded; g += 16)
          t = _mm512_fmadd_ps(_mm512_loadu_ps(z + j * padded + g),
                              _mm512_loadu_ps(xs + (m0 + r) * padded + g), t);
      if (j >= cols) continue;
      float v = _mm512_reduce_add_ps(t);
      if (a->bias) v += a->bias[n0 + j];
      ((bf16_t *)a->out)[(m0 + r) * N + n0 + j] = f32_to_bf16(v);
    }
}

#define FEW_ROW_TILES(kind, MODE)                                                           \
  for (int64_t m0 = 0; m0 < M; m0 += FEW_TILE) {                                            \
    const int R = M - m0 < FEW_TILE ? (int)(M - m0) : FEW_TILE;                             \
    if (R == 4) few_tile(a, kind, MODE, 4, m0, n0, xp, xs, s, z);                           \
    else if (R == 3) few_tile(a, kind, MODE, 3, m0, n0, xp, xs, s, z);                      \
    else if (R == 2) few_tile(a, kind, MODE, 2, m0, n0, xp, xs, s, z);                      \
    else few_tile(a, kind, MODE, 1, m0, n0, xp, xs, s, z);                                  \
  }

#define FEW_MODES(kind)                                                                     \
  {                                                                                         \
    if (mode == FEW_ONE) FEW_ROW_TILES(kind, FEW_ONE)                                       \
    else if (mode == FEW_PAIR) FEW_ROW_TILES(kind, FEW_PAIR)                                \
    else if (mode == FEW_HALF) FEW_ROW_TILES(kind, FEW_HALF)                                \
    else FEW_ROW_TILES(kind, FEW_WIDE)                                                      \
  }

static void few_gemm(const qmm_args *a, int kind) {
  const int64_t M = a->rows, N = a->out_features, K = a->in_features, gs = a->group_size;
  const int64_t padded = dot_align(K / gs), tiles = (N + FEW_COLS - 1) / FEW_COLS;
  const int zeros = kind != DOT_INT8;
  const int mode = K / gs == 1 ? FEW_ONE : gs == 16 ? FEW_HALF : gs == 32 ? FEW_PAIR : FEW_WIDE;
  bf16_t *xp = (bf16_t *)a->workspace;
  float *xs = zeros ? a->workspace + dot_align(M * few_chunks(a) * 32) : NULL;
  float *own = a->workspace + dot_align(M * few_chunks(a) * 32) +
               (zeros ? dot_align(M * padded) : 0);
  few_pack_rows(a, xp, xs);
  const int64_t row_bytes = kind == DOT_INT4 ? K / 2 : K;
  const int64_t params_per_row = (K / gs) << (kind != DOT_INT8);
#pragma omp parallel num_threads(a->num_threads)
  {
    float *s = own + dot_thread() * 2 * FEW_COLS * padded;
    float *z = zeros ? s + FEW_COLS * padded : NULL;
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
      const int64_t n0 = t * FEW_COLS;
      for (int j = 0; j < FEW_COLS; j++) {
        prefetch_column(a, n0 + j, row_bytes, params_per_row);
        few_params(a, kind, n0 + j < N ? n0 + j : n0, s + j * padded, z ? z + j * padded : NULL);
      }
      if (kind == DOT_INT4) FEW_MODES(DOT_INT4) /* kind and MODE constants in each copy */
      else if (kind == DOT_INT8) FEW_MODES(DOT_INT8)
      else FEW_MODES(DOT_INT8_ZERO)
    }
  }
}

int64_t dot_gemm_workspace(const qmm_args *a, int64_t kind) {
  return dot_few(a) ? few_workspace(a, kind != DOT_INT8) : dot_workspace(a, kind != DOT_INT8);
}
void int4_dot_gemm(const qmm_args *a) { dot_gemm(a, DOT_INT4); }
void int8_dot_gemm(const qmm_args *a) { dot_gemm(a, DOT_INT8); }
void int8_zero_dot_gemm(const qmm_args *a) { dot_gemm(a, DOT_INT8_ZERO); }
#endif

/* Dequantized rows [row0, row0 + count) of W as float32 [count, K]: the large-batch path,
 * where a float32 GEMM on a cache-sized slice of W beats widening each weight per tile. */
void int4_dequantize(const qmm_args *a, int64_t row0, int64_t count, float *out) {
  const int64_t K = a->in_features, gs = a->group_size, groups = K / gs;
#pragma omp parallel for schedule(static) num_threads(a->num_threads)
  for (int64_t n = row0; n < row0 + count; n++) {
    const uint8_t *q = (const uint8_t *)a->codes + n * (K / 2);
    float *w = out + (n - row0) * K;
    for (int64_t g = 0; g < groups; g++) {
      const float scale = param(a->params, (n * groups + g) * 2, a->params_dtype);
      const float zero = param(a->params, (n * groups + g) * 2 + 1, a->params_dtype);
      for (int64_t k = g * gs; k < (g + 1) * gs; k += 32)
        for (int j = 0; j < 16; j++) {
          w[k + j] = ((float)(q[k / 2 + j] & 0x0f) - 8.0f) * scale + zero;
          w[k + j + 16] = ((float)(q[k / 2 + j] >> 4) - 8.0f) * scale + zero;
        }
    }
  }
}

void int8_dequantize(const qmm_args *a, int64_t row0, int64_t count, float *out) {
  const int64_t K = a->in_features, gs = a->group_size, groups = K / gs;
#pragma omp parallel for schedule(static) num_threads(a->num_threads)
  for (int64_t n = row0; n < row0 + count; n++) {
    const int8_t *q = (const int8_t *)a->codes + n * K;
    for (int64_t g = 0; g < groups; g++) {
      const float scale = param(a->params, n * groups + g, a->params_dtype);
      for (int64_t k = g * gs; k < (g + 1) * gs; k++) out[(n - row0) * K + k] = (float)q[k] * scale;
    }
  }
}

void int8_zero_dequantize(const qmm_args *a, int64_t row0, int64_t count, float *out) {
  const int64_t K = a->in_features, gs = a->group_size, groups = K / gs;
#pragma omp parallel for schedule(static) num_threads(a->num_threads)
  for (int64_t n = row0; n < row0 + count; n++) {
    const int8_t *q = (const int8_t *)a->codes + n * K;
    for (int64_t g = 0; g < groups; g++) {
      const float scale = param(a->params, (n * groups + g) * 2, a->params_dtype);
      const float zero = param(a->params, (n * groups + g) * 2 + 1, a->params_dtype);
      for (int64_t k = g * gs; k < (g + 1) * gs; k++)
        out[(n - row0) * K + k] = (float)q[k] * scale + zero;
    }
  }
}

/* Rows index[0..count) of symmetric int8 codes in pack_int8_panels' layout (quant_panels.py:
 * column n's code at k is byte (n / 16) * 512 K / 32 + 512 (k / 32) + 64 (k % 32 / 4) + 4 (n % 16)
 * + k % 4 of the panels, plus 128) times their scales, params [N, K / group_size] in the rows'
 * layout: out [count, K] float32, or rounded once to bfloat16 (out_bf16), as Int8Weight.rows'
 * torch ops compute them (a tied embedding's lookups, one call instead of ten ops). Returns
 * how many ids lie outside [0, N) (those rows are left unwritten). */
int64_t int8_panel_dequantize_rows(const qmm_args *a, const int64_t *index, int64_t count,
                                   void *out, int32_t out_bf16) {
  const int64_t N = a->out_features, K = a->in_features, gs = a->group_size;
  int64_t bad = 0;
#pragma omp parallel for schedule(static) num_threads(a->num_threads) reduction(+ : bad) \
    if (count > 16)
  for (int64_t t = 0; t < count; t++) {
    const int64_t n = index[t];
    if (n < 0 || n >= N) {
      bad++;
      continue;
    }
    const uint8_t *column = (const uint8_t *)a->codes + (n / 16) * (K / 32) * 512 + 4 * (n % 16);
    for (int64_t k = 0; k < K; k++) {
      const float v = (float)((int)column[(k / 32) * 512 + (k % 32) / 4 * 64 + k % 4] - 128) *
                      param(a->params, n * (K / gs) + k / gs, a->params_dtype);
      if (out_bf16)
        ((bf16_t *)out)[t * K + k] = f32_to_bf16(v);
      else
        ((float *)out)[t * K + k] = v;
    }
  }
  return bad;
}

/* x [M, K] rounded as quantize_activations rounds it, as float32 codes times their scales
 * into out [M, K]: the rows the float loops multiply for int8 activations from
 * quant_matmul.INTEGER_ROWS rows on. */
void round_activations(const qmm_args *a, float *out) {
  const int64_t K = a->in_features;
  for (int64_t m = 0; m < a->rows; m++)
    for (int64_t b = 0; b < K / 32; b++) {
      int8_t q[32];
      float d;
      quantize_block(a->x, m * a->x_stride + b * 32, a->x_bf16, q, &d);
      for (int j = 0; j < 32; j++) out[m * K + b * 32 + j] = (float)q[j] * d;
    }
}

/* Bit 0: the AVX2 inner loops are built in; bit 1: the build may use AVX-512; bit 2: the int8
 * activations' AVX512-VNNI loop; bit 3: the AVX512-BF16 products (int4_dot_gemm and its
 * kin). */
int quant_matmul_features(void) {
  int f = QMM_AVX2;
#ifdef __AVX512F__
  f |= 2;
#endif
#ifdef QMM_VNNI
  f |= 4;
#endif
#ifdef QMM_DOT
  f |= 8;
#endif
  return f;
}
