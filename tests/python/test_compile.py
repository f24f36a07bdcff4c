"""torch.compile(fullgraph=True) of a step that uses the ops: no graph breaks, and the same
results as eager (bit for bit: the compiled graph runs the same kernels)."""
import pytest
import torch

import qkvfuse
from conftest import DEVICES, raw_bytes
from packed_problem import LAYOUTS, Problem


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
