"""torch.compile(fullgraph=True) of a step that uses the ops: no graph breaks, and the same
results as eager (bit for bit: the compiled graph runs the same kernels)."""
import pytest
import torch

import qkvfuse
from conftest import DEVICES, raw_bytes
from packed_problem import LAYOUT_CASES, LAYOUTS, Problem


def step(x, qk_weight, v_weight, weight_f8, weight_f8_t, weight_scale, qkv_scale, x_scale,
         grad_scale, factor1, factor2, qk, num_heads, paired, key_offset, rotary_dim):
    """An attention input step as a model writes it: quantize the input once, the packed FP8
    projection with norm + rotary, and a stand-alone bf16 norm + rotary."""
    x_f8, x_f8_t = qkvfuse.quantize_dual_layout(x.detach(), x_scale)
    q, k, v = qkvfuse.packed_fp8_qkv(x, qk_weight, v_weight, weight_f8, weight_f8_t, weight_scale,
                                     qkv_scale, x_scale, grad_scale, factor1, factor2, num_heads,
                                     paired, key_offset, rotary_dim, x_f8, x_f8_t)
    q2, k2 = qkvfuse.qk_norm_rope(qk, factor1, factor2, num_heads, rotary_dim, paired,
                                  key_offset)
    return q, k, v, q2, k2


def run(fn, p, qk, grads_out=None):
    """(outputs, gradients of x, both weights, qkv_scale and qk); random output gradients (made
    here when not given, and returned) so that every output's backward path is exercised."""
    w = p.cache[0]
    outputs = fn(p.x, p.qk_weight, p.v_weight, w.weight_f8, w.weight_f8_t, w.weight_scale,
                 p.qkv_scale, p.x_scale, p.grad_scale, p.factor1, p.factor2, qk, p.heads,
                 p.paired, p.key_offset, p.rotary_dim)
    if grads_out is None:
        grads_out = [torch.randn_like(t) for t in outputs]
    grads = torch.autograd.grad(outputs, (p.x, p.qk_weight, p.v_weight, p.qkv_scale, qk),
                                grads_out)
    return [t.detach() for t in outputs] + list(grads), grads_out


@pytest.mark.parametrize("device", DEVICES)
# The paired case compiles with dynamic shapes: fake kernels and views traced with a symbolic T.
@pytest.mark.parametrize("name, dynamic", [("plain", False), ("paired", True)])
def test_compiled_step_matches_eager(device, name, dynamic):
    torch._dynamo.reset()
    p = Problem(LAYOUTS[name], device)
    qk = torch.randn(p.tokens, 2 * p.heads, p.qk_dim, device=device).to(torch.bfloat16)
    qk.requires_grad_()
    eager, grads_out = run(step, p, qk)
    compiled, _ = run(torch.compile(step, fullgraph=True, dynamic=dynamic), p, qk, grads_out)
    for a, b in zip(compiled, eager):
        assert a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype
        assert torch.equal(raw_bytes(a), raw_bytes(b))


def layout_step(x, qk_weight, v_weight, weight_f8, weight_f8_t, weight_scale, qkv_scale, x_scale,
                grad_scale, factor1, factor2, qk, num_heads, paired, key_offset, rotary_dim,
                options):
    """step() with a general layout's keyword options (a dict of tensors and scalars)."""
    x_f8, x_f8_t = qkvfuse.quantize_dual_layout(x.detach(), x_scale)
    q, k, v = qkvfuse.packed_fp8_qkv(x, qk_weight, v_weight, weight_f8, weight_f8_t, weight_scale,
                                     qkv_scale, x_scale, grad_scale, factor1, factor2, num_heads,
                                     paired, key_offset, rotary_dim, x_f8, x_f8_t, **options)
    q2, k2 = qkvfuse.qk_norm_rope(qk, factor1, factor2, num_heads, rotary_dim, paired,
                                  key_offset, **options)
    return q, k, v, q2, k2


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name, dynamic", [("qwen3_gqa", False), ("gemma3_mqa", True),
                                           ("rotary_only_partial", False),
                                           ("paired_weights", False),
                                           ("key_offset_neox_weights", False)])
