// The head_dim-64 attention paths of paged_attention_cpu.cpp on W-lane vectors (attention_d64_cpu.cpp): W = 8 on
// AVX2 + FMA (x86 CPUs without AVX-512: AMD Zen 1-3, Intel before Skylake-SP and its client parts), W = 16 on
// AVX-512; float32 arithmetic over a float32 or bfloat16 cache (KvT: float, or uint16_t holding bfloat16 bits).
// Only the widths the build has are defined (kHave8, kHave16: callers test them with `if constexpr`).
//   one_row_d64<W>  one query row (decode), the scores kept whole per query head
//   rows_d64<W>     up to W query rows of one request, flash-style (online softmax) with the rows in the lanes
//   rows_gemm       (8 lanes) up to kGemmRows query rows over at most kGemmMaxKeys keys as small matrix products
// Common arguments: q rows q_row floats apart (the query heads' 64 values side by side), o rows o_row apart;
// row_off[j]: key j's row in K and V (every KV head's 64 values side by side); query heads [h_lo, h_hi) in groups of
// G sharing a KV head; sc: the softmax scale. Rows at positions first .. first + nrow - 1 see keys 0 .. their
// position; a decode row sees all nkeys.
#pragma once

#include <cstdint>

namespace tallyserve_attention_d64 {

#if defined(__AVX2__) && defined(__FMA__)
constexpr bool kHave8 = true;
#else
constexpr bool kHave8 = false;
#endif
#if defined(__AVX512F__)
constexpr bool kHave16 = true;
#else
constexpr bool kHave16 = false;
#endif

constexpr int64_t kKeysPerPiece = 256;  // rows_d64: keys per piece copied as float32 into kc / vc
constexpr int64_t kRowPiece = 64;       // one_row_d64<8>: keys per piece copied out of the cache into buf
constexpr int64_t kGemmRows = 192;      // rows_gemm: query rows per call, at most
constexpr int64_t kGemmMaxKeys = 4096;  // rows_gemm: keys, at most

// One query row (decode), G of 1 to 4. scores: (Hq * nkeys) floats of scratch, head h's at h * nkeys; buf (W = 8
// only; nullptr for 16): kRowPiece * Hkv * 64 values of scratch.
template <int W, typename KvT>
void one_row_d64(const float* q, float* o, const KvT* K, const KvT* V, const int64_t* row_off, int64_t nkeys,
                 int64_t h_lo, int64_t h_hi, int64_t G, float sc, float* scores, KvT* buf);

// Up to W query rows of one request. Scratch in floats: kc, vc kKeysPerPiece * 64 each; qt, ot G * 64 * W each;
// stats G * 2 * W.
template <int W, typename KvT>
void rows_d64(const float* q, int64_t q_row, float* o, int64_t o_row, const KvT* K, const KvT* V,
              const int64_t* row_off, int64_t nrow, int64_t first, int64_t h_lo, int64_t h_hi, int64_t G, float sc,
              float* kc, float* vc, float* qt, float* ot, float* stats);

// Up to kGemmRows query rows of one request over first + nrow (at most kGemmMaxKeys) keys, on 8 lanes. Scratch in
// floats: kt, vr 64 * 16 * ceil(keys / 16) each; scores 6 * 16 * ceil(keys / 16).
template <typename KvT>
void rows_gemm(const float* q, int64_t q_row, float* o, int64_t o_row, const KvT* K, const KvT* V,
               const int64_t* row_off, int64_t nrow, int64_t first, int64_t h_lo, int64_t h_hi, int64_t G, float sc,
               float* kt, float* vr, float* scores);

}  // namespace tallyserve_attention_d64
