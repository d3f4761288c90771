/* Elementwise layer ops for the CPU, bit-identical to the eager torch ops transformers runs
   (cpu_ops.py loads this file; tests/model/test_cpu_ops.py compares every output bit).
   Each does in one pass per row what takes torch several tensor ops, each a dispatch and a
   round trip through memory: most of what a small-batch decode step spent outside its
   matmuls.

   RMSNorm, optionally fused with the residual add before it:

     h   = residual + x                      (rounded to the dtype: the new residual)
     v   = sum(float(h)^2) / n + eps         (float32; the sum in torch's order, below)
     y   = round(float(h) * (1 / sqrt(v)))   (rounded to the dtype)
     out = round(weight * y)

   The sum must add the squares in the order of torch's CPU sum over a contiguous row
   (aten/src/ATen/native/cpu/SumKernel.cpp, vectorized_inner_sum): `lanes`-wide vectors, four
   interleaved vector accumulators, each a cascade of up to four levels, folded 0 += 1, 2, 3;
   then the scalar tail, then the lanes one by one. A float32 sum in another order differs in
   the last bit often enough to flip bfloat16 roundings. Which vector width torch's sum runs
   with depends on its build and the CPU (8 floats on an AVX-512 CPU with torch 2.13), so the
   caller finds it by comparing row_sum_f32 with torch.sum and does not use this file when no
   width matches.

   Rotary embedding (rotate-half pairing), in place:

     x[i]     = round(round(x[i] * cos[i])         + round(-x[i + D/2] * sin[i]))
     x[i+D/2] = round(round(x[i + D/2] * cos[i+D/2]) + round(x[i] * sin[i+D/2]))

   which is transformers' x * cos + rotate_half(x) * sin, rounding where its ops round.

   SiLU and multiply (bfloat16 only), at the end of the file. */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

typedef uint16_t bf16_t;

