"""qkvfuse.qk_norm_rope and its backward against the plain PyTorch chain (reference.py)."""
import pytest
import torch

import qkvfuse
import reference as ref
from conftest import DEVICES, assert_bf16_close, poison_allocator
from qkvfuse._layout import RopeLayout

BF16 = torch.bfloat16

# (tokens, num_heads, qk_dim, rotary_dim, paired, key_offset). Every even D in [2, 256] runs on
# both devices: on CUDA, D a multiple of 8 from 32 with 16-byte aligned tensors takes the vector
# kernels, everything else (NARROW_LAYOUTS, misaligned tensors) the generic path.
LAYOUTS = {
    "plain": (33, 2, 32, 32, False, False),
    "paired": (17, 4, 32, 32, True, False),
    "key_offset": (19, 2, 64, 32, False, True),
}
NARROW_LAYOUTS = {
    "odd_plain": (7, 3, 8, 8, False, False),
    "one_token_key_offset": (1, 1, 6, 2, False, True),
    "narrow_paired": (3, 2, 2, 2, True, False),
    "wide_key_offset": (33, 2, 34, 18, False, True),
}


def make_inputs(layout, device, factor_dtype=torch.float32, token_padding=8, column_offset=0):
    """qk [T, 2H, D] bf16 as a column slice of a wider buffer (a GEMM output's Q/K columns),
    starting `column_offset` columns into it, and the rotary tables ([T, 2D] when paired)."""
    tokens, heads, dim, rotary_dim, paired, _ = layout
    width = column_offset + 2 * heads * dim + token_padding
    wide = torch.randn(tokens, width, device=device).to(BF16)
    qk = wide[:, column_offset : column_offset + 2 * heads * dim].view(tokens, 2 * heads, dim)
    width = 2 * dim if paired else dim
    factor1, factor2 = ref.rotary_factors(tokens, width, rotary_dim, factor_dtype, device)
    return qk, factor1, factor2


def misaligned(tensor):
    """A copy of `tensor` one element into a buffer whose rows are 3 elements longer: the pointer
    aligned to its elements only, the strides but the last odd."""
    rows = tensor.reshape(-1, tensor.shape[-1])
    buffer = tensor.new_empty(rows.shape[0], rows.shape[1] + 3)
    out = buffer[:, 1 : 1 + rows.shape[1]]
    out.copy_(rows)
    return out.view(tensor.shape)


def call_args(layout):
    _, heads, _, rotary_dim, paired, key_offset = layout
    return heads, rotary_dim, paired, key_offset


def layouts_on(device):
    return {**LAYOUTS, **NARROW_LAYOUTS}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("factor_dtype", [torch.float32, BF16])
