// cpu/qkv_backward_fp8.cpp: the CPU reference of the fused backward into FP8 (SPEC.md section 3).
//
//   Q/K features f = h2*D + d:               code = e4m3(bf16(dx[t, h2, d]) / grad_scale)
//   V features   f = (Hq+Hkv)*D + h*Dv + d:  code = e4m3(grad_v[t, h, d] / grad_scale), or with
//                the V norm (SPEC.md section 9) e4m3(bf16(dv[t, h, d]) / grad_scale), dv its
//                gradient
//   grad_row[t, f] = grad_t[f, t] = code
// with dx the QK-norm/rotary backward of sections 2 and 8 and both divisions true fp32 divisions.
//
// The QK part reuses the bf16 backward (cpu::qk_norm_rope_backward, which also writes the norm
// weights' gradients and, with the V norm, dv) into temporary bf16 buffers [T, Hq + Hkv, D] and
// [T, Hkv, Dv]: that *is* "rounded to bf16 first", so the two ops cannot drift apart. The GPU
// kernel fuses these steps; the reference spends the extra buffer for one definition of dx.
#include <cstdint>
#include <vector>

#include "backend.hpp"
#include "cpu/parallel.hpp"
#include "qkvfuse/numeric.hpp"

namespace qkvfuse::cpu {

void qkv_backward_fp8(const QkvBackwardFp8Params& p) {
  const int64_t tokens = p.qk.sizes[0];
  const int64_t heads2 = p.qk.sizes[1];
  const int64_t head_dim = p.qk.sizes[2];
  const int64_t heads = p.grad_v.sizes[1];
  const int64_t v_dim = p.grad_v.sizes[2];
  const int64_t qk_features = heads2 * head_dim;
  const int64_t features = qkv_dim(p.layout, head_dim, v_dim);

  std::vector<uint16_t> dx(size_t(tokens * qk_features));
  std::vector<uint16_t> dv(p.layout.normalize_v ? size_t(tokens * heads * v_dim) : 0);
  const TensorView dv_view =
      p.layout.normalize_v
          ? make_view(dv.data(), DType::kBFloat16, p.qk.device, {tokens, heads, v_dim})
          : TensorView{};
  const QkNormRopeBackwardParams rope{
      .grad_q = p.grad_q,
      .grad_k = p.grad_k,
      .qk = p.qk,
      .grad_qk = make_view(dx.data(), DType::kBFloat16, p.qk.device, {tokens, heads2, head_dim}),
      .grad_q_weight = p.grad_q_weight,
      .grad_k_weight = p.grad_k_weight,
      .workspace = {},
      .layout = p.layout,
      .grad_v_out = p.layout.normalize_v ? p.grad_v : TensorView{},
      .v = p.v,
      .grad_v = dv_view,
  };
  cpu::qk_norm_rope_backward(rope);  // qualified: ADL would also find the public op

  const float scale = *p.grad_scale.ptr<const float>();
  auto* row = p.grad_row.ptr<uint8_t>();
  auto* transposed = p.grad_t.ptr<uint8_t>();
  const auto* grad_v = p.grad_v.ptr<const uint16_t>();
  parallel_for(tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const auto write = [&](int64_t feature, uint16_t bf16) {
        const uint8_t code = float_to_e4m3(bf16_to_float(bf16) / scale);
        row[t * features + feature] = code;
        transposed[feature * tokens + t] = code;
      };
      for (int64_t f = 0; f < qk_features; ++f) write(f, dx[size_t(t * qk_features + f)]);
      for (int64_t h = 0; h < heads; ++h) {
        const uint16_t* g = p.layout.normalize_v
                                ? dv.data() + (t * heads + h) * v_dim
                                : grad_v + t * p.grad_v.strides[0] + h * p.grad_v.strides[1];
        for (int64_t d = 0; d < v_dim; ++d) write(qk_features + h * v_dim + d, g[d]);
      }
    }
  });
}

}  // namespace qkvfuse::cpu
