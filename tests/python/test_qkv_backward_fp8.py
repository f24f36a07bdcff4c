"""qkv_backward_fp8: the fused norm/rotary + V gradient into e4m3, in both layouts, against the
plain PyTorch chain's float64 gradient (reference.qkv_grad_row)."""
import pytest
import torch

import qkvfuse
import reference as ref
from conftest import DEVICES, assert_e4m3_close, opcheck, poison_allocator, raw_bytes, rel_error
from layout_cases import CASES, MAIN_CASES, make, weights_of
from qkvfuse._layout import RopeLayout

BF16 = torch.bfloat16

# (tokens, num_heads, qk_dim, v_dim, rotary_dim, paired, key_offset). Both devices take every
# even D in [2, 256]; Dv >= 1 on the CPU, in [1, 512] on CUDA. GENERIC_LAYOUTS are off the CUDA
# vector kernel's widths (D a multiple of 8 from 32, Dv a multiple of 8 up to 256).
LAYOUTS = {
    "plain": (32, 2, 32, 32, 32, False, False),
    "paired": (16, 4, 32, 48, 32, True, False),
    "key_offset": (48, 2, 64, 32, 32, False, True),
}
GENERIC_LAYOUTS = {
    "odd": (7, 3, 8, 6, 8, False, False),
    "wide_v_key_offset": (33, 2, 34, 300, 18, False, True),
    "odd_v_paired": (5, 2, 64, 1, 64, True, False),
}


