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

/// Angle tables (factor tables or a cos/sin cache): bf16 or fp32. f(TypeTag<__nv_bfloat16 or
/// float>).
template <typename F>
void angle_dtype_switch(const char* op, DType dtype, F&& f) {
  switch (dtype) {
    case DType::kBFloat16: f(TypeTag<__nv_bfloat16>{}); break;
    case DType::kFloat32: f(TypeTag<float>{}); break;
    default:
      QKVF_FAIL(op, " (CUDA): unsupported angle table dtype ", dtype_name(dtype),
                "; the CUDA kernels take bfloat16 or float32 tables");
  }
}

/// f(std::integral_constant<int, V>{}) for the chunk width V of rope_paths.hpp (8, 2 or 1).
template <typename F>
void chunk_width_switch(const char* op, int width, F&& f) {
  switch (width) {
    case 8: f(std::integral_constant<int, 8>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 1: f(std::integral_constant<int, 1>{}); break;
    default: QKVF_FAIL(op, " (CUDA): no kernel for chunks of ", width, " elements");
  }
}

}  // namespace qkvfuse::cuda
