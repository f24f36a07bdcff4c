// cublaslt_scalars.cu: the one-thread kernel that folds alpha into the FP8 GEMM's operand scales
// (see cublaslt_scalars.hpp and fp8_gemm_cublaslt.cpp).
#include "cuda/cublaslt_scalars.hpp"

#include "cuda/check.hpp"

namespace qkvfuse::cuda {
namespace {

__global__ void fold_scales_kernel(const float* __restrict__ scale_a,
                                   const float* __restrict__ scale_b,
                                   const float* __restrict__ alpha, float* __restrict__ combined,
                                   float* __restrict__ one) {
  // Plain fp32 products in the CPU backend's order: (scale_a * scale_b) * alpha. cuBLASLt then
  // multiplies by alpha = 1 and by the other scale = 1, both exact.
  float product = __fmul_rn(scale_a[0], scale_b[0]);
  if (alpha != nullptr) product = __fmul_rn(product, alpha[0]);
  combined[0] = product;
  one[0] = 1.0f;
}

}  // namespace

void launch_fold_scales(const float* scale_a, const float* scale_b, const float* alpha,
                        float* combined, float* one, cudaStream_t stream) {
  fold_scales_kernel<<<1, 1, 0, stream>>>(scale_a, scale_b, alpha, combined, one);
  QKVF_CUDA_CHECK_LAUNCH("fold_scales_kernel");
}

}  // namespace qkvfuse::cuda
