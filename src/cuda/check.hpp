// check.hpp: CUDA runtime error checks and the device guard. Internal, host side.
#pragma once

#include <cuda_runtime_api.h>

#include "qkvfuse/error.hpp"
#include "qkvfuse/tensor.hpp"

/// Throws qkvfuse::Error with the runtime's message when a CUDA runtime call fails.
#define QKVF_CUDA_CHECK(expr)                                                              \
  do {                                                                                     \
    const cudaError_t qkvf_status_ = (expr);                                               \
    QKVF_CHECK(qkvf_status_ == cudaSuccess, #expr " failed: ", cudaGetErrorName(qkvf_status_), \
               ": ", cudaGetErrorString(qkvf_status_));                                    \
  } while (0)

/// After every kernel launch: a bad configuration surfaces here, not at some later call.
#define QKVF_CUDA_CHECK_LAUNCH(kernel_name)                                                \
  do {                                                                                     \
    const cudaError_t qkvf_status_ = cudaGetLastError();                                   \
    QKVF_CHECK(qkvf_status_ == cudaSuccess, "launch of " kernel_name " failed: ",          \
               cudaGetErrorName(qkvf_status_), ": ", cudaGetErrorString(qkvf_status_));    \
  } while (0)

namespace qkvfuse::cuda {

/// Makes `device` current for its lifetime and restores the caller's device after, so that
/// launches and cuBLASLt calls go to the device the tensors live on, whatever was current.
class DeviceGuard {
 public:
  explicit DeviceGuard(Device device) {
    QKVF_CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != device.index) QKVF_CUDA_CHECK(cudaSetDevice(device.index));
    current_ = device.index;
  }
  ~DeviceGuard() {
    if (previous_ != current_) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
  int current_ = 0;
};

inline cudaStream_t to_cuda(Stream stream) { return stream; }

/// Number of multiprocessors of the current device (cached per device).
int multiprocessor_count();

}  // namespace qkvfuse::cuda
