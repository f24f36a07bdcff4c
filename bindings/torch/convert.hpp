// convert.hpp: torch tensors as qkvfuse::TensorView, and the stream a call launches on.
//
// The binding adds no validation of its own beyond what it needs to allocate outputs: the public
// C++ API checks every view (dtype, shape, strides, alignment, device) and throws qkvfuse::Error,
// which PyTorch's op dispatcher turns into a Python RuntimeError carrying the library's message.
// The few errors raised here read like the library's: "<op>: <argument>: expected ..., got ...".
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

#include "qkvfuse/tensor.hpp"

namespace qkvfuse::torch_binding {

/// Converts the tensor arguments of one op; `op` prefixes every message.
class OpArgs {
 public:
  explicit OpArgs(const char* op) : op_(op) {}

  /// A non-owning view of `tensor` (defined: the op schemas admit no None for a Tensor): data
  /// pointer, dtype, device, sizes and strides. Throws qkvfuse::Error naming `name` for a dtype
  /// the library does not take (bfloat16, float32, float64, float8_e4m3fn), more than kMaxDims
  /// dims, or a device other than CPU and CUDA.
  TensorView view(const at::Tensor& tensor, const char* name) const;

  /// As view, and the absent view (the library's "no tensor") for nullopt.
  TensorView optional_view(const std::optional<at::Tensor>& tensor, const char* name) const;

  /// Throws unless `tensor` has `ndim` dims. For the few sizes the binding reads to allocate
  /// outputs before the library sees the arguments; `layout` names the expected shape.
  void expect_dims(const at::Tensor& tensor, int64_t ndim, const char* name,
                   const char* layout) const;

  /// Throws unless a size argument (num_heads, qk_dim, v_dim) is >= 1.
  void expect_positive(int64_t value, const char* name) const;

 private:
  const char* op_;
};

/// torch's current CUDA stream on `tensor`'s device, so kernels order with the caller's work and
/// are captured into CUDA graphs; nullptr (unused) for CPU tensors.
Stream current_stream(const at::Tensor& tensor);

}  // namespace qkvfuse::torch_binding
