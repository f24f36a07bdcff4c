// rope_paths.hpp: which kernels serve a QK-norm + rotary call on CUDA. Internal, host side.
//
// Each of the three ops (forward, bf16 backward, fused FP8 backward) has two implementations:
// - the vector kernels (qk_norm_rope.cu, qk_norm_rope_backward.cu, qkv_backward_fp8.cu): every
//   access a 16-byte vector, tuned for the model's widths; they need D a multiple of 8 in
//   [32, 256] and 16-byte aligned rows (pointers and all strides but the last), and for the FP8
//   backward Dv a multiple of 8 up to 256;
// - the element-pair kernels (rope_generic.cu): everything else the op's contract allows (every
//   even D in [2, 256], any Dv in [1, kMaxVWidth], any strides, pointers aligned to their
//   elements only). Same math in the same rounding order (rope_generic.cuh), hence the same
//   results as the vector kernels and the CPU backend within the tests' tolerances.
// Each op's entry point asks `vector_path` and hands the call to the element-pair kernel when it
// says no, so the choice is made in one place and both paths see validated arguments.
#pragma once

#include <cstdint>
#include <initializer_list>

#include "qkvfuse/qk_norm_rope.hpp"
#include "qkvfuse/qkv_backward_fp8.hpp"
#include "qkvfuse/tensor.hpp"

namespace qkvfuse::cuda::rope {

/// True when the view's data pointer and every stride but the last (of dims longer than 1) are
/// multiples of `bytes`: every row starts on a `bytes` boundary.
inline bool rows_aligned(const TensorView& view, int64_t bytes) {
  const int64_t element = int64_t(dtype_size(view.dtype));
  if (int64_t(reinterpret_cast<uintptr_t>(view.data) % uint64_t(bytes)) != 0) return false;
  for (int d = 0; d + 1 < view.ndim; ++d) {
    if (view.sizes[d] > 1 && (view.strides[d] * element) % bytes != 0) return false;
  }
  return true;
}

/// Every view's rows 16-byte aligned: what the vector kernels' LDG.128 / STG.128 need.
inline bool vector_rows(std::initializer_list<const TensorView*> views) {
  for (const TensorView* view : views) {
    if (!rows_aligned(*view, 16)) return false;
  }
  return true;
}

/// Head widths the vector kernels' lane geometries cover (rope::head_width_switch).
inline bool vector_head_width(int64_t head_dim) {
  return head_dim % 8 == 0 && head_dim >= 32 && head_dim <= 256;
}

inline bool vector_path(const QkNormRopeParams& p) {
  return vector_head_width(p.qk.sizes[2]) &&
         vector_rows({&p.qk, &p.factor1, &p.factor2, &p.q, &p.k});
}

inline bool vector_path(const QkNormRopeBackwardParams& p) {
  return vector_head_width(p.qk.sizes[2]) &&
         vector_rows({&p.grad_q, &p.grad_k, &p.qk, &p.factor1, &p.factor2, &p.grad_qk});
}

/// The e4m3 outputs are contiguous: their row strides (qkv_dim and T bytes) need not be
/// multiples of 16, the vector kernel handles that (8-byte row stores; grad_t byte by byte when
/// T % 16 != 0). Their base pointers must be 16-byte aligned.
inline bool vector_path(const QkvBackwardFp8Params& p) {
  const int64_t v_dim = p.grad_v.sizes[2];
  const auto aligned16 = [](const void* data) {
    return reinterpret_cast<uintptr_t>(data) % 16 == 0;
  };
  return vector_head_width(p.qk.sizes[2]) && v_dim % 8 == 0 && v_dim <= 256 &&
         vector_rows({&p.grad_q, &p.grad_k, &p.grad_v, &p.qk, &p.factor1, &p.factor2}) &&
         aligned16(p.grad_row.data) && aligned16(p.grad_t.data);
}

}  // namespace qkvfuse::cuda::rope

namespace qkvfuse::cuda::generic {

// The element-pair kernels (rope_generic.cu). Arguments validated by the public entry points.
void qk_norm_rope(const QkNormRopeParams& params);
void qk_norm_rope_backward(const QkNormRopeBackwardParams& params);
void qkv_backward_fp8(const QkvBackwardFp8Params& params);

}  // namespace qkvfuse::cuda::generic
