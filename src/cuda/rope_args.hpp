// rope_args.hpp: the arguments of the rope kernels (forward, bf16 backward, fused FP8 backward),
// built once from the public layout. Internal; the kernels take them by value.
//
// RopeInputs is the part every rope kernel reads: the saved qk rows, the layout's integer shape
// and flags, the angle source and the norm weights. make_rope_inputs() is the one place that
// translates a validated RopeLayout into it; each op's launcher adds its own outputs.
// Section9Inputs is what SPEC.md section 9's options add (the token-wide norm, the V norm): its
// own struct at the end of each kernel's arguments, after everything the kernels of sections 1-8
// read, so that those kernels keep their parameters where they were (their SASS is the code that
// ran on a GPU; docs/perf_notes.md, "Section 9 on CUDA").
#pragma once

#include <cstdint>

#include "qkvfuse/qk_norm_rope.hpp"
#include "qkvfuse/tensor.hpp"
#include "rope_math.hpp"

namespace qkvfuse::cuda::rope {

using qkvfuse::rope::Dims;

/// Where a rope kernel reads its angles (SPEC.md sections 1 and 8).
struct Angles {
  bool cache;                ///< cos/sin cache (else factor tables)
  const void* factor1;       ///< tables [T, D] ([T, 2D] paired): (t, j) at t*factor1_stride + j
  const void* factor2;       ///< same shape and dtype as factor1
  int64_t factor1_stride;
  int64_t factor2_stride;
  const void* cos_sin;       ///< cache [P, r]: cos of frequency i at column i, sin at r/2 + i
  int64_t cos_sin_stride;    ///< elements between positions
  int64_t num_positions;     ///< P
  const void* positions;     ///< [T] int32 or int64: positions[t * positions_stride]
  int64_t positions_stride;
  bool positions_int64;
  bool fp32;                 ///< the tables' or the cache's dtype: float32 (else bf16)
};

/// The norm's learned weights: w + offset per lane, read as fp32 (bf16 or fp32 in memory).
struct NormWeights {
  const void* q;  ///< [D] ([Hq*D] under a token-wide norm) or nullptr
  const void* k;  ///< [D] ([Hkv*D]) or nullptr
  bool q_fp32;
  bool k_fp32;
  float offset;
};

/// What every rope kernel reads. Element strides; bf16 tensors as their 16-bit patterns.
struct RopeInputs {
  const uint16_t* qk;  ///< [T, Hq + Hkv, D]: (t, h2, d) at t*qk_stride_t + h2*qk_stride_h + d
  int64_t qk_stride_t;
  int64_t qk_stride_h;
  int64_t tokens;      ///< T >= 1
  Dims dims;           ///< Hq, Hkv, D, r, style, paired
  bool normalize;      ///< RMS-norm (else n = x)
  bool key_offset;     ///< keys' lanes >= r from token t-1 (Hq = Hkv)
  float eps;
  Angles angles;
  NormWeights weights;
};

/// What SPEC.md section 9's options add to RopeInputs (QKVFUSE_CUDA_SECTION9=1): read only by the
/// kernels of the configuration that serves them (rope_dispatch.hpp Section9) and by the
/// launchers.
struct Section9Inputs {
  bool token_scope;    ///< norm_scope kToken: one RMS over a token's rows of each kind
  bool normalize_v;    ///< the V rows' weightless RMS norm
  const uint16_t* v;   ///< normalize_v: [T, Hkv, Dv], (t, h, d) at t*v_stride_t + h*v_stride_h + d
  int64_t v_stride_t;
  int64_t v_stride_h;
  int v_dim;           ///< Dv (normalize_v), else 0
};

/// The gradients of q and k (backward kernels), in the forward's output layouts.
struct GradRows {
  const uint16_t* q;  ///< [T, Hq, D] ([2T, Hq/2, D] paired): (t', h', d) at t'*q_stride_t + ...
  int64_t q_stride_t;
  int64_t q_stride_h;
  const uint16_t* k;  ///< [T, Hkv, D] (paired [2T, Hkv/2, D])
  int64_t k_stride_t;
  int64_t k_stride_h;
};

inline RopeInputs make_rope_inputs(const RopeLayout& layout, const TensorView& qk) {
  const bool cache = !is_absent(layout.cos_sin);
  const Angles angles =
      cache ? Angles{.cache = true,
                     .factor1 = nullptr,
                     .factor2 = nullptr,
                     .factor1_stride = 0,
                     .factor2_stride = 0,
                     .cos_sin = layout.cos_sin.data,
                     .cos_sin_stride = layout.cos_sin.strides[0],
                     .num_positions = layout.cos_sin.sizes[0],
                     .positions = layout.positions.data,
                     .positions_stride = layout.positions.strides[0],
                     .positions_int64 = layout.positions.dtype == DType::kInt64,
                     .fp32 = layout.cos_sin.dtype == DType::kFloat32}
            : Angles{.cache = false,
                     .factor1 = layout.factor1.data,
                     .factor2 = layout.factor2.data,
                     .factor1_stride = layout.factor1.strides[0],
                     .factor2_stride = layout.factor2.strides[0],
                     .cos_sin = nullptr,
                     .cos_sin_stride = 0,
                     .num_positions = 0,
                     .positions = nullptr,
                     .positions_stride = 0,
                     .positions_int64 = false,
                     .fp32 = layout.factor1.dtype == DType::kFloat32};
  return {.qk = static_cast<const uint16_t*>(qk.data),
          .qk_stride_t = qk.strides[0],
          .qk_stride_h = qk.strides[1],
          .tokens = qk.sizes[0],
          .dims = qkvfuse::rope::dims_of(layout, qk.sizes[2]),
          .normalize = layout.normalize,
          .key_offset = layout.key_offset,
          .eps = layout.eps,
          .angles = angles,
          .weights = {.q = layout.q_weight.data,
                      .k = layout.k_weight.data,
                      .q_fp32 = layout.q_weight.dtype == DType::kFloat32,
                      .k_fp32 = layout.k_weight.dtype == DType::kFloat32,
                      .offset = layout.weight_offset}};
}

/// `v`: the V norm's input (layout.normalize_v), else absent.
inline Section9Inputs make_section9_inputs(const RopeLayout& layout, const TensorView& v) {
  const bool v_rows = layout.normalize_v && !is_absent(v);
  return {.token_scope = layout.norm_scope == NormScope::kToken,
          .normalize_v = v_rows,
          .v = v_rows ? static_cast<const uint16_t*>(v.data) : nullptr,
          .v_stride_t = v_rows ? v.strides[0] : 0,
          .v_stride_h = v_rows ? v.strides[1] : 0,
          .v_dim = v_rows ? int(v.sizes[2]) : 0};
}

inline GradRows make_grad_rows(const TensorView& grad_q, const TensorView& grad_k) {
  return {.q = static_cast<const uint16_t*>(grad_q.data),
          .q_stride_t = grad_q.strides[0],
          .q_stride_h = grad_q.strides[1],
          .k = static_cast<const uint16_t*>(grad_k.data),
          .k_stride_t = grad_k.strides[0],
          .k_stride_h = grad_k.strides[1]};
}

/// Lanes of the query (`key` false) or key weight and of its gradient: D, or H*D of the kind
/// under a token-wide norm.
inline int64_t weight_lanes(const RopeLayout& layout, int64_t head_dim, bool key) {
  if (layout.norm_scope != NormScope::kToken) return head_dim;
  return (key ? kv_heads(layout) : layout.num_heads) * head_dim;
}

inline bool has_weights(const RopeLayout& layout) {
  return !is_absent(layout.q_weight) || !is_absent(layout.k_weight);
}

inline bool has_weights_args(const RopeInputs& in) {
  return in.weights.q != nullptr || in.weights.k != nullptr;
}

}  // namespace qkvfuse::cuda::rope