def make_inputs(layout, device):
    tokens, heads, dim, v_dim, rotary_dim, paired, key_offset = layout
    qk = torch.randn(tokens, 2 * heads, dim, device=device).to(BF16)
    width = 2 * dim if paired else dim
    factor1, factor2 = ref.rotary_factors(tokens, width, rotary_dim, BF16, device)
    out_shape = (2 * tokens, heads // 2, dim) if paired else (tokens, heads, dim)
    grad_q = torch.randn(out_shape, device=device).to(BF16)
    grad_k = torch.randn(out_shape, device=device).to(BF16)
    # grad_v as a strided view (a column slice), as attention backward may hand it over.
    grad_v = torch.randn(tokens, heads * v_dim + 8, device=device).to(BF16)
    grad_v = grad_v[:, : heads * v_dim].view(tokens, heads, v_dim)
    # A scale that puts the largest gradient near 200 in e4m3 units: normal values, no saturation.
    dx = ref.qk_norm_rope_grad(grad_q, grad_k, qk, factor1, factor2, heads, rotary_dim, paired,
                               key_offset)
    largest = max(dx.abs().max().item(), grad_v.float().abs().max().item())
    grad_scale = torch.tensor(largest / 200, device=device)
    return (grad_q, grad_k, grad_v, qk, factor1, factor2, grad_scale,
            heads, rotary_dim, paired, key_offset)


def op_args(args):
    """The qkv_backward_fp8 op's arguments from the function's (make_inputs)."""
    (grad_q, grad_k, grad_v, qk, factor1, factor2, grad_scale, heads, rotary_dim, paired,
     key_offset) = args
    layout = RopeLayout(heads, rotary_dim=rotary_dim, paired=paired, key_offset=key_offset,
                        factor1=factor1, factor2=factor2)
    return (grad_q, grad_k, grad_v, qk, grad_scale, *layout)


def layouts_on(device):
    return {**LAYOUTS, **GENERIC_LAYOUTS}


@pytest.mark.parametrize("device", DEVICES)
def test_matches_chain(device):
    for name, layout in layouts_on(device).items():
        args = make_inputs(layout, device)
        tokens, heads, dim, v_dim = layout[:4]
        qkv_dim = 2 * heads * dim + heads * v_dim
        poison_allocator(device, tokens * qkv_dim, tokens * qkv_dim)
        grad_row, grad_t = qkvfuse.qkv_backward_fp8(*args)
        assert grad_row.shape == (tokens, qkv_dim) and grad_t.shape == (qkv_dim, tokens), name
        assert grad_row.is_contiguous() and grad_t.is_contiguous()
        assert_e4m3_close(grad_row, ref.qkv_grad_row(*args))
        assert torch.equal(grad_t.view(torch.uint8), grad_row.view(torch.uint8).T)
        # V features are a plain quantize: bit-exact.
        v_part = grad_row[:, 2 * heads * dim :]
        assert torch.equal(raw_bytes(v_part), raw_bytes(ref.quantize(args[2].reshape(tokens, -1),
                                                                     args[6])))


@pytest.mark.parametrize("device", DEVICES)
def test_deterministic(device):
    args = make_inputs(LAYOUTS["key_offset"], device)
    first = qkvfuse.qkv_backward_fp8(*args)
    second = qkvfuse.qkv_backward_fp8(*args)
    assert all(torch.equal(raw_bytes(a), raw_bytes(b)) for a, b in zip(first, second))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_opcheck(device, name):
    args = op_args(make_inputs(LAYOUTS[name], device))
    opcheck(torch.ops.qkvfuse.qkv_backward_fp8.default, args)


@pytest.mark.parametrize("device", DEVICES)
def test_v_width_past_512(device):
    """CPU: any Dv >= 1; CUDA: Dv up to 512 (its generic kernel stages V in shared memory), past
    that an error naming grad_v."""
    args = make_inputs((4, 2, 32, 513, 32, False, False), device)
    if device == "cpu":
        grad_row, grad_t = qkvfuse.qkv_backward_fp8(*args)
        assert grad_row.shape == (4, 2 * 2 * 32 + 2 * 513) and grad_t.shape == grad_row.shape[::-1]
    else:
        with pytest.raises(RuntimeError, match="qkv_backward_fp8: grad_v"):
            qkvfuse.qkv_backward_fp8(*args)


# ---- general layouts (SPEC.md section 8) ---------------------------------------------------------

def layout_inputs(case, device, v_dim=24):
    """(grad_q, grad_k, grad_v, qk, grad_scale, kwargs) for a layout_cases case; grad_scale puts
    the largest gradient near 200 in e4m3 units."""
    qk, kwargs = make(case, device)
    q, k = qkvfuse.qk_norm_rope(qk, **kwargs)
    grad_q, grad_k = torch.randn_like(q), torch.randn_like(k)
    grad_v = torch.randn(qk.shape[0], kwargs["num_kv_heads"], v_dim, device=device).to(BF16)
    dx, _, _ = ref.rope_grads(grad_q, grad_k, qk, **kwargs)
    largest = max(dx.abs().max().item(), grad_v.float().abs().max().item())
    grad_scale = torch.tensor(largest / 200, device=device)
    return grad_q, grad_k, grad_v, qk, grad_scale, kwargs


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", list(CASES))
def test_layouts_match_reference(device, case):
    grad_q, grad_k, grad_v, qk, grad_scale, kwargs = layout_inputs(case, device)
    heads, kv, dim = kwargs["num_heads"], kwargs["num_kv_heads"], qk.shape[2]
    options = {n: v for n, v in kwargs.items() if n not in ("factor1", "factor2")}
    poison_allocator(device, 2 * dim, 2 * dim)
    out = qkvfuse.qkv_backward_fp8(grad_q, grad_k, grad_v, qk, kwargs.get("factor1"),
                                   kwargs.get("factor2"), grad_scale, **options)
    weights = weights_of(kwargs)
    assert len(out) == (4 if weights else 2)
    grad_row, grad_t = out[:2]
    tokens = qk.shape[0]
    qkv_dim = (heads + kv) * dim + kv * grad_v.shape[2]
    assert grad_row.shape == (tokens, qkv_dim) and grad_t.shape == (qkv_dim, tokens)
    expected = ref.rope_grad_row(grad_q, grad_k, grad_v, qk, grad_scale, **kwargs)
    assert_e4m3_close(grad_row, expected[0])
    assert torch.equal(grad_t.view(torch.uint8), grad_row.view(torch.uint8).T)
    for got, want, name in zip(out[2:], expected[1:], ("q_weight", "k_weight")):
        if name not in weights:
            assert got is None, name
            continue
        assert got.dtype == weights[name].dtype and got.shape == (dim,), name
        assert rel_error(got, want) < (1e-2 if got.dtype == BF16 else 1e-5), name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", MAIN_CASES)
def test_layouts_opcheck(device, case):
    grad_q, grad_k, grad_v, qk, grad_scale, kwargs = layout_inputs(case, device)
    layout = RopeLayout(**{n: kwargs[n] for n in RopeLayout._fields if n in kwargs})
    opcheck(torch.ops.qkvfuse.qkv_backward_fp8.default,
            (grad_q, grad_k, grad_v, qk, grad_scale, *layout))
