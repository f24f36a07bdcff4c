// convert.cpp: torch::Tensor -> qkvfuse::TensorView, boxed-call arguments by name, and torch's
// current CUDA stream.
#include "convert.hpp"

#include "qkvfuse/error.hpp"

#if QKVFUSE_TORCH_CUDA
#include <c10/cuda/CUDAStream.h>
#endif

namespace qkvfuse::torch_binding {
namespace {

bool to_dtype(at::ScalarType type, DType* dtype) {
  switch (type) {
    case at::kBFloat16: *dtype = DType::kBFloat16; return true;
    case at::kFloat: *dtype = DType::kFloat32; return true;
    case at::kDouble: *dtype = DType::kFloat64; return true;
    case at::kFloat8_e4m3fn: *dtype = DType::kFloat8E4M3; return true;
    case at::kInt: *dtype = DType::kInt32; return true;
    case at::kLong: *dtype = DType::kInt64; return true;
    // Taken by no op, but passed often enough by mistake that the op's own check should refuse
    // them, naming the dtypes this argument takes.
    case at::kHalf: *dtype = DType::kFloat16; return true;
    case at::kFloat8_e5m2: *dtype = DType::kFloat8E5M2; return true;
    default: return false;
  }
}

/// torch's Python name of the dtypes to_dtype does not map ("torch.int8"), else ScalarType's.
std::string python_dtype_name(at::ScalarType type) {
  switch (type) {
    case at::kByte: return "torch.uint8";
    case at::kChar: return "torch.int8";
    case at::kShort: return "torch.int16";
    case at::kBool: return "torch.bool";
    case at::kComplexHalf: return "torch.complex32";
    case at::kComplexFloat: return "torch.complex64";
    case at::kComplexDouble: return "torch.complex128";
    default: return std::string("torch dtype ") + c10::toString(type);
  }
}

/// "[32, 64]": shapes for messages, without iostreams (see qkvfuse/error.hpp).
std::string shape_text(const at::Tensor& tensor) {
  std::string out = "[";
  for (int64_t d = 0; d < tensor.dim(); ++d) out += (d ? ", " : "") + std::to_string(tensor.size(d));
  return out + "]";
}

}  // namespace

TensorView OpArgs::view(const at::Tensor& tensor, const char* name) const {
  TensorView view;
  QKVF_CHECK(to_dtype(tensor.scalar_type(), &view.dtype), op_, ": ", name, ": got dtype ",
             python_dtype_name(tensor.scalar_type()), ", which no qkvfuse op takes");
  QKVF_CHECK(tensor.dim() <= kMaxDims, op_, ": ", name, ": expected at most ", kMaxDims,
             " dims, got shape ", shape_text(tensor));
  const at::Device device = tensor.device();
  QKVF_CHECK(device.is_cpu() || device.is_cuda(), op_, ": ", name,
             ": expected a cpu or cuda tensor, got one on ", device.str());
  // A CUDA tensor always carries its ordinal (index() is -1 only for a bare "cuda" spec).
  view.device = device.is_cuda() ? Device{DeviceType::kCUDA, device.index()} : Device{};
  view.data = tensor.data_ptr();
  view.ndim = int(tensor.dim());
  for (int d = 0; d < view.ndim; ++d) {
    view.sizes[d] = tensor.size(d);
    view.strides[d] = tensor.stride(d);
  }
  return view;
}

TensorView OpArgs::optional_view(const std::optional<at::Tensor>& tensor, const char* name) const {
  return tensor.has_value() ? view(*tensor, name) : TensorView{};
}

void OpArgs::expect_dims(const at::Tensor& tensor, int64_t ndim, const char* name,
                         const char* layout) const {
  QKVF_CHECK(tensor.dim() == ndim, op_, ": ", name, ": expected ", ndim, " dims ", layout,
             ", got shape ", shape_text(tensor));
}

void OpArgs::expect_positive(int64_t value, const char* name, int64_t least) const {
  QKVF_CHECK(value >= least, op_, ": ", name, ": expected >= ", least, ", got ", value);
}

BoxedCall::BoxedCall(const c10::OperatorHandle& op, torch::jit::Stack* stack)
    : schema_(op.schema()),
      stack_(stack),
      arguments_(schema_.arguments().size()),
      first_(stack->size() - arguments_) {}

const c10::IValue& BoxedCall::operator[](const char* name) const {
  const auto& arguments = schema_.arguments();
  for (std::size_t i = 0; i < arguments_; ++i) {
    const std::size_t index = (cursor_ + i) % arguments_;
    if (arguments[index].name() == name) {
      cursor_ = index + 1;
      return (*stack_)[first_ + index];
    }
  }
  QKVF_FAIL(schema_.name(), ": the binding reads an argument `", name,
            "` that its schema does not declare");
}

std::optional<at::Tensor> BoxedCall::optional_tensor(const char* name) const {
  const c10::IValue& value = (*this)[name];
  if (value.isNone()) return std::nullopt;
  return value.toTensor();
}

std::optional<int64_t> BoxedCall::optional_integer(const char* name) const {
  const c10::IValue& value = (*this)[name];
  if (value.isNone()) return std::nullopt;
  return value.toInt();
}

Stream current_stream(const at::Tensor& tensor) {
#if QKVFUSE_TORCH_CUDA
  if (tensor.is_cuda()) return c10::cuda::getCurrentCUDAStream(tensor.device().index()).stream();
#else
  (void)tensor;
#endif
  return nullptr;
}

}  // namespace qkvfuse::torch_binding
