// qk_norm_rope.cpp: the public QK-norm + rotary entry points (forward and backward), the
// backward's workspace size and the position check: validate every argument, skip empty work,
// run on the device the tensors live on.
#include "qkvfuse/qk_norm_rope.hpp"

#include <vector>

#include "backend.hpp"
#include "qkvfuse/error.hpp"
#include "validate.hpp"

namespace qkvfuse {

namespace validate {

Device validate_qk_norm_rope(const QkNormRopeParams& p, const std::string& op) {
  const Checker check(op);
  check.not_pending_on_cuda(p.layout, p.qk);
  const std::vector<Arg> inputs =
      concat({{p.qk, "qk"}, {p.v, "v", true}}, rope_tensor_args(p.layout));
  const std::vector<Arg> outputs = {{p.q, "q"}, {p.k, "k"}, {p.v_out, "v_out", true}};
  const Device device = check.same_device(concat(inputs, outputs));
  const RopeShape shape = rope_inputs(check, p.qk, p.layout, device, /*wide_qk_on_cpu=*/true);
  rope_output_pair(check, outputs[0], outputs[1], shape, p.qk.dtype, /*contiguous=*/true);
  const int64_t v_dim = rope_v_input(check, p.layout, inputs[1], shape, p.qk.dtype, device);
  rope_v_output(check, p.layout, outputs[2], shape, v_dim, p.qk.dtype, /*contiguous=*/true);
  check.no_overlap(outputs, inputs);
  return device;
}

namespace {

Device validate_qk_norm_rope_backward(const QkNormRopeBackwardParams& p) {
  const Checker check("qk_norm_rope_backward");
  check.not_pending_on_cuda(p.layout, p.qk);
  const std::vector<Arg> inputs =
      concat({{p.grad_q, "grad_q"},
              {p.grad_k, "grad_k"},
              {p.qk, "qk"},
              {p.grad_v_out, "grad_v_out", true},
              {p.v, "v", true}},
             rope_tensor_args(p.layout));
  const std::vector<Arg> outputs = {{p.grad_qk, "grad_qk"},
                                    {p.grad_q_weight, "grad_q_weight", true},
                                    {p.grad_k_weight, "grad_k_weight", true},
                                    {p.workspace, "workspace", true},
                                    {p.grad_v, "grad_v", true}};
  const Device device = check.same_device(concat(inputs, outputs));
  const RopeShape shape = rope_inputs(check, p.qk, p.layout, device, /*wide_qk_on_cpu=*/true);
  rope_output_pair(check, inputs[0], inputs[1], shape, p.qk.dtype, /*contiguous=*/false);
  const int64_t v_dim = rope_v_input(check, p.layout, inputs[4], shape, p.qk.dtype, device);
  rope_v_output(check, p.layout, inputs[3], shape, v_dim, p.qk.dtype, /*contiguous=*/false);
  rope_v_output(check, p.layout, outputs[4], shape, v_dim, p.qk.dtype, /*contiguous=*/true);
  check.dtype(p.grad_qk, "grad_qk", p.qk.dtype);
  check.shape(p.grad_qk, "grad_qk", {shape.tokens, shape.q_heads + shape.kv_heads, shape.head_dim},
              "(qk's shape)");
  check.contiguous(p.grad_qk, "grad_qk");
  check.element_aligned(p.grad_qk, "grad_qk");
  rope_weight_grads(check, p.layout, shape, outputs[1], outputs[2], outputs[3],
                    backward_workspace_size(p));
  check.no_overlap(outputs, inputs);
  return device;
}

}  // namespace
}  // namespace validate

void qk_norm_rope(const QkNormRopeParams& params) {
  const Device device = validate::validate_qk_norm_rope(params, "qk_norm_rope");
  if (params.qk.sizes[0] == 0) return;  // T = 0: nothing to compute
  validate::check_positions_if_asked(params.layout, params.stream);
  if (device.type == DeviceType::kCUDA) {
    cuda::qk_norm_rope(params);
  } else {
    cpu::qk_norm_rope(params);
  }
}

void qk_norm_rope_backward(const QkNormRopeBackwardParams& params) {
  const Device device = validate::validate_qk_norm_rope_backward(params);
  validate::check_positions_if_asked(params.layout, params.stream);
  if (device.type == DeviceType::kCUDA) {
    cuda::qk_norm_rope_backward(params);
  } else {
    cpu::qk_norm_rope_backward(params);
  }
}

int64_t backward_workspace_size(const QkNormRopeBackwardParams& params) {
  const bool weighted = !is_absent(params.layout.q_weight) || !is_absent(params.layout.k_weight);
  if (!weighted || params.qk.device.type != DeviceType::kCUDA || params.qk.ndim != 3) return 0;
  // A layout the CUDA kernels do not take yet has no workspace: its call is refused.
  if (!validate::cuda_pending_option(params.layout, params.qk.sizes[2]).empty()) return 0;
  return cuda::backward_workspace_size(params);
}

void check_positions(const TensorView& positions, int64_t num_positions, Stream stream) {
  const validate::Checker check("check_positions");
  const Device device = check.same_device({{positions, "positions"}});
  check.dtype_in(positions, "positions", {DType::kInt32, DType::kInt64});
  check.ndim(positions, "positions", 1);
  check.element_aligned(positions, "positions");
  QKVF_CHECK(num_positions >= 0, "check_positions: num_positions: expected >= 0, got ",
             num_positions);
  if (positions.sizes[0] == 0) return;
  const BadPosition bad = device.type == DeviceType::kCUDA
                              ? cuda::find_bad_position(positions, num_positions, stream)
                              : cpu::find_bad_position(positions, num_positions);
  QKVF_CHECK(bad.index < 0, "check_positions: positions[", bad.index, "] = ", bad.value,
             " lies outside [0, ", num_positions, "), the rows of cos_sin");
}

}  // namespace qkvfuse
