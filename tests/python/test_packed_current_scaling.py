"""packed_fp8_qkv_current_scaling: the packed FP8 projection with every scale computed in the
call, against the same projection composed by hand from the public ops (x quantized with
max|x| / 448, a PackedWeightCache of the weight, packed_fp8_qkv, and a gradient hook setting
grad_scale = 4 * max |grad q, k, v| / 448), which test_packed_qkv.py checks against float64.
The two compute the same bits; the scales follow the tensors of each call."""
import pytest
import torch

import qkvfuse
from conftest import DEVICES, raw_bytes
from packed_problem import LAYOUT_CASES, LAYOUTS, Problem
from qkvfuse.rotary import rotary_cos_sin

BF16 = torch.bfloat16
ALL_LAYOUTS = {**{name: (layout, None) for name, layout in LAYOUTS.items()}, **LAYOUT_CASES}


def by_hand(p, x, weight, qkv_scale, headroom=4.0):
    """(q, k, v) through the ops the function replaces, with the scales computed here."""
    rows = (p.heads + p.kv_heads) * p.qk_dim
    qk_weight, v_weight = weight[:rows], weight[rows:]
    x_scale = (x.detach().abs().amax().float() / 448).clamp_min(2.0**-100)
    x_f8, x_f8_t = qkvfuse.quantize_dual_layout(x.detach(), x_scale)
    cache = qkvfuse.PackedWeightCache([(qk_weight.detach(), v_weight.detach())])[0]
    grad_scale = torch.empty((), dtype=torch.float32, device=x.device)
    q, k, v = qkvfuse.packed_fp8_qkv(
        x, qk_weight, v_weight, cache.weight_f8, cache.weight_f8_t, cache.weight_scale,
        qkv_scale, x_scale, grad_scale, p.factor1, p.factor2, p.heads, p.paired, p.key_offset,
        p.rotary_dim, x_f8, x_f8_t, **p.options)

    def hook(grads):
        amax = max(g.abs().amax().float() for g in grads if g is not None)
        grad_scale.copy_((amax / (448 / headroom)).clamp_min(2.0**-100))

    torch.autograd.graph.register_multi_grad_hook((q, k, v), hook)
    return q, k, v


def current(p, x, weight, qkv_scale, **kwargs):
    return qkvfuse.packed_fp8_qkv_current_scaling(
        x, weight, p.heads, p.qk_dim, qkv_scale=qkv_scale, rotary_dim=p.rotary_dim,
        paired=p.paired, key_offset=p.key_offset, factor1=p.factor1, factor2=p.factor2,
        **p.options, **kwargs)


def run(fn, p, x_factor=1.0, grad_factor=1.0, grads_out=None, **kwargs):
    """(q, k, v and the gradients of x, the packed weight, qkv_scale and the norm weights), from
    fresh leaves of the problem's x (times x_factor) and weight; output gradients random (made
    here when not given) times grad_factor."""
    x = (p.x.detach() * x_factor).requires_grad_()
    weight = torch.cat((p.qk_weight, p.v_weight)).detach().requires_grad_()
    qkv_scale = p.qkv_scale.detach().clone().requires_grad_()
    norm_weights = list(p.norm_weights.values())
    for w in norm_weights:
        w.grad = None
    outputs = fn(p, x, weight, qkv_scale, **kwargs)
    if grads_out is None:
        grads_out = [torch.randn_like(t) for t in outputs]
    torch.autograd.backward(outputs, [g * grad_factor for g in grads_out])
    grads = [x.grad, weight.grad, qkv_scale.grad] + [w.grad for w in norm_weights]
    return [t.detach() for t in outputs] + grads, grads_out


def assert_same_bits(mine, want):
    assert len(mine) == len(want)
    for i, (a, b) in enumerate(zip(mine, want)):
        assert a.shape == b.shape and a.dtype == b.dtype, i
        assert torch.equal(raw_bytes(a), raw_bytes(b)), i


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(ALL_LAYOUTS))
def test_equals_the_ops_composed_by_hand(device, name):
    layout, options = ALL_LAYOUTS[name]
    p = Problem(layout, device, options)
    want, grads_out = run(by_hand, p)
    mine, _ = run(current, p, grads_out=grads_out)
    assert_same_bits(mine, want)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["plain", "qwen3_gqa"])
def test_scales_follow_the_tensors_of_the_call(device, name):
    """Current scaling is exact under power-of-two scaling: x times 2^12 or 2^-12 gives v times
    the same (q, k are normalized) and the output gradients times 2^12 or 2^-12 give every
    gradient times the same, bit for bit. A scale that did not follow x or the gradients would
    saturate or flush e4m3 codes at these factors instead."""
    layout, options = ALL_LAYOUTS[name]
    p = Problem(layout, device, options)
    base, grads_out = run(current, p)
    for factor in (2.0**12, 2.0**-12):
        scaled_x, _ = run(current, p, x_factor=factor, grads_out=grads_out)
        assert torch.equal(scaled_x[2], base[2] * factor)
        scaled_grads, _ = run(current, p, grad_factor=factor, grads_out=grads_out)
        assert_same_bits(scaled_grads[:3], base[:3])
        for got, want in zip(scaled_grads[3:], base[3:]):
            assert torch.equal(got, want * factor)


