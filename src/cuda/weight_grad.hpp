// weight_grad.hpp: the norm weights' gradients of the rope backward kernels, summed without float
// atomics (SPEC.md section 8: fp32, the same bits on every run). Internal, host side.
//
// Each block of a backward kernel sums its rows' contributions gw[d] * n[d] into one partial row
// of the workspace: the Q weight's lanes, then the K weight's ([2][D]; [Hq*D + Hkv*D] under a
// token-wide norm, SPEC.md section 9); reduce() then adds the partial rows column by
// column in a fixed order: segments of kRowsPerSegment rows (each in row order, 8 threads per
// column, combined in thread order), then the segment sums the same way, level by level. The order depends only on
// the number of partial rows, which depends only on the shapes.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "qkvfuse/tensor.hpp"

namespace qkvfuse::cuda::weight_grad {

inline constexpr int64_t kRowsPerSegment = 64;

inline int64_t segments(int64_t partial_rows) {
  return (partial_rows + kRowsPerSegment - 1) / kRowsPerSegment;
}

/// Float32 elements of the workspace: the partial rows of `row_floats` each, then the rows of
/// each level of segment sums that is not the last.
inline int64_t workspace_floats(int64_t partial_rows, int64_t row_floats) {
  int64_t total = partial_rows;
  for (int64_t rows = partial_rows; rows > kRowsPerSegment;) {
    rows = segments(rows);
    total += rows;
  }
  return total * row_floats;
}

/// grad_q_weight[d] = sum_n partials[n][d] for d < q_width, grad_k_weight[d] = sum_n
/// partials[n][q_width + d] for d < k_width (each written when present, in its dtype: bf16 or
/// fp32). partials is the workspace, rows of q_width + k_width floats first. With no rows the
/// gradients are zeros.
void reduce(float* workspace, int64_t partial_rows, int q_width, int k_width,
            const TensorView& grad_q_weight, const TensorView& grad_k_weight, cudaStream_t stream);

}  // namespace qkvfuse::cuda::weight_grad
