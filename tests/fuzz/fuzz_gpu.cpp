// fuzz_gpu.cpp: the CUDA Memory of the fuzz harness (built only with the CUDA backend).
//
// Every case gets fresh device allocations of its buffers' sizes (cudaMalloc, freed at the end of
// the case), so compute-sanitizer's memcheck sees any access outside them. Inputs are
// copied whole, poisoned padding included, at a 16-byte aligned address plus a random multiple of
// 16 bytes plus the view's own offset: the kernels see pointers of every alignment the API
// accepts, not only cudaMalloc's 256 bytes. Outputs are poisoned and sit between guard bytes
// (a write past either end shows even without the sanitizer), at a 16-byte aligned address
// plus the case's output offset.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "fuzz.hpp"
#include "gpu_util.hpp"

namespace qkvfuse::fuzz {
namespace {

constexpr size_t kGuardBytes = 256;
constexpr uint8_t kGuardByte = 0xa5;

void check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    throw std::runtime_error(std::string("CUDA error in ") + what + ": " + cudaGetErrorName(status) +
                             ": " + cudaGetErrorString(status));
  }
}

cudaStream_t fuzz_stream() {
  static const cudaStream_t stream = [] {
    cudaStream_t s = nullptr;
    check(cudaSetDevice(0), "cudaSetDevice(0)");
    check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
    return s;
  }();
  return stream;
}

/// A host pattern of `bytes` bytes repeating `element` (bf16 or float poison), kept around.
const std::vector<uint8_t>& poison_pattern(DType dtype, size_t bytes) {
  static std::vector<uint8_t> bf16_pattern, f32_pattern;
  std::vector<uint8_t>& pattern = dtype == DType::kBFloat16 ? bf16_pattern : f32_pattern;
  if (pattern.size() < bytes) {
    const size_t element = dtype_size(dtype);
    pattern.resize(bytes + 4096);
    for (size_t i = 0; i + element <= pattern.size(); i += element) {
      if (dtype == DType::kBFloat16) {
        std::memcpy(&pattern[i], &kPoisonBF16, 2);
      } else {
        std::memcpy(&pattern[i], &kPoisonF32, 4);
      }
    }
  }
  return pattern;
}

class GpuMemory final : public Memory {
 public:
  explicit GpuMemory(uint64_t seed) : state_(seed | 1), stream_(fuzz_stream()) {}

  ~GpuMemory() override {
    for (void* p : allocations_) cudaFree(p);  // waits for the case's work: it is done anyway
  }

  Device device() const override { return Device{DeviceType::kCUDA, 0}; }
  Stream stream() const override { return stream_; }

  TensorView input(const HostBuffer& host) override {
    const std::vector<uint8_t>& bytes = host.bytes();
    const size_t pad = random_pad();
    char* const base = allocate(pad + bytes.size()) + pad;
    check(cudaMemcpyAsync(base, bytes.data(), bytes.size(), cudaMemcpyHostToDevice, stream_),
          "cudaMemcpyAsync (input upload)");
    TensorView view = host.view();
    view.data = base + size_t(host.placement().offset) * dtype_size(host.dtype());
    view.device = device();
    return view;
  }

  TensorView output(const std::string& name, DType dtype, std::vector<int64_t> sizes,
                    int64_t offset) override {
    int64_t count = 1;
    for (int64_t s : sizes) count *= s;
    const size_t size = size_t(count) * dtype_size(dtype);
    // The offset's bytes count as guard: a write before the output shows there.
    const size_t front = kGuardBytes + random_pad() + size_t(offset) * dtype_size(dtype);
    char* base = allocate(front + size + kGuardBytes);
    char* data = base + front;
    check(cudaMemsetAsync(base, kGuardByte, front, stream_), "cudaMemsetAsync (guard)");
    check(cudaMemsetAsync(data + size, kGuardByte, kGuardBytes, stream_), "cudaMemsetAsync (guard)");
    if (size > 0) {
      if (dtype == DType::kFloat8E4M3) {
        check(cudaMemsetAsync(data, kPoisonE4M3, size, stream_), "cudaMemsetAsync (poison)");
      } else {
        check(cudaMemcpyAsync(data, poison_pattern(dtype, size).data(), size, cudaMemcpyHostToDevice,
                              stream_),
              "cudaMemcpyAsync (poison)");
      }
    }
    blocks_.push_back({name, base, front, size});
    TensorView view;
    view.data = data;
    view.dtype = dtype;
    view.device = device();
    view.ndim = int(sizes.size());
    int64_t stride = 1;
    for (int d = view.ndim; d-- > 0;) {
      view.sizes[d] = sizes[size_t(d)];
      view.strides[d] = stride;
      stride *= sizes[size_t(d)];
    }
    return view;
  }

