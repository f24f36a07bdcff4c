// fused_qkv_gemm_support.cpp: which layouts and sizes the fused QKV GEMM is built for
// (fused_qkv_unsupported, fused_qkv_gemm.hpp). Plain host code in every build, CPU-only ones
// included: fused_qkv_gemm's validation throws its reason, and the packed op's forward asks it
// before choosing a GEMM (ForwardGemm), so the two cannot disagree.
#include <cmath>
#include <cstdint>
#include <string>

#include "cuda/fused_qkv_gemm.hpp"
#include "qkvfuse/error.hpp"
#include "rope_math.hpp"

namespace qkvfuse::cuda {

using detail::concat;

std::string fused_qkv_unsupported(const RopeLayout& layout, const FusedQkvSizes& sizes) {
  const int64_t head_dim = sizes.head_dim;
  // The epilogue's norm + rotary: weightless RMS-norm, factor tables.
  if (!is_absent(layout.cos_sin) || !is_absent(layout.positions)) {
    return "layout: a cos/sin cache (cos_sin, positions) is not built into the fused epilogue; "
           "pass the factor tables layout.factor1, layout.factor2";
  }
  if (!layout.normalize) {
    return "layout.normalize = false (no QK norm) is not built into the fused epilogue";
  }
  if (!is_absent(layout.q_weight) || !is_absent(layout.k_weight)) {
    return "layout: norm weights (q_weight, k_weight) are not built into the fused epilogue";
  }
  // One factor dtype is built (FusedFactor, fused_qkv_gemm_args.hpp).
  if (layout.factor1.dtype != DType::kBFloat16) {
    return concat("layout.factor1: the fused epilogue is built for bfloat16 factor tables only, "
                  "got ", dtype_name(layout.factor1.dtype),
                  " (float32 tables run on the unfused forward: fp8_gemm + qk_norm_rope)");
  }
  if (head_dim != 64 && head_dim != 96 && head_dim != 128) {
    return concat("no fused kernel for head width D = ", head_dim,
                  "; built: D = 64, 96 and 128 (a CTA tile holds whole heads)");
  }
  // Lanes >= r pass through (keys' from token t-1 under key offset); the epilogue is built for
  // that with key offset, the speedrun's long-window layers, and otherwise for r = D only.
  const int64_t rotary_dim = rope::resolved_rotary_dim(layout, head_dim);
  if (rotary_dim != head_dim && !layout.key_offset) {
    return concat("layout.rotary_dim: a partial rotary (r = ", rotary_dim, " < D = ", head_dim,
                  ") is built only with key_offset; expected -1 or D");
  }
  if (layout.rotary_style == RotaryStyle::kNeox) {
    // The NeoX partner (d +- D/2) must be whole 32-column blocks away (fused_qkv_epilogue.cuh).
    if (head_dim % 64 != 0) {
      return concat("layout.rotary_style = kNeox is built for D a multiple of 64, got D = ",
                    head_dim);
    }
    if (rotary_dim != head_dim || layout.key_offset) {
      return concat("layout.rotary_style = kNeox is built for a rotary width of D only (rotary_dim "
                    "-1 or D, no key_offset), got rotary_dim = ", layout.rotary_dim,
                    ", key_offset = ", layout.key_offset);
    }
  }
  // reciprocal_sqrt_rn's exact range (fused_qkv_epilogue.cuh, rms_rstd).
  if (!(std::isfinite(layout.eps) && layout.eps >= 0x1p-100f)) {
    return concat("layout.eps: expected a finite value >= 2^-100, got ", layout.eps);
  }
  const int64_t q_heads = layout.num_heads;
  const int64_t kv = kv_heads(layout);
  const int64_t tile_n = fused_tile_n(int(head_dim));
  if ((q_heads + kv) * head_dim % tile_n != 0) {
    return concat("expected (Hq + Hkv) * D a multiple of ", tile_n,
                  " (no CTA tile may hold both Q/K and V columns), got (", q_heads, " + ", kv,
                  ") * ", head_dim);
  }
  if (sizes.v_dim < 8 || sizes.v_dim % 8 != 0) {
    return concat("v: expected Dv a multiple of 8 (16-byte chunks of one head), got ", sizes.v_dim);
  }
  // The kernel's M, N and its paired output rows are int.
  constexpr int64_t kInt32Max = (int64_t(1) << 31) - 1;
  const int64_t n = (q_heads + kv) * head_dim + kv * sizes.v_dim;
  if (sizes.tokens > kInt32Max / 2 || n > kInt32Max) {
    return concat("T and N must fit in int32 (2T too), got T = ", sizes.tokens, ", N = ", n);
  }
  return {};
}

}  // namespace qkvfuse::cuda