def test_compiled_layout_step_matches_eager(device, name, dynamic):
    """Every option through torch.compile(fullgraph=True), the norm weights' gradients included
    (they flow from both the packed op and qk_norm_rope)."""
    torch._dynamo.reset()
    layout, options = LAYOUT_CASES[name]
    p = Problem(layout, device, options)
    qk = torch.randn(p.tokens, p.heads + p.kv_heads, p.qk_dim, device=device).to(torch.bfloat16)
    qk.requires_grad_()
    w = p.cache[0]
    inputs = (p.x, p.qk_weight, p.v_weight, p.qkv_scale, qk, *p.norm_weights.values())

    def run_layout(fn, grads_out=None):
        outputs = fn(p.x, p.qk_weight, p.v_weight, w.weight_f8, w.weight_f8_t, w.weight_scale,
                     p.qkv_scale, p.x_scale, p.grad_scale, p.factor1, p.factor2, qk, p.heads,
                     p.paired, p.key_offset, p.rotary_dim, p.options)
        if grads_out is None:
            grads_out = [torch.randn_like(t) for t in outputs]
        grads = torch.autograd.grad(outputs, inputs, grads_out)
        return [t.detach() for t in outputs] + list(grads), grads_out

    eager, grads_out = run_layout(layout_step)
    compiled, _ = run_layout(torch.compile(layout_step, fullgraph=True, dynamic=dynamic),
                             grads_out)
    assert len(compiled) == len(eager) == 5 + len(inputs)
    for a, b in zip(compiled, eager):
        assert a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype
        assert torch.equal(raw_bytes(a), raw_bytes(b))


def checked_rope(qk, cos_sin, positions):
    qkvfuse.check_positions(positions, cos_sin.shape[0])
    return qkvfuse.qk_norm_rope(qk, num_heads=2, num_kv_heads=1, rotary_style="neox",
                                cos_sin=cos_sin, positions=positions)


def test_compiled_check_positions_still_checks():
    """check_positions returns nothing: the compiled graph must keep it (it is registered as
    having a side effect) and raise as eager does."""
    torch._dynamo.reset()
    qk = torch.randn(5, 3, 8).to(torch.bfloat16)
    cos_sin = torch.randn(6, 8)
    compiled = torch.compile(checked_rope, fullgraph=True)
    good = torch.tensor([0, 5, 2, 1, 3])
    for a, b in zip(compiled(qk, cos_sin, good), checked_rope(qk, cos_sin, good)):
        assert torch.equal(a, b)
    with pytest.raises(RuntimeError, match=r"check_positions: positions\[1\] = 6 lies outside"):
        compiled(qk, cos_sin, torch.tensor([0, 6, 2, 1, 3]))


def test_meta_tensors_give_meta_outputs():
    """Every tensor on the meta device: the fake kernels answer with outputs of the right shapes
    on meta, as tracing and device="meta" model building need (a meta tensor among real ones is
    an error instead: test_errors.py)."""
    layout, options = LAYOUT_CASES["qwen3_gqa"]
    p = Problem(layout, "meta", options)
    q, k, v = qkvfuse.packed_fp8_qkv(*p.arguments(), **p.options)
    assert [t.shape for t in (q, k, v)] == [(32, 4, 32), (32, 2, 32), (32, 2, 32)]
    grads = torch.autograd.grad((q, k, v), (p.x, p.qk_weight, p.v_weight, p.qkv_scale,
                                            p.options["q_weight"]),
                                [torch.ones_like(t) for t in (q, k, v)])
    assert [g.shape for g in grads] == [p.x.shape, p.qk_weight.shape, p.v_weight.shape, (),
                                        (32,)]
    qk = p.x.new_empty((32, 6, 32)).requires_grad_()
    q, k = qkvfuse.qk_norm_rope(qk, **p.rope_layout(detach=True))
    (grad_qk,) = torch.autograd.grad((q, k), (qk,), (torch.ones_like(q), torch.ones_like(k)))
    grad_row, grad_t, _, _ = qkvfuse.qkv_backward_fp8(
        q.detach(), k.detach(), v.detach(), qk.detach(), grad_scale=p.grad_scale,
        **p.rope_layout(detach=True))
    row, t, amax = qkvfuse.quantize_dual_layout(p.x.detach(), p.x_scale, amax=True)
    d = qkvfuse.fp8_gemm(row, row, p.x_scale, p.x_scale)
    outputs = (q, k, grad_qk, grad_row, grad_t, row, t, amax, d, *grads)
    assert all(t.device.type == "meta" for t in outputs)
    assert (grad_qk.shape, grad_row.shape, grad_t.shape, t.shape, d.shape) == (
        qk.shape, (32, 256), (256, 32), (64, 32), (32, 32))
