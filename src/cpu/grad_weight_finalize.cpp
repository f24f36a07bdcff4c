// cpu/grad_weight_finalize.cpp: the last step of the packed backward (SPEC.md section 6).
//
//   grad_qkv_scale = sum_i grad_weight[i] * weight[i]     over [grad_qk_weight; grad_v_weight]
//   grad_weight[i] = bf16(grad_weight[i] * qkv_scale)     in place, after its product was taken
// Each product of two bf16 values is exact in fp32. The reduction order is fixed by the element
// count alone: the concatenated weights are cut into kGradScalePartials contiguous chunks of
// ceil(n / kGradScalePartials) elements, each chunk summed in fp32 in index order into
// partials[p], then the partials summed in fp32 in order. Threads split the chunks, so the bits
// do not depend on the thread count.
#include <algorithm>
#include <cstdint>

#include "backend.hpp"
#include "cpu/parallel.hpp"
#include "qkvfuse/numeric.hpp"
#include "qkvfuse/packed_qkv.hpp"

namespace qkvfuse::cpu {

void grad_weight_finalize(const GradWeightFinalizeParams& p) {
  const int64_t qk_count = p.grad_qk_weight.numel();
  const int64_t total = qk_count + p.grad_v_weight.numel();
  const int64_t chunk = (total + kGradScalePartials - 1) / kGradScalePartials;
  const float qkv_scale = *p.qkv_scale.ptr<const float>();
  float* partials = p.partials.ptr<float>();

  // Element i of the concatenation [qk part; v part]; both parts are contiguous.
  const auto grad_at = [&](int64_t i) -> uint16_t& {
    return i < qk_count ? p.grad_qk_weight.ptr<uint16_t>()[i]
                        : p.grad_v_weight.ptr<uint16_t>()[i - qk_count];
  };
  const auto weight_at = [&](int64_t i) {
    return i < qk_count ? p.qk_weight.ptr<const uint16_t>()[i]
                        : p.v_weight.ptr<const uint16_t>()[i - qk_count];
  };

  parallel_for(kGradScalePartials, 8, [&](int64_t begin, int64_t end) {
    for (int64_t part = begin; part < end; ++part) {
      const int64_t first = std::min(total, part * chunk);
      const int64_t last = std::min(total, first + chunk);
      float sum = 0.0f;
      for (int64_t i = first; i < last; ++i) {
        uint16_t& grad = grad_at(i);
        const float g = bf16_to_float(grad);
        sum += g * bf16_to_float(weight_at(i));
        grad = float_to_bf16(g * qkv_scale);
      }
      partials[part] = sum;
    }
  });

  float sum = 0.0f;
  for (int64_t part = 0; part < kGradScalePartials; ++part) sum += partials[part];
  *p.grad_qkv_scale.ptr<float>() = sum;
}

}  // namespace qkvfuse::cpu
