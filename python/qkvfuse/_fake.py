"""Fake (meta) kernels for torch.compile and FakeTensor tracing: the same output shapes, dtypes and
(contiguous) strides as bindings/torch/ops.cpp allocates. The rope ops end with the layout's
arguments (and, for the FP8 and packed backwards, the V norm's v), which RopeLayout.of_op reads
back; its last fields have defaults, so a call may pass fewer of them, or pass them by name.
ops.cpp names this module with m.set_python_module, so torch can point at it when it is missing.

These kernels also run, in place of the library, for a call with one argument on the `meta`
device among real ones (the dispatcher prefers the Meta kernel): so each first checks, as the
library does, that all its tensors share one device; the outputs would otherwise be empty
tensors of uninitialized memory on the other arguments' device.
"""
import torch

from . import _checks
from ._layout import RopeLayout

E4M3 = torch.float8_e4m3fn


def _dual_layout(x):
    t_shape = (*x.shape[:-2], x.shape[-1], x.shape[-2])
    return x.new_empty(x.shape, dtype=E4M3), x.new_empty(t_shape, dtype=E4M3)


def _rope_devices(op, layout: RopeLayout, **tensors):
    _checks.same_device(op, {**tensors, **layout.named_tensors()})


def _rope_forward(op, qk, v, fragment, kwargs):
    layout = RopeLayout.of_op(fragment, kwargs)
    _rope_devices(op, layout, qk=qk, v=v)
    q_shape, k_shape = layout.output_shapes(qk.shape[0], qk.shape[2])
    return qk.new_empty(q_shape), qk.new_empty(k_shape)


@torch.library.register_fake("qkvfuse::qk_norm_rope")
def _qk_norm_rope(qk, *layout, **kwargs):
    return _rope_forward("qk_norm_rope", qk, None, layout, kwargs)


@torch.library.register_fake("qkvfuse::qkv_norm_rope")
def _qkv_norm_rope(qk, v, *layout, **kwargs):
    return (*_rope_forward("qkv_norm_rope", qk, v, layout, kwargs), qk.new_empty(v.shape))


@torch.library.register_fake("qkvfuse::qk_norm_rope_backward")
def _qk_norm_rope_backward(grad_q, grad_k, qk, *layout, **kwargs):
    layout = RopeLayout.of_op(layout, kwargs)
    _rope_devices("qk_norm_rope_backward", layout, grad_q=grad_q, grad_k=grad_k, qk=qk)
    return (qk.new_empty(qk.shape), *layout.weight_grads_like(qk))


@torch.library.register_fake("qkvfuse::qkv_norm_rope_backward")
def _qkv_norm_rope_backward(grad_q, grad_k, grad_v_out, qk, v, *layout, **kwargs):
    layout = RopeLayout.of_op(layout, kwargs)
    _rope_devices("qkv_norm_rope_backward", layout, grad_q=grad_q, grad_k=grad_k,
                  grad_v_out=grad_v_out, qk=qk, v=v)
    return (qk.new_empty(qk.shape), qk.new_empty(v.shape), *layout.weight_grads_like(qk))


@torch.library.register_fake("qkvfuse::qkv_backward_fp8")
def _qkv_backward_fp8(grad_q, grad_k, grad_v, qk, grad_scale, *fragment, **kwargs):
    layout = RopeLayout.of_op(fragment, kwargs)
    _rope_devices("qkv_backward_fp8", layout, grad_q=grad_q, grad_k=grad_k, grad_v=grad_v, qk=qk,
                  grad_scale=grad_scale, v=RopeLayout.trailing(fragment, "v", kwargs))
    tokens = qk.shape[0]
    qkv_dim = layout.qkv_dim(qk.shape[2], grad_v.shape[2])
    return (qk.new_empty((tokens, qkv_dim), dtype=E4M3),
            qk.new_empty((qkv_dim, tokens), dtype=E4M3), *layout.weight_grads_like(qk))


@torch.library.register_fake("qkvfuse::check_positions")
def _check_positions(positions, num_positions):
    return None


@torch.library.register_fake("qkvfuse::quantize_dual_layout")
def _quantize_dual_layout(x, scale):
    _checks.same_device("quantize_dual_layout", dict(x=x, scale=scale))
    return _dual_layout(x)


@torch.library.register_fake("qkvfuse::quantize_dual_layout_amax")
def _quantize_dual_layout_amax(x, scale):
    _checks.same_device("quantize_dual_layout", dict(x=x, scale=scale))
    return (*_dual_layout(x), x.new_empty(scale.shape, dtype=torch.float32))


@torch.library.register_fake("qkvfuse::quantize_weight_bank")
def _quantize_weight_bank(weights):
    return (*_dual_layout(weights), weights.new_empty((weights.shape[0],), dtype=torch.float32))


@torch.library.register_fake("qkvfuse::fp8_gemm")
def _fp8_gemm(a, b, scale_a, scale_b, alpha=None, fast_accum=False):
    _checks.same_device("fp8_gemm", dict(a=a, b=b, scale_a=scale_a, scale_b=scale_b, alpha=alpha))
    return a.new_empty((a.shape[0], b.shape[0]), dtype=torch.bfloat16)


@torch.library.register_fake("qkvfuse::packed_qkv_forward")
def _packed_qkv_forward(x_f8, weight_f8, x_scale, weight_scale, qkv_scale, qk_dim, v_dim, *layout,
                        **kwargs):
    layout = RopeLayout.of_op(layout, kwargs)
    _rope_devices("packed_qkv_forward", layout, x_f8=x_f8, weight_f8=weight_f8, x_scale=x_scale,
                  weight_scale=weight_scale, qkv_scale=qkv_scale)
    tokens = x_f8.shape[0]
    q_shape, k_shape = layout.output_shapes(tokens, qk_dim)
    bf16 = torch.bfloat16
    # With the V norm, v_out follows the projection in the buffer (_layout.v_out_view).
    v_out = layout.kv_heads * v_dim if layout.normalize_v else 0
    return (x_f8.new_empty(q_shape, dtype=bf16), x_f8.new_empty(k_shape, dtype=bf16),
            x_f8.new_empty((tokens * (layout.qkv_dim(qk_dim, v_dim) + v_out),), dtype=bf16))


@torch.library.register_fake("qkvfuse::packed_qkv_backward")
def _packed_qkv_backward(grad_q, grad_k, grad_v, qk, x_f8_t, weight_f8_t, qk_weight, v_weight,
                         x_scale, weight_scale, qkv_scale, grad_scale, *fragment, **kwargs):
    layout = RopeLayout.of_op(fragment, kwargs)
    _rope_devices("packed_qkv_backward", layout, grad_q=grad_q, grad_k=grad_k, grad_v=grad_v,
                  qk=qk, x_f8_t=x_f8_t, weight_f8_t=weight_f8_t, qk_weight=qk_weight,
                  v_weight=v_weight, x_scale=x_scale, weight_scale=weight_scale,
                  qkv_scale=qkv_scale, grad_scale=grad_scale,
                  v=RopeLayout.trailing(fragment, "v", kwargs))
    tokens, channels = qk.shape[0], x_f8_t.shape[0]
    qkv_dim = qk_weight.shape[0] + v_weight.shape[0]
    bf16 = torch.bfloat16
    return (qk.new_empty((tokens, channels), dtype=bf16),
            qk.new_empty((qkv_dim, channels), dtype=bf16),
            qk.new_empty(qkv_scale.shape, dtype=torch.float32),
            *layout.weight_grads_like(qk))
