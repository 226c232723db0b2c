// tallyserve CPU attention for chunks on AMX tiles: up to 16 query rows of one request over a bfloat16 cache, with
// float32 results equal to the float32 path's to rounding.
//
// AMX multiplies bfloat16 tiles into float32 sums, and a bfloat16 cache holds K and V exactly, so only the float32
// operands need care: each query row and each probability is split into three bfloat16 parts (x = hi + mid + lo,
// exactly: 8 of float32's 24 significant bits each), and a product of two bfloat16 values is exact in float32. So
// every score and every weighted value is the float32 path's products summed in float32, in another order.
//
// Layout (per KV head group, per piece of up to kPiece keys):
//   scores^T (keys x rows) = K (keys x 64) . Q^T           A: K rows copied from the cache, B: q, pair-interleaved
//   out^T   (64 x rows)   += V^T (64 x keys) . P^T         A: V transposed, B: probabilities, pair-interleaved
// The rows sit in the 16 lanes of each score vector, as in rows_d64: the online softmax (per piece) needs no
// horizontal sums, and the causal mask is a lane compare.

#include "attention_amx_cpu.h"

#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "cpu_math.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__) && defined(__AVX512BF16__) && \
    defined(__linux__)
#define TALLYSERVE_HAVE_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#else
#define TALLYSERVE_HAVE_AMX 0
#endif

namespace tallyserve_amx {

namespace {
std::atomic<bool> g_enabled{[] {
  const char* env = std::getenv("TALLYSERVE_CPU_AMX");
  return env == nullptr || std::strcmp(env, "0") != 0;
}()};
}  // namespace

#if TALLYSERVE_HAVE_AMX

namespace {

// ---- tile plumbing: the process's tile permission and a scoped tile configuration ----

// Linux hands a process the AMX tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM, XTILEDATA).
inline bool tile_state_granted() {
  static const bool granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return granted;
}

struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Every tile 16 rows of 64 bytes; the caller's configuration (other kernels of this thread may cache theirs) is
// saved on entry and put back on exit.
class TileScope {
 public:
  TileScope() {
    _tile_storeconfig(&saved_);
    TileConfig cfg{};
    cfg.palette_id = 1;
    for (int t = 0; t < 8; ++t) cfg.colsb[t] = 64, cfg.rows[t] = 16;
    _tile_loadconfig(&cfg);
  }
  ~TileScope() {
    if (saved_.palette_id != 0)
      _tile_loadconfig(&saved_);
    else
      _tile_release();
  }
  TileScope(const TileScope&) = delete;
  TileScope& operator=(const TileScope&) = delete;

 private:
  TileConfig saved_{};
};

// ---- the kernel ----

constexpr int64_t kPiece = 64;  // keys per piece (a multiple of 32)

// x = p[0] + p[1] + p[2], each part a bfloat16 value held as a float32 whose low 16 bits are zero: the top 8
// significant bits, the next 8, the last 8 (truncation, so for normal numbers the parts add up to x's 24 bits with
// no rounding). A subnormal remainder (|x| below about 2^-110) keeps only its top bits: AMX reads subnormal
// inputs as zero anyway, and a low bit left set would land in the neighbouring value of a pair.
inline __m512 bf16_part(__m512 x) {
  return _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(static_cast<int32_t>(0xffff0000u))));
}
inline void split3(__m512 x, __m512 p[3]) {
  p[0] = bf16_part(x);
  x = _mm512_sub_ps(x, p[0]);
  p[1] = bf16_part(x);
  p[2] = bf16_part(_mm512_sub_ps(x, p[1]));
}

// Two vectors of such parts as 16 bfloat16 pairs (a in the low half of each 32-bit lane, b in the high half).
inline __m512i pairs(__m512 a, __m512 b) {
  return _mm512_or_si512(_mm512_srli_epi32(_mm512_castps_si512(a), 16), _mm512_castps_si512(b));
}

