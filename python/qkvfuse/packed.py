"""packed_fp8_qkv: the packed FP8 QKV projection with QK-norm + rotary, as an autograd function
(SPEC.md section 6). A drop-in for the reference: `PackedFP8QKV` is, as there, the autograd
function's `apply` (class `PackedFP8QKVFunction`), with the same arguments in the same order and
the same outputs; gradients for x, qk_weight, v_weight and qkv_scale only.

Why a torch.autograd.Function rather than torch.library.register_autograd on the forward op: the
tensors that receive gradients (x, qk_weight, v_weight) are not read by the forward kernels, and q/k
and v come out as views of one GEMM buffer, which a custom op may not return (its outputs must not
alias each other). The Function cuts those views itself, and its backward calls the registered
packed_qkv_backward op; torch.compile traces both through the ops' fake kernels.
"""
import torch

from ._layout import qkv_views, kernel_readable, split_grad_weight

_ops = torch.ops.qkvfuse


class PackedFP8QKVFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, qk_weight, v_weight, weight_f8, weight_f8_t, weight_scale, qkv_scale,
                x_scale, grad_scale, factor1, factor2, num_heads, paired, key_offset, rotary_dim,
                x_f8, x_f8_t):
        qk_dim = qk_weight.shape[0] // (2 * num_heads)
        v_dim = v_weight.shape[0] // num_heads
        q, k, qkv = _ops.packed_qkv_forward(x_f8, weight_f8, x_scale, weight_scale, qkv_scale,
                                            factor1, factor2, num_heads, qk_dim, v_dim, rotary_dim,
                                            paired, key_offset)
        qk, v = qkv_views(qkv, x_f8.shape[0], num_heads, qk_dim, v_dim, paired)
        ctx.save_for_backward(qk, factor1, factor2, x_f8_t, weight_f8_t, qk_weight, v_weight,
                              x_scale, weight_scale, qkv_scale)
        # grad_scale is read when the backward runs, not saved with a version check: a tensor
        # hook on q, k or v may set it from this step's gradients (current scaling; see
        # examples/train_gpt.py).
        ctx.grad_scale = grad_scale
        ctx.x_shape = x.shape
        ctx.layout = (num_heads, rotary_dim, paired, key_offset)
        return q, k, v

    @staticmethod
    def backward(ctx, grad_q, grad_k, grad_v):
        (qk, factor1, factor2, x_f8_t, weight_f8_t, qk_weight, v_weight, x_scale, weight_scale,
         qkv_scale) = ctx.saved_tensors
        grad_scale = ctx.grad_scale
        grad_x, grad_weight, grad_qkv_scale = _ops.packed_qkv_backward(
            kernel_readable(grad_q), kernel_readable(grad_k),
            kernel_readable(grad_v), qk, factor1, factor2, x_f8_t, weight_f8_t, qk_weight,
            v_weight, x_scale, weight_scale, qkv_scale, grad_scale, *ctx.layout)
        grad_qk_weight, grad_v_weight = split_grad_weight(grad_weight, qk_weight.shape[0])
        # One slot per forward argument; only x, the two weights and qkv_scale carry gradients.
        return (grad_x.view(ctx.x_shape), grad_qk_weight, grad_v_weight, None, None, None,
                grad_qkv_scale, None, None, None, None, None, None, None, None, None, None)


# The reference exports its autograd function's apply under this name: calling it runs the op.
PackedFP8QKV = PackedFP8QKVFunction.apply


def packed_fp8_qkv(x, qk_weight, v_weight, weight_f8, weight_f8_t, weight_scale, qkv_scale,
                   x_scale, grad_scale, factor1, factor2, num_heads, paired, key_offset, rotary_dim,
                   x_f8, x_f8_t):
    """(q, k, v) = norm + rotary of x @ (qkv_scale * [Wq; Wk; Wv]).T, as one FP8 GEMM off the cached
    packed weight (two for paired layers, so that v is dense).

      x            bf16 [T, C] (or any shape of T*C elements): receives the gradient only
      qk_weight    bf16 [2*H*D, C], v_weight bf16 [H*Dv, C]: the master weights
      weight_f8    e4m3 [qkv_dim, C], weight_f8_t e4m3 [C, qkv_dim], weight_scale float32 scalar:
                   the cached packed weight (PackedWeightCache)
      qkv_scale    float32 scalar, learnable
      x_scale, grad_scale  float32 scalars; x_f8 [T, C], x_f8_t [C, T]: x quantized with x_scale.
                   grad_scale is read when the backward runs: it must bring the gradients into
                   e4m3 range (a fixed 1/448 lets small gradients round to zero), and a tensor
                   hook on q, k or v may set it from the gradients of the step (current scaling)
      factor1/2    rotary tables [T, D] ([T, 2D] when paired), bf16 or float32
    Returns q, k [T, H, D] ([2T, H/2, D] when paired) and v [T, H, Dv], bf16.
    """
    return PackedFP8QKVFunction.apply(x, qk_weight, v_weight, weight_f8, weight_f8_t, weight_scale,
                                      qkv_scale, x_scale, grad_scale, factor1, factor2, num_heads,
                                      paired, key_offset, rotary_dim, x_f8, x_f8_t)
