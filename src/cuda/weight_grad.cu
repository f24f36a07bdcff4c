// weight_grad.cu: the fixed-order reduction of the norm weights' partial gradients
// (weight_grad.hpp).
//
// One kernel, launched once per level: block (strip, segment) sums rows [segment * 64, +64) of a
// [rows][q_width + k_width] matrix for 32 columns, 8 rows per thread in row order, then the 8 threads of a column
// in thread order. A level writes one row per segment; the last (a single segment) writes the
// gradients themselves.
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/check.hpp"
#include "cuda/weight_grad.hpp"
#include "qkvfuse/error.hpp"
#include "qkvfuse/numeric.hpp"

namespace qkvfuse::cuda::weight_grad {
namespace {

constexpr int kColumns = 32;
constexpr int kRowLanes = 8;
static_assert(kRowsPerSegment % kRowLanes == 0, "whole rows per thread");

struct Output {
  void* q;  ///< grad_q_weight [q_width] or nullptr
  void* k;
  bool q_fp32;
  bool k_fp32;
};

__device__ __forceinline__ void store(void* out, int d, bool fp32, float value) {
  if (fp32) {
    static_cast<float*>(out)[d] = value;
  } else {
    static_cast<uint16_t*>(out)[d] = float_to_bf16(value);
  }
}

/// in [rows][cols] -> out [segments][cols] (sums over 64-row segments), or, with `final`, the
/// gradients (one segment).
__global__ void __launch_bounds__(kColumns* kRowLanes)
    sum_rows_kernel(const float* in, int64_t rows, int cols, float* out, bool final, Output grads,
                    int q_width) {
  __shared__ float sums[kRowLanes][kColumns];
  const int column = int(blockIdx.x) * kColumns + int(threadIdx.x) % kColumns;
  const int row_lane = int(threadIdx.x) / kColumns;
  const int64_t first = int64_t(blockIdx.y) * kRowsPerSegment;
  float sum = 0.0f;
  if (column < cols) {
#pragma unroll
    for (int i = 0; i < int(kRowsPerSegment / kRowLanes); ++i) {
      const int64_t row = first + row_lane + int64_t(i) * kRowLanes;
      if (row < rows) sum = __fadd_rn(sum, in[row * cols + column]);
    }
  }
  sums[row_lane][threadIdx.x % kColumns] = sum;
  __syncthreads();
  if (row_lane != 0 || column >= cols) return;
  float total = 0.0f;
#pragma unroll
  for (int lane = 0; lane < kRowLanes; ++lane) total = __fadd_rn(total, sums[lane][threadIdx.x]);
  if (!final) {
    out[int64_t(blockIdx.y) * cols + column] = total;
    return;
  }
  const bool key = column >= q_width;
  void* grad = key ? grads.k : grads.q;
  if (grad != nullptr) store(grad, column - (key ? q_width : 0), key ? grads.k_fp32 : grads.q_fp32,
                             total);
}

void launch(const float* in, int64_t rows, int cols, float* out, bool final, const Output& grads,
            int q_width, cudaStream_t stream) {
  const int64_t segs = segments(rows);
  QKVF_CHECK(segs <= 65535, "weight gradient reduction: ", rows, " partial rows");
  const dim3 grid(unsigned((cols + kColumns - 1) / kColumns), unsigned(segs));
  sum_rows_kernel<<<grid, kColumns * kRowLanes, 0, stream>>>(in, rows, cols, out, final, grads,
                                                             q_width);
  QKVF_CUDA_CHECK_LAUNCH("weight_grad::sum_rows_kernel");
}

}  // namespace

void reduce(float* workspace, int64_t partial_rows, int q_width, int k_width,
            const TensorView& grad_q_weight, const TensorView& grad_k_weight, cudaStream_t stream) {
  const Output grads{grad_q_weight.data, grad_k_weight.data,
                     grad_q_weight.dtype == DType::kFloat32, grad_k_weight.dtype == DType::kFloat32};
  if (partial_rows == 0) {
    for (const TensorView* grad : {&grad_q_weight, &grad_k_weight}) {
      if (grad->data != nullptr) {
        QKVF_CUDA_CHECK(cudaMemsetAsync(grad->data, 0, size_t(grad->numel()) *
                                                           dtype_size(grad->dtype), stream));
      }
    }
    return;
  }
  const int cols = q_width + k_width;
  float* in = workspace;
  int64_t rows = partial_rows;
  while (rows > kRowsPerSegment) {
    float* out = in + rows * cols;  // the next level's rows follow this level's
    launch(in, rows, cols, out, false, grads, q_width, stream);
    in = out;
    rows = segments(rows);
  }
  launch(in, rows, cols, nullptr, true, grads, q_width, stream);
}

}  // namespace qkvfuse::cuda::weight_grad