def test_forward_matches_chain(device, factor_dtype):
    for name, layout in layouts_on(device).items():
        qk, factor1, factor2 = make_inputs(layout, device, factor_dtype)
        tokens, heads, dim = qk.shape[0], layout[1], layout[2]
        poison_allocator(device, 2 * qk.numel(), 2 * qk.numel())
        q, k = qkvfuse.qk_norm_rope(qk, factor1, factor2, *call_args(layout))
        q_ref, k_ref = ref.qk_norm_rope(qk, factor1, factor2, *call_args(layout))
        expected = (2 * tokens, heads // 2, dim) if layout[4] else (tokens, heads, dim)
        assert q.shape == k.shape == expected, name
        assert q.dtype == k.dtype == BF16 and q.is_contiguous() and k.is_contiguous()
        assert_bf16_close(q, q_ref)
        assert_bf16_close(k, k_ref)


@pytest.mark.parametrize("device", DEVICES)
def test_misaligned_tensors_match_chain(device):
    """qk a column slice one element off, factors and gradients with odd strides one element into
    their buffers: the generic path on CUDA, even at D = 32 and 64."""
    for name, layout in layouts_on(device).items():
        qk, factor1, factor2 = make_inputs(layout, device, token_padding=3, column_offset=1)
        factor1, factor2 = misaligned(factor1), misaligned(factor2)
        qk = qk.detach().requires_grad_()
        q, k = qkvfuse.qk_norm_rope(qk, factor1, factor2, *call_args(layout))
        q_ref, k_ref = ref.qk_norm_rope(qk.detach(), factor1, factor2, *call_args(layout))
        assert_bf16_close(q, q_ref)
        assert_bf16_close(k, k_ref)
        grad_q, grad_k = misaligned(torch.randn_like(q)), misaligned(torch.randn_like(k))
        (grad_qk,) = torch.autograd.grad((q, k), (qk,), (grad_q, grad_k))
        expected = ref.qk_norm_rope_grad(grad_q, grad_k, qk.detach(), factor1, factor2,
                                         *call_args(layout))
        assert grad_qk.dtype == BF16, name
        assert_bf16_close(grad_qk, expected)


def test_rotary_dim_defaults_to_head_width():
    # Under key offset, where rotary_dim is read: the default must be D (64 here), not D / 2.
    qk, factor1, factor2 = make_inputs(LAYOUTS["key_offset"], "cpu")
    default = qkvfuse.qk_norm_rope(qk, factor1, factor2, 2, key_offset=True)
    explicit = qkvfuse.qk_norm_rope(qk, factor1, factor2, 2, 64, False, True)
    half = qkvfuse.qk_norm_rope(qk, factor1, factor2, 2, 32, False, True)
    for a, b in zip(default, explicit):
        assert torch.equal(a, b)
    assert not torch.equal(default[1], half[1])


@pytest.mark.parametrize("device", DEVICES)
def test_backward_matches_chain(device):
    for name, layout in layouts_on(device).items():
        qk, factor1, factor2 = make_inputs(layout, device)
        qk = qk.detach().requires_grad_()
        q, k = qkvfuse.qk_norm_rope(qk, factor1, factor2, *call_args(layout))
        grad_q, grad_k = torch.randn_like(q), torch.randn_like(k)
        # A transposed-then-transposed-back gradient: arbitrary token/head strides.
        grad_q = grad_q.transpose(0, 1).contiguous().transpose(0, 1)
        (grad_qk,) = torch.autograd.grad((q, k), (qk,), (grad_q, grad_k))
        expected = ref.qk_norm_rope_grad(grad_q, grad_k, qk.detach(), factor1, factor2,
                                         *call_args(layout))
        assert grad_qk.dtype == BF16, name
        assert_bf16_close(grad_qk, expected)


def test_backward_accepts_broadcast_gradients():
    # .sum() hands the backward an expanded (stride 0) gradient; it must still match.
    qk, factor1, factor2 = make_inputs(LAYOUTS["plain"], "cpu")
    qk = qk.detach().requires_grad_()
    q, k = qkvfuse.qk_norm_rope(qk, factor1, factor2, 2)
    (q.sum() + 2 * k.sum()).backward()
    expected = ref.qk_norm_rope_grad(torch.ones_like(q), 2 * torch.ones_like(k), qk.detach(),
                                     factor1, factor2, 2, 32, False, False)
    assert_bf16_close(qk.grad, expected)


@pytest.mark.parametrize("name", ["plain", "paired", "key_offset"])
def test_gradcheck_float64(name):
    _, heads, _, _, paired, key_offset = LAYOUTS[name]
    layout = (4, heads, 8, 4, paired, key_offset)
    qk, factor1, factor2 = make_inputs(layout, "cpu", torch.float64)
    qk = qk.double().detach().requires_grad_()

    def fn(x):
        return qkvfuse.qk_norm_rope(x, factor1, factor2, *call_args(layout))

    assert torch.autograd.gradcheck(fn, (qk,))


def op_layout(layout, factor1, factor2):
    """The ops' layout arguments (RopeLayout's fields) of a speedrun layout."""
    heads, rotary_dim, paired, key_offset = call_args(layout)
    return tuple(RopeLayout(heads, rotary_dim=rotary_dim, paired=paired, key_offset=key_offset,
                            factor1=factor1, factor2=factor2))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_opcheck(device, name):
    layout = LAYOUTS[name]
    qk, factor1, factor2 = make_inputs(layout, device)
    torch.library.opcheck(torch.ops.qkvfuse.qk_norm_rope.default,
                          (qk.detach().requires_grad_(), *op_layout(layout, factor1, factor2)))
    q, k = qkvfuse.qk_norm_rope(qk, factor1, factor2, *call_args(layout))
    torch.library.opcheck(torch.ops.qkvfuse.qk_norm_rope_backward.default,
                          (torch.randn_like(q), torch.randn_like(k), qk,
                           *op_layout(layout, factor1, factor2)))


@pytest.mark.parametrize("device", DEVICES)
def test_positional_and_keyword_calls_agree(device):
    """The two ways to call it give the same bits: the speedrun's positional order (the
    reference's: factor1, factor2, num_heads, rotary_dim, paired, key_offset) and keywords; a
    general layout by keyword from num_heads on, or positionally with two Nones for the tables."""
    qk, factor1, factor2 = make_inputs(LAYOUTS["key_offset"], device)
    heads = qk.shape[1] // 2
    positional = qkvfuse.qk_norm_rope(qk, factor1, factor2, heads, 32, False, True)
    keywords = qkvfuse.qk_norm_rope(qk, key_offset=True, rotary_dim=32, num_heads=heads,
                                    factor2=factor2, factor1=factor1)
    for a, b in zip(positional, keywords):
        assert torch.equal(a, b)
    cos_sin = qkvfuse.rotary_cos_sin(40, qk.shape[2], device=device)
    positions = torch.randint(0, 40, (qk.shape[0],), device=device)
    general = dict(rotary_style="neox", cos_sin=cos_sin, positions=positions)
    by_keyword = qkvfuse.qk_norm_rope(qk, num_heads=heads, **general)
    with_nones = qkvfuse.qk_norm_rope(qk, None, None, heads, **general)
    for a, b in zip(by_keyword, with_nones):
        assert torch.equal(a, b)
    # And it is the cache's rotation (tables built from the cache give the same bits).
    tables = qkvfuse.factor_tables_from_cos_sin(cos_sin, positions, qk.shape[2], "neox")
    for a, b in zip(by_keyword, qkvfuse.qk_norm_rope(qk, *tables, heads, rotary_style="neox")):
        assert torch.equal(a, b)
