// qkvfuse/tensor.hpp: the non-owning tensor view every public entry point takes.
//
// Every input, output and workspace of an op is a view (pointer, dtype, device, sizes, strides in
// elements) of memory the caller owns; the library's own allocations are fp8_gemm's cuBLASLt
// workspace (32 MiB per device and stream, kept for the process; qkvfuse/fp8_gemm.hpp) and the
// CPU backend's temporary host buffers. The PyTorch binding builds views from torch tensors; C++
// users build them with make_view().
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>

// Spelled exactly as the CUDA runtime declares it (`typedef struct CUstream_st* cudaStream_t`),
// so qkvfuse::Stream and cudaStream_t are the same type without including CUDA headers here.
struct CUstream_st;

namespace qkvfuse {

using Stream = CUstream_st*;  ///< a cudaStream_t; nullptr is the legacy default stream

enum class DType : int8_t {
  kBFloat16,
  kFloat32,
  kFloat64,
  kFloat8E4M3,  ///< float8_e4m3fn: bias 7, max 448, 0x7f/0xff NaN, no infinities
  kInt32,       ///< rotary positions
  kInt64,       ///< rotary positions
  // Taken by no op: they exist so that a view can describe a tensor of a dtype a caller may pass
  // by mistake (a float16 model, the other FP8 format), and each op's checks refuse it naming the
  // argument and the dtypes that argument takes.
  kFloat16,
  kFloat8E5M2,
};

/// "bfloat16", "float32", "float64", "float8_e4m3fn", "int32", "int64", "float16",
/// "float8_e5m2".
const char* dtype_name(DType dtype);
/// Size of one element in bytes.
std::size_t dtype_size(DType dtype);

enum class DeviceType : int8_t { kCPU, kCUDA };

struct Device {
  DeviceType type = DeviceType::kCPU;
  int index = 0;  ///< CUDA ordinal; 0 for the CPU
};
inline bool operator==(Device a, Device b) { return a.type == b.type && a.index == b.index; }
inline bool operator!=(Device a, Device b) { return !(a == b); }

/// "cpu" or "cuda:N".
std::string device_name(Device device);

inline constexpr int kMaxDims = 4;

/// A strided view. Sizes and strides are in elements; make_view takes any strides, and each op's
/// header says which layouts it accepts (outputs are contiguous or row-strided; inputs mostly
/// need a contiguous last dim). A 0-dimensional view is a scalar.
struct TensorView {
  void* data = nullptr;
  DType dtype = DType::kFloat32;
  Device device{};
  int ndim = 0;
  int64_t sizes[kMaxDims] = {};
  int64_t strides[kMaxDims] = {};

  int64_t size(int dim) const { return sizes[dim]; }
  int64_t stride(int dim) const { return strides[dim]; }
  int64_t numel() const;
  bool is_contiguous() const;  ///< row-major with no padding
  template <typename T>
  T* ptr() const { return static_cast<T*>(data); }
  /// "bfloat16[49152, 12, 128] strides [1536, 128, 1] on cuda:0", for error messages.
  std::string describe() const;
};

/// A view of `data` with the given sizes; `strides` defaults to row-major contiguous.
TensorView make_view(void* data, DType dtype, Device device, std::initializer_list<int64_t> sizes,
                     std::initializer_list<int64_t> strides = {});

/// True when the view names no tensor (data == nullptr and ndim == 0): optional arguments.
inline bool is_absent(const TensorView& view) { return view.data == nullptr && view.ndim == 0; }

}  // namespace qkvfuse
