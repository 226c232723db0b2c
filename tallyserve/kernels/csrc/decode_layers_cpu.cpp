// tallyserve CPU: a step's decoder layers in one compiled call (tallyserve_cpu::decode_layers), from the fused
// operators of fused_ops_cpu.cpp and the paged attention of paged_attention_cpu.cpp; models/cpu_layers.py calls it.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <string>
#include <vector>

#include "fused_ops_cpu.h"

namespace {

using namespace tallyserve_cpu_ops;

// The decoder layers of one step of a Llama-family model (no biases, no q/k norm) whose every request attends
// through the compiled paged kernel, in one call: exactly the operators, in the order, of the Python forward
// (LlamaModel._forward_fused with CpuSdpaBackend): add + RMSNorm, the q/k/v product, RoPE in place, the KV write,
// paged attention, the output product, add + RMSNorm, gate/up, SiLU-and-multiply, down; then the final add +
// RMSNorm. x: the float32 embeddings (T, H), updated in place as the residual stream. What this saves is the Python
// around ~13 operators per layer (a one-sequence step of the bundled model spent ~4 ms of its ~25 there).
// Five variants (projections): float32 projections through ATen's matmul (0), oneDNN's on the blocked weights
// (3, pack_cpu_weight) or tallyserve's AVX2 kernel on the weights' panels (4, pack_sgemm_weight; every projection's
// output features a multiple of 16); under dtype="bfloat16" (the norms and SiLU-and-multiply handing the projections bfloat16,
// q/k/v back in float32) 1, one to four rows through gemv_bf16, and 2, more rows through oneDNN's matmul on the
// blocked weights, as layers.linear picks them.
using AttentionOp = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                               const at::Tensor&, double);

c10::TypedOperatorHandle<AttentionOp>& attention_op() {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("tallyserve_cpu::paged_attention", "").typed<AttentionOp>();
  return op;
}

struct LayerWeights {
  at::TensorList in_norm, qkv, o, post_norm, gate_up, down;
};

