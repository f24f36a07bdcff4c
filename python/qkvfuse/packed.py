"""packed_fp8_qkv: the packed FP8 QKV projection with QK-norm + rotary, as an autograd function
(SPEC.md sections 6 and 8). A drop-in for the reference: `PackedFP8QKV` is, as there, the autograd
function's `apply` (class `PackedFP8QKVFunction`), with the same arguments in the same order and
the same outputs; gradients for x, qk_weight, v_weight and qkv_scale only. `packed_fp8_qkv` takes
the same positional arguments and the general layout's options as keywords (GQA, NeoX rotary,
norm weights, which then receive gradients too, a cos/sin cache; PackedFP8QKVLayoutFunction).

Why a torch.autograd.Function rather than torch.library.register_autograd on the forward op: the
tensors that receive gradients (x, qk_weight, v_weight) are not read by the forward kernels, and q/k
and v come out as views of one GEMM buffer, which a custom op may not return (its outputs must not
alias each other). The Function cuts those views itself, and its backward calls the registered
packed_qkv_backward op; torch.compile traces both through the ops' fake kernels.
"""
from typing import Optional

import torch

from . import _checks
from ._layout import (DEFAULT_EPS, RopeLayout, kernel_readable, qkv_views, split_grad_weight,
                      v_out_view)
from .ops import rope_layout

_ops = torch.ops.qkvfuse


def _forward(ctx, x, qk_weight, v_weight, weight_f8, weight_f8_t, weight_scale, qkv_scale,
             x_scale, grad_scale, x_f8, x_f8_t, layout: RopeLayout):
    # What only the backward reads is checked now, so that a mistake fails this call; the head
    # widths come from the master weights' rows. The library checks the rest when the op runs.
    qk_dim, v_dim = _checks.packed_arguments("packed_fp8_qkv", dict(
        x=x, qk_weight=qk_weight, v_weight=v_weight, weight_f8=weight_f8, weight_f8_t=weight_f8_t,
        weight_scale=weight_scale, qkv_scale=qkv_scale, x_scale=x_scale, grad_scale=grad_scale,
        x_f8=x_f8, x_f8_t=x_f8_t), layout)
    q, k, qkv = _ops.packed_qkv_forward(x_f8, weight_f8, x_scale, weight_scale, qkv_scale, qk_dim,
                                        v_dim, *layout)
    qk, v = qkv_views(qkv, x_f8.shape[0], layout, qk_dim, v_dim)
    # With the V norm the raw V is the backward's input and the normalized one the output.
    v_out = v_out_view(qkv, x_f8.shape[0], layout, qk_dim, v_dim)
    ctx.save_for_backward(qk, v if v_out is not None else None, x_f8_t, weight_f8_t, qk_weight,
                          v_weight, x_scale, weight_scale, qkv_scale, *layout.tensors())
    # grad_scale is read when the backward runs, not saved with a version check: a tensor
    # hook on q, k or v may set it from this step's gradients (current scaling; see
    # examples/train_gpt.py).
    ctx.grad_scale = grad_scale
    ctx.x_shape = x.shape
    ctx.options = layout.options()
    return q, k, v if v_out is None else v_out


def _backward(ctx, grad_q, grad_k, grad_v):
    """(grad_x, grad_qk_weight, grad_v_weight, grad_qkv_scale, grad_q_weight, grad_k_weight), the
    norm weights' None where absent."""
    (qk, v, x_f8_t, weight_f8_t, qk_weight, v_weight, x_scale, weight_scale, qkv_scale,
     *tensors) = ctx.saved_tensors
    layout = RopeLayout.of_parts(ctx.options, tensors)
    _checks.positive_scale("packed_fp8_qkv", "grad_scale", ctx.grad_scale)
    grad_x, grad_weight, grad_qkv_scale, grad_q_weight, grad_k_weight = _ops.packed_qkv_backward(
        kernel_readable(grad_q), kernel_readable(grad_k), kernel_readable(grad_v), qk, x_f8_t,
        weight_f8_t, qk_weight, v_weight, x_scale, weight_scale, qkv_scale, ctx.grad_scale,
        *layout, v)
    grad_qk_weight, grad_v_weight = split_grad_weight(grad_weight, qk_weight.shape[0])
    return (grad_x.view(ctx.x_shape), grad_qk_weight, grad_v_weight, grad_qkv_scale,
            *layout.weight_grads(grad_q_weight, grad_k_weight))


class PackedFP8QKVFunction(torch.autograd.Function):
    """The reference's autograd function: its arguments, the speedrun's layout (SPEC.md 6)."""

    @staticmethod
    def forward(ctx, x, qk_weight, v_weight, weight_f8, weight_f8_t, weight_scale, qkv_scale,
                x_scale, grad_scale, factor1, factor2, num_heads, paired, key_offset, rotary_dim,
                x_f8, x_f8_t):
        layout = RopeLayout(num_heads, rotary_dim=rotary_dim, paired=paired,
                            key_offset=key_offset, factor1=factor1, factor2=factor2)
        return _forward(ctx, x, qk_weight, v_weight, weight_f8, weight_f8_t, weight_scale,
                        qkv_scale, x_scale, grad_scale, x_f8, x_f8_t, layout)

    @staticmethod
    def backward(ctx, grad_q, grad_k, grad_v):
        grad_x, grad_qk_weight, grad_v_weight, grad_qkv_scale, _, _ = _backward(
            ctx, grad_q, grad_k, grad_v)
        # One slot per forward argument; only x, the two weights and qkv_scale carry gradients.
        return (grad_x, grad_qk_weight, grad_v_weight, None, None, None, grad_qkv_scale, None,
                None, None, None, None, None, None, None, None, None)