def test_grad_headroom():
    """grad_headroom = 3 (not a power of two: other e4m3 codes than the default 4's): the same
    bits as the hand-made path with that headroom, other gradients than the default's."""
    p = Problem(LAYOUTS["plain"], "cpu")
    want, grads_out = run(by_hand, p, headroom=3.0)
    mine, _ = run(current, p, grads_out=grads_out, grad_headroom=3.0)
    assert_same_bits(mine, want)
    default, _ = run(current, p, grads_out=grads_out)
    assert not torch.equal(default[3], mine[3])


def test_zero_tokens():
    p = Problem(LAYOUTS["plain"], "cpu")
    x = torch.empty(0, p.x.shape[1], dtype=BF16, requires_grad=True)
    weight = torch.cat((p.qk_weight, p.v_weight)).detach().requires_grad_()
    empty = torch.empty(0, p.qk_dim)
    q, k, v = qkvfuse.packed_fp8_qkv_current_scaling(x, weight, p.heads, p.qk_dim,
                                                     factor1=empty, factor2=empty)
    assert q.shape == (0, p.heads, p.qk_dim) and v.shape == (0, p.heads, p.v_dim)
    (q.sum() + k.sum() + v.sum()).backward()
    assert x.grad.shape == x.shape and torch.equal(weight.grad, torch.zeros_like(weight))


def test_errors_name_the_argument():
    p = Problem(LAYOUTS["plain"], "cpu")
    weight = torch.cat((p.qk_weight, p.v_weight)).detach()
    x = p.x.detach()
    tables = dict(factor1=p.factor1, factor2=p.factor2)
    call = qkvfuse.packed_fp8_qkv_current_scaling
    with pytest.raises(RuntimeError, match=r"packed_fp8_qkv_current_scaling: x: expected "
                                           r"torch.bfloat16, got torch.float32"):
        call(x.float(), weight, p.heads, p.qk_dim, **tables)
    with pytest.raises(RuntimeError, match=r"weight: expected a contiguous torch.bfloat16 tensor "
                                           r".* got torch.float32 of shape \[192, 64\]"):
        call(x, weight.float(), p.heads, p.qk_dim, **tables)
    with pytest.raises(RuntimeError, match=r"weight: expected .*\[\(Hq \+ Hkv\) \* D \+ Hkv \* "
                                           r"Dv, C\] = \[128 \+ 2 \* Dv, C\] .* got "
                                           r"torch.bfloat16 of shape \[128, 64\]"):
        call(x, weight[:128], p.heads, p.qk_dim, **tables)
    with pytest.raises(RuntimeError, match=r"weight: expected a contiguous"):
        call(x, weight.t().contiguous().t(), p.heads, p.qk_dim, **tables)
    with pytest.raises(TypeError, match=r"weight: expected a tensor, got float"):
        call(x, 1.0, p.heads, p.qk_dim, **tables)
    with pytest.raises(TypeError, match=r"qkv_scale: expected a torch.float32 tensor"):
        call(x, weight, p.heads, p.qk_dim, qkv_scale=1.0, **tables)
    with pytest.raises(ValueError, match=r"grad_headroom: expected a positive finite number, "
                                         r"got 0"):
        call(x, weight, p.heads, p.qk_dim, grad_headroom=0, **tables)
    with pytest.raises(ValueError, match=r"rotary_style"):  # required with a cos/sin cache
        call(x, weight, p.heads, p.qk_dim, cos_sin=torch.randn(40, 32),
             positions=torch.zeros(32, dtype=torch.int64))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name, dynamic", [("plain", False), ("qwen3_gqa", True)])
def test_compiled_fullgraph_equals_eager(device, name, dynamic):
    """torch.compile(fullgraph=True): the scales' reductions, both quantizations and the
    backward's gradient scale trace into the graphs; the same bits as eager."""
    torch._dynamo.reset()
    layout, options = ALL_LAYOUTS[name]
    p = Problem(layout, device, options)
    eager, grads_out = run(current, p)
    compiled_fn = torch.compile(current, fullgraph=True, dynamic=dynamic, backend="aot_eager")
    compiled, _ = run(compiled_fn, p, grads_out=grads_out)
    assert_same_bits(compiled, eager)


# ---- SPEC.md section 9's options (the families' FP8 path in the transformers integration) -----

