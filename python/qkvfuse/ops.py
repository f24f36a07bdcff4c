"""The functional API over torch.ops.qkvfuse.

Each function is a thin call of one registered op; shapes and dtypes are documented in SPEC.md and
include/qkvfuse/*.hpp. Invalid arguments raise RuntimeError with the library's message, which names
the offending argument as the C++ params struct does: the same names as here, except that the
layout's arguments read `layout.<name>` (layout.factor1, layout.q_weight, ...) and the quantize
functions' source (x, weights) is `src` there.
"""
from typing import Optional

import torch
import torch.fx

from ._layout import DEFAULT_EPS, RopeLayout

_ops = torch.ops.qkvfuse


def rope_layout(num_heads, rotary_dim=None, paired=False, key_offset=False, factor1=None,
                factor2=None, *, num_kv_heads=None, rotary_style="interleaved", normalize=True,
                q_weight=None, k_weight=None, weight_offset=0.0, eps=DEFAULT_EPS, cos_sin=None,
                positions=None, op="qk_norm_rope", normalize_v=False, norm_scope="head",
                query_only=False) -> RopeLayout:
    """The RopeLayout of the public functions' arguments (SPEC.md sections 8 and 9); the library
    validates it when the op runs, naming the argument at fault."""
    if num_heads is None:
        raise TypeError(f"{op}: num_heads is required")
    if query_only and num_kv_heads == 0:
        num_kv_heads = None  # a query-only layout has no key heads: the binding's None is 0
    return RopeLayout(num_heads, num_kv_heads, rotary_dim, rotary_style, normalize, eps,
                      weight_offset, paired, key_offset, factor1, factor2, cos_sin, positions,
                      q_weight, k_weight, normalize_v, norm_scope, query_only)


def _check_v(op, v, normalize_v):
    """The V norm's tensor goes with the option (the library says the same as layout.normalize_v
    and v, but a Python caller should read Python names)."""
    if normalize_v and v is None:
        raise ValueError(f"{op}: normalize_v=True needs v, the V heads [T, Hkv, Dv] to normalize")
    if v is not None and not normalize_v:
        raise ValueError(f"{op}: v: given, but normalize_v is False (v is the V norm's input)")


def qk_norm_rope(qk: torch.Tensor, factor1: Optional[torch.Tensor] = None,
                 factor2: Optional[torch.Tensor] = None, num_heads: Optional[int] = None,
                 rotary_dim: Optional[int] = None, paired: bool = False,
                 key_offset: bool = False, *, num_kv_heads: Optional[int] = None,
                 rotary_style: str = "interleaved", normalize: bool = True,
                 q_weight: Optional[torch.Tensor] = None, k_weight: Optional[torch.Tensor] = None,
                 weight_offset: float = 0.0, eps: float = DEFAULT_EPS,
                 cos_sin: Optional[torch.Tensor] = None, positions: Optional[torch.Tensor] = None,
                 v: Optional[torch.Tensor] = None, normalize_v: bool = False,
                 norm_scope: str = "head", query_only: bool = False):
    """(q, k) = rotary(norm(qk)) per head (SPEC.md sections 1 and 8), differentiable in qk and the
    norm weights (the backward is the registered qk_norm_rope_backward op); with normalize_v,
    (q, k, v_out) (SPEC.md section 9).

      qk            [T, Hq + Hkv, D] (query heads first), bf16 (float32/float64 too on the CPU);
                    last dim contiguous, other strides free. D even, 2..256.
      factor1/2     per-token rotary tables [T, D] ([T, 2D] when paired), bf16 or float32, in the
                    speedrun's sign convention (qkvfuse.speedrun_factor_tables); None with cos_sin
      num_heads     Hq (required)
      rotary_dim    r: lanes [0, r) rotate, even, in [0, D]; default D with tables and
                    cos_sin.shape[1] with a cos/sin cache (which r must then equal)
      paired        outputs [2T, Hq/2, D] (Hq = Hkv even, factor tables [T, 2D])
      key_offset    keys' lanes >= r come from the previous token (Hq = Hkv)
    Keyword-only:
      num_kv_heads  Hkv (GQA/MQA; divides Hq); default Hq
      rotary_style  "interleaved" (lane d turns with d ^ 1) or "neox" (with d +- r/2)
      normalize     False: rotary only, no RMS-norm (norm weights then not allowed)
      q_weight, k_weight  [D] bf16 or float32 norm weights: n * (w + weight_offset); each
                    receives a gradient (summed in float32, deterministic), in its own dtype
      weight_offset 1.0 for Gemma's (1 + w)
      eps           the RMS-norm's epsilon, default 2^-23
      cos_sin       [P, r] bf16 or float32 cos/sin cache (qkvfuse.rotary_cos_sin): columns
                    [0, r/2) cos, [r/2, r) sin of frequency i; read at `positions`
      positions     int32 or int64 [T], each in [0, P). A position outside gives NaN in that
                    token's rotary lanes (never an out-of-bounds read); qkvfuse.check_positions
                    or QKVFUSE_CHECK_POSITIONS=1 raise instead. Without factor tables and
                    cos_sin nothing rotates (rotary_dim None or 0): NoPE layers
      v, normalize_v  the V norm: v [T, Hkv, Dv] (qk's dtype, last dim contiguous; may be a view
                    of qk's key rows) comes back normalized per head row, v * rsqrt(mean(v^2) +
                    eps), as a third output; differentiable in v too
      norm_scope    "head" (one RMS per head row) or "token" (one over a token's Hq*D query values
                    and one over its Hkv*D key values, OLMo 2/3; weights [Hq*D] and [Hkv*D])
      query_only    qk holds the Hq query heads alone (Gemma 4's KV-shared layers): k is empty
                    [T, 0, D]; num_kv_heads must be None
    q is [T, Hq, D] and k [T, Hkv, D] ([2T, Hq/2, D] when paired), qk's dtype.
    """
    _check_v("qk_norm_rope", v, normalize_v)
    layout = rope_layout(num_heads, rotary_dim, paired, key_offset, factor1, factor2,
                         num_kv_heads=num_kv_heads, rotary_style=rotary_style, normalize=normalize,
                         q_weight=q_weight, k_weight=k_weight, weight_offset=weight_offset, eps=eps,
                         cos_sin=cos_sin, positions=positions, normalize_v=normalize_v,
                         norm_scope=norm_scope, query_only=query_only)
    if normalize_v:
        return _ops.qkv_norm_rope(qk, v, *layout)
    return _ops.qk_norm_rope(qk, *layout)


