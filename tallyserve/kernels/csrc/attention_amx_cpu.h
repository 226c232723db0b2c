// tallyserve CPU attention for chunks on AMX tiles (attention_amx_cpu.cpp), called by paged_attention_cpu.cpp's
// items of several query rows over a bfloat16 cache.
#pragma once

#include <cstdint>
#include <vector>

namespace tallyserve_amx {

// Query rows per call of rows_bf16: four tiles of 16 share each piece's keys and values, copied once.
constexpr int64_t kRowsPerItem = 64;

// Per-thread scratch, sized on first use.
struct Scratch {
  std::vector<uint16_t> kc, vt, qb, pb;
  std::vector<float> st, ot, stats, pv;
};

// Whether rows_bf16 may run: built with AMX-BF16, the kernel granted the tile state, and not turned off.
bool usable();
// Turn the AMX path on or off (TALLYSERVE_CPU_AMX=0 starts it off); returns usable() after the change.
bool set_enabled(bool on);

// As paged_attention_cpu.cpp's rows_d64 over a bfloat16 cache (same arguments, same result to float32 rounding):
// up to kRowsPerItem query rows of one request at positions first .. first + nrow - 1, head_dim 64, query heads
// [h_lo, h_hi) in groups of G sharing a KV head, each row over keys 0 .. its position.
void rows_bf16(const float* q, int64_t q_row, float* o, int64_t o_row, const uint16_t* K, const uint16_t* V,
               const int64_t* row_off, int64_t nrow, int64_t first, int64_t h_lo, int64_t h_hi, int64_t G, float sc,
               Scratch& w);

}  // namespace tallyserve_amx