static inline float bf16_to_f32(bf16_t v) {
  const uint32_t u = (uint32_t)v << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

static inline bf16_t f32_to_bf16(float f) { /* round to nearest even, as torch */
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  if (f != f) return 0x7fc0;
  return (bf16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

enum { MAX_LANES = 16, ILP = 4, LEVELS = 4 };

static int64_t ceil_log2(int64_t x) {
  if (x <= 2) return 1;
  int64_t bits = 0;
  for (uint64_t v = (uint64_t)(x - 1); v; v >>= 1) bits++;
  return bits;
}

/* torch's multi_row_sum for ILP interleaved vectors: acc[k] = sum over i of vec[i * ILP + k]
   with the cascade of levels; lanes of one vector are independent. */
static void multi_row_sum(const float* x, int64_t groups, int64_t lanes, float out[ILP][MAX_LANES]) {
  float acc[LEVELS][ILP][MAX_LANES];
  memset(acc, 0, sizeof acc);
  const int64_t power = ceil_log2(groups) / LEVELS > 4 ? ceil_log2(groups) / LEVELS : 4;
  const int64_t step = (int64_t)1 << power, mask = step - 1;
  int64_t i = 0;
  for (; i + step <= groups;) {
    for (int64_t j = 0; j < step; j++, i++)
      for (int64_t k = 0; k < ILP; k++)
        for (int64_t l = 0; l < lanes; l++) acc[0][k][l] += x[(i * ILP + k) * lanes + l];
    for (int64_t j = 1; j < LEVELS; j++) {
      for (int64_t k = 0; k < ILP; k++)
        for (int64_t l = 0; l < lanes; l++) {
          acc[j][k][l] += acc[j - 1][k][l];
          acc[j - 1][k][l] = 0.0f;
        }
      if ((i & (mask << (j * power))) != 0) break;
    }
  }
  for (; i < groups; i++)
    for (int64_t k = 0; k < ILP; k++)
      for (int64_t l = 0; l < lanes; l++) acc[0][k][l] += x[(i * ILP + k) * lanes + l];
  for (int64_t j = 1; j < LEVELS; j++)
    for (int64_t k = 0; k < ILP; k++)
      for (int64_t l = 0; l < lanes; l++) acc[0][k][l] += acc[j][k][l];
  memcpy(out, acc[0], sizeof acc[0]);
}

/* sum of x[0, n) in torch's order for a contiguous row (see the top of the file). */
static float torch_row_sum(const float* x, int64_t n, int64_t lanes) {
  if (n < lanes) lanes = 1; /* torch's scalar_inner_sum: the same cascade over elements */
  const int64_t vectors = n / lanes, groups = vectors / ILP;
  float part[ILP][MAX_LANES];
  multi_row_sum(x, groups, lanes, part);
  for (int64_t v = groups * ILP; v < vectors; v++)
    for (int64_t l = 0; l < lanes; l++) part[0][l] += x[v * lanes + l];
  for (int64_t k = 1; k < ILP; k++)
    for (int64_t l = 0; l < lanes; l++) part[0][l] += part[k][l];
  float total = 0.0f;
  for (int64_t t = vectors * lanes; t < n; t++) total += x[t];
  for (int64_t l = 0; l < lanes; l++) total += part[0][l];
  return total;
}

float row_sum_f32(const float* x, int64_t n, int64_t lanes) {
  return torch_row_sum(x, n, lanes);
}

typedef struct {
  const void* x;      /* [rows, n] contiguous */
  void* residual;     /* [rows, n] contiguous, or NULL; with it, residual + x is normalised and
                         stored back into residual */
  const void* weight; /* [n] */
  void* out;          /* [rows, n] contiguous */
  float* scratch;     /* 2 n floats per thread */
  int64_t rows, n, lanes, num_threads;
  float eps;
} rms_args;

/* float(h) of one row into h, its squares into sq; returns 1 / sqrt(mean + eps). */
static float inverse_rms(float* h, float* sq, int64_t n, int64_t lanes, float eps) {
  for (int64_t i = 0; i < n; i++) sq[i] = h[i] * h[i];
  const float variance = torch_row_sum(sq, n, lanes) / (float)n + eps;
  return 1.0f / sqrtf(variance);
}

static inline float f32_id(float v) { return v; }

/* LOAD widens a T to float, STORE rounds a float to T (identity for float32). */
#define DEFINE_RMS_NORM(NAME, T, LOAD, STORE)                                                \
void NAME(const rms_args* a) {                                                               \
  const int64_t n = a->n;                                                                    \
  _Pragma("omp parallel for num_threads(a->num_threads) schedule(static) if (a->rows > 1)")  \
  for (int64_t r = 0; r < a->rows; r++) {                                                    \
    const T* x = (const T*)a->x + r * n;                                                     \
    T* res = a->residual ? (T*)a->residual + r * n : 0;                                      \
    const T* w = (const T*)a->weight;                                                        \
    T* out = (T*)a->out + r * n;                                                             \
    float* h = a->scratch + 2 * n * omp_get_thread_num();                                    \
    for (int64_t i = 0; i < n; i++) {                                                        \
      if (res) res[i] = STORE(LOAD(res[i]) + LOAD(x[i]));                                    \
      h[i] = LOAD(res ? res[i] : x[i]);                                                      \
    }                                                                                        \
    const float inv = inverse_rms(h, h + n, n, a->lanes, a->eps);                            \
    for (int64_t i = 0; i < n; i++) out[i] = STORE(LOAD(w[i]) * LOAD(STORE(h[i] * inv)));    \
  }                                                                                          \
}

DEFINE_RMS_NORM(rms_norm_bf16, bf16_t, bf16_to_f32, f32_to_bf16)
DEFINE_RMS_NORM(rms_norm_f32, float, f32_id, f32_id)

typedef struct {
  void* x;         /* [tokens, heads, head_dim], rows of head_dim contiguous */
  const void* cos; /* [tokens, head_dim] contiguous */
  const void* sin;
  int64_t tokens, heads, head_dim, token_stride, num_threads;
} rope_args;

#define DEFINE_ROTARY(NAME, T, LOAD, STORE)                                                  \
void NAME(const rope_args* a) {                                                              \
  const int64_t D = a->head_dim, half = D / 2;                                               \
  _Pragma("omp parallel for num_threads(a->num_threads) schedule(static) if (a->tokens > 1)") \
  for (int64_t t = 0; t < a->tokens; t++) {                                                  \
    const T* c = (const T*)a->cos + t * D;                                                   \
    const T* s = (const T*)a->sin + t * D;                                                   \
    for (int64_t h = 0; h < a->heads; h++) {                                                 \
      T* x = (T*)a->x + t * a->token_stride + h * D;                                         \
      for (int64_t i = 0; i < half; i++) {                                                   \
        const float x1 = LOAD(x[i]), x2 = LOAD(x[i + half]);                                 \
        x[i] = STORE(LOAD(STORE(x1 * LOAD(c[i]))) + LOAD(STORE(-x2 * LOAD(s[i]))));          \
        x[i + half] = STORE(LOAD(STORE(x2 * LOAD(c[i + half])))                              \
                            + LOAD(STORE(x1 * LOAD(s[i + half]))));                          \
      }                                                                                      \
    }                                                                                        \
  }                                                                                          \
}

DEFINE_ROTARY(rotary_bf16, bf16_t, bf16_to_f32, f32_to_bf16)
DEFINE_ROTARY(rotary_f32, float, f32_id, f32_id)

/* SiLU and multiply for bfloat16: out = round(round(silu(gate)) * up), gate and up the two
   halves of each row of the gate/up projection.

   torch computes silu(x) = x / (1 + exp(-x)) in float32 with a vectorised exp (and libm's expf
   in loop tails); for every finite bfloat16 input, libm's expf gives the same bfloat16 result
   as torch's vectorised one (checked over all 65,280 finite inputs; the test checks it again
   against the torch build in use), so silu is a 65,536-entry table indexed by the input's bits,
   built once with libm's expf. */
static bf16_t silu_table[65536];
static int silu_table_ready = 0;

void silu_table_init(void) {
  if (silu_table_ready) return;
  for (int64_t bits = 0; bits < 65536; bits++) {
    const float x = bf16_to_f32((bf16_t)bits);
    silu_table[bits] = f32_to_bf16(x / (1.0f + expf(-x)));
  }
  silu_table_ready = 1;
}

typedef struct {
  const void* gate_up; /* [rows, 2 * n]: gate then up, rows row_stride elements apart */
  void* out;           /* [rows, n] contiguous */
  int64_t rows, n, row_stride, num_threads;
} silu_args;

void silu_and_mul_bf16(const silu_args* a) {
  const int64_t n = a->n;
#pragma omp parallel for num_threads(a->num_threads) schedule(static) if (a->rows > 1)
  for (int64_t r = 0; r < a->rows; r++) {
    const bf16_t* gate = (const bf16_t*)a->gate_up + r * a->row_stride;
    const bf16_t* up = gate + n;
    bf16_t* out = (bf16_t*)a->out + r * n;
    for (int64_t i = 0; i < n; i++)
      out[i] = f32_to_bf16(bf16_to_f32(silu_table[gate[i]]) * bf16_to_f32(up[i]));
  }
}
