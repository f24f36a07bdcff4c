// ops.cpp: the torch.ops.qkvfuse operators.
//
// Each op allocates its outputs (and workspaces) with torch's allocator, wraps everything as
// TensorViews and calls the public C++ entry point, which validates the arguments and runs on the
// device the tensors live on. So CPU and CUDA register the same functions.
//
// Every op is functional: its outputs are fresh tensors that alias no input and no other output
// (torch.library's rule for custom ops, which torch.compile relies on). Where the library writes two
// results into one buffer (the packed forward's Q/K and V columns, the backward's two weight
// gradients), the op returns that buffer whole and the Python package cuts the views
// (python/qkvfuse/_layout.py). Fake (meta) kernels and autograd live in the Python package.
#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "convert.hpp"
#include "qkvfuse/error.hpp"
#include "qkvfuse/qkvfuse.hpp"

namespace qkvfuse::torch_binding {
namespace {

using at::Tensor;

RopeLayout rope_layout(int64_t num_heads, int64_t rotary_dim, bool paired, bool key_offset) {
  RopeLayout layout;
  layout.num_heads = num_heads;
  layout.rotary_dim = rotary_dim;
  layout.paired = paired;
  layout.key_offset = key_offset;
  return layout;
}

// q and k: [T, H, D], or [2T, H/2, D] for paired heads (the library checks that H is even).
std::vector<int64_t> rope_output_shape(const OpArgs& args, const Tensor& qk, int64_t num_heads,
                                       bool paired) {
  args.expect_dims(qk, 3, "qk", "[T, 2H, D]");
  args.expect_positive(num_heads, "num_heads");
  if (paired) return {2 * qk.size(0), num_heads / 2, qk.size(2)};
  return {qk.size(0), num_heads, qk.size(2)};
}

at::TensorOptions e4m3_like(const Tensor& tensor) {
  return tensor.options().dtype(at::kFloat8_e4m3fn);
}

std::tuple<Tensor, Tensor> qk_norm_rope(const Tensor& qk, const Tensor& factor1,
                                        const Tensor& factor2, int64_t num_heads,
                                        int64_t rotary_dim, bool paired, bool key_offset) {
  const OpArgs args("qk_norm_rope");
  const c10::DeviceGuard guard(qk.device());
  const auto shape = rope_output_shape(args, qk, num_heads, paired);
  Tensor q = at::empty(shape, qk.options());
  Tensor k = at::empty(shape, qk.options());
  QkNormRopeParams params;
  params.qk = args.view(qk, "qk");
  params.factor1 = args.view(factor1, "factor1");
  params.factor2 = args.view(factor2, "factor2");
  params.q = args.view(q, "q");
  params.k = args.view(k, "k");
  params.layout = rope_layout(num_heads, rotary_dim, paired, key_offset);
  params.stream = current_stream(qk);
  qkvfuse::qk_norm_rope(params);
  return {q, k};
}

Tensor qk_norm_rope_backward(const Tensor& grad_q, const Tensor& grad_k, const Tensor& qk,
                             const Tensor& factor1, const Tensor& factor2, int64_t num_heads,
                             int64_t rotary_dim, bool paired, bool key_offset) {
  const OpArgs args("qk_norm_rope_backward");
  const c10::DeviceGuard guard(qk.device());
  args.expect_dims(qk, 3, "qk", "[T, 2H, D]");
  Tensor grad_qk = at::empty(qk.sizes(), qk.options());
  QkNormRopeBackwardParams params;
  params.grad_q = args.view(grad_q, "grad_q");
  params.grad_k = args.view(grad_k, "grad_k");
  params.qk = args.view(qk, "qk");
  params.factor1 = args.view(factor1, "factor1");
  params.factor2 = args.view(factor2, "factor2");
  params.grad_qk = args.view(grad_qk, "grad_qk");
  params.layout = rope_layout(num_heads, rotary_dim, paired, key_offset);
  params.stream = current_stream(qk);
  qkvfuse::qk_norm_rope_backward(params);
  return grad_qk;
}

std::tuple<Tensor, Tensor> qkv_backward_fp8(const Tensor& grad_q, const Tensor& grad_k,
                                            const Tensor& grad_v, const Tensor& qk,
                                            const Tensor& factor1, const Tensor& factor2,
                                            const Tensor& grad_scale, int64_t num_heads,
                                            int64_t rotary_dim, bool paired, bool key_offset) {
  const OpArgs args("qkv_backward_fp8");
  const c10::DeviceGuard guard(qk.device());
  args.expect_dims(qk, 3, "qk", "[T, 2H, D]");
  args.expect_dims(grad_v, 3, "grad_v", "[T, H, Dv]");
  args.expect_positive(num_heads, "num_heads");
  const int64_t tokens = qk.size(0);
  const int64_t qkv_dim = qk.size(1) * qk.size(2) + num_heads * grad_v.size(2);
  Tensor grad_row = at::empty({tokens, qkv_dim}, e4m3_like(qk));
  Tensor grad_t = at::empty({qkv_dim, tokens}, e4m3_like(qk));
  QkvBackwardFp8Params params;
  params.grad_q = args.view(grad_q, "grad_q");
  params.grad_k = args.view(grad_k, "grad_k");
  params.grad_v = args.view(grad_v, "grad_v");
  params.qk = args.view(qk, "qk");
  params.factor1 = args.view(factor1, "factor1");
  params.factor2 = args.view(factor2, "factor2");
  params.grad_scale = args.view(grad_scale, "grad_scale");
  params.grad_row = args.view(grad_row, "grad_row");
  params.grad_t = args.view(grad_t, "grad_t");
  params.layout = rope_layout(num_heads, rotary_dim, paired, key_offset);
  params.stream = current_stream(qk);
  qkvfuse::qkv_backward_fp8(params);
  return {grad_row, grad_t};
}

// The e4m3 outputs of a dual-layout quantize of src [M, N] or [B, M, N]: row (src's shape) and t
// (the last two dims swapped).
std::tuple<Tensor, Tensor> alloc_dual_layout(const OpArgs& args, const Tensor& src) {
  args.expect_dims(src, src.dim() == 3 ? 3 : 2, "src", "[M, N] or [B, M, N]");
  auto t_shape = src.sizes().vec();
  std::swap(t_shape[t_shape.size() - 1], t_shape[t_shape.size() - 2]);
  return {at::empty(src.sizes(), e4m3_like(src)), at::empty(t_shape, e4m3_like(src))};
}

// amax (nullopt for none) has scale's shape: [] or [1] for one matrix, [B] for a batch. An empty
// src leaves the library's outputs unwritten (a no-op there): the amax of no elements is returned
// as 0 here, the value an all-zero source gives, rather than uninitialized memory.
std::tuple<Tensor, Tensor, std::optional<Tensor>> run_quantize_dual(const char* op,
                                                                     const Tensor& src,
                                                                     const Tensor& scale,
                                                                     bool with_amax) {
  const OpArgs args(op);
  const c10::DeviceGuard guard(src.device());
  auto [row, t] = alloc_dual_layout(args, src);
  QuantizeDualParams params;
  params.scale = args.view(scale, "scale");
  std::optional<Tensor> amax;
  if (with_amax) {
    const auto f32 = src.options().dtype(at::kFloat);
    amax = src.numel() == 0 ? at::zeros(scale.sizes(), f32) : at::empty(scale.sizes(), f32);
  }
  params.src = args.view(src, "src");
  params.row = args.view(row, "row");
  params.t = args.view(t, "t");
  params.amax = args.optional_view(amax, "amax");
  params.stream = current_stream(src);
  qkvfuse::quantize_dual_layout(params);
  return {row, t, amax};
}

std::tuple<Tensor, Tensor> quantize_dual_layout(const Tensor& x, const Tensor& scale) {
  auto [row, t, amax] = run_quantize_dual("quantize_dual_layout", x, scale, false);
  return {row, t};
}

std::tuple<Tensor, Tensor, Tensor> quantize_dual_layout_amax(const Tensor& x, const Tensor& scale) {
  auto [row, t, amax] = run_quantize_dual("quantize_dual_layout", x, scale, true);
  return {row, t, *amax};
}

std::tuple<Tensor, Tensor, Tensor> quantize_weight_bank(const Tensor& weights) {
  const OpArgs args("quantize_weight_bank");
  const c10::DeviceGuard guard(weights.device());
  args.expect_dims(weights, 3, "src", "[B, M, N]");
  auto [row, t] = alloc_dual_layout(args, weights);
  // Empty entries get scale 1, as all-zero ones do (the library writes nothing for an empty src).
  const auto f32 = weights.options().dtype(at::kFloat);
  Tensor scale = weights.numel() == 0 ? at::ones({weights.size(0)}, f32)
                                      : at::empty({weights.size(0)}, f32);
  QuantizeWeightBankParams params;
  params.src = args.view(weights, "src");
  params.scale = args.view(scale, "scale");
  params.row = args.view(row, "row");
  params.t = args.view(t, "t");
  params.stream = current_stream(weights);
  qkvfuse::quantize_weight_bank(params);
  return {row, t, scale};
}

Tensor fp8_gemm(const Tensor& a, const Tensor& b, const Tensor& scale_a, const Tensor& scale_b,
                const std::optional<Tensor>& alpha, bool fast_accum) {
  const OpArgs args("fp8_gemm");
  const c10::DeviceGuard guard(a.device());
  args.expect_dims(a, 2, "a", "[M, K]");
  args.expect_dims(b, 2, "b", "[N, K]");
  Tensor d = at::empty({a.size(0), b.size(0)}, a.options().dtype(at::kBFloat16));
  Fp8GemmParams params;
  params.a = args.view(a, "a");
  params.b = args.view(b, "b");
  params.scale_a = args.view(scale_a, "scale_a");
  params.scale_b = args.view(scale_b, "scale_b");
  params.alpha = args.optional_view(alpha, "alpha");
  params.d = args.view(d, "d");
  params.fast_accum = fast_accum;
  params.stream = current_stream(a);
  qkvfuse::fp8_gemm(params);
  return d;
}

// Returns (q, k, qkv): qkv is one flat bf16 buffer of T * qkv_dim holding the GEMM's Q/K columns
// (saved for the backward) and V. Plain layers store it as row-major [T, qkv_dim] so that one GEMM
// writes both column slices; paired layers store [T, 2HD] then [T, HDv] so that V is dense (two
// GEMMs). python/qkvfuse/_layout.py's qkv_views cuts the same views from the returned buffer.
std::tuple<Tensor, Tensor, Tensor> packed_qkv_forward(
    const Tensor& x_f8, const Tensor& weight_f8, const Tensor& x_scale, const Tensor& weight_scale,
    const Tensor& qkv_scale, const Tensor& factor1, const Tensor& factor2, int64_t num_heads,
    int64_t qk_dim, int64_t v_dim, int64_t rotary_dim, bool paired, bool key_offset) {
  const OpArgs args("packed_qkv_forward");
  const c10::DeviceGuard guard(x_f8.device());
  args.expect_dims(x_f8, 2, "x_f8", "[T, C]");
  args.expect_positive(num_heads, "num_heads");
  args.expect_positive(qk_dim, "qk_dim");
  args.expect_positive(v_dim, "v_dim");
  const int64_t tokens = x_f8.size(0);
  const int64_t qk_features = 2 * num_heads * qk_dim;
  const int64_t v_features = num_heads * v_dim;
  const auto bf16 = x_f8.options().dtype(at::kBFloat16);
  Tensor qkv = at::empty({tokens * (qk_features + v_features)}, bf16);
  Tensor qk_flat, v_flat;
  if (paired) {
    qk_flat = qkv.narrow(0, 0, tokens * qk_features).view({tokens, qk_features});
    v_flat = qkv.narrow(0, tokens * qk_features, tokens * v_features).view({tokens, v_features});
  } else {
    const Tensor rows = qkv.view({tokens, qk_features + v_features});
    qk_flat = rows.narrow(1, 0, qk_features);
    v_flat = rows.narrow(1, qk_features, v_features);
  }
  const Tensor qk = qk_flat.view({tokens, 2 * num_heads, qk_dim});
  const Tensor v = v_flat.view({tokens, num_heads, v_dim});
  const auto shape = rope_output_shape(args, qk, num_heads, paired);
  Tensor q = at::empty(shape, bf16);
  Tensor k = at::empty(shape, bf16);

  PackedQkvForwardParams params;
  params.x_f8 = args.view(x_f8, "x_f8");
  params.weight_f8 = args.view(weight_f8, "weight_f8");
  params.x_scale = args.view(x_scale, "x_scale");
  params.weight_scale = args.view(weight_scale, "weight_scale");
  params.qkv_scale = args.view(qkv_scale, "qkv_scale");
  params.factor1 = args.view(factor1, "factor1");
  params.factor2 = args.view(factor2, "factor2");
  params.qk = args.view(qk, "qk");
  params.v = args.view(v, "v");
  params.q = args.view(q, "q");
  params.k = args.view(k, "k");
  params.layout = rope_layout(num_heads, rotary_dim, paired, key_offset);
  params.stream = current_stream(x_f8);
  qkvfuse::packed_qkv_forward(params);
  return {q, k, qkv};
}

// Returns (grad_x, grad_weight, grad_qkv_scale). grad_weight is [qkv_dim, C]: the gradients of
// qk_weight (its first 2HD rows) and v_weight (the rest), written by one wgrad GEMM.
std::tuple<Tensor, Tensor, Tensor> packed_qkv_backward(
    const Tensor& grad_q, const Tensor& grad_k, const Tensor& grad_v, const Tensor& qk,
    const Tensor& factor1, const Tensor& factor2, const Tensor& x_f8_t, const Tensor& weight_f8_t,
    const Tensor& qk_weight, const Tensor& v_weight, const Tensor& x_scale,
    const Tensor& weight_scale, const Tensor& qkv_scale, const Tensor& grad_scale,
    int64_t num_heads, int64_t rotary_dim, bool paired, bool key_offset) {
  const OpArgs args("packed_qkv_backward");
  const c10::DeviceGuard guard(qk.device());
  args.expect_dims(qk, 3, "qk", "[T, 2H, D]");
  args.expect_dims(x_f8_t, 2, "x_f8_t", "[C, T]");
  args.expect_dims(qk_weight, 2, "qk_weight", "[2*H*D, C]");
  args.expect_dims(v_weight, 2, "v_weight", "[H*Dv, C]");
  const TensorView qkv_scale_view = args.view(qkv_scale, "qkv_scale");
  const int64_t tokens = qk.size(0);
  const int64_t channels = x_f8_t.size(0);
  const int64_t qk_features = qk_weight.size(0);
  const int64_t v_features = v_weight.size(0);
  const auto bf16 = qk.options().dtype(at::kBFloat16);
  const auto f32 = qk.options().dtype(at::kFloat);

  Tensor grad_x = at::empty({tokens, channels}, bf16);
  Tensor grad_weight = at::empty({qk_features + v_features, channels}, bf16);
  Tensor grad_qkv_scale = at::empty(qkv_scale.sizes(), f32);
  // Workspaces: the caching allocator takes them back when the op returns; on CUDA the stream
  // order makes the memory safe to reuse for work queued after this op.
  Tensor grad_row = at::empty({tokens, qk_features + v_features}, e4m3_like(qk));
  Tensor grad_t = at::empty({qk_features + v_features, tokens}, e4m3_like(qk));
  Tensor partials = at::empty({kGradScalePartials}, f32);

  PackedQkvBackwardParams params;
  params.grad_q = args.view(grad_q, "grad_q");
  params.grad_k = args.view(grad_k, "grad_k");
  params.grad_v = args.view(grad_v, "grad_v");
  params.qk = args.view(qk, "qk");
  params.factor1 = args.view(factor1, "factor1");
  params.factor2 = args.view(factor2, "factor2");
  params.x_f8_t = args.view(x_f8_t, "x_f8_t");
  params.weight_f8_t = args.view(weight_f8_t, "weight_f8_t");
  params.qk_weight = args.view(qk_weight, "qk_weight");
  params.v_weight = args.view(v_weight, "v_weight");
  params.x_scale = args.view(x_scale, "x_scale");
  params.weight_scale = args.view(weight_scale, "weight_scale");
  params.qkv_scale = qkv_scale_view;
  params.grad_scale = args.view(grad_scale, "grad_scale");
  params.grad_row = args.view(grad_row, "grad_row");
  params.grad_t = args.view(grad_t, "grad_t");
  params.partials = args.view(partials, "partials");
  params.grad_x = args.view(grad_x, "grad_x");
  params.grad_qk_weight = args.view(grad_weight.narrow(0, 0, qk_features), "grad_qk_weight");
  params.grad_v_weight = args.view(grad_weight.narrow(0, qk_features, v_features), "grad_v_weight");
  params.grad_qkv_scale = args.view(grad_qkv_scale, "grad_qkv_scale");
  params.layout = rope_layout(num_heads, rotary_dim, paired, key_offset);
  params.stream = current_stream(qk);
  qkvfuse::packed_qkv_backward(params);
  if (tokens == 0) {
    // The library writes nothing at T = 0; a sum over no tokens is 0.
    grad_weight.zero_();
    grad_qkv_scale.zero_();
  }
  return {grad_x, grad_weight, grad_qkv_scale};
}

// The Autograd kernel of the ops without a gradient of their own: the FP8 producers, the backward
// ops, and the packed forward (whose gradient python/qkvfuse/packed.py defines around it). It runs
// the op below autograd, so outputs simply do not require grad, instead of carrying the fallback's
// grad_fn that fails only when a backward reaches it. (qk_norm_rope's autograd is registered from
// Python with torch.library.register_autograd.)
void run_without_gradient(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const at::AutoDispatchBelowADInplaceOrView guard;
  op.callBoxed(stack);
}

constexpr const char* kOpsWithoutGradient[] = {
    "qk_norm_rope_backward", "qkv_backward_fp8", "quantize_dual_layout",
    "quantize_dual_layout_amax", "quantize_weight_bank", "fp8_gemm",
    "packed_qkv_forward", "packed_qkv_backward",
};

void register_kernels(torch::Library& m) {
  m.impl("qk_norm_rope", &qk_norm_rope);
  m.impl("qk_norm_rope_backward", &qk_norm_rope_backward);
  m.impl("qkv_backward_fp8", &qkv_backward_fp8);
  m.impl("quantize_dual_layout", &quantize_dual_layout);
  m.impl("quantize_dual_layout_amax", &quantize_dual_layout_amax);
  m.impl("quantize_weight_bank", &quantize_weight_bank);
  m.impl("fp8_gemm", &fp8_gemm);
  m.impl("packed_qkv_forward", &packed_qkv_forward);
  m.impl("packed_qkv_backward", &packed_qkv_backward);
}

}  // namespace
}  // namespace qkvfuse::torch_binding