template <typename QkvProduct, typename OProduct, typename Norm, typename Mlp>
at::Tensor run_decode_layers(at::Tensor x, const LayerWeights& w, const at::Tensor& final_norm, double eps,
                             int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim, const at::Tensor& cos,
                             const at::Tensor& sin, at::TensorList kv_caches, const at::Tensor& slot_mapping,
                             const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                             const at::Tensor& seq_lens, double scale, QkvProduct qkv_product, OProduct o_product,
                             Norm norm, Mlp mlp) {
  const int64_t L = static_cast<int64_t>(w.qkv.size());
  TORCH_CHECK(L > 0 && static_cast<int64_t>(w.in_norm.size()) == L && static_cast<int64_t>(w.o.size()) == L &&
                  static_cast<int64_t>(w.post_norm.size()) == L && static_cast<int64_t>(w.gate_up.size()) == L &&
                  static_cast<int64_t>(w.down.size()) == L && static_cast<int64_t>(kv_caches.size()) == L,
              "decode_layers: one weight of each kind and one cache per layer");
  check_f32(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x: contiguous (T, H)");
  const int64_t T = x.size(0), heads = num_q_heads + 2 * num_kv_heads;
  at::Tensor residual = x;
  at::Tensor h = norm(x, c10::optional<at::Tensor>(), w.in_norm[0]);
  for (int64_t i = 0; i < L; ++i) {
    if (i) h = norm(h, residual, w.in_norm[i]);
    at::Tensor qkv = qkv_product(h, w.qkv[i]);
    TORCH_CHECK(qkv.scalar_type() == at::kFloat && qkv.size(1) == heads * head_dim, "decode_layers: q/k/v of ",
                heads, " heads of ", head_dim, " in float32");
    at::Tensor qkv3 = qkv.view({T, heads, head_dim});
    rotary_(qkv3.narrow(1, 0, num_q_heads + num_kv_heads), cos, sin);
    write_kv_cache_(qkv3.narrow(1, num_q_heads, num_kv_heads), qkv3.narrow(1, num_q_heads + num_kv_heads, num_kv_heads),
                    kv_caches[i], slot_mapping);
    at::Tensor out = attention_op().call(qkv3.narrow(1, 0, num_q_heads), kv_caches[i], block_tables, query_start_loc,
                                         seq_lens, scale);
    h = o_product(out.reshape({T, num_q_heads * head_dim}), w.o[i]);
    h = norm(h, residual, w.post_norm[i]);
    h = mlp(h, w.gate_up[i], w.down[i]);
  }
  return add_rms_norm(h.to(at::kFloat), residual, final_norm, eps);
}

// layers.linear on a weight with oneDNN's blocked copy (pack_cpu_weight; bfloat16 from five rows on, float32 at
// every row count): oneDNN's matmul on x, the product in the weight's dtype.
at::Tensor linear_packed(const at::Tensor& x, const at::Tensor& packed) {
  static const c10::OperatorHandle op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  std::vector<c10::IValue> stack{x, packed, c10::IValue(), std::string("none"),
                                 c10::List<std::optional<at::Scalar>>(), std::string("")};
  op.callBoxed(stack);
  return stack[0].toTensor();
}

at::Tensor decode_layers(at::Tensor x, at::TensorList in_norm, at::TensorList qkv_w, at::TensorList o_w,
                         at::TensorList post_norm, at::TensorList gate_up_w, at::TensorList down_w,
                         const at::Tensor& final_norm, double eps, int64_t num_q_heads, int64_t num_kv_heads,
                         int64_t head_dim, const at::Tensor& cos, const at::Tensor& sin, at::TensorList kv_caches,
                         const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                         const at::Tensor& query_start_loc, const at::Tensor& seq_lens, double scale,
                         int64_t projections) {
  TORCH_CHECK(projections >= 0 && projections <= 4, "decode_layers: projections 0 (float32), 1 (bfloat16, one to "
              "four rows), 2 (bfloat16, oneDNN's blocked weights), 3 (float32, oneDNN's blocked weights) or 4 "
              "(float32, tallyserve's panels)");
  const LayerWeights w{in_norm, qkv_w, o_w, post_norm, gate_up_w, down_w};
  auto norm_bf16 = [eps](const at::Tensor& a, const c10::optional<at::Tensor>& r, const at::Tensor& wt) {
    return add_rms_norm_bf16(a, r, wt, eps);
  };
  // layers.linear on bfloat16 weights (product: gemv_bf16 for one to four rows, oneDNN's matmul on the blocked
  // weights passed in place of the plain ones from five): x rounded to bfloat16; q/k/v come back in float32 (the
  // model's dtype), the output product stays in bfloat16 for the next norm, the MLP in bfloat16 throughout
  auto run_bf16 = [&](auto product) {
    auto qkv_product = [product](const at::Tensor& a, const at::Tensor& b) {
      return product(a.to(at::kBFloat16).contiguous(), b).to(at::kFloat);
    };
    auto o_product = [product](const at::Tensor& a, const at::Tensor& b) {
      return product(a.to(at::kBFloat16).contiguous(), b);
    };
    auto mlp = [product](const at::Tensor& a, const at::Tensor& gate_up_weight, const at::Tensor& down_weight) {
      return product(silu_mul_bf16(product(a.contiguous(), gate_up_weight)), down_weight);
    };
    return run_decode_layers(x, w, final_norm, eps, num_q_heads, num_kv_heads, head_dim, cos, sin, kv_caches,
                             slot_mapping, block_tables, query_start_loc, seq_lens, scale, qkv_product, o_product,
                             norm_bf16, mlp);
  };
  if (projections == 2) {
    TORCH_CHECK(x.size(0) > kGemvMaxRows, "decode_layers with blocked bfloat16 weights: more than ", kGemvMaxRows,
                " rows");
    return run_bf16([](const at::Tensor& a, const at::Tensor& b) { return linear_packed(a, b); });
  }
  // float32 projections: ATen's matmul on the plain weights (0), oneDNN's on the blocked ones (3) or the AVX2
  // kernel on the panels (4), as layers.linear makes them
  auto run_f32 = [&](auto product) {
    auto norm = [eps](const at::Tensor& a, const c10::optional<at::Tensor>& r, const at::Tensor& wt) {
      return add_rms_norm(a, r, wt, eps);
    };
    auto mlp = [product](const at::Tensor& a, const at::Tensor& gate_up_weight, const at::Tensor& down_weight) {
      at::Tensor gate_up = product(a, gate_up_weight);  // Python: F.silu(gate) * up, then down
      const int64_t n = gate_up.size(1) / 2;
      return product(at::silu(gate_up.narrow(1, 0, n)) * gate_up.narrow(1, n, n), down_weight);
    };
    return run_decode_layers(x, w, final_norm, eps, num_q_heads, num_kv_heads, head_dim, cos, sin, kv_caches,
                             slot_mapping, block_tables, query_start_loc, seq_lens, scale, product, product, norm, mlp);
  };
  if (projections == 0) return run_f32([](const at::Tensor& a, const at::Tensor& b) { return at::linear(a, b); });
  if (projections == 3) {
    return run_f32([](const at::Tensor& a, const at::Tensor& b) { return linear_packed(a.contiguous(), b); });
  }
  if (projections == 4) {
    return run_f32([](const at::Tensor& a, const at::Tensor& b) {
      return linear_sgemm(a.contiguous(), b, b.size(0) * 16);
    });
  }
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  TORCH_CHECK(x.size(0) <= kGemvMaxRows, "decode_layers with bfloat16 projections: 1 to ", kGemvMaxRows, " rows");
  return run_bf16([](const at::Tensor& a, const at::Tensor& b) { return gemv_bf16(a, b); });
#else
  TORCH_CHECK(false, "decode_layers: bfloat16 projections need a build with AVX512-BF16 (gemv_bf16)");
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tallyserve_cpu, m) {
  m.def("decode_layers(Tensor(a!) x, Tensor[] in_norm, Tensor[] qkv_w, Tensor[] o_w, Tensor[] post_norm, "
        "Tensor[] gate_up_w, Tensor[] down_w, Tensor final_norm, float eps, int num_q_heads, int num_kv_heads, "
        "int head_dim, Tensor cos, Tensor sin, Tensor(b!)[] kv_caches, Tensor slot_mapping, Tensor block_tables, "
        "Tensor query_start_loc, Tensor seq_lens, float scale, int projections) -> Tensor");
}

TORCH_LIBRARY_IMPL(tallyserve_cpu, CPU, m) { m.impl("decode_layers", &decode_layers); }

// decode_layers takes oneDNN's blocked weights (opaque MkldnnCPU tensors) in its weight lists under projections=2.
TORCH_LIBRARY_IMPL(tallyserve_cpu, MkldnnCPU, m) { m.impl("decode_layers", &decode_layers); }
