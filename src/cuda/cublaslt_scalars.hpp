// cublaslt_scalars.hpp: device-resident scalars for the cuBLASLt FP8 GEMM. Internal, host side.
//
// cuBLASLt reads alpha and beta through pointers. With CUBLASLT_POINTER_MODE_DEVICE both must be
// device memory, so every device needs a 1.0f (alpha when the caller gives none) and a 0.0f
// (beta: D is overwritten, never accumulated into). They live in a `__device__` array in
// cublaslt_scalars.cu: the module loader places it on each device it loads the module on, so
// there is no cudaMalloc or host-to-device copy to order against the caller's streams, and
// nothing that a CUDA graph capture in progress could trip over.
#pragma once

#include <cuda_runtime_api.h>

namespace qkvfuse::cuda {

/// {1.0f, 0.0f} in the current device's memory: [0] is alpha = 1, [1] is beta = 0.
/// Cheap after the first call per device (the address is cached per device).
const float* device_one_zero();

/// out[0] = a[0] * b[0] on `stream`: the fallback that folds alpha into one operand scale when a
/// cuBLASLt configuration cannot read alpha from device memory (see fp8_gemm_cublaslt.cpp).
void launch_multiply_scalars(const float* a, const float* b, float* out, cudaStream_t stream);

}  // namespace qkvfuse::cuda
