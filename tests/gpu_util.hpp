// gpu_util.hpp: helpers for the GPU tests: the skip when no device is present, device buffers.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "qkvfuse/tensor.hpp"

namespace qkvfuse::test {

/// Empty when a CUDA device is usable, otherwise the reason none is.
std::string gpu_unavailable_reason();

/// Skips the calling test, printing why, when no CUDA device is usable.
#define QKVF_REQUIRE_GPU()                                                        \
  do {                                                                            \
    const std::string qkvf_reason_ = ::qkvfuse::test::gpu_unavailable_reason();   \
    if (!qkvf_reason_.empty()) GTEST_SKIP() << "GPU test skipped: " << qkvf_reason_; \
  } while (0)

inline constexpr Device kGPU{DeviceType::kCUDA, 0};

/// Device memory owning RAII buffer; bytes are copied to and from host vectors.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t bytes);
  ~DeviceBuffer();
  DeviceBuffer(DeviceBuffer&& other) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  void fill_byte(uint8_t value);                  ///< poison
  void upload(const void* host, size_t bytes);    ///< host -> device, synchronous
  void download(void* host, size_t bytes) const;  ///< device -> host, synchronous

  template <typename T>
  static DeviceBuffer from(const std::vector<T>& host) {
    DeviceBuffer buffer(host.size() * sizeof(T));
    buffer.upload(host.data(), host.size() * sizeof(T));
    return buffer;
  }
  template <typename T>
  std::vector<T> to_host() const {
    std::vector<T> host(bytes_ / sizeof(T));
    download(host.data(), host.size() * sizeof(T));
    return host;
  }

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

/// A device copy of a host view: the bytes from its first to its last element, same strides.
struct DeviceView {
  DeviceBuffer buffer;
  TensorView view;
};
/// The copy starts `element_offset` elements past the start of its allocation (cudaMalloc's
/// 256-byte alignment), so its pointer has exactly that offset's alignment: 1 element of bf16 is
/// a 2-byte aligned pointer, off the 16-byte vectors. The elements before it hold 0xff bytes (NaN
/// in bf16 and float32), so a kernel that reads before the view gets NaN.
DeviceView to_device(const TensorView& host, int64_t element_offset = 0);

/// 64 fp32 ulps of a row's largest value: what a different summation order of the row sums can
/// move a result by where the row's terms cancel (GPU vs CPU comparisons of the rope ops).
inline constexpr double kSumOrderNoise = 1.0 / (1 << 18);

/// Fills a 16-bit buffer with a 16-bit pattern (bf16 poison such as 0x7fc1).
void fill_u16(DeviceBuffer& buffer, uint16_t value);

/// Waits for all work on the current device and throws on any asynchronous error.
void synchronize();

}  // namespace qkvfuse::test
