// qk_norm_rope.cpp: the public QK-norm + rotary entry points (forward and backward): validate
// every argument, skip empty work, run on the device the tensors live on.
#include "qkvfuse/qk_norm_rope.hpp"

#include <vector>

#include "backend.hpp"
#include "qkvfuse/error.hpp"
#include "validate.hpp"

namespace qkvfuse {

namespace validate {

Device validate_qk_norm_rope(const QkNormRopeParams& p, const std::string& op) {
  const Checker check(op);
  const std::vector<Arg> inputs = {{p.qk, "qk"}, {p.factor1, "factor1"}, {p.factor2, "factor2"}};
  const std::vector<Arg> outputs = {{p.q, "q"}, {p.k, "k"}};
  const Device device = check.same_device(concat(inputs, outputs));
  const RopeShape shape = rope_inputs(check, p.qk, p.factor1, p.factor2, p.layout, device,
                                      /*wide_qk_on_cpu=*/true);
  rope_output_pair(check, outputs[0], outputs[1], shape, p.qk.dtype, /*contiguous=*/true);
  check.no_overlap(outputs, inputs);
  return device;
}

namespace {

Device validate_qk_norm_rope_backward(const QkNormRopeBackwardParams& p) {
  const Checker check("qk_norm_rope_backward");
  const std::vector<Arg> inputs = {{p.grad_q, "grad_q"},
                                   {p.grad_k, "grad_k"},
                                   {p.qk, "qk"},
                                   {p.factor1, "factor1"},
                                   {p.factor2, "factor2"}};
  const std::vector<Arg> outputs = {{p.grad_qk, "grad_qk"}};
  const Device device = check.same_device(concat(inputs, outputs));
  const RopeShape shape = rope_inputs(check, p.qk, p.factor1, p.factor2, p.layout, device,
                                      /*wide_qk_on_cpu=*/true);
  rope_output_pair(check, inputs[0], inputs[1], shape, p.qk.dtype, /*contiguous=*/false);
  check.dtype(p.grad_qk, "grad_qk", p.qk.dtype);
  check.shape(p.grad_qk, "grad_qk", {shape.tokens, 2 * shape.heads, shape.head_dim},
              "(qk's shape)");
  check.contiguous(p.grad_qk, "grad_qk");
  check.element_aligned(p.grad_qk, "grad_qk");
  check.no_overlap(outputs, inputs);
  return device;
}

}  // namespace
}  // namespace validate

void qk_norm_rope(const QkNormRopeParams& params) {
  const Device device = validate::validate_qk_norm_rope(params, "qk_norm_rope");
  if (params.qk.sizes[0] == 0) return;  // T = 0: nothing to compute
  if (device.type == DeviceType::kCUDA) {
    cuda::qk_norm_rope(params);
  } else {
    cpu::qk_norm_rope(params);
  }
}

void qk_norm_rope_backward(const QkNormRopeBackwardParams& params) {
  const Device device = validate::validate_qk_norm_rope_backward(params);
  if (params.qk.sizes[0] == 0) return;
  if (device.type == DeviceType::kCUDA) {
    cuda::qk_norm_rope_backward(params);
  } else {
    cpu::qk_norm_rope_backward(params);
  }
}

}  // namespace qkvfuse