def section9_call(variant):
    """(x, weight, q_weight, k_weight as fresh leaves, Hq, D, layout keywords) of a small call
    with one option of section 9: the V norm, query_only (the weight's Q rows alone), the
    token-wide norm (weights [H * D]) or no angles."""
    query_only, token = variant == "query_only", variant == "token_norm"
    tokens, channels, heads, kv, dim = 16, 32, 4, 0 if query_only else 2, 16
    x = torch.randn(tokens, channels).to(BF16).requires_grad_()
    weight = (torch.randn((heads + 2 * kv) * dim, channels) * 0.05).to(BF16).requires_grad_()
    q_weight = (1 + 0.2 * torch.randn(heads * dim if token else dim)).requires_grad_()
    k_weight = None if query_only else (
        1 + 0.2 * torch.randn(kv * dim if token else dim)).requires_grad_()
    angles = variant != "no_angles"
    kwargs = dict(num_kv_heads=None if query_only else kv, rotary_style="neox",
                  q_weight=q_weight, k_weight=k_weight, eps=1e-6,
                  cos_sin=rotary_cos_sin(tokens, dim, dtype=torch.float32) if angles else None,
                  positions=torch.arange(tokens) if angles else None,
                  normalize_v=variant == "v_norm", norm_scope="token" if token else "head",
                  query_only=query_only)
    return x, weight, heads, dim, kwargs


def section9_by_hand(x, weight, heads, dim, kwargs):
    """by_hand's composition for section9_call's layouts (k, v empty with query_only: the
    gradient scale from the gradients that exist)."""
    rows = (heads + (0 if kwargs["query_only"] else kwargs["num_kv_heads"])) * dim
    qk_weight, v_weight = weight[:rows], weight[rows:]
    x_scale = (x.detach().abs().amax().float() / 448).clamp_min(2.0**-100)
    x_f8, x_f8_t = qkvfuse.quantize_dual_layout(x.detach(), x_scale)
    cache = qkvfuse.PackedWeightCache([(qk_weight.detach(), v_weight.detach())])[0]
    grad_scale = torch.empty((), dtype=torch.float32)
    outputs = qkvfuse.packed_fp8_qkv(
        x, qk_weight, v_weight, cache.weight_f8, cache.weight_f8_t, cache.weight_scale,
        torch.ones(()), x_scale, grad_scale, None, None, heads, False, False, None, x_f8, x_f8_t,
        **kwargs)

    def hook(grads):
        amax = max(g.abs().amax().float() for g in grads)
        grad_scale.copy_((amax / (448 / 4.0)).clamp_min(2.0**-100))

    # On the outputs the backward reaches: query_only's q alone (its k and v are empty), through
    # a tensor hook (torch's multi-grad hook of one tensor did not fire here).
    present = [t for t in outputs if t.numel()]
    if len(present) == 1:
        present[0].register_hook(lambda grad: hook([grad]))
    else:
        torch.autograd.graph.register_multi_grad_hook(present, hook)
    return outputs


@pytest.mark.parametrize("variant", ["v_norm", "query_only", "token_norm", "no_angles"])
def test_section9_options_equal_the_ops_composed_by_hand(variant):
    """The options the families need (Gemma 4's V norm and KV-shared layers, OLMo's token-wide
    norm, SmolLM3's NoPE layers): the same bits as packed_fp8_qkv with the scales computed by
    hand, which test_families_ops.py checks against float64; forward, and the gradients of x,
    the weight and the norm weights."""
    results = []
    grads_out = None
    for fn in (section9_by_hand, lambda x, w, h, d, kw: qkvfuse.packed_fp8_qkv_current_scaling(
            x, w, h, d, **kw)):
        torch.manual_seed(3)  # the same inputs for both
        x, weight, heads, dim, kwargs = section9_call(variant)
        outputs = fn(x, weight, heads, dim, kwargs)
        if grads_out is None:
            grads_out = [torch.randn_like(t) for t in outputs]
        torch.autograd.backward([t for t in outputs if t.numel()],
                                [g for g in grads_out if g.numel()])
        leaves = [x, weight, kwargs["q_weight"], kwargs["k_weight"]]
        results.append([t.detach() for t in outputs] +
                       [t.grad for t in leaves if t is not None])
    mine, want = results[1], results[0]
    assert_same_bits(mine, want)
    if variant == "query_only":
        assert mine[1].shape == (16, 0, 16) and mine[2].shape == (16, 0, 16)


def test_section9_weight_errors_name_the_layout():
    x, weight, heads, dim, kwargs = section9_call("query_only")
    with pytest.raises(RuntimeError, match=r"weight: expected a contiguous torch.bfloat16 tensor "
                                           r"\[Hq \* D, C\] = \[64, C\] \(query_only: the query "
                                           r"rows alone\).* got torch.bfloat16 of shape "
                                           r"\[80, 32\]"):
        qkvfuse.packed_fp8_qkv_current_scaling(
            x, torch.cat((weight, weight[:16])).detach(), heads, dim, **kwargs)
