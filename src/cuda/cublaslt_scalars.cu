// cublaslt_scalars.cu: the per-device {1, 0} constants cuBLASLt reads alpha/beta from, and the
// one-thread kernel that multiplies two device scalars (the folded-alpha fallback).
#include "cuda/cublaslt_scalars.hpp"

#include <array>
#include <atomic>

#include "cuda/check.hpp"

namespace qkvfuse::cuda {
namespace {

// Statically allocated device memory is instantiated per device when the module is loaded there,
// which makes it the one kind of device memory that needs no allocation call at first use.
__device__ float g_one_zero[2] = {1.0f, 0.0f};

__global__ void multiply_scalars_kernel(const float* __restrict__ a, const float* __restrict__ b,
                                        float* __restrict__ out) {
  // A plain fp32 product: the same rounding cuBLASLt applies when it multiplies its scales.
  out[0] = __fmul_rn(a[0], b[0]);
}

}  // namespace

const float* device_one_zero() {
  static std::array<std::atomic<const float*>, 64> cache{};
  int device = 0;
  QKVF_CUDA_CHECK(cudaGetDevice(&device));
  QKVF_CHECK(device >= 0 && device < int(cache.size()), "device ordinal ", device,
             " beyond the supported 64");
  const float* address = cache[device].load(std::memory_order_acquire);
  if (address == nullptr) {
    // Racing threads all get the same address; storing it twice is harmless.
    void* symbol = nullptr;
    QKVF_CUDA_CHECK(cudaGetSymbolAddress(&symbol, g_one_zero));
    address = static_cast<const float*>(symbol);
    cache[device].store(address, std::memory_order_release);
  }
  return address;
}

void launch_multiply_scalars(const float* a, const float* b, float* out, cudaStream_t stream) {
  multiply_scalars_kernel<<<1, 1, 0, stream>>>(a, b, out);
  QKVF_CUDA_CHECK_LAUNCH("multiply_scalars_kernel");
}

}  // namespace qkvfuse::cuda
