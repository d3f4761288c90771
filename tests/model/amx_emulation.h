/* The AMX tile instructions paged_decode.c uses, emulated in plain C, for
   tests/model/test_amx_emulated.py: put before the kernel's source and built with -mamx-tile
   and -mamx-bf16 (so that the source compiles its AMX kernels), no tile instruction
   is emitted, and the AMX kernels' logic runs on a CPU without AMX (correctness only: each
   product is a scalar loop). The tile registers are per thread, on the heap; Linux's grant
   of them (arch_prctl) always succeeds. */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <unistd.h>
typedef struct { uint8_t d[8][16][64]; int rows[8], colsb[8]; } emu_tiles;
static __thread emu_tiles* emu_p; /* heap: the static TLS block is small */
#define emu (*emu_p)
static inline void emu_loadconfig(const void* cfg) {
  const uint8_t* c = (const uint8_t*)cfg;
  if (!emu_p) emu_p = (emu_tiles*)malloc(sizeof(emu_tiles));
  if (!emu_p) abort(); /* no memory for a thread's tiles: the test process stops here */
  memset(&emu, 0, sizeof emu);
  for (int t = 0; t < 8; t++) {
    emu.colsb[t] = c[16 + 2 * t] | c[17 + 2 * t] << 8;
    emu.rows[t] = c[48 + t];
  }
}
static inline void emu_loadd(int t, const void* base, long stride) {
  memset(emu.d[t], 0, sizeof emu.d[t]);
  for (int r = 0; r < emu.rows[t]; r++)
    memcpy(emu.d[t][r], (const uint8_t*)base + r * stride, emu.colsb[t]);
}
static inline void emu_stored(int t, void* base, long stride) {
  for (int r = 0; r < emu.rows[t]; r++)
    memcpy((uint8_t*)base + r * stride, emu.d[t][r], emu.colsb[t]);
}
static inline float emu_bf16(const uint8_t* p) {
  uint32_t u = (uint32_t)(p[0] | p[1] << 8) << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}
static inline void emu_dpbf16ps(int c, int a, int b) {
  const int M = emu.rows[c], N = emu.colsb[c] / 4, K = emu.colsb[a] / 4;
  for (int m = 0; m < M; m++)
    for (int n = 0; n < N; n++) {
      float acc;
      memcpy(&acc, &emu.d[c][m][4 * n], 4);
      for (int k = 0; k < K; k++)
        acc += emu_bf16(&emu.d[a][m][4 * k]) * emu_bf16(&emu.d[b][k][4 * n])
             + emu_bf16(&emu.d[a][m][4 * k + 2]) * emu_bf16(&emu.d[b][k][4 * n + 2]);
      memcpy(&emu.d[c][m][4 * n], &acc, 4);
    }
}
#undef _tile_loadd
#undef _tile_stored
#undef _tile_zero
#undef _tile_dpbf16ps
#define _tile_loadconfig(cfg) emu_loadconfig(cfg)
#define _tile_release() ((void)0)
#define _tile_loadd(t, base, stride) emu_loadd(t, base, stride)
#define _tile_stored(t, base, stride) emu_stored(t, base, stride)
#define _tile_zero(t) memset(emu.d[t], 0, sizeof emu.d[t])
#define _tile_dpbf16ps(c, a, b) emu_dpbf16ps(c, a, b)
#define syscall(...) 0
