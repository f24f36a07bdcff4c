"""packed_fp8_qkv, the autograd op, against a float64 model of SPEC.md section 6
(reference.packed_forward / packed_backward), and its drop-in argument order."""
import importlib.util
import inspect
import os
from pathlib import Path

import pytest
import torch

import qkvfuse
from conftest import (DEVICES, assert_bf16_close, opcheck, poison_allocator, rel_error,
                      requires_cuda)
from packed_problem import LAYOUT_CASES, LAYOUTS, Problem
from qkvfuse._layout import RopeLayout, qkv_views

BF16 = torch.bfloat16

# The reference PackedFP8QKV's arguments, in order (SPEC.md section 6).
REFERENCE_ARGUMENTS = [
    "x", "qk_weight", "v_weight", "weight_f8", "weight_f8_t", "weight_scale", "qkv_scale",
    "x_scale", "grad_scale", "factor1", "factor2", "num_heads", "paired", "key_offset",
    "rotary_dim", "x_f8", "x_f8_t",
]


# The general layout's options: keyword-only, after the reference's arguments.
OPTIONS = ["num_kv_heads", "rotary_style", "normalize", "q_weight", "k_weight", "weight_offset",
           "eps", "cos_sin", "positions", "normalize_v", "norm_scope", "query_only"]


def test_argument_order_is_the_reference_order():
    parameters = inspect.signature(qkvfuse.packed_fp8_qkv).parameters
    positional = [n for n, p in parameters.items() if p.kind == p.POSITIONAL_OR_KEYWORD]
    keyword_only = [n for n, p in parameters.items() if p.kind == p.KEYWORD_ONLY]
    assert positional == REFERENCE_ARGUMENTS
    assert keyword_only == OPTIONS and len(parameters) == len(positional) + len(keyword_only)
    forward = list(inspect.signature(qkvfuse.PackedFP8QKVFunction.forward).parameters)
    assert forward == ["ctx"] + REFERENCE_ARGUMENTS


def test_argument_order_matches_the_seed_file():
    seed = reference_module()
    if seed is None:
        pytest.skip("reference implementation not found (set QKVFUSE_REFERENCE to its path)")
    forward = list(inspect.signature(seed.PackedFP8QKVFunction.forward).parameters)
    assert forward == ["ctx"] + REFERENCE_ARGUMENTS


# The speedrun's layouts (no options) and the general ones (SPEC.md section 8).
ALL_LAYOUTS = {**{name: (layout, None) for name, layout in LAYOUTS.items()}, **LAYOUT_CASES}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(ALL_LAYOUTS))
def test_forward_and_gradients_match_model(device, name):
    layout, options = ALL_LAYOUTS[name]
    p = Problem(layout, device, options)
    poison_allocator(device, 4 * p.tokens * (p.heads + p.kv_heads) * p.qk_dim)
    q, k, v = qkvfuse.packed_fp8_qkv(*p.arguments(), **p.options)
    q_ref, k_ref, v_ref, qk_ref = p.model_forward()
    assert q.shape == q_ref.shape and k.shape == k_ref.shape and v.shape == v_ref.shape
    # The op's GEMM (fp32 accumulation) and the model's (float64) may round a qk element to
    # neighbouring bf16 values; after the norm that is at most about one more bf16 ulp.
    # On the GPU the forward GEMM uses fast accumulation (as the reference does): allow 0.2 % of
    # elements past the rounding bound (seen on an H200: 1 of 2048 in q, 1 of 3072 in v).
    outliers = 0.002 if device == "cuda" else 0.0
    assert_bf16_close(q, q_ref, ulps=4, outliers=outliers)
    assert_bf16_close(k, k_ref, ulps=4, outliers=outliers)
    assert_bf16_close(v, v_ref, ulps=2, outliers=outliers)
    # Paired layers get a dense v; plain ones a strided view of the one GEMM output.
    assert v.is_contiguous() == p.paired
    assert v.stride(-1) == 1

    grad_q, grad_k, grad_v = (torch.randn_like(t) for t in (q, k, v))
    norm_weights = p.norm_weights
    grads = torch.autograd.grad((q, k, v), (p.x, p.qk_weight, p.v_weight, p.qkv_scale,
                                            *norm_weights.values()), (grad_q, grad_k, grad_v))
    expected = p.model_backward(grad_q, grad_k, grad_v, qk_ref)
    # bf16 results carry one rounding (rel. error ~2^-9).
    tolerances = {"x": 5e-3, "qk_weight": 5e-3, "v_weight": 5e-3}
    for grad, want, (what, tolerance) in zip(grads, expected, tolerances.items()):
        assert grad.dtype == BF16, what
        assert grad.shape == want.shape, what
        assert rel_error(grad, want) < tolerance, (what, rel_error(grad, want))
    # The norm weights' gradients: float32 sums over every row of its kind, in the weight's dtype.
    # The op's qk may sit a bf16 rounding from the model's (the two GEMMs), so 1e-3 for float32.
    wanted = dict(zip(("q_weight", "k_weight"), expected[4:]))
    for grad, (what, weight) in zip(grads[4:], norm_weights.items()):
        assert grad.dtype == weight.dtype and grad.shape == weight.shape, what
        tolerance = 1e-2 if weight.dtype == BF16 else 1e-3
        assert rel_error(grad, wanted[what]) < tolerance, (what, rel_error(grad, wanted[what]))
    # grad_qkv_scale = sum(grad_weight * W), summed in fp32. On the CPU the wgrad GEMM is exact, so
    # it matches the model to fp32 summation error. On the GPU a bf16 grad_weight element may sit
    # one rounding (2^-8 relative) from the model's; those differences have random signs, so their
    # sum stays within a few times 2^-8 * ||grad_weight * W||_2 (6 sigma here).
    grad_scale_out, want_scale = grads[3], expected[3]
    assert grad_scale_out.dtype == torch.float32 and grad_scale_out.shape == want_scale.shape
    error = (grad_scale_out.double() - want_scale.double()).abs().item()
    bound = 1e-4 * want_scale.double().abs().item()
    if device == "cuda":
        scale = p.qkv_scale.detach().double()
        products = [(g.double() / scale) * w.detach().double()
                    for g, w in ((expected[1], p.qk_weight), (expected[2], p.v_weight))]
        bound += 6 * 2**-8 * torch.cat([t.reshape(-1) for t in products]).norm().item()
    assert error <= bound, ("qkv_scale", error, bound)


