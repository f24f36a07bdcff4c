"""Plain PyTorch models of SPEC.md, in float64 by default: the independent references the tests
compare qkvfuse against. Nothing here calls qkvfuse."""
import torch
import torch.nn.functional as F

E4M3 = torch.float8_e4m3fn
BF16 = torch.bfloat16
EPS = torch.finfo(torch.float32).eps  # F.rms_norm's fp32 eps, 2^-23


def swap_pairs(x):
    """Adjacent lanes exchanged: swap(x)[d] = x[d ^ 1]."""
    return x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)


def rotary_factors(tokens, width, rotary_dim=None, dtype=torch.float32, device="cpu", offset=0):
    """Interleaved rotary tables [tokens, width]: factor1 = cos, factor2 = sin with odd lanes
    negated; dims from rotary_dim on are stationary (1, 0). `offset` shifts the positions."""
    rotary_dim = width if rotary_dim is None else rotary_dim
    pairs = torch.arange(width // 2, dtype=torch.float64)
    freq = torch.where(2 * pairs < rotary_dim, 1000.0 ** (-2 * pairs / max(rotary_dim, 1)), 0.0)
    theta = (torch.arange(tokens, dtype=torch.float64) + offset)[:, None] * freq[None, :]
    cos = theta.cos().repeat_interleave(2, dim=1)
    sin = theta.sin().repeat_interleave(2, dim=1)
    sign = torch.tensor([1.0, -1.0], dtype=torch.float64).repeat(width // 2)
    return cos.to(dtype).to(device), (sin * sign).to(dtype).to(device)


def qk_norm_rope(qk, factor1, factor2, num_heads, rotary_dim, paired, key_offset,
                 dtype=torch.float64):
    """SPEC.md section 1 as a differentiable chain: F.rms_norm, interleaved rotary (on the
    [T, H/2, 2D] view and reshaped to [2T, H/2, D] when paired), key offset."""
    tokens, _, dim = qk.shape
    n = F.rms_norm(qk.to(dtype), (dim,), eps=EPS)
    f1, f2 = factor1.to(dtype)[:, None], factor2.to(dtype)[:, None]

    def rotate(x):
        if paired:
            x = x.reshape(tokens, num_heads // 2, 2 * dim)
            return (f1 * x + f2 * swap_pairs(x)).reshape(2 * tokens, num_heads // 2, dim)
        return f1 * x + f2 * swap_pairs(x)

    q, k = rotate(n[:, :num_heads]), rotate(n[:, num_heads:])
    if key_offset:
        # Keys' stationary dims come from the previous token's normalized row; token 0 keeps its own.
        previous = n[:-1, num_heads:, rotary_dim:]
        stationary = torch.cat((k[:1, :, rotary_dim:], previous), dim=0)
        k = torch.cat((k[:, :, :rotary_dim], stationary), dim=-1)
    return q, k


def qk_norm_rope_grad(grad_q, grad_k, qk, factor1, factor2, num_heads, rotary_dim, paired,
                      key_offset):
    """float64 gradient of qk_norm_rope w.r.t. qk, by autograd through the chain above."""
    qk64 = qk.to(torch.float64).requires_grad_()
    q, k = qk_norm_rope(qk64, factor1, factor2, num_heads, rotary_dim, paired, key_offset)
    (grad,) = torch.autograd.grad((q, k), (qk64,), (grad_q.to(q.dtype), grad_k.to(k.dtype)))
    return grad


def to_e4m3(x):
    """SPEC.md section 4: round to nearest even, saturating at +-448 (torch's cast alone gives NaN
    past 448), NaN kept."""
    return x.clamp(-448.0, 448.0).to(E4M3)


def quantize(x, scale):
    """e4m3(x / scale), the division in fp32 as the kernels do it."""
    return to_e4m3(x.float() / scale.float())


def qkv_grad_row(grad_q, grad_k, grad_v, qk, factor1, factor2, grad_scale, num_heads, rotary_dim,
                 paired, key_offset):
    """SPEC.md section 3: [T, qkv_dim] e4m3, Q/K features from the bf16-rounded dx."""
    tokens = qk.shape[0]
    dx = qk_norm_rope_grad(grad_q, grad_k, qk, factor1, factor2, num_heads, rotary_dim, paired,
                           key_offset)
    features = torch.cat((dx.to(BF16).reshape(tokens, -1), grad_v.reshape(tokens, -1)), dim=1)
    return quantize(features, grad_scale)


def fp8_gemm(a, b, scale_a, scale_b, alpha=None):
    """(a @ b^T) * scale_a * scale_b * alpha in float64 from e4m3 operands (unrounded)."""
    out = (a.double() @ b.double().T) * scale_a.double() * scale_b.double()
    return out if alpha is None else out * alpha.double()


def packed_forward(x_f8, weight_f8, x_scale, weight_scale, qkv_scale, factor1, factor2, num_heads,
                   qk_dim, v_dim, rotary_dim, paired, key_offset):
    """SPEC.md section 6 forward: (q, k, v, qk), the GEMM rounded to bf16 as the op stores it."""
    tokens = x_f8.shape[0]
    qkv = fp8_gemm(x_f8, weight_f8, x_scale, weight_scale * qkv_scale).to(BF16)
    qk = qkv[:, : 2 * num_heads * qk_dim].reshape(tokens, 2 * num_heads, qk_dim)
    v = qkv[:, 2 * num_heads * qk_dim :].reshape(tokens, num_heads, v_dim)
    q, k = qk_norm_rope(qk, factor1, factor2, num_heads, rotary_dim, paired, key_offset)
    return q, k, v, qk


def packed_backward(grad_q, grad_k, grad_v, qk, factor1, factor2, x_f8, weight_f8, qk_weight,
                    v_weight, x_scale, weight_scale, qkv_scale, grad_scale, num_heads, rotary_dim,
                    paired, key_offset):
    """SPEC.md section 6 backward: (grad_x, grad_qk_weight, grad_v_weight, grad_qkv_scale) in
    float64, with the bf16 roundings the op makes (wgrad output, then its scaling by qkv_scale)."""
    grad_row = qkv_grad_row(grad_q, grad_k, grad_v, qk, factor1, factor2, grad_scale, num_heads,
                            rotary_dim, paired, key_offset)
    grad_weight = fp8_gemm(grad_row.T.contiguous(), x_f8.T.contiguous(), grad_scale,
                           x_scale).to(BF16).double()
    grad_x = fp8_gemm(grad_row, weight_f8.T.contiguous(), grad_scale, weight_scale * qkv_scale)
    weight = torch.cat((qk_weight, v_weight)).double()
    grad_qkv_scale = (grad_weight * weight).sum()
    scaled = (grad_weight * qkv_scale.double()).to(BF16).double()
    return grad_x, scaled[: qk_weight.shape[0]], scaled[qk_weight.shape[0] :], grad_qkv_scale


# ---- general layouts (SPEC.md section 8) ---------------------------------------------------------

def rope(qk, num_heads, num_kv_heads=None, rotary_dim=None, rotary_style="interleaved",
         normalize=True, eps=EPS, weight_offset=0.0, paired=False, key_offset=False, factor1=None,
         factor2=None, cos_sin=None, positions=None, q_weight=None, k_weight=None,
         norm_scope="head", query_only=False):
    """SPEC.md sections 8 and 9 in float64, differentiable in qk and the weights: (q, k).

    norm_scope "token": one RMS over each token's query heads and one over its key heads, the
    weights [H * D] of the kind; query_only: qk holds the query heads alone (k is [T, 0, D]);
    no factor tables and no cos_sin: nothing rotates.

    The cos/sin path is written as the rotation itself (interleaved: the pairs (2i, 2i+1), as
    GPT-J's rotate_every_two; NeoX: the halves of the rotary lanes, as Hugging Face's rotate_half),
    turning each pair by +theta. The factor-table path is y[e] = f1[e] n[e] + f2[e] n[partner(e)]
    over the table's rows ([T, H/2, 2D] views when paired, reshaped to [2T, H/2, D] after)."""
    x = qk.double()
    tokens, _, dim = x.shape
    kv = 0 if query_only else num_heads if num_kv_heads is None else num_kv_heads
    has_angles = cos_sin is not None or factor1 is not None
    if rotary_dim is None:
        rotary_dim = 0 if not has_angles else dim if cos_sin is None else cos_sin.shape[1]
    r, half = rotary_dim, rotary_dim // 2

    def norm(part):
        if not normalize:
            return part
        # The mean over a head row, or over a token's rows of this kind.
        over = (-1,) if norm_scope == "head" else (-2, -1)
        return part * torch.rsqrt(part.pow(2).mean(over, keepdim=True) + eps)

    def weigh(part, weight):
        if weight is None:
            return part
        return part * (weight.double().reshape(-1, dim) + weight_offset)

    q, k = weigh(norm(x[:, :num_heads]), q_weight), weigh(norm(x[:, num_heads:]), k_weight)

    def rotate(part):
        if not has_angles:
            return part
        if cos_sin is not None:
            angles = cos_sin.double()[positions.long()][:, None]  # [T, 1, r]
            cos, sin = angles[..., :half], angles[..., half:]
            lanes, rest = part[..., :r], part[..., r:]
            if rotary_style == "neox":
                a, b = lanes[..., :half], lanes[..., half:]
                lanes = torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)
            else:
                a, b = lanes[..., 0::2], lanes[..., 1::2]
                lanes = torch.stack((a * cos - b * sin, b * cos + a * sin), dim=-1).flatten(-2)
            return torch.cat((lanes, rest), dim=-1)
        width = factor1.shape[1]
        heads = part.shape[1]
        rows = part.reshape(tokens, heads * dim // width, width)
        lane = torch.arange(width, device=part.device)
        d = lane % dim
        if rotary_style == "neox":
            partner = lane - d + torch.where(d < half, d + half, d - half)
        else:
            partner = lane ^ 1
        rotary = d < r
        partner = torch.where(rotary, partner, lane)
        y = factor1.double()[:, None] * rows + factor2.double()[:, None] * rows[..., partner]
        y = torch.where(rotary, y, rows)
        return y.reshape(tokens, heads, dim)

    q_out, k_out = rotate(q), rotate(k)
    if paired:
        q_out = q_out.reshape(2 * tokens, num_heads // 2, dim)
        k_out = k_out.reshape(2 * tokens, kv // 2, dim)
    if key_offset:
        previous = torch.cat((k[:1], k[:-1]), dim=0)  # token 0 keeps its own
        k_out = torch.cat((k_out[..., :r], previous[..., r:]), dim=-1)
    return q_out, k_out


def v_norm(v, eps=EPS):
    """SPEC.md section 9's V norm in float64: v * rsqrt(mean(v^2) + eps) per head row."""
    v = v.double()
    return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)


def rope_grads(grad_q, grad_k, qk, **layout):
    """float64 (grad_qk, grad_q_weight, grad_k_weight) of rope() by autograd (None for an absent
    weight)."""
    qk64 = qk.detach().double().requires_grad_()
    weights = {}
    for name in ("q_weight", "k_weight"):
        if layout.get(name) is not None:
            weights[name] = layout[name].detach().double().requires_grad_()
    q, k = rope(qk64, **{**layout, **weights})
    inputs = (qk64, *weights.values())
    grads = torch.autograd.grad((q, k), inputs, (grad_q.double(), grad_k.double()))
    grads = dict(zip(("qk", *weights), grads))
    return grads["qk"], grads.get("q_weight"), grads.get("k_weight")


def rope_grad_row(grad_q, grad_k, grad_v, qk, grad_scale, **layout):
    """SPEC.md sections 3 and 8: [T, qkv_dim] e4m3, Q/K features from the bf16-rounded dx, then
    V; and the float64 weight gradients."""
    tokens = qk.shape[0]
    dx, grad_q_weight, grad_k_weight = rope_grads(grad_q, grad_k, qk, **layout)
    features = torch.cat((dx.to(BF16).reshape(tokens, -1), grad_v.reshape(tokens, -1)), dim=1)
    return quantize(features, grad_scale), grad_q_weight, grad_k_weight
