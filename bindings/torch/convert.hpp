// convert.hpp: torch tensors as qkvfuse::TensorView, the arguments of a boxed op call, and the
// stream a call launches on.
//
// The binding adds no validation of its own beyond what it needs to allocate outputs: the public
// C++ API checks every view (dtype, shape, strides, alignment, device) and throws qkvfuse::Error,
// which the binding rethrows in Python's terms (errors.hpp) as a Python RuntimeError. The few
// errors raised here read like the library's: "<op>: <argument>: expected ..., got ...".
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

#include <cstddef>
#include <optional>
#include <string>

#include "qkvfuse/tensor.hpp"

namespace qkvfuse::torch_binding {

/// Converts the tensor arguments of one op; `op` prefixes every message.
class OpArgs {
 public:
  explicit OpArgs(const char* op) : op_(op) {}

  const char* op() const { return op_; }

  /// A non-owning view of `tensor`: data pointer, dtype, device, sizes and strides. Throws
  /// qkvfuse::Error naming `name` for a dtype qkvfuse::DType cannot describe (float16 and
  /// float8_e5m2 it can, so that the op refuses them listing this argument's dtypes), more than
  /// kMaxDims dims, or a device other than CPU and CUDA.
  TensorView view(const at::Tensor& tensor, const char* name) const;

  /// As view, and the absent view (the library's "no tensor") for nullopt.
  TensorView optional_view(const std::optional<at::Tensor>& tensor, const char* name) const;

  /// Throws unless `tensor` has `ndim` dims. For the few sizes the binding reads to allocate
  /// outputs before the library sees the arguments; `layout` names the expected shape.
  void expect_dims(const at::Tensor& tensor, int64_t ndim, const char* name,
                   const char* layout) const;

  /// Throws unless a size argument (num_heads, qk_dim, v_dim) is >= `least` (1 by default).
  void expect_positive(int64_t value, const char* name, int64_t least = 1) const;

 private:
  const char* op_;
};

/// The arguments of one boxed call (the IValues on the dispatcher's stack), read by their names
/// in the op's schema; finish() replaces them with the outputs. The rope ops are boxed kernels so
/// that one helper reads the layout's arguments, which every rope schema shares (ops.cpp).
class BoxedCall {
 public:
  BoxedCall(const c10::OperatorHandle& op, torch::jit::Stack* stack);

  /// The argument called `name`. Lookups scan the schema from just after the previous hit, so
  /// reading arguments in schema order costs one comparison each.
  const c10::IValue& operator[](const char* name) const;

  const at::Tensor& tensor(const char* name) const { return (*this)[name].toTensor(); }
  std::optional<at::Tensor> optional_tensor(const char* name) const;
  int64_t integer(const char* name) const { return (*this)[name].toInt(); }
  std::optional<int64_t> optional_integer(const char* name) const;
  double real(const char* name) const { return (*this)[name].toDouble(); }
  bool flag(const char* name) const { return (*this)[name].toBool(); }
  std::string text(const char* name) const { return (*this)[name].toStringRef(); }

  /// Pops the arguments and pushes the outputs, in the schema's order of returns.
  template <typename... Outputs>
  void finish(Outputs&&... outputs) {
    torch::jit::drop(*stack_, arguments_);
    torch::jit::push(*stack_, std::forward<Outputs>(outputs)...);
  }

 private:
  const c10::FunctionSchema& schema_;
  torch::jit::Stack* stack_;
  std::size_t arguments_;
  std::size_t first_;
  mutable std::size_t cursor_ = 0;
};

/// torch's current CUDA stream on `tensor`'s device, so kernels order with the caller's work and
/// are captured into CUDA graphs; nullptr (unused) for CPU tensors.
Stream current_stream(const at::Tensor& tensor);

}  // namespace qkvfuse::torch_binding
