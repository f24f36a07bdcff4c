// static_switch.hpp: compile-time dispatch helpers for the CUDA launchers. Internal, host side.
//
// A run-time value (a flag, a dtype, a head width) selects one template instantiation; the
// selected constant reaches the callable as the type of its argument, so a generic lambda reads
// it with `decltype(arg)::value` (FlashAttention 3's static_switch.h, written as functions so
// that the branches are ordinary C++). Nothing is ever silently skipped: a value no branch
// covers throws qkvfuse::Error naming the operation and the value.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>
#include <type_traits>

#include "qkvfuse/error.hpp"
#include "qkvfuse/tensor.hpp"

namespace qkvfuse::cuda {

/// A type carried as a value, so that a generic lambda can receive it: `decltype(tag)::type`.
template <typename T>
struct TypeTag {
  using type = T;
};

/// f(std::true_type{}) when `cond`, else f(std::false_type{}).
template <typename F>
void bool_switch(bool cond, F&& f) {
  if (cond) {
    f(std::true_type{});
  } else {
    f(std::false_type{});
  }
}

/// Rotary factor tables: bf16 (the model's tables) or fp32. f(TypeTag<__nv_bfloat16 or float>).
template <typename F>
void factor_dtype_switch(const char* op, DType dtype, F&& f) {
  switch (dtype) {
    case DType::kBFloat16: f(TypeTag<__nv_bfloat16>{}); break;
    case DType::kFloat32: f(TypeTag<float>{}); break;
    default:
      QKVF_FAIL(op, " (CUDA): unsupported rotary factor dtype ", dtype_name(dtype),
                "; the CUDA kernels take bfloat16 or float32 factor tables");
  }
}

/// The rope kernels' two flags besides the head width: f(KeyOffset{}, TypeTag<FactorT>{}), with
/// KeyOffset a std::bool_constant and FactorT the factor tables' element type.
template <typename F>
void key_offset_factor_switch(const char* op, bool key_offset, DType factor_dtype, F&& f) {
  bool_switch(key_offset, [&](auto key_offset_tag) {
    factor_dtype_switch(op, factor_dtype, [&](auto factor_tag) { f(key_offset_tag, factor_tag); });
  });
}

}  // namespace qkvfuse::cuda