// Schemas. Argument names match the Python package and the C++ params structs. pt2_compliant_tag:
// each op has a fake kernel (python/qkvfuse/_fake.py) and passes torch.library.opcheck.
TORCH_LIBRARY(qkvfuse, m) {
  // Tells torch where the fake kernels are registered, so it can name the module to import.
  m.set_python_module("qkvfuse._fake");
  const std::vector<at::Tag> tags{at::Tag::pt2_compliant_tag};
  m.def("qk_norm_rope(Tensor qk, Tensor factor1, Tensor factor2, int num_heads, int rotary_dim, "
        "bool paired, bool key_offset) -> (Tensor q, Tensor k)",
        tags);
  m.def("qk_norm_rope_backward(Tensor grad_q, Tensor grad_k, Tensor qk, Tensor factor1, "
        "Tensor factor2, int num_heads, int rotary_dim, bool paired, bool key_offset) -> Tensor",
        tags);
  m.def("qkv_backward_fp8(Tensor grad_q, Tensor grad_k, Tensor grad_v, Tensor qk, "
        "Tensor factor1, Tensor factor2, Tensor grad_scale, int num_heads, int rotary_dim, "
        "bool paired, bool key_offset) -> (Tensor grad_row, Tensor grad_t)",
        tags);
  m.def("quantize_dual_layout(Tensor x, Tensor scale) -> (Tensor row, Tensor t)", tags);
  m.def("quantize_dual_layout_amax(Tensor x, Tensor scale) -> (Tensor row, Tensor t, Tensor amax)",
        tags);
  m.def("quantize_weight_bank(Tensor weights) -> (Tensor row, Tensor t, Tensor scale)", tags);
  m.def("fp8_gemm(Tensor a, Tensor b, Tensor scale_a, Tensor scale_b, Tensor? alpha=None, "
        "bool fast_accum=False) -> Tensor",
        tags);
  m.def("packed_qkv_forward(Tensor x_f8, Tensor weight_f8, Tensor x_scale, Tensor weight_scale, "
        "Tensor qkv_scale, Tensor factor1, Tensor factor2, int num_heads, int qk_dim, int v_dim, "
        "int rotary_dim, bool paired, bool key_offset) -> (Tensor q, Tensor k, Tensor qkv)",
        tags);
  m.def("packed_qkv_backward(Tensor grad_q, Tensor grad_k, Tensor grad_v, Tensor qk, "
        "Tensor factor1, Tensor factor2, Tensor x_f8_t, Tensor weight_f8_t, Tensor qk_weight, "
        "Tensor v_weight, Tensor x_scale, Tensor weight_scale, Tensor qkv_scale, "
        "Tensor grad_scale, int num_heads, int rotary_dim, bool paired, bool key_offset) "
        "-> (Tensor grad_x, Tensor grad_weight, Tensor grad_qkv_scale)",
        tags);
}

TORCH_LIBRARY_IMPL(qkvfuse, CPU, m) { qkvfuse::torch_binding::register_kernels(m); }
TORCH_LIBRARY_IMPL(qkvfuse, CUDA, m) { qkvfuse::torch_binding::register_kernels(m); }
TORCH_LIBRARY_IMPL(qkvfuse, Autograd, m) {
  for (const char* name : qkvfuse::torch_binding::kOpsWithoutGradient) {
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<
                     &qkvfuse::torch_binding::run_without_gradient>());
  }
}
