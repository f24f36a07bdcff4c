// tensor.cpp: TensorView helpers.
#include "qkvfuse/tensor.hpp"


#include "qkvfuse/error.hpp"

namespace qkvfuse {

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kBFloat16: return "bfloat16";
    case DType::kFloat32: return "float32";
    case DType::kFloat64: return "float64";
    case DType::kFloat8E4M3: return "float8_e4m3fn";
    case DType::kInt32: return "int32";
    case DType::kInt64: return "int64";
    case DType::kFloat16: return "float16";
    case DType::kFloat8E5M2: return "float8_e5m2";
  }
  QKVF_FAIL("unknown dtype tag ", int(dtype));
}

std::size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kBFloat16: return 2;
    case DType::kFloat32: return 4;
    case DType::kFloat64: return 8;
    case DType::kFloat8E4M3: return 1;
    case DType::kInt32: return 4;
    case DType::kInt64: return 8;
    case DType::kFloat16: return 2;
    case DType::kFloat8E5M2: return 1;
  }
  QKVF_FAIL("unknown dtype tag ", int(dtype));
}

std::string device_name(Device device) {
  if (device.type == DeviceType::kCPU) return "cpu";
  return "cuda:" + std::to_string(device.index);
}

int64_t TensorView::numel() const {
  int64_t count = 1;
  for (int d = 0; d < ndim; ++d) count *= sizes[d];
  return count;
}

bool TensorView::is_contiguous() const {
  if (numel() == 0) return true;  // as torch: an empty tensor is contiguous whatever its strides
  int64_t expected = 1;
  for (int d = ndim - 1; d >= 0; --d) {
    if (sizes[d] != 1 && strides[d] != expected) return false;
    expected *= sizes[d];
  }
  return true;
}

std::string TensorView::describe() const {
  std::string out = std::string(dtype_name(dtype)) + "[";
  for (int d = 0; d < ndim; ++d) out += (d ? ", " : "") + std::to_string(sizes[d]);
  out += "] strides [";
  for (int d = 0; d < ndim; ++d) out += (d ? ", " : "") + std::to_string(strides[d]);
  return out + "] on " + device_name(device);
}

TensorView make_view(void* data, DType dtype, Device device, std::initializer_list<int64_t> sizes,
                     std::initializer_list<int64_t> strides) {
  QKVF_CHECK(int(sizes.size()) <= kMaxDims, "make_view: at most ", kMaxDims, " dims, got ",
             sizes.size());
  QKVF_CHECK(strides.size() == 0 || strides.size() == sizes.size(),
             "make_view: expected as many strides as sizes (", sizes.size(), "), got ",
             strides.size());
  TensorView view;
  view.data = data;
  view.dtype = dtype;
  view.device = device;
  view.ndim = int(sizes.size());
  int d = 0;
  for (int64_t size : sizes) {
    QKVF_CHECK(size >= 0, "make_view: sizes must be >= 0, got ", size, " in dim ", d);
    view.sizes[d++] = size;
  }
  if (strides.size() != 0) {
    d = 0;
    for (int64_t stride : strides) view.strides[d++] = stride;
  } else {
    int64_t stride = 1;
    for (d = view.ndim - 1; d >= 0; --d) {
      view.strides[d] = stride;
      stride *= view.sizes[d];
    }
  }
  return view;
}

}  // namespace qkvfuse
