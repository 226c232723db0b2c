// Software AMX tiles for tests/unit/test_attention_amx_emulated.py, force-included (-include) into a build of the
// kernel's own attention_amx_cpu.cpp, unchanged: the build enables the AMX ISA flags (so the kernel compiles its AMX
// path) and this header replaces every tile instruction the kernel uses with code that runs on any CPU with
// AVX-512F (the kernel's vector code needs that). The tile state is eight tiles of 16 rows x 64 bytes per thread,
// in the one configuration the kernel uses (every tile 16 x 64 bytes); configuring and releasing it are no-ops.
//
// TDPBF16PS as Intel's pseudocode defines it: for each row m, each pair k of the A row, each column n,
//   C[m][n] += fp32(A[m].bf16[2k]) * fp32(B[k].bf16[2n]);  C[m][n] += fp32(A[m].bf16[2k+1]) * fp32(B[k].bf16[2n+1])
// with bfloat16 subnormal inputs read as zero (DAZ); a product of two bfloat16 values is exact in float32, so only
// the order of the float32 sums can differ from the hardware's.
#pragma once

#include <immintrin.h>  // first: its tile intrinsics are replaced below, and later includes of it are no-ops

#include <cstdint>
#include <cstring>

namespace tallyserve_amx_emulation {

struct Tile {
  alignas(64) uint8_t row[16][64];
};

inline Tile* tiles() {
  thread_local Tile t[8];
  return t;
}

inline void loadd(int t, const void* base, long stride) {
  for (int r = 0; r < 16; ++r) std::memcpy(tiles()[t].row[r], static_cast<const char*>(base) + r * stride, 64);
}

inline void stored(int t, void* base, long stride) {
  for (int r = 0; r < 16; ++r) std::memcpy(static_cast<char*>(base) + r * stride, tiles()[t].row[r], 64);
}

inline void zero(int t) { std::memset(tiles()[t].row, 0, sizeof(Tile::row)); }

inline float bf16(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  if ((u & 0x7f800000u) == 0) u &= 0x80000000u;  // subnormal in: zero (DAZ)
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline void dpbf16ps(int dst, int a, int b) {
  float c[16][16];
  uint16_t A[16][32], B[16][32];
  std::memcpy(c, tiles()[dst].row, sizeof(c));
  std::memcpy(A, tiles()[a].row, sizeof(A));
  std::memcpy(B, tiles()[b].row, sizeof(B));
  for (int m = 0; m < 16; ++m)
    for (int k = 0; k < 16; ++k)
      for (int n = 0; n < 16; ++n) {
        c[m][n] += bf16(A[m][2 * k]) * bf16(B[k][2 * n]);
        c[m][n] += bf16(A[m][2 * k + 1]) * bf16(B[k][2 * n + 1]);
      }
  std::memcpy(tiles()[dst].row, c, sizeof(c));
}

}  // namespace tallyserve_amx_emulation

#undef _tile_loadd
#undef _tile_stored
#undef _tile_zero
#undef _tile_dpbf16ps
#undef _tile_loadconfig
#undef _tile_storeconfig
#undef _tile_release
#define _tile_loadd(t, base, stride) ::tallyserve_amx_emulation::loadd((t), (base), (stride))
#define _tile_stored(t, base, stride) ::tallyserve_amx_emulation::stored((t), (base), (stride))
#define _tile_zero(t) ::tallyserve_amx_emulation::zero(t)
#define _tile_dpbf16ps(dst, a, b) ::tallyserve_amx_emulation::dpbf16ps((dst), (a), (b))
#define _tile_loadconfig(config) ((void)(config))
#define _tile_storeconfig(config) ((void)(config))  // the saved configuration stays empty: released on exit
#define _tile_release() ((void)0)