def test_gradients_only_for_x_weights_and_qkv_scale():
    p = Problem(LAYOUTS["plain"], "cpu")
    args = list(p.arguments())
    w = p.cache[0]
    args[3:6] = [w.weight_f8, w.weight_f8_t, w.weight_scale.clone().requires_grad_()]
    q, k, v = qkvfuse.packed_fp8_qkv(*args)
    (q.float().sum() + k.float().sum() + v.float().sum()).backward()
    assert args[5].grad is None
    assert all(t.grad is not None for t in (p.x, p.qk_weight, p.v_weight, p.qkv_scale))


@pytest.mark.parametrize("device", DEVICES)
def test_grad_scale_is_read_when_the_backward_runs(device):
    """A hook on q may set grad_scale from the step's gradients (current scaling): the backward
    must use the value set then, exactly as if it had been passed in. The value at the forward
    does not matter, zero included (qkvfuse.integrations passes an uninitialized one): the
    backward checks it when it runs (test_errors.py)."""
    p = Problem(LAYOUTS["plain"], device)
    args = list(p.arguments())
    wanted = 2.0 ** -6
    grads, results = None, []
    for set_by_hook in (False, True):
        scale = torch.tensor(0.0 if set_by_hook else wanted, device=device)
        args[8] = scale
        q, k, v = qkvfuse.packed_fp8_qkv(*args)
        if set_by_hook:
            def set_scale(grad, scale=scale):
                scale.fill_(wanted)  # returns None: the gradient itself is left unchanged
            q.register_hook(set_scale)
        if grads is None:
            grads = [torch.randn_like(t) for t in (q, k, v)]
        results.append(torch.autograd.grad((q, k, v), (p.x, p.qk_weight, p.v_weight, p.qkv_scale),
                                           grads))
    for passed, hooked in zip(*results):
        assert torch.equal(passed, hooked)


def test_packed_fp8_qkv_is_the_reference_callable():
    """As in the reference, PackedFP8QKV is the autograd function's apply: calling it runs the
    op."""
    p = Problem(LAYOUTS["plain"], "cpu")
    ours = qkvfuse.PackedFP8QKV(*p.arguments())
    direct = qkvfuse.packed_fp8_qkv(*p.arguments())
    assert len(ours) == 3
    for a, b in zip(ours, direct):
        assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
