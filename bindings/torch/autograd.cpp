// autograd.cpp: the binding's Autograd kernels: qk_norm_rope's autograd, and the kernel of the ops
// without a gradient of their own.
//
// qk_norm_rope's forward saves qk and the layout's tensors, and keeps the layout's other arguments by name;
// the backward calls the registered qk_norm_rope_backward op with them and returns the gradients
// of qk and of the norm weights (SPEC.md sections 2 and 8). It is C++ rather than
// torch.library.register_autograd for the host's sake: the Python path took about 160 us of a
// forward + backward on top of the two ops (much of it re-reading the op's schema per call), which
// shows wherever the GPU is not far ahead of the host (perf_notes.md). torch.compile traces it as
// it traced the Python one: the ops it calls have fake kernels (python/qkvfuse/_fake.py).
//
// The packed op's autograd stays in Python (python/qkvfuse/packed.py says why).
#include "autograd.hpp"

#include <ATen/ATen.h>
#include <torch/autograd.h>

#include <optional>
#include <string>
#include <vector>

#include "convert.hpp"

namespace qkvfuse::torch_binding {
namespace {

using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using torch::jit::Stack;

const c10::OperatorHandle& backward_op() {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("qkvfuse::qk_norm_rope_backward", "");
  return op;
}

/// Whether the schema argument is a tensor (Tensor or Tensor?): saved with save_for_backward, so
/// that autograd checks their versions; the other arguments go to saved_data.
bool is_tensor_argument(const c10::Argument& argument) {
  static const c10::TypePtr optional_tensor = c10::OptionalType::ofTensor();
  return argument.real_type()->isSubtypeOf(*optional_tensor);
}

/// A gradient as the kernels read it: last dim contiguous, no broadcast dims (autograd may hand in
/// expanded or transposed gradients). An empty one becomes a fresh tensor with dense strides.
/// Sizes and strides may be symbolic (torch.compile traces this function). The packed op's
/// Python autograd does the same with python/qkvfuse/_layout.py's kernel_readable.
Tensor kernel_readable(const Tensor& grad) {
  if (grad.sym_numel() == 0) return at::empty_symint(grad.sym_sizes(), grad.options());
  bool broadcast = false;
  for (int64_t d = 0; d < grad.dim(); ++d) {
    broadcast = broadcast || (grad.sym_stride(d) == 0 && grad.sym_size(d) > 1);
  }
  if (grad.sym_stride(-1) == 1 && !broadcast) return grad;
  return grad.contiguous();
}

/// The function: its differentiable inputs are qk and the norm weights (passed on their own so
/// that autograd records them; the op reads them from `args`); `args` is the forward op's whole
/// argument stack (qk first, then the layout fragment, kRopeLayoutSchema of ops.cpp).
struct QkNormRopeFunction : torch::autograd::Function<QkNormRopeFunction> {
  static variable_list forward(AutogradContext* ctx, const Tensor& /*qk*/,
                               const std::optional<Tensor>& /*q_weight*/,
                               const std::optional<Tensor>& /*k_weight*/,
                               const c10::OperatorHandle* op, Stack args) {
    const std::vector<c10::Argument>& arguments = op->schema().arguments();
    variable_list saved;
    for (size_t i = 0; i < arguments.size(); ++i) {
      if (is_tensor_argument(arguments[i])) {
        saved.push_back(args[i].isNone() ? Tensor() : args[i].toTensor());
      } else {
        ctx->saved_data[arguments[i].name()] = args[i];
      }
    }
    ctx->save_for_backward(saved);
    {
      const at::AutoDispatchBelowADInplaceOrView guard;
      op->callBoxed(&args);
    }
    return {args[0].toTensor(), args[1].toTensor()};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    // The backward op's arguments: grad_q, grad_k, then the forward's (qk, <layout>) by name.
    const variable_list saved = ctx->get_saved_variables();
    const std::vector<c10::Argument>& arguments = backward_op().schema().arguments();
    Stack stack{kernel_readable(grads[0]), kernel_readable(grads[1])};
    size_t next_saved = 0;
    Tensor q_weight;
    Tensor k_weight;
    for (size_t i = 2; i < arguments.size(); ++i) {
      if (!is_tensor_argument(arguments[i])) {
        stack.push_back(ctx->saved_data.at(arguments[i].name()));
        continue;
      }
      const Tensor& tensor = saved.at(next_saved++);
      if (arguments[i].name() == "q_weight") q_weight = tensor;
      if (arguments[i].name() == "k_weight") k_weight = tensor;
      stack.push_back(tensor.defined() ? c10::IValue(tensor) : c10::IValue());
    }
    backward_op().callBoxed(&stack);
    // (grad_qk, grad_q_weight, grad_k_weight); an absent weight's placeholder is dropped.
    const Tensor grad_q_weight = q_weight.defined() ? stack[1].toTensor() : Tensor();
    const Tensor grad_k_weight = k_weight.defined() ? stack[2].toTensor() : Tensor();
    // One per forward input: qk, q_weight, k_weight, op, args.
    return {stack[0].toTensor(), grad_q_weight, grad_k_weight, Tensor(), Tensor()};
  }
};

}  // namespace

void run_without_gradient(const c10::OperatorHandle& op, Stack* stack) {
  const at::AutoDispatchBelowADInplaceOrView guard;
  op.callBoxed(stack);
}

void qk_norm_rope_autograd(const c10::OperatorHandle& op, Stack* stack) {
  Tensor qk;
  std::optional<Tensor> q_weight;
  std::optional<Tensor> k_weight;
  {
    const BoxedCall call(op, stack);
    qk = call.tensor("qk");
    q_weight = call.optional_tensor("q_weight");
    k_weight = call.optional_tensor("k_weight");
  }
  const bool needs_grad = at::GradMode::is_enabled() &&
                          (qk.requires_grad() || (q_weight && q_weight->requires_grad()) ||
                           (k_weight && k_weight->requires_grad()));
  // Nothing to record: run the op as the ops without a gradient run.
  if (!needs_grad) return run_without_gradient(op, stack);
  const size_t count = op.schema().arguments().size();
  Stack args(stack->end() - int64_t(count), stack->end());
  torch::jit::drop(*stack, count);
  const variable_list outputs =
      QkNormRopeFunction::apply(qk, q_weight, k_weight, &op, std::move(args));
  stack->emplace_back(outputs[0]);
  stack->emplace_back(outputs[1]);
}

}  // namespace qkvfuse::torch_binding
