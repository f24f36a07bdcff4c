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
