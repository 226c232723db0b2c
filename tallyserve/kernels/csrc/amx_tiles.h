// AMX tile plumbing for tallyserve's AMX kernels (attention_amx_cpu.cpp): the process's tile permission and a
// scoped tile configuration.
#pragma once

#include <cstdint>

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

#if TALLYSERVE_HAVE_AMX

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

#endif

}  // namespace tallyserve_amx
