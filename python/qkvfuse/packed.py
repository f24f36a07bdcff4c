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

`packed_fp8_qkv_current_scaling` is the same projection for a model that keeps only its master
weights (the Hugging Face integration): every scale is computed per call, on the device, from
the tensors of that call (x, the weight, and in the backward the incoming gradients), so nothing
is cached between calls and the whole of it traces into a torch.compile graph.
"""
from typing import Optional

import torch

from . import _checks
from ._layout import (DEFAULT_EPS, RopeLayout, kernel_readable, qkv_views, split_grad_weight,
                      v_out_view)
from .ops import quantize_dual_layout, quantize_weight_bank, rope_layout

_ops = torch.ops.qkvfuse

E4M3_MAX = 448.0
# Never a zero scale: it would saturate every e4m3 code (docs/special_values.md).
MIN_SCALE = 2.0**-100
# The gradient scale's default headroom over max |grad q, k, v|: the norm's backward can grow a
# row's gradient beyond its input's (examples/train_gpt.py uses the same).
GRAD_HEADROOM = 4.0


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
        return (grad_x, grad_qk_weight, grad_v_weight, None, None, None, grad_qkv_scale, None,
                None, None, None, *_layout_grads(grad_q_weight, grad_k_weight))


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


# ---- current scaling: every scale from the tensors of the call ---------------------------------

def current_scale(tensors, headroom: float = 1.0) -> torch.Tensor:
    """float32 scalar headroom * max |tensors| / 448 (never below MIN_SCALE), on the device, no
    host synchronization: the e4m3 scale that maps the largest element to 448 / headroom."""
    # The infinity norm of an empty tensor is refused (a max has no identity): T = 0 has none.
    present = [t for t in tensors if t.numel() > 0]
    if not present:
        return torch.full((), MIN_SCALE, dtype=torch.float32, device=tensors[0].device)
    amax = torch.stack(torch._foreach_norm(present, float("inf"))).amax().float()
    # A division, so that the default headrooms (1, 4) give the correctly rounded quotient.
    return torch.clamp_min(amax / (E4M3_MAX / headroom), MIN_SCALE)


class PackedFP8QKVCurrentScalingFunction(torch.autograd.Function):
    """packed_fp8_qkv_current_scaling's autograd function: x, the packed weight, qkv_scale, the
    head width and the gradient's headroom, then RopeLayout's fields in order. Gradients for x,
    weight, qkv_scale and the norm weights."""

    @staticmethod
    def forward(ctx, x, weight, qkv_scale, head_dim, grad_headroom, *layout):
        layout = RopeLayout(*layout)
        qk_rows = (layout.num_heads + layout.kv_heads) * head_dim
        # A query-only call has no V rows: any V width serves the empty V (head_dim's).
        v_dim = (weight.shape[0] - qk_rows) // layout.kv_heads if layout.kv_heads else head_dim
        x2d = x.reshape(-1, weight.shape[1])
        # Outside autocast, whose CUDA policy would reduce the norm in float32 (a cast of x).
        with torch.autocast(x.device.type, enabled=False):
            x_scale = current_scale((x2d,))
        x_f8, x_f8_t = quantize_dual_layout(x2d, x_scale)
        # The weight bank op computes amax / 448 on the device; one entry here.
        weight_f8, weight_f8_t, weight_scale = quantize_weight_bank(weight.unsqueeze(0))
        weight_f8, weight_f8_t, weight_scale = weight_f8[0], weight_f8_t[0], weight_scale[0]
        q, k, qkv = _ops.packed_qkv_forward(x_f8, weight_f8, x_scale, weight_scale, qkv_scale,
                                            head_dim, v_dim, *layout)
        qk, v = qkv_views(qkv, x_f8.shape[0], layout, head_dim, v_dim)
        # With the V norm the raw V is the backward's input and the normalized one the output.
        v_out = v_out_view(qkv, x_f8.shape[0], layout, head_dim, v_dim)
        ctx.save_for_backward(qk, v if v_out is not None else None, x_f8_t, weight_f8_t, weight,
                              x_scale, weight_scale, qkv_scale, *layout.tensors())
        ctx.qk_rows = qk_rows
        ctx.grad_headroom = grad_headroom
        ctx.x_shape = x.shape
        ctx.options = layout.options()
        return q, k, v if v_out is None else v_out

    @staticmethod
    def backward(ctx, grad_q, grad_k, grad_v):
        (qk, v, x_f8_t, weight_f8_t, weight, x_scale, weight_scale, qkv_scale,
         *tensors) = ctx.saved_tensors
        layout = RopeLayout.of_parts(ctx.options, tensors)
        grads = [kernel_readable(g) for g in (grad_q, grad_k, grad_v)]
        # This call's gradient scale, from the gradients themselves (one more read of them).
        grad_scale = current_scale(grads, ctx.grad_headroom)
        grad_x, grad_weight, grad_qkv_scale, grad_q_weight, grad_k_weight = (
            _ops.packed_qkv_backward(*grads, qk, x_f8_t, weight_f8_t, weight[:ctx.qk_rows],
                                     weight[ctx.qk_rows:], x_scale, weight_scale, qkv_scale,
                                     grad_scale, *layout, v))
        return (grad_x.view(ctx.x_shape), grad_weight, grad_qkv_scale, None, None,
                *_layout_grads(*layout.weight_grads(grad_q_weight, grad_k_weight)))


def _layout_grads(grad_q_weight, grad_k_weight) -> tuple:
    """The gradients of RopeLayout's fields, in order: the norm weights' (the fields after them,
    SPEC.md section 9's options, have none)."""
    weight_grads = {"q_weight": grad_q_weight, "k_weight": grad_k_weight}
    return tuple(weight_grads.get(name) for name in RopeLayout._fields)


def packed_fp8_qkv_current_scaling(
        x: torch.Tensor, weight: torch.Tensor, num_heads: int, head_dim: int, *,
        qkv_scale: Optional[torch.Tensor] = None, grad_headroom: float = GRAD_HEADROOM,
        num_kv_heads: Optional[int] = None, rotary_dim: Optional[int] = None,
        paired: bool = False, key_offset: bool = False,
        factor1: Optional[torch.Tensor] = None, factor2: Optional[torch.Tensor] = None,
        rotary_style: Optional[str] = None, normalize: bool = True,
        q_weight: Optional[torch.Tensor] = None, k_weight: Optional[torch.Tensor] = None,
        weight_offset: float = 0.0, eps: float = DEFAULT_EPS,
        cos_sin: Optional[torch.Tensor] = None, positions: Optional[torch.Tensor] = None,
        normalize_v: bool = False, norm_scope: str = "head", query_only: bool = False):
    """(q, k, v) = norm + rotary of x @ (qkv_scale * weight).T through one FP8 GEMM, as
    packed_fp8_qkv computes them, with every e4m3 scale computed in the call (current scaling):

      x          bf16 [T, C] (or any shape of T*C elements): x_scale = max|x| / 448, quantized
                 to e4m3 [T, C] and [C, T] in this call
      weight     bf16 [(Hq+Hkv)*D + Hkv*Dv, C], contiguous: the packed [Wq; Wk; Wv] (e.g. a
                 torch.cat of the master weights cast to bf16, through which their gradients
                 flow), quantized to e4m3 in both layouts with scale max|weight| / 448 in this
                 call; [Hq*D, C] (the query rows alone) with query_only. Its rows may be gathered
                 from anywhere: e.g. a gated query's query rows of q_proj (the gate's rows are the
                 caller's own projection), or k_proj's rows twice for a V equal to the key
                 projection (autograd adds the two gradients)
      num_heads  Hq;  head_dim  D (Dv follows from the weight's rows)
      qkv_scale  float32 scalar multiplying the product (learnable; None: 1)
      grad_headroom  the backward quantizes grad q, k, v with grad_scale = grad_headroom *
                 max(|grad q|, |grad k|, |grad v|) / 448, computed from the gradients that
                 reach this call's backward (so gradient accumulation, checkpointing and several
                 forwards before one backward each get their own); a fixed scale lets small
                 gradients round to zero in e4m3 (docs/training/README.md)
    The layout keywords are packed_fp8_qkv's and qk_norm_rope's (num_kv_heads, rotary_dim,
    paired, key_offset, factor tables or cos_sin + positions, rotary_style (required with
    cos_sin), normalize, q_weight, k_weight, weight_offset, eps) and SPEC.md section 9's
    (normalize_v: v comes back normalized per head row; norm_scope "token"; query_only: k and v
    empty; without factor tables and cos_sin nothing rotates). Scales never drop below 2^-100
    (an all-zero tensor). Gradients for x, weight, qkv_scale and the norm weights.
    Returns q [T, Hq, D], k [T, Hkv, D] ([2T, Hq/2, D] each when paired), v [T, Hkv, Dv], bf16.

    What per-call weight scaling costs: the weight's quantization (two passes over the bf16
    weight: 2 + 2 bytes read and 1 + 1 written per element) runs in every forward. A cache
    refreshed once per optimizer step (PackedWeightCache) runs the same passes once per step
    after copying the weights into its bank (2 more bytes written, 2 or 4 read), so per-call
    scaling moves fewer bytes with one forward per step and more from three (gradient
    accumulation; activation checkpointing's recomputation counts as a forward). Per layer and
    forward: Qwen3-0.6B's q/k/v weight (F = 4096, C = 1024, 4.2 M elements) 25 MB, about 8 us at
    3 TB/s; Qwen3-8B's (F = 6144, C = 4096, 25.2 M) 151 MB, about 50 us. Against the layer's
    forward at the whole-step benchmark's shapes (issue 31: 0.6B at 8 x 2048 tokens, 0.65 TFLOP of
    GEMMs and attention, about 1.1 ms at 600 TFLOP/s; 8B at 4 x 2048, 3.3 TFLOP, about 5.5 ms)
    that is under 1 % of the forward and about 0.3 % of forward + backward.
    """
    name = "packed_fp8_qkv_current_scaling"
    layout = rope_layout(num_heads, rotary_dim, paired, key_offset, factor1, factor2,
                         num_kv_heads=num_kv_heads, rotary_style=rotary_style, normalize=normalize,
                         q_weight=q_weight, k_weight=k_weight, weight_offset=weight_offset, eps=eps,
                         cos_sin=cos_sin, positions=positions, op=name, normalize_v=normalize_v,
                         norm_scope=norm_scope, query_only=query_only)
    _checks.tensor(name, "x", x)
    _checks.tensor(name, "weight", weight)
    _checks.tensor(name, "qkv_scale", qkv_scale, optional=True, expected=_checks.SCALAR)
    _checks.integer(name, "head_dim", head_dim, least=1)
    _checks.number(name, "grad_headroom", grad_headroom)
    if not 0 < grad_headroom < float("inf"):
        raise ValueError(f"{name}: grad_headroom: expected a positive finite number, got "
                         f"{grad_headroom}")
    if x.dtype != torch.bfloat16:
        raise RuntimeError(f"{name}: x: expected torch.bfloat16, got {x.dtype}")
    qk_rows = (layout.num_heads + layout.kv_heads) * head_dim
    kv_heads = layout.kv_heads  # 0 with query_only: no V rows
    rows = weight.shape[0] if weight.dim() == 2 else 0
    v_rows = rows - qk_rows
    if not (weight.dtype == torch.bfloat16 and weight.is_contiguous()
            and (v_rows > 0 and kv_heads >= 1 and v_rows % kv_heads == 0
                 or v_rows == kv_heads == 0)
            and weight.shape[1] >= 1 and x.numel() % weight.shape[1] == 0):
        expected = (f"[Hq * D, C] = [{qk_rows}, C] (query_only: the query rows alone)"
                    if layout.query_only else
                    f"[(Hq + Hkv) * D + Hkv * Dv, C] = [{qk_rows} + {kv_heads} * Dv, C] with "
                    f"Dv >= 1")
        raise RuntimeError(
            f"{name}: weight: expected a contiguous torch.bfloat16 tensor {expected} (Hq = "
            f"{layout.num_heads}, Hkv = {kv_heads}, D = head_dim = {head_dim}) and C "
            f"dividing x's {x.numel()} elements, got {weight.dtype} of shape "
            f"{list(weight.shape)}")
    if qkv_scale is None:
        qkv_scale = torch.ones((), dtype=torch.float32, device=x.device)
    return PackedFP8QKVCurrentScalingFunction.apply(x, weight, qkv_scale, head_dim, grad_headroom,
                                                    *layout)