// Two vectors of 16 bfloat16 values (cache rows) as 16 pairs.
inline __m512i pairs(__m256i a, __m256i b) {
  return _mm512_or_si512(_mm512_cvtepu16_epi32(a), _mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}

// Transpose of a 16 x 16 block of 32-bit values held as 16 row vectors, in place.
inline void transpose16(__m512i v[16]) {
  __m512 r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_castsi512_ps(v[i]);
  for (int i = 0; i < 16; i += 2) t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]), t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  for (int i = 0; i < 16; i += 4) {  // rows i..i+3: columns 0, 1, 2, 3 of each 128-bit lane
    r[i] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 8; ++i) {
    v[i] = _mm512_castps_si512(_mm512_shuffle_f32x4(t[i], t[i + 8], 0x88));
    v[i + 8] = _mm512_castps_si512(_mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd));
  }
}

// Scores^T of 16 keys (kr: rows of 64 bfloat16, 128 bytes apart) against NH heads' q^T tiles (qa: per head 3 parts
// x 2 halves of 256 pairs), into out (per head kPiece x 16 floats apart). The heads' accumulators (tiles 0, 5, 6)
// take turns, so one product need not wait for the previous one into the same tile.
template <int NH>
inline void score_tiles(const uint16_t* kr, const uint32_t* qa, float* out) {
  _tile_loadd(1, kr, 128);
  _tile_loadd(2, kr + 32, 128);
  _tile_zero(0);
  if (NH > 1) _tile_zero(5);
  if (NH > 2) _tile_zero(6);
  for (int sh = 0; sh < 6; ++sh) {  // part sh / 2, half sh % 2 of the head dimension
    _tile_loadd(3, qa + sh * 256, 64);
    if (sh % 2 == 0) _tile_dpbf16ps(0, 1, 3); else _tile_dpbf16ps(0, 2, 3);
    if (NH > 1) {
      _tile_loadd(4, qa + 1536 + sh * 256, 64);
      if (sh % 2 == 0) _tile_dpbf16ps(5, 1, 4); else _tile_dpbf16ps(5, 2, 4);
    }
    if (NH > 2) {
      _tile_loadd(7, qa + 3072 + sh * 256, 64);
      if (sh % 2 == 0) _tile_dpbf16ps(6, 1, 7); else _tile_dpbf16ps(6, 2, 7);
    }
  }
  _tile_stored(0, out, 64);
  if (NH > 1) _tile_stored(5, out + kPiece * 16, 64);
  if (NH > 2) _tile_stored(6, out + 2 * kPiece * 16, 64);
}

}  // namespace

bool usable() { return g_enabled.load(std::memory_order_relaxed) && tile_state_granted(); }

bool set_enabled(bool on) {
  g_enabled.store(on);
  return usable();
}