def qkv_backward_fp8(grad_q, grad_k, grad_v, qk, factor1, factor2, grad_scale, num_heads: int,
                     rotary_dim: Optional[int] = None, paired: bool = False,
                     key_offset: bool = False, *, num_kv_heads: Optional[int] = None,
                     rotary_style: str = "interleaved", normalize: bool = True,
                     q_weight: Optional[torch.Tensor] = None,
                     k_weight: Optional[torch.Tensor] = None, weight_offset: float = 0.0,
                     eps: float = DEFAULT_EPS, cos_sin: Optional[torch.Tensor] = None,
                     positions: Optional[torch.Tensor] = None, v: Optional[torch.Tensor] = None,
                     normalize_v: bool = False, norm_scope: str = "head",
                     query_only: bool = False):
    """(grad_row [T, qkv_dim], grad_t [qkv_dim, T]), e4m3: the norm/rotary gradient of Q and K
    (rounded to bf16) and grad_v [T, Hkv, Dv], divided by grad_scale, in both layouts (SPEC.md
    sections 3 and 8; qkv_dim = (Hq + Hkv) * D + Hkv * Dv). The layout arguments are
    qk_norm_rope's. With normalize_v, grad_v is the gradient of v_out and v the forward's v: the
    V features are then the V norm's gradient, rounded to bf16 first (SPEC.md section 9). With a
    norm weight given, returns (grad_row, grad_t, grad_q_weight, grad_k_weight), None for the
    weight not given."""
    _check_v("qkv_backward_fp8", v, normalize_v)
    layout = rope_layout(num_heads, rotary_dim, paired, key_offset, factor1, factor2,
                         num_kv_heads=num_kv_heads, rotary_style=rotary_style, normalize=normalize,
                         q_weight=q_weight, k_weight=k_weight, weight_offset=weight_offset, eps=eps,
                         cos_sin=cos_sin, positions=positions, op="qkv_backward_fp8",
                         normalize_v=normalize_v, norm_scope=norm_scope, query_only=query_only)
    grad_row, grad_t, grad_q_weight, grad_k_weight = _ops.qkv_backward_fp8(
        grad_q, grad_k, grad_v, qk, grad_scale, *layout, v)
    if q_weight is None and k_weight is None:
        return grad_row, grad_t
    return (grad_row, grad_t, *layout.weight_grads(grad_q_weight, grad_k_weight))


def check_positions(positions: torch.Tensor, num_positions: int) -> None:
    """Raises RuntimeError naming the first token whose position lies outside [0, num_positions)
    (num_positions: cos_sin.shape[0]). positions: int32 or int64 [T]. On CUDA it synchronizes
    the stream, and it cannot run while a CUDA graph is being captured (nor in a torch.compile
    graph replayed as one, mode="reduce-overhead"); QKVFUSE_CHECK_POSITIONS=1 makes every rope
    op run it first."""
    _ops.check_positions(positions, num_positions)


# The op returns nothing: without this, torch.compile's graph passes would drop it as dead code.
torch.fx.node.has_side_effect(_ops.check_positions.default)


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
