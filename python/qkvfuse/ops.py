"""The functional API over torch.ops.qkvfuse.

Each function is a thin call of one registered op; shapes and dtypes are documented in SPEC.md and
include/qkvfuse/*.hpp. Errors name the argument at fault as these functions spell it and say what
was expected: a tensor of the wrong dtype, shape or device raises RuntimeError (the library's
check), a Python value of the wrong type TypeError (checked here first), a bad option ValueError.
The library's C++ source location of an error is not in its message: TORCH_SHOW_CPP_STACKTRACES=1
shows it (README.md, "Errors").

The rope functions take the speedrun's arguments positionally, in the reference's order
(qk_norm_rope(qk, factor1, factor2, num_heads, rotary_dim, paired, key_offset)), and every
argument by keyword; the general layouts (SPEC.md section 8) are called by keyword from num_heads
on: qk_norm_rope(qk, num_heads=32, num_kv_heads=8, rotary_style="neox", cos_sin=...,
positions=...).
"""
from typing import Optional

import torch
import torch.fx

from . import _checks
from ._layout import DEFAULT_EPS, RopeLayout

_ops = torch.ops.qkvfuse

ROTARY_STYLES = ("interleaved", "neox")
NORM_SCOPES = ("head", "token")

# A cos/sin cache does not say which lanes pair: a default would rotate the wrong lanes of the
# other convention's cache and give wrong q and k with no error.
_STYLE_REQUIRED = (
    'required with a cos/sin cache, which does not say how its lanes pair: "neox" for Hugging '
    'Face models (rotate_half: Llama, Qwen, Gemma, Mistral, ...), "interleaved" for GPT-J-style '
    'pairs (d, d ^ 1)')


def rope_layout(num_heads, rotary_dim=None, paired=False, key_offset=False, factor1=None,
                factor2=None, *, num_kv_heads=None, rotary_style=None, normalize=True,
                q_weight=None, k_weight=None, weight_offset=0.0, eps=DEFAULT_EPS, cos_sin=None,
                positions=None, op="qk_norm_rope", normalize_v=False, norm_scope="head",
                query_only=False) -> RopeLayout:
    """The RopeLayout of the public functions' arguments (SPEC.md sections 8 and 9), their Python
    types checked; the library validates the rest when the op runs, naming the argument at fault.
    rotary_style None is "interleaved" with factor tables (the speedrun's, SPEC.md sections 1-7)
    or without an angle source (nothing rotates), and an error with a cos/sin cache."""
    # An int in factor1's place is num_heads given second: the general call without its keywords.
    hint = (f"; the general layouts pass num_heads and the angles by keyword: {op}(..., "
            f"num_heads=..., cos_sin=..., positions=..., rotary_style=...)"
            if isinstance(factor1, int) else "")
    _checks.tensor(op, "factor1", factor1, optional=True, hint=hint)
    if num_heads is None:
        raise TypeError(f"{op}: num_heads: missing (a required argument)")
    _checks.integer(op, "num_heads", num_heads)
    _checks.integer(op, "num_kv_heads", num_kv_heads, optional=True)
    _checks.integer(op, "rotary_dim", rotary_dim, optional=True, least=0)
    for name, value in (("paired", paired), ("key_offset", key_offset), ("normalize", normalize),
                        ("normalize_v", normalize_v), ("query_only", query_only)):
        _checks.flag(op, name, value)
    _checks.number(op, "weight_offset", weight_offset)
    _checks.number(op, "eps", eps)
    for name, value in (("factor2", factor2), ("cos_sin", cos_sin), ("positions", positions),
                        ("q_weight", q_weight), ("k_weight", k_weight)):
        _checks.tensor(op, name, value, optional=True)
    if rotary_style is None:
        if cos_sin is not None:
            raise ValueError(f"{op}: rotary_style: {_STYLE_REQUIRED}")
        rotary_style = "interleaved"
    elif rotary_style not in ROTARY_STYLES:
        raise ValueError(f'{op}: rotary_style: expected "interleaved" or "neox", got '
                         f"{rotary_style!r}")
    if norm_scope not in NORM_SCOPES:
        raise ValueError(f'{op}: norm_scope: expected "head" or "token", got {norm_scope!r}')
    if query_only and num_kv_heads == 0:
        num_kv_heads = None  # a query-only layout has no key heads: the binding's None is 0
    return RopeLayout(num_heads, num_kv_heads, rotary_dim, rotary_style, normalize, eps,
                      weight_offset, paired, key_offset, factor1, factor2, cos_sin, positions,
                      q_weight, k_weight, normalize_v, norm_scope, query_only)


