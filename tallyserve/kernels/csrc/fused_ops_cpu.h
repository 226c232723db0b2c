// tallyserve CPU fused operators (fused_ops_cpu.cpp) that other compiled files call directly: decode_layers
// (decode_layers_cpu.cpp) runs a step's layers from them without a dispatch per operator.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace tallyserve_cpu_ops {

// gemv_bf16's most rows (layers.CPU_GEMV_MAX_ROWS)
constexpr int64_t kGemvMaxRows = 4;

void check_f32(const at::Tensor& t, const char* name);
at::Tensor add_rms_norm(const at::Tensor& x, const c10::optional<at::Tensor>& residual, const at::Tensor& weight,
                        double eps);
void rotary_(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin);
int64_t write_kv_cache_(const at::Tensor& k, const at::Tensor& v, at::Tensor kv_cache, const at::Tensor& slot_mapping);
at::Tensor add_rms_norm_bf16(const at::Tensor& x, const c10::optional<at::Tensor>& residual, const at::Tensor& weight,
                             double eps);
at::Tensor silu_mul_bf16(const at::Tensor& gate_up);
// sgemm_avx2_cpu.cpp: x @ w^T on the weight's 16-feature panels (pack_sgemm_weight), n output features
at::Tensor linear_sgemm(const at::Tensor& x, const at::Tensor& packed, int64_t n);
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
at::Tensor gemv_bf16(const at::Tensor& x, const at::Tensor& w);
#endif

}  // namespace tallyserve_cpu_ops
