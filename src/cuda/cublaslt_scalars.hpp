// cublaslt_scalars.hpp: the operand-scale staging kernel of the cuBLASLt FP8 GEMM. Internal, host
// side.
//
// The GEMM runs cuBLASLt in host pointer mode (alpha = 1, beta = 0 from host memory, as
// torch._scaled_mm does), so a device-resident alpha cannot be handed to cuBLASLt as alpha. It is
// folded into the operand scales instead, on the stream, by a one-thread kernel that writes the
// combined scale and a 1.0f into 16-byte aligned slots that the GEMM owns (see
// fp8_gemm_cublaslt.cpp). The same kernel also re-homes caller scales that are not 16-byte aligned.
#pragma once

#include <cuda_runtime_api.h>

namespace qkvfuse::cuda {

/// On `stream`: combined[0] = (scale_a[0] * scale_b[0]) * alpha[0] (alpha may be null: then
/// scale_a[0] * scale_b[0]) and one[0] = 1.0f. The product order is the CPU backend's
/// (src/cpu/fp8_gemm.cpp), each step an fp32 round-to-nearest multiply.
void launch_fold_scales(const float* scale_a, const float* scale_b, const float* alpha,
                        float* combined, float* one, cudaStream_t stream);

}  // namespace qkvfuse::cuda
