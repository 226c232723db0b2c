// The kernel's AMX attention code (tallyserve/kernels/csrc/attention_amx_cpu.cpp, found through -I), built with
// amx_emulation.h force-included, called through a C interface from tests/unit/test_attention_amx_emulated.py.
#include "attention_amx_cpu.cpp"

#define EMULATION_API extern "C" __attribute__((visibility("default")))

EMULATION_API int amx_emulation_built() { return TALLYSERVE_HAVE_AMX; }

EMULATION_API long amx_emulation_rows_per_item() { return tallyserve_amx::kRowsPerItem; }

// tallyserve_amx::rows_bf16 with per-thread scratch, as paged_attention_cpu.cpp's attend_items calls it.
EMULATION_API void amx_emulation_rows_bf16(const float* q, int64_t q_row, float* o, int64_t o_row, const uint16_t* K,
                                           const uint16_t* V, const int64_t* row_off, int64_t nrow, int64_t first,
                                           int64_t h_lo, int64_t h_hi, int64_t G, float sc) {
#if TALLYSERVE_HAVE_AMX
  thread_local tallyserve_amx::Scratch scratch;
  tallyserve_amx::rows_bf16(q, q_row, o, o_row, K, V, row_off, nrow, first, h_lo, h_hi, G, sc, scratch);
#endif
}