void rows_bf16(const float* q, int64_t q_row, float* o, int64_t o_row, const uint16_t* K, const uint16_t* V,
               const int64_t* row_off, int64_t nrow, int64_t first, int64_t h_lo, int64_t h_hi, int64_t G, float sc,
               Scratch& w) {
  const int64_t nkeys = first + nrow, nsub = (nrow + 15) / 16;  // row tiles of 16
  // scratch: K rows (kPiece x 64 bf16), V^T (per 32 keys: 64 x 16 pairs), q^T per row tile and head (3 parts x
  // 2 halves x 16 x 16 pairs), probabilities^T (3 parts x kPiece / 32 x 16 x 16 pairs), scores per head (kPiece x 16),
  // out^T per row tile and head (64 x 16), running max and sum per row tile and head, one piece's out^T
  if (w.kc.empty()) {
    w.kc.resize(kPiece * 64), w.vt.resize(kPiece * 64), w.pb.resize(3 * kPiece * 32);
    w.pv.resize(1024);
  }
  if (w.st.size() < static_cast<size_t>(G * kPiece * 16)) w.st.resize(G * kPiece * 16);
  const size_t heads = static_cast<size_t>(nsub * G);
  if (w.qb.size() < heads * 6 * 512) w.qb.resize(heads * 6 * 512), w.ot.resize(heads * 1024), w.stats.resize(heads * 32);
  uint16_t* kc = w.kc.data();
  uint32_t* vt = reinterpret_cast<uint32_t*>(w.vt.data());
  uint32_t* qb = reinterpret_cast<uint32_t*>(w.qb.data());
  uint32_t* pb = reinterpret_cast<uint32_t*>(w.pb.data());
  float* st = w.st.data();
  float* pv = w.pv.data();
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 neg_inf = _mm512_set1_ps(-INFINITY);
  const __m512 scale16 = _mm512_set1_ps(sc);
  TileScope tiles;
  for (int64_t g = h_lo / G; g < h_hi / G; ++g) {
    for (int64_t t = 0; t < nsub; ++t)
      for (int64_t a = 0; a < G; ++a) {  // q^T of each head in three parts; output, max and sum cleared
        const int64_t rows_t = std::min<int64_t>(16, nrow - 16 * t), ta = t * G + a;
        __m512i x[3][2][16];  // [part][16 pairs of dims][row]
        for (int64_t m = 0; m < 16; ++m) {
          const float* qr = q + (16 * t + std::min(m, rows_t - 1)) * q_row + (g * G + a) * 64;
          for (int h = 0; h < 2; ++h) {  // dims 2k, 2k + 1 of half h as pair k
            const __m512 d0 = _mm512_loadu_ps(qr + 32 * h), d1 = _mm512_loadu_ps(qr + 32 * h + 16);
            const __m512i idx_even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
            const __m512 even = _mm512_permutex2var_ps(d0, idx_even, d1);
            const __m512 odd = _mm512_permutex2var_ps(d0, _mm512_add_epi32(idx_even, _mm512_set1_epi32(1)), d1);
            __m512 pe[3], po[3];
            split3(even, pe);
            split3(odd, po);
            for (int s = 0; s < 3; ++s) x[s][h][m] = pairs(pe[s], po[s]);
          }
        }
        for (int s = 0; s < 3; ++s)
          for (int h = 0; h < 2; ++h) {
            transpose16(x[s][h]);
            uint32_t* b = qb + ((ta * 3 + s) * 2 + h) * 256;
            for (int k = 0; k < 16; ++k) _mm512_storeu_si512(b + k * 16, x[s][h][k]);
          }
        std::memset(w.ot.data() + ta * 1024, 0, sizeof(float) * 1024);
        _mm512_storeu_ps(w.stats.data() + ta * 32, neg_inf);
        _mm512_storeu_ps(w.stats.data() + ta * 32 + 16, _mm512_setzero_ps());
      }
    for (int64_t c0 = 0; c0 < nkeys; c0 += kPiece) {
      const int64_t cn = std::min(kPiece, nkeys - c0), padded = (cn + 31) / 32 * 32;
      for (int64_t j = 0; j < cn; ++j) std::memcpy(kc + j * 64, K + row_off[c0 + j] + g * 64, 128);
      std::memset(kc + cn * 64, 0, sizeof(uint16_t) * (padded - cn) * 64);
      for (int64_t kb = 0; kb < padded / 32; ++kb) {  // V^T: row d of block kb holds keys kb*32 .. +31 as 16 pairs
        __m512i e[4][16];  // [16 dims][pair of keys]
        for (int64_t r = 0; r < 16; ++r) {
          const int64_t j0 = kb * 32 + 2 * r, j1 = j0 + 1;
          const uint16_t* v0 = V + row_off[c0 + std::min(j0, cn - 1)] + g * 64;
          const uint16_t* v1 = V + row_off[c0 + std::min(j1, cn - 1)] + g * 64;
          for (int c = 0; c < 4; ++c) {
            const __m256i a0 = j0 < cn ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v0 + 16 * c)) : _mm256_setzero_si256();
            const __m256i a1 = j1 < cn ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v1 + 16 * c)) : _mm256_setzero_si256();
            e[c][r] = pairs(a0, a1);
          }
        }
        uint32_t* blk = vt + kb * 1024;
        for (int c = 0; c < 4; ++c) {
          transpose16(e[c]);
          for (int d = 0; d < 16; ++d) _mm512_storeu_si512(blk + (16 * c + d) * 16, e[c][d]);
        }
      }
      for (int64_t t = 0; t < nsub; ++t) {
        const int64_t rows_t = std::min<int64_t>(16, nrow - 16 * t), last = first + 16 * t + rows_t - 1;
        if (c0 > last) continue;  // every key of the piece is past every row of this tile
        const int64_t cn_t = std::min(cn, last - c0 + 1), padded_t = (cn_t + 31) / 32 * 32, nkb = padded_t / 32;
        const __m512i pos = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(first + 16 * t)),
                                             _mm512_min_epi32(lane, _mm512_set1_epi32(static_cast<int32_t>(rows_t - 1))));
        for (int64_t a0 = 0; a0 < G; a0 += 3) {  // scores^T of up to three heads at once
          const uint32_t* qa = qb + (t * G + a0) * 6 * 256;
          for (int64_t jb = 0; jb < padded_t; jb += 16) {
            float* out = st + (a0 * kPiece + jb) * 16;
            if (G - a0 >= 3)
              score_tiles<3>(kc + jb * 64, qa, out);
            else if (G - a0 == 2)
              score_tiles<2>(kc + jb * 64, qa, out);
            else
              score_tiles<1>(kc + jb * 64, qa, out);
          }
        }
        for (int64_t a = 0; a < G; ++a) {
          const int64_t ta = t * G + a;
          float* sa = st + a * kPiece * 16;
          float* stats = w.stats.data() + ta * 32;
          __m512 m = _mm512_loadu_ps(stats), l = _mm512_loadu_ps(stats + 16), top = m;
          for (int64_t j = 0; j < cn_t; ++j) {  // key c0 + j: valid in the lanes whose position is at or past it
            const __mmask16 valid =
                _mm512_cmp_epi32_mask(pos, _mm512_set1_epi32(static_cast<int32_t>(c0 + j)), _MM_CMPINT_NLT);
            const __m512 s = _mm512_mask_blend_ps(valid, neg_inf, _mm512_mul_ps(_mm512_loadu_ps(sa + j * 16), scale16));
            _mm512_storeu_ps(sa + j * 16, s);
            top = _mm512_max_ps(top, s);
          }
          // lanes with no key yet (m = -inf) start from zero; key 0 is valid in every lane, so top is finite
          const __m512 corr = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(m, neg_inf, _CMP_NEQ_OQ),
                                                  tallyserve_cpu_math::exp_vec<16>(_mm512_sub_ps(m, top)));
          l = _mm512_mul_ps(l, corr);
          for (int64_t kb = 0; kb < nkb; ++kb)  // P^T in three parts, pairs of consecutive keys per lane
            for (int64_t r = 0; r < 16; ++r) {
              __m512 p[2];
              for (int u = 0; u < 2; ++u) {
                const int64_t j = kb * 32 + 2 * r + u;
                const __mmask16 valid =
                    j < cn_t ? _mm512_cmp_epi32_mask(pos, _mm512_set1_epi32(static_cast<int32_t>(c0 + j)), _MM_CMPINT_NLT)
                             : static_cast<__mmask16>(0);
                p[u] = _mm512_maskz_mov_ps(valid, tallyserve_cpu_math::exp_vec<16>(_mm512_sub_ps(_mm512_loadu_ps(sa + j * 16), top)));
              }
              l = _mm512_add_ps(l, _mm512_add_ps(p[0], p[1]));
              __m512 p0[3], p1[3];
              split3(p[0], p0);
              split3(p[1], p1);
              for (int s = 0; s < 3; ++s) _mm512_storeu_si512(pb + ((s * nkb + kb) * 16 + r) * 16, pairs(p0[s], p1[s]));
            }
          _mm512_storeu_ps(stats, top);
          _mm512_storeu_ps(stats + 16, l);
          _tile_zero(4);
          _tile_zero(5);
          _tile_zero(6);
          _tile_zero(7);
          for (int64_t kb = 0; kb < nkb; ++kb) {  // the three parts of P^T in tiles 0, 2, 3; V^T by 16 dims in 1
            const uint32_t* blk = vt + kb * 1024;
            _tile_loadd(0, pb + kb * 256, 64);
            _tile_loadd(2, pb + (nkb + kb) * 256, 64);
            _tile_loadd(3, pb + (2 * nkb + kb) * 256, 64);
            _tile_loadd(1, blk, 64);
            _tile_dpbf16ps(4, 1, 0);
            _tile_dpbf16ps(4, 1, 2);
            _tile_dpbf16ps(4, 1, 3);
            _tile_loadd(1, blk + 256, 64);
            _tile_dpbf16ps(5, 1, 0);
            _tile_dpbf16ps(5, 1, 2);
            _tile_dpbf16ps(5, 1, 3);
            _tile_loadd(1, blk + 512, 64);
            _tile_dpbf16ps(6, 1, 0);
            _tile_dpbf16ps(6, 1, 2);
            _tile_dpbf16ps(6, 1, 3);
            _tile_loadd(1, blk + 768, 64);
            _tile_dpbf16ps(7, 1, 0);
            _tile_dpbf16ps(7, 1, 2);
            _tile_dpbf16ps(7, 1, 3);
          }
          _tile_stored(4, pv, 64);
          _tile_stored(5, pv + 256, 64);
          _tile_stored(6, pv + 512, 64);
          _tile_stored(7, pv + 768, 64);
          float* oa = w.ot.data() + ta * 1024;
          for (int64_t d = 0; d < 64; ++d)
            _mm512_storeu_ps(oa + d * 16, _mm512_fmadd_ps(_mm512_loadu_ps(oa + d * 16), corr, _mm512_loadu_ps(pv + d * 16)));
        }
      }
    }
    for (int64_t t = 0; t < nsub; ++t)
      for (int64_t a = 0; a < G; ++a) {  // divide by the sums, rows back out of the lanes
        const int64_t ta = t * G + a, rows_t = std::min<int64_t>(16, nrow - 16 * t);
        const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.f), _mm512_loadu_ps(w.stats.data() + ta * 32 + 16));
        float* oa = w.ot.data() + ta * 1024;
        __m512i cols[16];
        for (int d0 = 0; d0 < 64; d0 += 16) {
          for (int d = 0; d < 16; ++d)
            cols[d] = _mm512_castps_si512(_mm512_mul_ps(_mm512_loadu_ps(oa + (d0 + d) * 16), inv));
          transpose16(cols);
          for (int64_t i = 0; i < rows_t; ++i)
            _mm512_storeu_si512(o + (16 * t + i) * o_row + (g * G + a) * 64 + d0, cols[i]);
        }
      }
  }
}

#else

bool usable() { return false; }
bool set_enabled(bool on) {
  g_enabled.store(on);
  return false;
}
void rows_bf16(const float*, int64_t, float*, int64_t, const uint16_t*, const uint16_t*, const int64_t*, int64_t,
               int64_t, int64_t, int64_t, int64_t, float, Scratch&) {}

#endif

}  // namespace tallyserve_amx

// The AMX path for chunks over a bfloat16 cache: on or off, and whether it runs.
TORCH_LIBRARY_FRAGMENT(tallyserve_cpu, m) {
  m.def("set_amx(bool on) -> bool", [](bool on) { return tallyserve_amx::set_enabled(on); });
  m.def("amx_usable() -> bool", [] { return tallyserve_amx::usable(); });
}
