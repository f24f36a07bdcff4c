// positions.cu: check_positions on CUDA: the first token whose rotary position lies outside
// [0, P) (qkvfuse/qk_norm_rope.hpp). It answers the host, so it synchronizes the stream; it
// refuses to run under stream capture, where the answer could not be read.
#include <cuda_runtime.h>

#include <cstdint>

#include "backend.hpp"
#include "cuda/check.hpp"
#include "qkvfuse/error.hpp"

namespace qkvfuse::cuda {
namespace {

constexpr int kThreads = 256;

/// first[0] = the smallest bad index (T if none): an integer atomicMin, so any order of the
/// blocks gives the same answer.
__global__ void __launch_bounds__(kThreads)
    find_bad_position_kernel(const void* positions, int64_t stride, bool int64, int64_t tokens,
                             int64_t num_positions, unsigned long long* first) {
  for (int64_t t = int64_t(blockIdx.x) * kThreads + threadIdx.x; t < tokens;
       t += int64_t(gridDim.x) * kThreads) {
    const int64_t position = int64 ? static_cast<const long long*>(positions)[t * stride]
                                   : int64_t(static_cast<const int*>(positions)[t * stride]);
    if (position < 0 || position >= num_positions) atomicMin(first, (unsigned long long)t);
  }
}

}  // namespace

BadPosition find_bad_position(const TensorView& positions, int64_t num_positions, Stream stream) {
  DeviceGuard guard(positions.device);
  const cudaStream_t cuda_stream = to_cuda(stream);
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  QKVF_CUDA_CHECK(cudaStreamIsCapturing(cuda_stream, &capture));
  QKVF_CHECK(capture == cudaStreamCaptureStatusNone,
             "check_positions: the stream is being captured into a CUDA graph, and the check "
             "must synchronize to report; check the positions before capturing (or unset "
             "QKVFUSE_CHECK_POSITIONS)");
  const int64_t tokens = positions.sizes[0];
  unsigned long long* first = nullptr;
  QKVF_CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&first), sizeof(*first), cuda_stream));
  const unsigned long long none = (unsigned long long)tokens;
  unsigned long long answer = none;
  cudaError_t status = cudaMemcpyAsync(first, &none, sizeof(none), cudaMemcpyHostToDevice,
                                       cuda_stream);
  if (status == cudaSuccess) {
    const int64_t blocks = (tokens + kThreads - 1) / kThreads;
    find_bad_position_kernel<<<unsigned(blocks < 1024 ? blocks : 1024), kThreads, 0,
                               cuda_stream>>>(positions.data, positions.strides[0],
                                              positions.dtype == DType::kInt64, tokens,
                                              num_positions, first);
    status = cudaGetLastError();
  }
  if (status == cudaSuccess) {
    status = cudaMemcpyAsync(&answer, first, sizeof(answer), cudaMemcpyDeviceToHost, cuda_stream);
  }
  const cudaError_t freed = cudaFreeAsync(first, cuda_stream);
  if (status == cudaSuccess) status = freed;
  if (status == cudaSuccess) status = cudaStreamSynchronize(cuda_stream);
  QKVF_CUDA_CHECK(status);
  if (answer == none) return {};
  const int64_t index = int64_t(answer);
  int64_t value = 0;
  const size_t bytes = dtype_size(positions.dtype);
  const char* element = static_cast<const char*>(positions.data) + index * positions.strides[0] *
                                                                       int64_t(bytes);
  QKVF_CUDA_CHECK(cudaMemcpy(&value, element, bytes, cudaMemcpyDeviceToHost));
  if (bytes == 4) value = int64_t(int32_t(uint32_t(value)));
  return {index, value};
}

}  // namespace qkvfuse::cuda
