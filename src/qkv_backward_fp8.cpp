// qkv_backward_fp8.cpp: the public fused FP8 backward entry point: validate, skip empty work,
// dispatch.
#include "qkvfuse/qkv_backward_fp8.hpp"

#include <string>
#include <vector>

#include "backend.hpp"
#include "qkvfuse/error.hpp"
#include "validate.hpp"

namespace qkvfuse {

namespace validate {

Device validate_qkv_backward_fp8(const QkvBackwardFp8Params& p, const std::string& op) {
  const Checker check(op);
  const std::vector<Arg> inputs = {
      {p.grad_q, "grad_q"},   {p.grad_k, "grad_k"},   {p.grad_v, "grad_v"},        {p.qk, "qk"},
      {p.factor1, "factor1"}, {p.factor2, "factor2"}, {p.grad_scale, "grad_scale"}};
  const std::vector<Arg> outputs = {{p.grad_row, "grad_row"}, {p.grad_t, "grad_t"}};
  const Device device = check.same_device(concat(inputs, outputs));
  const RopeShape shape = rope_inputs(check, p.qk, p.factor1, p.factor2, p.layout, device,
                                      /*wide_qk_on_cpu=*/false);
  rope_output_pair(check, inputs[0], inputs[1], shape, DType::kBFloat16,
                   /*contiguous=*/false);

  const int64_t tokens = shape.tokens;
  const int64_t heads = shape.heads;
  check.dtype(p.grad_v, "grad_v", DType::kBFloat16);
  check.shape(p.grad_v, "grad_v", {tokens, heads, Dim::any("Dv")}, "(T and H from qk)");
  // CUDA stages a token tile's Q, K and V features in shared memory: Dv is bounded there.
  const bool cuda = device.type == DeviceType::kCUDA;
  const std::string v_range = cuda ? "in [1, " + std::to_string(cuda::kMaxVWidth) + "]" : ">= 1";
  QKVF_CHECK(p.grad_v.sizes[2] >= 1 && (!cuda || p.grad_v.sizes[2] <= cuda::kMaxVWidth), op,
             ": grad_v: expected a V head width Dv ", v_range, " on ", device_name(device),
             ", got ", p.grad_v.describe());
  check.last_dim_contiguous(p.grad_v, "grad_v");
  check.element_aligned(p.grad_v, "grad_v");
  check.scalar_f32(p.grad_scale, "grad_scale");
  check.aligned(p.grad_scale, "grad_scale", device);

  const int64_t qkv_dim = 2 * heads * shape.head_dim + heads * p.grad_v.sizes[2];
  const std::string why = "(qkv_dim = 2*H*D + H*Dv = " + std::to_string(qkv_dim) + ")";
  check.dtype(p.grad_row, "grad_row", DType::kFloat8E4M3);
  check.shape(p.grad_row, "grad_row", {tokens, qkv_dim}, why);
  check.dtype(p.grad_t, "grad_t", DType::kFloat8E4M3);
  check.shape(p.grad_t, "grad_t", {qkv_dim, tokens}, why);
  for (const Arg& out : outputs) {
    check.contiguous(out.view, out.name);
    check.element_aligned(out.view, out.name);
  }
  check.no_overlap(outputs, inputs);
  return device;
}

}  // namespace validate

void qkv_backward_fp8(const QkvBackwardFp8Params& params) {
  const Device device = validate::validate_qkv_backward_fp8(params, "qkv_backward_fp8");
  if (params.qk.sizes[0] == 0) return;  // T = 0: nothing to compute
  if (device.type == DeviceType::kCUDA) {
    cuda::qkv_backward_fp8(params);
  } else {
    cpu::qkv_backward_fp8(params);
  }
}

}  // namespace qkvfuse