def _check_v(op, v, normalize_v):
    """The V norm's tensor goes with the option: checked here since the op that runs (qk_norm_rope
    or qkv_norm_rope) follows from normalize_v."""
    _checks.tensor(op, "v", v, optional=True)
    if normalize_v and v is None:
        raise ValueError(f"{op}: v: missing (normalize_v=True normalizes v, the V heads "
                         f"[T, Hkv, Dv])")
    if v is not None and not normalize_v:
        raise ValueError(f"{op}: v: given, but normalize_v is False (v is the V norm's input)")


def qk_norm_rope(qk: torch.Tensor, factor1: Optional[torch.Tensor] = None,
                 factor2: Optional[torch.Tensor] = None, num_heads: Optional[int] = None,
                 rotary_dim: Optional[int] = None, paired: bool = False,
                 key_offset: bool = False, *, num_kv_heads: Optional[int] = None,
                 rotary_style: Optional[str] = None, normalize: bool = True,
                 q_weight: Optional[torch.Tensor] = None, k_weight: Optional[torch.Tensor] = None,
                 weight_offset: float = 0.0, eps: float = DEFAULT_EPS,
                 cos_sin: Optional[torch.Tensor] = None, positions: Optional[torch.Tensor] = None,
                 v: Optional[torch.Tensor] = None, normalize_v: bool = False,
                 norm_scope: str = "head", query_only: bool = False):
    """(q, k) = rotary(norm(qk)) per head (SPEC.md sections 1 and 8), differentiable in qk and the
    norm weights (the backward is the registered qk_norm_rope_backward op); with normalize_v,
    (q, k, v_out) (SPEC.md section 9).

    The speedrun's layout, with per-token factor tables, positionally in the reference's order:
        q, k = qk_norm_rope(qk, factor1, factor2, num_heads)
    The general layouts by keyword from num_heads on, e.g. a Qwen3 layer:
        q, k = qk_norm_rope(qk, num_heads=32, num_kv_heads=8, rotary_style="neox",
                            q_weight=q_norm.weight, k_weight=k_norm.weight, eps=1e-6,
                            cos_sin=cos_sin, positions=position_ids)
    (num_heads second without its keyword, qk_norm_rope(qk, 32, ...), raises TypeError).

      qk            [T, Hq + Hkv, D] (query heads first), bf16 (float32/float64 too on the CPU);
                    last dim contiguous, other strides free. D even, 2..512 (2..256 on CUDA
                    for now: SPEC.md section 9).
      factor1/2     per-token rotary tables [T, D] ([T, 2D] when paired), bf16 or float32, in the
                    speedrun's sign convention (qkvfuse.speedrun_factor_tables); None with cos_sin
      num_heads     Hq (required)
      rotary_dim    r: lanes [0, r) rotate, even, in [0, D]; default D with tables and
                    cos_sin.shape[1] with a cos/sin cache (which r must then equal)
      paired        outputs [2T, Hq/2, D] (Hq = Hkv even, factor tables [T, 2D])
      key_offset    keys' lanes >= r come from the previous token (Hq = Hkv)
    Keyword-only:
      num_kv_heads  Hkv (GQA/MQA; divides Hq); default Hq
      rotary_style  "interleaved" (lane d turns with d ^ 1: the speedrun, GPT-J) or "neox" (with
                    d +- r/2: Hugging Face's rotate_half, as in Llama, Qwen, Gemma). Required
                    with cos_sin, which does not say how its lanes pair; with factor tables (or
                    no angle source) the default is "interleaved"
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
    _checks.tensor("qk_norm_rope", "qk", qk)
    layout = rope_layout(num_heads, rotary_dim, paired, key_offset, factor1, factor2,
                         num_kv_heads=num_kv_heads, rotary_style=rotary_style, normalize=normalize,
                         q_weight=q_weight, k_weight=k_weight, weight_offset=weight_offset, eps=eps,
                         cos_sin=cos_sin, positions=positions, normalize_v=normalize_v,
                         norm_scope=norm_scope, query_only=query_only)
    _check_v("qk_norm_rope", v, normalize_v)
    if normalize_v:
        return _ops.qkv_norm_rope(qk, v, *layout)
    return _ops.qk_norm_rope(qk, *layout)


def qkv_backward_fp8(grad_q, grad_k, grad_v, qk, factor1=None, factor2=None, grad_scale=None,
                     num_heads: Optional[int] = None, rotary_dim: Optional[int] = None,
                     paired: bool = False, key_offset: bool = False, *,
                     num_kv_heads: Optional[int] = None, rotary_style: Optional[str] = None,
                     normalize: bool = True, q_weight: Optional[torch.Tensor] = None,
                     k_weight: Optional[torch.Tensor] = None, weight_offset: float = 0.0,
                     eps: float = DEFAULT_EPS, cos_sin: Optional[torch.Tensor] = None,
                     positions: Optional[torch.Tensor] = None, v: Optional[torch.Tensor] = None,
                     normalize_v: bool = False, norm_scope: str = "head",
                     query_only: bool = False):
    """(grad_row [T, qkv_dim], grad_t [qkv_dim, T]), e4m3: the norm/rotary gradient of Q and K
    (rounded to bf16) and grad_v [T, Hkv, Dv], divided by grad_scale (a float32 tensor [] or
    [1]), in both layouts (SPEC.md sections 3 and 8; qkv_dim = (Hq + Hkv) * D + Hkv * Dv). The
    layout arguments are qk_norm_rope's: the speedrun's positionally (grad_q, grad_k, grad_v, qk,
    factor1, factor2, grad_scale, num_heads, ...), the general layouts' by keyword from
    grad_scale on. With normalize_v, grad_v is the gradient of v_out and v the forward's v: the
    V features are then the V norm's gradient, rounded to bf16 first (SPEC.md section 9). With a
    norm weight given, returns (grad_row, grad_t, grad_q_weight, grad_k_weight), None for the
    weight not given."""
    op = "qkv_backward_fp8"
    for name, value in (("grad_q", grad_q), ("grad_k", grad_k), ("grad_v", grad_v), ("qk", qk)):
        _checks.tensor(op, name, value)
    if grad_scale is None:
        raise TypeError(f"{op}: grad_scale: missing (a required argument)")
    _checks.tensor(op, "grad_scale", grad_scale, expected=_checks.SCALAR)
    layout = rope_layout(num_heads, rotary_dim, paired, key_offset, factor1, factor2,
                         num_kv_heads=num_kv_heads, rotary_style=rotary_style, normalize=normalize,
                         q_weight=q_weight, k_weight=k_weight, weight_offset=weight_offset, eps=eps,
                         cos_sin=cos_sin, positions=positions, op=op, normalize_v=normalize_v,
                         norm_scope=norm_scope, query_only=query_only)
    _check_v(op, v, normalize_v)
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
    _checks.tensor("check_positions", "positions", positions)
    _checks.integer("check_positions", "num_positions", num_positions)
    _ops.check_positions(positions, num_positions)


# The op returns nothing: without this, torch.compile's graph passes would drop it as dead code.
torch.fx.node.has_side_effect(_ops.check_positions.default)


def quantize_dual_layout(x: torch.Tensor, scale: torch.Tensor, amax: bool = False):
    """(row, t) = e4m3(x / scale) and its transpose, from one read of x (SPEC.md section 5); with
    amax=True also max|x| (scale's shape). x is bf16 [M, N] with a float32 scale [] or [1], or
    [B, M, N] with scale [B]."""
    _checks.tensor("quantize_dual_layout", "x", x)
    _checks.tensor("quantize_dual_layout", "scale", scale,
                   expected=_checks.SCALAR + " ([B] for x [B, M, N])")
    if amax:
        return _ops.quantize_dual_layout_amax(x, scale)
    return _ops.quantize_dual_layout(x, scale)


def quantize_weight_bank(weights: torch.Tensor):
    """(row [B, M, N], t [B, N, M], scale [B]) for bf16 weights [B, M, N], with the current scale
    max|weights[b]| / 448 per entry (1 for an all-zero entry), computed on the device."""
    _checks.tensor("quantize_weight_bank", "weights", weights)
    return _ops.quantize_weight_bank(weights)


def fp8_gemm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
             alpha: Optional[torch.Tensor] = None, fast_accum: bool = False) -> torch.Tensor:
    """bf16 (a @ b^T) * scale_a * scale_b * alpha for e4m3 a [M, K] and b [N, K], fp32
    accumulation; the scales are float32 tensors [] or [1]."""
    _checks.tensor("fp8_gemm", "a", a)
    _checks.tensor("fp8_gemm", "b", b)
    for name, value in (("scale_a", scale_a), ("scale_b", scale_b)):
        _checks.tensor("fp8_gemm", name, value, expected=_checks.SCALAR)
    _checks.tensor("fp8_gemm", "alpha", alpha, optional=True,
                   expected=_checks.SCALAR + " or None")
    _checks.flag("fp8_gemm", "fast_accum", fast_accum)
    return _ops.fp8_gemm(a, b, scale_a, scale_b, alpha, fast_accum)
