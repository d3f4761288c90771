/* Probe for a design question, not part of the package: would a K layout with the keys of a
   block in SIMD lanes make the AVX2 score loop of the 8-bit kernels cheaper?

       gcc -O3 -march=native -o /tmp/probe benchmarks/k_layout_probe.c -lm && /tmp/probe 8192 21
       gcc -O3 -march=native -DE4M3 -o /tmp/probe benchmarks/k_layout_probe.c -lm && /tmp/probe 8192 21

   Scores of 3 query heads (float32 rows) over blocks of 16 keys x 4 KV heads, head_dim 64,
   8-bit codes (int8, or fp8 e4m3 with -DE4M3) and a bfloat16 scale per row:
   - "rows": the cache's layout ([block, key, KV head, head_dim + 2] bytes) and the loop of
     paged_decode.c's AVX2 kernels (4 keys x 3 heads of 8-lane partial sums, each reduced by a
     transposing add tree, sum4);
   - "lanes": per (block, KV head), dimension d of the 16 keys together (head_dim x 16 bytes),
     then the 16 scales: per dimension, each head's query entry broadcast and two 8-key FMAs; no
     horizontal sums, the scales applied as two vectors.
   The argument is the number of blocks (256: ~1 MB, in L2/L3; 8192: ~35 MB, from memory); each
   layout's blocks are prefetched two ahead, as the kernel does. Prints the fastest of the
   rounds (the two layouts alternate within each round) as ns per key and KV head, and their
   ratio, and the largest difference between the two layouts' scores (float rounding: the sums
   run in another order). Random codes and scales (seed 1). */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <time.h>

#ifdef E4M3
#define FORMAT "e4m3"
#else
#define FORMAT "int8"
#endif
#define D 64
#define BS 16
#define KVH 4
#define G 3
#define R (D + 2)

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + 1e-9 * t.tv_nsec;
}
static inline float bf(const uint8_t* p) {
  uint32_t u = (uint32_t)(p[0] | (p[1] << 8)) << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}
#ifdef E4M3
static inline __m256 cvt8(const int8_t* p) {
  const __m128i x = _mm_slli_epi16(_mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i*)p)), 7);
  return _mm256_cvtph_ps(_mm_and_si128(x, _mm_set1_epi16((short)0xBF80)));
}
static inline void cvt16(__m128i b, __m256* x0, __m256* x1) {
  const __m256i x = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(b), 7),
                                     _mm256_set1_epi16((short)0xBF80));
  *x0 = _mm256_cvtph_ps(_mm256_castsi256_si128(x));
  *x1 = _mm256_cvtph_ps(_mm256_extracti128_si256(x, 1));
}
#else
static inline __m256 cvt8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}
static inline void cvt16(__m128i b, __m256* x0, __m256* x1) {
  *x0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
  *x1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
}
#endif
/* paged_decode.c's sum4 and score loop, copied so that the probe builds on its own */
static inline __m128 sum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 s01 = _mm256_add_ps(_mm256_unpacklo_ps(a0, a1), _mm256_unpackhi_ps(a0, a1));
  const __m256 s23 = _mm256_add_ps(_mm256_unpacklo_ps(a2, a3), _mm256_unpackhi_ps(a2, a3));
  const __m256d x = _mm256_castps_pd(s01), y = _mm256_castps_pd(s23);
  const __m256 h = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(x, y)),
                                 _mm256_castpd_ps(_mm256_unpackhi_pd(x, y)));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// rows: block of BS x KVH rows of R bytes; head h's rows at stride KVH * R
__attribute__((noinline)) static void score_rows(const float* qf, const uint8_t* k, float* out) {
  const int64_t ks = KVH * R;
  for (int i = 0; i < BS; i += 4) {
    __m256 acc[G][4];
    for (int g = 0; g < G; g++)
      for (int u = 0; u < 4; u++) acc[g][u] = _mm256_setzero_ps();
#pragma GCC unroll 8
    for (int c = 0; c < D / 8; c++) {
      __m256 qc[G];
      for (int g = 0; g < G; g++) qc[g] = _mm256_loadu_ps(qf + g * D + 8 * c);
      for (int u = 0; u < 4; u++) {
        const __m256 x = cvt8((const int8_t*)k + (i + u) * ks + 8 * c);
        for (int g = 0; g < G; g++) acc[g][u] = _mm256_fmadd_ps(qc[g], x, acc[g][u]);
      }
    }
    const __m128 s = _mm_setr_ps(bf(k + i * ks + D), bf(k + (i + 1) * ks + D),
                                 bf(k + (i + 2) * ks + D), bf(k + (i + 3) * ks + D));
    for (int g = 0; g < G; g++)
      _mm_storeu_ps(out + g * 64 + i, _mm_mul_ps(sum4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]), s));
  }
}

