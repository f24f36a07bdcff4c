// autograd.hpp: the binding's Autograd kernels (autograd.cpp).
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

namespace qkvfuse::torch_binding {

/// The Autograd kernel of the ops without a gradient of their own (ops.cpp's kOpsWithoutGradient):
/// runs the op below autograd, so its outputs simply do not require grad, instead of carrying the
/// fallback's grad_fn that fails only when a backward reaches it.
void run_without_gradient(const c10::OperatorHandle& op, torch::jit::Stack* stack);

/// The Autograd kernel of qkvfuse::qk_norm_rope and qkvfuse::qkv_norm_rope (boxed): records the
/// backward when qk, v or a norm weight requires grad, else runs as run_without_gradient.
void rope_autograd(const c10::OperatorHandle& op, torch::jit::Stack* stack);

}  // namespace qkvfuse::torch_binding