  void finish() override {
    const cudaError_t status = cudaStreamSynchronize(stream_);
    if (status != cudaSuccess) {
      throw std::runtime_error(std::string("CUDA error after the launch: ") + cudaGetErrorName(status) +
                               ": " + cudaGetErrorString(status) +
                               " (the CUDA context is unusable from here on)");
    }
    check(cudaGetLastError(), "cudaGetLastError after the op");
  }

  std::vector<uint8_t> read(const TensorView& view) override {
    for (const Block& block : blocks_) {
      if (block.base + block.front == view.data) {
        std::vector<uint8_t> bytes(block.size);
        if (block.size) {
          check(cudaMemcpyAsync(bytes.data(), view.data, block.size, cudaMemcpyDeviceToHost, stream_),
                "cudaMemcpyAsync (output download)");
          check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize (output download)");
        }
        return bytes;
      }
    }
    throw std::logic_error("fuzz: read of an unknown output");
  }

  std::string damaged_guards() override {
    std::string damaged;
    for (const Block& block : blocks_) {
      std::vector<uint8_t> front(block.front), back(kGuardBytes);
      check(cudaMemcpyAsync(front.data(), block.base, block.front, cudaMemcpyDeviceToHost, stream_),
            "cudaMemcpyAsync (guard)");
      check(cudaMemcpyAsync(back.data(), block.base + block.front + block.size, kGuardBytes,
                            cudaMemcpyDeviceToHost, stream_),
            "cudaMemcpyAsync (guard)");
      check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize (guard)");
      bool ok = true;
      for (uint8_t b : front) ok = ok && b == kGuardByte;
      for (uint8_t b : back) ok = ok && b == kGuardByte;
      if (!ok) damaged += (damaged.empty() ? "" : ", ") + block.name;
    }
    return damaged;
  }

 private:
  struct Block {
    std::string name;
    char* base;
    size_t front;
    size_t size;
  };

  /// A random multiple of 16 bytes in [0, 240].
  size_t random_pad() {
    state_ ^= state_ << 13;
    state_ ^= state_ >> 7;
    state_ ^= state_ << 17;
    return 16 * size_t(state_ % 16);
  }

  /// `bytes` of device memory at a 16-byte aligned address (cudaMalloc's 256 bytes, but the
  /// harness relies on no more than 16).
  char* allocate(size_t bytes) {
    void* p = nullptr;
    check(cudaMalloc(&p, bytes + 16), "cudaMalloc");
    allocations_.push_back(p);
    const uintptr_t aligned = (reinterpret_cast<uintptr_t>(p) + 15) & ~uintptr_t(15);
    return reinterpret_cast<char*>(aligned);
  }

  uint64_t state_;
  cudaStream_t stream_;
  std::vector<void*> allocations_;
  std::vector<Block> blocks_;
};

}  // namespace

std::string gpu_unavailable_reason() { return test::gpu_unavailable_reason(); }

std::unique_ptr<Memory> make_gpu_memory(uint64_t seed) { return std::make_unique<GpuMemory>(seed); }

std::string gpu_error_state() {
  cudaError_t status = cudaStreamSynchronize(fuzz_stream());
  if (status == cudaSuccess) status = cudaGetLastError();
  if (status == cudaSuccess) return "";
  return std::string(cudaGetErrorName(status)) + ": " + cudaGetErrorString(status);
}

std::string gpu_name() {
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) return "CUDA device 0";
  return std::string(prop.name) + " (sm_" + std::to_string(prop.major) + std::to_string(prop.minor) +
         ", " + std::to_string(prop.multiProcessorCount) + " SMs)";
}

}  // namespace qkvfuse::fuzz