def test_zero_tokens(device):
    """T = 0: empty q, k, v; the weight and qkv_scale gradients are sums over no tokens, 0 (not
    uninitialized memory), also when autograd hands in expanded zero-size gradients (.sum())."""
    p = Problem((0,) + LAYOUTS["plain"][1:], device)
    q, k, v = qkvfuse.packed_fp8_qkv(*p.arguments())
    assert q.shape == (0, p.heads, p.qk_dim) and v.shape == (0, p.heads, p.v_dim)
    poison_allocator(device, 2 * p.qk_weight.numel() + 2 * p.v_weight.numel(), 4)
    (q.float().sum() + k.float().sum() + v.float().sum()).backward()
    assert p.x.grad.shape == p.x.shape
    for weight in (p.qk_weight, p.v_weight):
        assert torch.equal(weight.grad, torch.zeros_like(weight))
    assert p.qkv_scale.grad.item() == 0.0


def test_x_may_have_any_shape_of_t_by_c():
    p = Problem(LAYOUTS["plain"], "cpu")
    x3 = p.x.detach().view(1, *p.x.shape).requires_grad_()
    args = list(p.arguments())
    args[0] = x3
    q, _, _ = qkvfuse.packed_fp8_qkv(*args)
    q.float().sum().backward()
    assert x3.grad.shape == x3.shape


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["plain", "paired", "qwen3_gqa", "gemma3_mqa",
                                  "key_offset_neox_weights"])
def test_opcheck(device, name):
    layout, options = ALL_LAYOUTS[name]
    p = Problem(layout, device, options)
    w = p.cache[0]
    layout = RopeLayout(**p.rope_layout(detach=True))
    forward_args = (p.x_f8, w.weight_f8, p.x_scale, w.weight_scale, p.qkv_scale.detach(),
                    p.qk_dim, p.v_dim, *layout)
    opcheck(torch.ops.qkvfuse.packed_qkv_forward.default, forward_args)
    q, k, qkv = torch.ops.qkvfuse.packed_qkv_forward(*forward_args)
    qk, v = qkv_views(qkv, p.tokens, layout, p.qk_dim, p.v_dim)
    opcheck(torch.ops.qkvfuse.packed_qkv_backward.default,
            (torch.randn_like(q), torch.randn_like(k), torch.randn_like(v), qk, p.x_f8_t,
             w.weight_f8_t, p.qk_weight.detach(), p.v_weight.detach(), p.x_scale,
             w.weight_scale, p.qkv_scale.detach(), p.grad_scale, *layout))


@pytest.mark.parametrize("device", DEVICES)
def test_layout_zero_tokens(device):
    """T = 0 with norm weights: their gradients are sums over no rows, zeros."""
    layout, options = LAYOUT_CASES["qwen3_gqa"]
    p = Problem((0,) + layout[1:], device, options)
    q, k, v = qkvfuse.packed_fp8_qkv(*p.arguments(), **p.options)
    assert q.shape == (0, 4, 32) and k.shape == (0, 2, 32) and v.shape == (0, 2, 32)
    (q.float().sum() + k.float().sum() + v.float().sum()).backward()
    for weight in p.norm_weights.values():
        assert torch.equal(weight.grad, torch.zeros_like(weight))
    assert p.qkv_scale.grad.item() == 0.0


def reference_module():
    """The seed reference (Python + Triton), if it can be found and imported: QKVFUSE_REFERENCE,
    else shared/seed next to the repository."""
    path = os.environ.get("QKVFUSE_REFERENCE")
    if not path:
        seeds = sorted((Path(__file__).resolve().parents[3] / "shared" / "seed").glob("*.txt"))
        path = str(seeds[0]) if seeds else None
    if not path:
        return None
    loader = importlib.machinery.SourceFileLoader("qkvfuse_reference", path)
    spec = importlib.util.spec_from_loader("qkvfuse_reference", loader)
    module = importlib.util.module_from_spec(spec)
    try:
        loader.exec_module(module)
    except ImportError:
        return None
    return module


@requires_cuda
@pytest.mark.parametrize("name", ["plain", "paired", "key_offset"])
def test_matches_reference_implementation_on_cuda(name):
    seed = reference_module()
    if seed is None:
        pytest.skip("reference implementation not found (set QKVFUSE_REFERENCE to its path)")
    p = Problem(LAYOUTS[name], "cuda")
    outputs = qkvfuse.packed_fp8_qkv(*p.arguments())
    expected = seed.PackedFP8QKV(*p.arguments())
    # Two GEMM implementations may round a qk element to neighbouring bf16 values (see above).
    for out, want in zip(outputs, expected):
        assert_bf16_close(out, want, ulps=4)
    grads_out = [torch.randn_like(t) for t in outputs]
    inputs = (p.x, p.qk_weight, p.v_weight, p.qkv_scale)
    ours = torch.autograd.grad(outputs, inputs, grads_out)
    theirs = torch.autograd.grad(expected, inputs, grads_out)
    for a, b in zip(ours, theirs):
        assert rel_error(a, b) < 1e-2
