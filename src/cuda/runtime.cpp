// runtime.cpp: CUDA device queries and pointer checks.
#include <cuda_runtime_api.h>

#include <array>
#include <atomic>

#include "backend.hpp"
#include "cuda/check.hpp"
#include "qkvfuse/qkvfuse.hpp"

namespace qkvfuse {

bool built_with_cuda() { return true; }

int cuda_device_count() {
  int count = 0;
  // No driver or no GPU is not an error here: it means zero usable devices.
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky error state
    return 0;
  }
  return count;
}

namespace cuda {

int multiprocessor_count() {
  static std::array<std::atomic<int>, 64> cache{};
  int device = 0;
  QKVF_CUDA_CHECK(cudaGetDevice(&device));
  QKVF_CHECK(device < int(cache.size()), "device ordinal ", device, " beyond the supported 64");
  int count = cache[device].load(std::memory_order_relaxed);
  if (count == 0) {
    QKVF_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
    cache[device].store(count, std::memory_order_relaxed);
  }
  return count;
}

void check_pointer_on_device(const void* pointer, Device device, const char* name) {
  const int count = cuda_device_count();
  QKVF_CHECK(count > 0, name, ": is on ", device_name(device), ", but no CUDA device is available");
  QKVF_CHECK(device.index >= 0 && device.index < count, name, ": is on ", device_name(device),
             ", but only ", count, " CUDA device(s) exist");
  cudaPointerAttributes attributes{};
  const cudaError_t status = cudaPointerGetAttributes(&attributes, pointer);
  if (status != cudaSuccess) cudaGetLastError();
  const bool on_device = status == cudaSuccess &&
                         (attributes.type == cudaMemoryTypeDevice ||
                          attributes.type == cudaMemoryTypeManaged) &&
                         attributes.device == device.index;
  QKVF_CHECK(on_device, name, ": expected memory on ", device_name(device),
             ", but its pointer is not device memory of that GPU");
}

}  // namespace cuda
}  // namespace qkvfuse
