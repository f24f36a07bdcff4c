// autograd.hpp: the Autograd kernels written in C++ (autograd.cpp).
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

namespace qkvfuse::torch_binding {

/// The Autograd kernel of qkvfuse::qk_norm_rope (boxed): records the backward when qk or a norm
/// weight requires grad, else runs the op below autograd.
void qk_norm_rope_autograd(const c10::OperatorHandle& op, torch::jit::Stack* stack);

}  // namespace qkvfuse::torch_binding
