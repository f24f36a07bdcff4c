// static_switch.hpp: compile-time dispatch helpers for the CUDA launchers. Internal, host side.
//
// A run-time value (a flag, a dtype, a head width) selects one template instantiation; the
// selected constant reaches the callable as the type of its argument, so a generic lambda reads
// it with `decltype(arg)::value` or `decltype(arg)::type` (FlashAttention 3's static_switch.h,
// written as functions so that the branches are ordinary C++). The rope family's switches over a
// call's key are rope_config.cuh's; each throws qkvfuse::Error naming the op and the value no
// branch covers, so nothing is ever silently skipped.
#pragma once

namespace qkvfuse::cuda {

/// A type carried as a value, so that a generic lambda can receive it: `decltype(tag)::type`.
template <typename T>
struct TypeTag {
  using type = T;
};

}  // namespace qkvfuse::cuda
