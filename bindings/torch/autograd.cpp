// autograd.cpp: the binding's Autograd kernels: the autograd of qk_norm_rope and qkv_norm_rope,
// and the kernel of the ops without a gradient of their own.
//
// The forward saves qk (and v), the layout's tensors, and keeps the layout's other arguments by
// name; the backward calls the registered qk_norm_rope_backward (qkv_norm_rope_backward) op with
// them and returns the gradients of qk (v) and of the norm weights (SPEC.md sections 2, 8, 9). It is C++ rather than
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

/// The registered backward of qk_norm_rope, or with the V norm's v of qkv_norm_rope.
const c10::OperatorHandle& backward_op(bool with_v) {
  static const c10::OperatorHandle qk =
      c10::Dispatcher::singleton().findSchemaOrThrow("qkvfuse::qk_norm_rope_backward", "");
  static const c10::OperatorHandle qkv =
      c10::Dispatcher::singleton().findSchemaOrThrow("qkvfuse::qkv_norm_rope_backward", "");
  return with_v ? qkv : qk;
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

/// The function of qk_norm_rope and qkv_norm_rope: its differentiable inputs are qk, v (the V
/// norm's, qkv_norm_rope only) and the norm weights (passed on their own so that autograd records
/// them; the op reads them from `args`); `args` is the forward op's whole argument stack (qk, v,
/// then the layout fragment, kRopeLayoutSchema of ops.cpp). The backward op's arguments are the
/// gradients of the forward's outputs, then the forward's arguments in the same order; its
/// outputs are named grad_<input> (grad_qk, grad_v, grad_q_weight, grad_k_weight).
struct RopeFunction : torch::autograd::Function<RopeFunction> {
  static variable_list forward(AutogradContext* ctx, const Tensor& /*qk*/,
                               const std::optional<Tensor>& /*v*/,
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
    ctx->saved_data["outputs"] = int64_t(op->schema().returns().size());
    ctx->saved_data["with_v"] = op->schema().name() == "qkvfuse::qkv_norm_rope";
    {
      const at::AutoDispatchBelowADInplaceOrView guard;
      op->callBoxed(&args);
    }
    variable_list outputs;
    for (const c10::IValue& output : args) outputs.push_back(output.toTensor());
    return outputs;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const bool with_v = ctx->saved_data.at("with_v").toBool();
    const c10::OperatorHandle& backward = backward_op(with_v);
    const size_t outputs = size_t(ctx->saved_data.at("outputs").toInt());
    // The backward op's arguments: the gradients of the outputs, then the forward's by name.
    const variable_list saved = ctx->get_saved_variables();
    const std::vector<c10::Argument>& arguments = backward.schema().arguments();
    Stack stack;
    for (size_t i = 0; i < outputs; ++i) stack.push_back(kernel_readable(grads[i]));
    size_t next_saved = 0;
    Tensor v, q_weight, k_weight;
    for (size_t i = outputs; i < arguments.size(); ++i) {
      if (!is_tensor_argument(arguments[i])) {
        stack.push_back(ctx->saved_data.at(arguments[i].name()));
        continue;
      }
      const Tensor& tensor = saved.at(next_saved++);
      if (arguments[i].name() == "v") v = tensor;
      if (arguments[i].name() == "q_weight") q_weight = tensor;
      if (arguments[i].name() == "k_weight") k_weight = tensor;
      stack.push_back(tensor.defined() ? c10::IValue(tensor) : c10::IValue());
    }
    backward.callBoxed(&stack);
    // Outputs by name; an absent weight's placeholder is dropped.
    const std::vector<c10::Argument>& returns = backward.schema().returns();
    Tensor grad_qk, grad_v, grad_q_weight, grad_k_weight;
    for (size_t i = 0; i < returns.size(); ++i) {
      const std::string& name = returns[i].name();
      if (name == "grad_qk") grad_qk = stack[i].toTensor();
      if (name == "grad_v") grad_v = stack[i].toTensor();
      if (name == "grad_q_weight" && q_weight.defined()) grad_q_weight = stack[i].toTensor();
      if (name == "grad_k_weight" && k_weight.defined()) grad_k_weight = stack[i].toTensor();
    }
    // One per forward input: qk, v, q_weight, k_weight, op, args.
    return {grad_qk, grad_v, grad_q_weight, grad_k_weight, Tensor(), Tensor()};
  }
};

}  // namespace

void run_without_gradient(const c10::OperatorHandle& op, Stack* stack) {
  const at::AutoDispatchBelowADInplaceOrView guard;
  op.callBoxed(stack);
}

void rope_autograd(const c10::OperatorHandle& op, Stack* stack) {
  Tensor qk;
  std::optional<Tensor> v;
  std::optional<Tensor> q_weight;
  std::optional<Tensor> k_weight;
  const bool with_v = op.schema().name() == "qkvfuse::qkv_norm_rope";
  {
    const BoxedCall call(op, stack);
    qk = call.tensor("qk");
    if (with_v) v = call.tensor("v");
    q_weight = call.optional_tensor("q_weight");
    k_weight = call.optional_tensor("k_weight");
  }
  const bool needs_grad = at::GradMode::is_enabled() &&
                          (qk.requires_grad() || (v && v->requires_grad()) ||
                           (q_weight && q_weight->requires_grad()) ||
                           (k_weight && k_weight->requires_grad()));
  // Nothing to record: run the op as the ops without a gradient run.
  if (!needs_grad) return run_without_gradient(op, stack);
  const size_t count = op.schema().arguments().size();
  Stack args(stack->end() - int64_t(count), stack->end());
  torch::jit::drop(*stack, count);
  const variable_list outputs = RopeFunction::apply(qk, v, q_weight, k_weight, &op, std::move(args));
  for (const Tensor& output : outputs) stack->emplace_back(output);
}

}  // namespace qkvfuse::torch_binding
