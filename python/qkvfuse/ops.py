"""The functional API over torch.ops.qkvfuse, and the autograd of qk_norm_rope.

Each function is a thin call of one registered op; shapes and dtypes are documented in SPEC.md and
include/qkvfuse/*.hpp. Invalid arguments raise RuntimeError with the library's message, which names
the offending argument as the C++ params struct does: the same names as here, except that the
quantize functions' source (x, weights) is `src` there.
"""
from typing import Optional

import torch

from ._layout import kernel_readable

_ops = torch.ops.qkvfuse


def qk_norm_rope(qk: torch.Tensor, factor1: torch.Tensor, factor2: torch.Tensor, num_heads: int,
                 rotary_dim: Optional[int] = None, paired: bool = False,
                 key_offset: bool = False):
    """(q, k) = interleaved rotary of the per-head RMS-norm of qk [T, 2H, D] (SPEC.md section 1).

    q and k are [T, H, D] ([2T, H/2, D] when paired), qk's dtype. rotary_dim (dims from it on
    are stationary; read by key_offset) defaults to D. Differentiable in qk (the backward is the
    registered qk_norm_rope_backward op); the factors receive no gradient.
    """
    if rotary_dim is None:
        rotary_dim = qk.shape[-1]
    return _ops.qk_norm_rope(qk, factor1, factor2, num_heads, rotary_dim, paired, key_offset)


def _qk_norm_rope_setup_context(ctx, inputs, output):
    qk, factor1, factor2, num_heads, rotary_dim, paired, key_offset = inputs
    ctx.save_for_backward(qk, factor1, factor2)
    ctx.layout = (num_heads, rotary_dim, paired, key_offset)


def _qk_norm_rope_backward(ctx, grad_q, grad_k):
    qk, factor1, factor2 = ctx.saved_tensors
    grad_qk = _ops.qk_norm_rope_backward(
        kernel_readable(grad_q), kernel_readable(grad_k), qk, factor1, factor2,
        *ctx.layout)
    return grad_qk, None, None, None, None, None, None


torch.library.register_autograd("qkvfuse::qk_norm_rope", _qk_norm_rope_backward,
                                setup_context=_qk_norm_rope_setup_context)


def qkv_backward_fp8(grad_q, grad_k, grad_v, qk, factor1, factor2, grad_scale, num_heads: int,
                     rotary_dim: int, paired: bool, key_offset: bool):
    """(grad_row [T, qkv_dim], grad_t [qkv_dim, T]), e4m3: the norm/rotary gradient of Q and K
    (rounded to bf16) and grad_v, divided by grad_scale, in both layouts (SPEC.md section 3)."""
    return _ops.qkv_backward_fp8(grad_q, grad_k, grad_v, qk, factor1, factor2, grad_scale,
                                 num_heads, rotary_dim, paired, key_offset)


def quantize_dual_layout(x: torch.Tensor, scale: torch.Tensor, amax: bool = False):
    """(row, t) = e4m3(x / scale) and its transpose, from one read of x (SPEC.md section 5); with
    amax=True also max|x| (scale's shape). x is bf16 [M, N] with a scalar scale, or [B, M, N] with
    scale [B]."""
    if amax:
        return _ops.quantize_dual_layout_amax(x, scale)
    return _ops.quantize_dual_layout(x, scale)


def quantize_weight_bank(weights: torch.Tensor):
    """(row [B, M, N], t [B, N, M], scale [B]) for bf16 weights [B, M, N], with the current scale
    max|weights[b]| / 448 per entry (1 for an all-zero entry), computed on the device."""
    return _ops.quantize_weight_bank(weights)


def fp8_gemm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
             alpha: Optional[torch.Tensor] = None, fast_accum: bool = False) -> torch.Tensor:
    """bf16 (a @ b^T) * scale_a * scale_b * alpha for e4m3 a [M, K] and b [N, K], fp32 accumulation."""
    return _ops.fp8_gemm(a, b, scale_a, scale_b, alpha, fast_accum)