// lanes: per (block, head) D x BS bytes (dimension d of the 16 keys together), then BS bf16 scales
#define TB (D * BS + 2 * BS)
__attribute__((noinline)) static void score_lanes(const float* qf, const uint8_t* k, float* out) {
  __m256 acc[G][2];
  for (int g = 0; g < G; g++) acc[g][0] = acc[g][1] = _mm256_setzero_ps();
#pragma GCC unroll 8
  for (int d = 0; d < D; d++) {
    const __m128i b = _mm_loadu_si128((const __m128i*)(k + d * BS));
    __m256 x0, x1;
    cvt16(b, &x0, &x1);
    for (int g = 0; g < G; g++) {
      const __m256 q = _mm256_broadcast_ss(qf + g * D + d);
      acc[g][0] = _mm256_fmadd_ps(q, x0, acc[g][0]);
      acc[g][1] = _mm256_fmadd_ps(q, x1, acc[g][1]);
    }
  }
  const __m256i sc = _mm256_slli_epi32(
      _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(k + D * BS))), 16);
  const __m256i sc1 = _mm256_slli_epi32(
      _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(k + D * BS + 16))), 16);
  for (int g = 0; g < G; g++) {
    _mm256_storeu_ps(out + g * 64, _mm256_mul_ps(acc[g][0], _mm256_castsi256_ps(sc)));
    _mm256_storeu_ps(out + g * 64 + 8, _mm256_mul_ps(acc[g][1], _mm256_castsi256_ps(sc1)));
  }
}

int main(int argc, char** argv) {
  const int64_t nblocks = argc > 1 ? atoll(argv[1]) : 512;  // per layout
  const int reps = argc > 2 ? atoi(argv[2]) : 20;
  uint8_t* rows = aligned_alloc(64, nblocks * BS * KVH * R + 64);
  uint8_t* lanes = aligned_alloc(64, nblocks * KVH * TB + 64);
  srand(1);
  for (int64_t i = 0; i < nblocks * BS * KVH * R; i++) rows[i] = rand();
  for (int64_t r = 0; r < nblocks * BS * KVH; r++) {  /* scales 2^-7 .. 2^-4 */
    rows[r * R + D] = 0;
    rows[r * R + D + 1] = 0x3c + rand() % 4;
#ifdef E4M3
    for (int d = 0; d < D; d++)  /* no NaN codes (the quantizer never stores them) */
      if ((rows[r * R + d] & 0x7f) == 0x7f) rows[r * R + d] ^= 1;
#endif
  }
  /* the same codes and scales in the lanes layout */
  for (int64_t b = 0; b < nblocks; b++)
    for (int h = 0; h < KVH; h++)
      for (int i = 0; i < BS; i++) {
        const uint8_t* row = rows + ((b * BS + i) * KVH + h) * R;
        uint8_t* t = lanes + (b * KVH + h) * TB;
        for (int d = 0; d < D; d++) t[d * BS + i] = row[d];
        t[D * BS + 2 * i] = row[D];
        t[D * BS + 2 * i + 1] = row[D + 1];
      }
  float qf[G * D], out[G * 64], out2[G * 64];
  for (int i = 0; i < G * D; i++) qf[i] = (rand() % 1000) / 500.0f - 1.0f;
  double max_diff = 0, max_score = 0;  /* the two layouts' scores, every block */
  for (int64_t b = 0; b < nblocks; b++)
    for (int h = 0; h < KVH; h++) {
      score_rows(qf, rows + b * BS * KVH * R + h * R, out);
      score_lanes(qf, lanes + (b * KVH + h) * TB, out2);
      for (int g = 0; g < G; g++)
        for (int i = 0; i < BS; i++) {
          const double x = out[g * 64 + i], y = out2[g * 64 + i];
          if (fabs(x - y) > max_diff) max_diff = fabs(x - y);
          if (fabs(x) > max_score) max_score = fabs(x);
        }
    }
  double best_r = 1e9, best_l = 1e9, sink = 0;
  for (int rep = 0; rep < reps; rep++) {
    double t = now();
    for (int64_t b = 0; b < nblocks; b++) {
      if (b + 2 < nblocks)
        for (int64_t l = 0; l < BS * KVH * R; l += 64) __builtin_prefetch(rows + (b + 2) * BS * KVH * R + l, 0, 1);
      for (int h = 0; h < KVH; h++) { score_rows(qf, rows + b * BS * KVH * R + h * R, out); sink += out[5]; }
    }
    double tr = now() - t;
    t = now();
    for (int64_t b = 0; b < nblocks; b++) {
      if (b + 2 < nblocks)
        for (int64_t l = 0; l < KVH * TB; l += 64) __builtin_prefetch(lanes + (b + 2) * KVH * TB + l, 0, 1);
      for (int h = 0; h < KVH; h++) { score_lanes(qf, lanes + (b * KVH + h) * TB, out); sink += out[5]; }
    }
    double tl = now() - t;
    if (tr < best_r) best_r = tr;
    if (tl < best_l) best_l = tl;
  }
  const double per = 1e9 / (nblocks * BS * KVH);
  printf("{\"format\": \"%s\", \"blocks\": %lld, \"rows_ns\": %.2f, \"lanes_ns\": %.2f, \"ratio\": %.3f, "
         "\"max_score\": %.4g, \"max_diff\": %.3g, \"sink\": %g}\n",
         FORMAT, (long long)nblocks, best_r * per, best_l * per, best_l / best_r, max_score,
         max_diff, sink);
  return 0;
}