class PackedFP8QKVLayoutFunction(torch.autograd.Function):
    """The general layout: the projection's arguments, then RopeLayout's fields in order (their
    tensors factor1, factor2, cos_sin, positions, q_weight, k_weight). Gradients for x, qk_weight,
    v_weight, qkv_scale and the norm weights."""

    @staticmethod
    def forward(ctx, x, qk_weight, v_weight, weight_f8, weight_f8_t, weight_scale, qkv_scale,
                x_scale, grad_scale, x_f8, x_f8_t, *layout):
        return _forward(ctx, x, qk_weight, v_weight, weight_f8, weight_f8_t, weight_scale,
                        qkv_scale, x_scale, grad_scale, x_f8, x_f8_t, RopeLayout(*layout))

    @staticmethod
    def backward(ctx, grad_q, grad_k, grad_v):
        grad_x, grad_qk_weight, grad_v_weight, grad_qkv_scale, grad_q_weight, grad_k_weight = (
            _backward(ctx, grad_q, grad_k, grad_v))
        weight_grads = {"q_weight": grad_q_weight, "k_weight": grad_k_weight}
        layout_grads = tuple(weight_grads.get(name) for name in RopeLayout._fields)
        return (grad_x, grad_qk_weight, grad_v_weight, None, None, None, grad_qkv_scale, None,
                None, None, None, *layout_grads)


# The reference exports its autograd function's apply under this name: calling it runs the op.
PackedFP8QKV = PackedFP8QKVFunction.apply


def packed_fp8_qkv(x, qk_weight, v_weight, weight_f8, weight_f8_t, weight_scale, qkv_scale,
                   x_scale, grad_scale, factor1, factor2, num_heads, paired, key_offset, rotary_dim,
                   x_f8, x_f8_t, *, num_kv_heads: Optional[int] = None,
                   rotary_style: Optional[str] = None, normalize: bool = True,
                   q_weight: Optional[torch.Tensor] = None,
                   k_weight: Optional[torch.Tensor] = None, weight_offset: float = 0.0,
                   eps: float = DEFAULT_EPS, cos_sin: Optional[torch.Tensor] = None,
                   positions: Optional[torch.Tensor] = None, normalize_v: bool = False,
                   norm_scope: str = "head", query_only: bool = False):
    """(q, k, v) = norm + rotary of x @ (qkv_scale * [Wq; Wk; Wv]).T, as one FP8 GEMM off the cached
    packed weight (two for paired layers, so that v is dense).

      x            bf16 [T, C] (or any shape of T*C elements): receives the gradient only
      qk_weight    bf16 [(Hq+Hkv)*D, C], v_weight bf16 [Hkv*Dv, C]: the master weights
      weight_f8    e4m3 [qkv_dim, C], weight_f8_t e4m3 [C, qkv_dim], weight_scale float32 scalar:
                   the cached packed weight (PackedWeightCache); qkv_dim = (Hq+Hkv)*D + Hkv*Dv
      qkv_scale    float32 scalar, learnable
      x_scale, grad_scale  float32 scalars; x_f8 [T, C], x_f8_t [C, T]: x quantized with x_scale.
                   grad_scale is read when the backward runs: it must be positive and bring the
                   gradients into e4m3 range (a fixed 1/448 lets small gradients round to zero),
                   and a tensor hook on q, k or v may set it from the gradients of the step
                   (current scaling). On the CPU the backward refuses a scale that is not
                   positive and finite (ValueError); on CUDA nothing reads it on the host (that
                   would synchronize): a zero scale there gives zero (or NaN) gradients
                   (docs/special_values.md)
      factor1/2    rotary tables [T, D] ([T, 2D] when paired), bf16 or float32; None with cos_sin
      num_heads    Hq; paired, key_offset, rotary_dim (None: the default) as qk_norm_rope's
    Keyword-only, as qk_norm_rope's: num_kv_heads, rotary_style (required with cos_sin),
    normalize, q_weight, k_weight (these receive gradients), weight_offset, eps, cos_sin,
    positions. Every argument is checked when the forward runs, those only the backward reads
    included.
    SPEC.md section 9, as qk_norm_rope's: normalize_v (v comes back normalized per head row; its
    gradient goes through the V norm into v_weight), norm_scope, query_only (the weight's Q rows
    alone: qk_weight [Hq*D, C], v_weight [0, C], k and v empty); without factor1/2 and cos_sin
    nothing rotates.
    Returns q [T, Hq, D], k [T, Hkv, D] ([2T, Hq/2, D] each when paired) and v [T, Hkv, Dv], bf16.
    """
    layout = rope_layout(num_heads, rotary_dim, paired, key_offset, factor1, factor2,
                         num_kv_heads=num_kv_heads, rotary_style=rotary_style, normalize=normalize,
                         q_weight=q_weight, k_weight=k_weight, weight_offset=weight_offset, eps=eps,
                         cos_sin=cos_sin, positions=positions, op="packed_fp8_qkv",
                         normalize_v=normalize_v, norm_scope=norm_scope, query_only=query_only)
    return PackedFP8QKVLayoutFunction.apply(x, qk_weight, v_weight, weight_f8, weight_f8_t,
                                            weight_scale, qkv_scale, x_scale, grad_scale, x_f8,
                                            x_f8_t, *layout)
