// qkvfuse/qkvfuse.hpp: the whole public C++ API.
#pragma once

#include "qkvfuse/error.hpp"
#include "qkvfuse/fp8_gemm.hpp"
#include "qkvfuse/numeric.hpp"
#include "qkvfuse/packed_qkv.hpp"
#include "qkvfuse/qk_norm_rope.hpp"
#include "qkvfuse/qkv_backward_fp8.hpp"
#include "qkvfuse/quantize.hpp"
#include "qkvfuse/tensor.hpp"

namespace qkvfuse {
/// True when the library was built with its CUDA backend.
bool built_with_cuda();
/// Number of CUDA devices usable now (0 when built without CUDA or when no driver/GPU is there).
int cuda_device_count();
}  // namespace qkvfuse
