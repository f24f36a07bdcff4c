// gpu_util.cpp: GPU test helpers.
#include "gpu_util.hpp"

#include <cuda_runtime_api.h>

#include <utility>

#include "cuda/check.hpp"

namespace qkvfuse::test {

std::string gpu_unavailable_reason() {
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess) {
    cudaGetLastError();
    return std::string("no CUDA device (") + cudaGetErrorString(status) + ")";
  }
  if (count == 0) return "no CUDA device";
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) return "cannot query CUDA device 0";
  if (prop.major != 9) return std::string("kernels are built for sm_90a, device 0 is ") + prop.name;
  return "";
}

DeviceBuffer::DeviceBuffer(size_t bytes) : bytes_(bytes) {
  if (bytes) QKVF_CUDA_CHECK(cudaMalloc(&data_, bytes));
}
DeviceBuffer::~DeviceBuffer() {
  if (data_) cudaFree(data_);
}
DeviceBuffer::DeviceBuffer(DeviceBuffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}
DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  if (this != &other) {
    if (data_) cudaFree(data_);
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}
// Poison and uploads finish before returning: the ops under test run on non-blocking streams,
// which do not wait for the legacy default stream that cudaMemset and pageable copies use.
void DeviceBuffer::fill_byte(uint8_t value) {
  if (bytes_) QKVF_CUDA_CHECK(cudaMemset(data_, value, bytes_));
  QKVF_CUDA_CHECK(cudaDeviceSynchronize());
}
void DeviceBuffer::upload(const void* host, size_t bytes) {
  QKVF_CHECK(bytes <= bytes_, "upload of ", bytes, " bytes into a buffer of ", bytes_);
  if (bytes) QKVF_CUDA_CHECK(cudaMemcpy(data_, host, bytes, cudaMemcpyHostToDevice));
  QKVF_CUDA_CHECK(cudaDeviceSynchronize());
}
void DeviceBuffer::download(void* host, size_t bytes) const {
  QKVF_CHECK(bytes <= bytes_, "download of ", bytes, " bytes from a buffer of ", bytes_);
  if (bytes) QKVF_CUDA_CHECK(cudaMemcpy(host, data_, bytes, cudaMemcpyDeviceToHost));
}

DeviceView to_device(const TensorView& host, int64_t element_offset) {
  int64_t last = 0;
  for (int d = 0; d < host.ndim; ++d) last += (host.sizes[d] - 1) * host.strides[d];
  const size_t bytes = size_t(last + 1) * dtype_size(host.dtype);
  const size_t front = size_t(element_offset) * dtype_size(host.dtype);
  DeviceView out{DeviceBuffer(front + bytes), host};
  char* const data = static_cast<char*>(out.buffer.data()) + front;
  if (front) out.buffer.fill_byte(0xff);
  if (bytes) QKVF_CUDA_CHECK(cudaMemcpy(data, host.data, bytes, cudaMemcpyHostToDevice));
  QKVF_CUDA_CHECK(cudaDeviceSynchronize());
  out.view.data = data;
  out.view.device = kGPU;
  return out;
}

void fill_u16(DeviceBuffer& buffer, uint16_t value) {
  std::vector<uint16_t> pattern(buffer.bytes() / 2, value);
  buffer.upload(pattern.data(), pattern.size() * 2);
}

void synchronize() { QKVF_CUDA_CHECK(cudaDeviceSynchronize()); }

}  // namespace qkvfuse::test
