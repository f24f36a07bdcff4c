"""Output shapes and the views cut from the packed ops' buffers: one definition shared by the fake
kernels, the autograd functions and the tests (torch/ops.cpp lays the buffers out the same way)."""
import torch


def rope_output_shape(tokens, num_heads: int, qk_dim, paired: bool):
    """q and k are [T, H, D], or [2T, H/2, D] for paired heads (SPEC.md section 1)."""
    if paired:
        return (2 * tokens, num_heads // 2, qk_dim)
    return (tokens, num_heads, qk_dim)


def qkv_views(qkv: torch.Tensor, tokens, num_heads: int, qk_dim: int, v_dim: int, paired: bool):
    """(qk [T, 2H, D], v [T, H, Dv]) from packed_qkv_forward's flat buffer of T * qkv_dim.

    Plain layers: the buffer is row-major [T, qkv_dim], qk its first 2HD columns and v the rest
    (v strided, as one GEMM wrote both). Paired layers: qk [T, 2HD] then v [T, HDv], each dense,
    since paired attention merges v's token and head axes and would otherwise have to copy it.
    """
    qk_features = 2 * num_heads * qk_dim
    v_features = num_heads * v_dim
    if paired:
        qk_flat = qkv[: tokens * qk_features].view(tokens, qk_features)
        v_flat = qkv[tokens * qk_features :].view(tokens, v_features)
    else:
        rows = qkv.view(tokens, qk_features + v_features)
        qk_flat, v_flat = rows[:, :qk_features], rows[:, qk_features:]
    return qk_flat.view(tokens, 2 * num_heads, qk_dim), v_flat.view(tokens, num_heads, v_dim)


def split_grad_weight(grad_weight: torch.Tensor, qk_rows: int):
    """(grad_qk_weight, grad_v_weight): the two row slices of packed_qkv_backward's [qkv_dim, C]."""
    return grad_weight[:qk_rows], grad_weight[qk_rows:]


def kernel_readable(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` if the kernels can read it in place (last dim contiguous, no broadcast dims), else a
    dense copy. Gradients from autograd may be expanded (e.g. from .sum()) or transposed. An empty
    tensor becomes a fresh one with dense strides: .contiguous() keeps an empty expanded tensor as
    it is, and its zero strides fail the op's layout checks."""
    if tensor.numel() == 0:
        return torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)
    broadcast = any(s == 0 and n > 1 for s, n in zip(tensor.stride(), tensor.shape))
    if tensor.stride(-1) == 1 and not broadcast:
        return tensor
    return tensor.contiguous()
