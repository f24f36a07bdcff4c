// qkv_backward_fp8.cpp: the public fused FP8 backward entry point: validate, dispatch.
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
  check.not_pending_on_cuda(p.layout, p.qk);
  const std::vector<Arg> inputs = concat({{p.grad_q, "grad_q"},
                                          {p.grad_k, "grad_k"},
                                          {p.grad_v, "grad_v"},
                                          {p.qk, "qk"},
                                          {p.grad_scale, "grad_scale"},
                                          {p.v, "v", true}},
                                         rope_tensor_args(p.layout));
  const std::vector<Arg> outputs = {{p.grad_row, "grad_row"},
                                    {p.grad_t, "grad_t"},
                                    {p.grad_q_weight, "grad_q_weight", true},
                                    {p.grad_k_weight, "grad_k_weight", true},
                                    {p.workspace, "workspace", true}};
  const Device device = check.same_device(concat(inputs, outputs));
  const RopeShape shape = rope_inputs(check, p.qk, p.layout, device, /*wide_qk_on_cpu=*/false);
  rope_output_pair(check, inputs[0], inputs[1], shape, DType::kBFloat16, /*contiguous=*/false);

  const int64_t tokens = shape.tokens;
  check.dtype(p.grad_v, "grad_v", DType::kBFloat16);
  check.shape(p.grad_v, "grad_v", {tokens, shape.kv_heads, Dim::any("Dv")},
              "(T from qk, num_kv_heads)");
  // CUDA stages a token tile's Q, K and V features in shared memory: Dv is bounded there.
  const bool cuda = device.type == DeviceType::kCUDA;
  const std::string v_range = cuda ? "in [1, " + std::to_string(cuda::kMaxVWidth) + "]" : ">= 1";
  QKVF_CHECK(p.grad_v.sizes[2] >= 1 && (!cuda || p.grad_v.sizes[2] <= cuda::kMaxVWidth), op,
             ": grad_v: expected a V head width Dv ", v_range, " on ", device_name(device),
             ", got ", p.grad_v.describe());
  check.last_dim_contiguous(p.grad_v, "grad_v");
  check.element_aligned(p.grad_v, "grad_v");
  // The V norm's saved input: grad_v's shape (rope_v_input checks presence and the layout).
  const int64_t v_dim = rope_v_input(check, p.layout, inputs[5], shape, DType::kBFloat16, device);
  QKVF_CHECK(!p.layout.normalize_v || v_dim == p.grad_v.sizes[2], op,
             ": v: expected grad_v's V head width Dv = ", p.grad_v.sizes[2], ", got ",
             p.v.describe());
  check.scalar_f32(p.grad_scale, "grad_scale");
  check.aligned(p.grad_scale, "grad_scale", device);

  const int64_t features = qkv_dim(p.layout, shape.head_dim, p.grad_v.sizes[2]);
  const std::string why =
      "(qkv_dim = (Hq + Hkv)*D + Hkv*Dv = " + std::to_string(features) + ")";
  check.dtype(p.grad_row, "grad_row", DType::kFloat8E4M3);
  check.shape(p.grad_row, "grad_row", {tokens, features}, why);
  check.dtype(p.grad_t, "grad_t", DType::kFloat8E4M3);
  check.shape(p.grad_t, "grad_t", {features, tokens}, why);
  for (const Arg& out : {outputs[0], outputs[1]}) {
    check.contiguous(out.view, out.name);
    check.element_aligned(out.view, out.name);
  }
  rope_weight_grads(check, p.layout, shape, outputs[2], outputs[3], outputs[4],
                    backward_workspace_size(p));
  check.no_overlap(outputs, inputs);
  return device;
}

}  // namespace validate

void qkv_backward_fp8(const QkvBackwardFp8Params& params) {
  const Device device = validate::validate_qkv_backward_fp8(params, "qkv_backward_fp8");
  validate::check_positions_if_asked(params.layout, params.stream);
  if (device.type == DeviceType::kCUDA) {
    cuda::qkv_backward_fp8(params);
  } else {
    cpu::qkv_backward_fp8(params);
  }
}

int64_t backward_workspace_size(const QkvBackwardFp8Params& params) {
  const bool weighted = !is_absent(params.layout.q_weight) || !is_absent(params.layout.k_weight);
  // CUDA runs a token-wide norm through a bf16 dx in the workspace (src/cuda/qkv_backward_fp8.cu).
  const bool token = params.layout.norm_scope == NormScope::kToken;
  if (!(weighted || token) || params.qk.device.type != DeviceType::kCUDA || params.qk.ndim != 3) {
    return 0;
  }
  if (!validate::cuda_pending_option(params.layout, params.qk.sizes[2]).empty()) return 0;
  return cuda::backward_workspace_size(params);
}

}  // namespace qkvfuse
