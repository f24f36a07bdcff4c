"""SPEC.md section 9 through the Python ops: the V norm (qkvfuse.qk_norm_rope(..., v=,
normalize_v=True) -> (q, k, v_out)), the token-wide norm, query-only calls, calls without angles and
D up to 512, against reference.rope / reference.v_norm in float64; gradcheck, opcheck of the new
ops (qkv_norm_rope and its backward) and of the old ops with the new fields, torch.compile, the FP8
backward's V features and the packed op with the new options, and the errors in Python terms.
On CUDA the new options run only with QKVFUSE_CUDA_SECTION9=1 in the environment (kernels not yet
run on a GPU before): with it, each option on CUDA against the CPU backend on the same bf16 inputs
(forward and backward, D = 32 and Gemma 4's 512); without it, each refused by name."""
import pytest
import torch

import qkvfuse
import reference
from conftest import (assert_bf16_close, rel_error, requires_cuda, requires_section9,
                      without_section9)
from qkvfuse._layout import RopeLayout
from qkvfuse.rotary import rotary_cos_sin


def layout_of(**kwargs):
    return RopeLayout(**{n: kwargs[n] for n in RopeLayout._fields if n in kwargs})


# name -> (qk heads, layout kwargs without tensors, V width or None)
CASES = {
    # OLMo: one RMS over the token's query values and one over its key values, weights [H * D].
    "token_norm": dict(num_heads=4, num_kv_heads=2, norm_scope="token", rotary_style="neox"),
    # Gemma 4's sliding layers in small: q/k weights, the V norm.
    "v_norm": dict(num_heads=4, num_kv_heads=2, rotary_style="neox", normalize_v=True),
    # Gemma 4's KV-shared layers: the query heads alone.
    "query_only": dict(num_heads=3, query_only=True, rotary_style="neox"),
    # SmolLM3's NoPE layers: no angles (here with the norm, to have something to differentiate).
    "no_angles": dict(num_heads=2, num_kv_heads=1, angles=False),
    # Qwen3-Next: partial rotary (r = D/4, even; make() sets it) with (1 + w) weights.
    "partial_offset": dict(num_heads=4, num_kv_heads=2, rotary_style="neox", rotary_dim=None,
                           weight_offset=1.0),
}


def make(name, dim=32, tokens=5, dtype=torch.float64, device="cpu", requires_grad=False):
    """(qk, v or None, kwargs) of a case, with a cos/sin cache at packed positions."""
    spec = dict(CASES[name])
    angles = spec.pop("angles", True)
    if "rotary_dim" in spec:
        spec["rotary_dim"] = max(2, dim // 4 // 2 * 2)
    heads = spec["num_heads"] + (0 if spec.get("query_only") else spec.get("num_kv_heads",
                                                                          spec["num_heads"]))
    qk = torch.randn(tokens, heads, dim, dtype=dtype, device=device)
    kwargs = dict(spec, eps=1e-6)
    if angles:
        r = spec.get("rotary_dim", dim)
        kwargs["cos_sin"] = rotary_cos_sin(tokens + 3, r, dtype=dtype, device=device)
        kwargs["positions"] = torch.tensor([0, 1, 2, 0, 1][:tokens] + [0] * max(0, tokens - 5),
                                           device=device)
    kv = 0 if spec.get("query_only") else spec.get("num_kv_heads", spec["num_heads"])
    token = spec.get("norm_scope") == "token"
    mean = 0.0 if spec.get("weight_offset") else 1.0
    kwargs["q_weight"] = (mean + 0.3 * torch.randn(
        spec["num_heads"] * dim if token else dim, dtype=dtype, device=device))
    if kv:
        kwargs["k_weight"] = mean + 0.3 * torch.randn(kv * dim if token else dim, dtype=dtype,
                                                      device=device)
    v = None
    if spec.get("normalize_v"):
        v = torch.randn(tokens, kv, 24, dtype=dtype, device=device)
        kwargs["v"] = v
    if requires_grad:
        qk.requires_grad_()
        for t in (v, kwargs.get("q_weight"), kwargs.get("k_weight")):
            if t is not None:
                t.requires_grad_()
    return qk, v, kwargs


def ref_kwargs(kwargs):
    return {k: v for k, v in kwargs.items() if k not in ("v", "normalize_v")}


@pytest.mark.parametrize("name", list(CASES))
def test_forward_matches_the_float64_model(name):
    qk, v, kwargs = make(name)
    out = qkvfuse.qk_norm_rope(qk, **kwargs)
    q, k = reference.rope(qk, **ref_kwargs(kwargs))
    torch.testing.assert_close(out[0], q, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out[1], k, rtol=1e-12, atol=1e-12)
    if v is not None:
        assert len(out) == 3
        torch.testing.assert_close(out[2], reference.v_norm(v, 1e-6), rtol=1e-12, atol=1e-12)
    else:
        assert len(out) == 2


@pytest.mark.parametrize("name", list(CASES))
def test_gradcheck_float64(name):
    qk, v, kwargs = make(name, dim=6, tokens=3, requires_grad=True)
    tensors = [t for t in (qk, v, kwargs.get("q_weight"), kwargs.get("k_weight")) if t is not None]

    names = ["qk"] + (["v"] if v is not None else []) + [
        n for n in ("q_weight", "k_weight") if kwargs.get(n) is not None]

    def fn(qk_in, *rest):
        return qkvfuse.qk_norm_rope(qk_in, **{**kwargs, **dict(zip(names[1:], rest))})

    assert torch.autograd.gradcheck(fn, tuple(tensors))


@pytest.mark.parametrize("name", list(CASES))
def test_backward_matches_the_float64_model(name):
    """Gradients of qk, v and the weights against autograd through reference.rope / v_norm."""
    qk, v, kwargs = make(name, requires_grad=True)
    out = qkvfuse.qk_norm_rope(qk, **kwargs)
    grads = [torch.randn_like(o) for o in out]
    inputs = [t for t in (qk, v, kwargs.get("q_weight"), kwargs.get("k_weight")) if t is not None]
    got = torch.autograd.grad(out, inputs, grads)
    refs = [t.detach().clone().requires_grad_() for t in inputs]
    it = iter(refs)
    rqk = next(it)
    rv = next(it) if v is not None else None
    rk = dict(ref_kwargs(kwargs))
    for name_ in ("q_weight", "k_weight"):
        if kwargs.get(name_) is not None:
            rk[name_] = next(it)
    want_out = list(reference.rope(rqk, **rk))
    if rv is not None:
        want_out.append(reference.v_norm(rv, 1e-6))
    want = torch.autograd.grad(want_out, refs, grads)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)


def test_bf16_forward_and_backward_within_rounding():
    """bf16: one rounding of the fp32 result (the float64 model rounded, within 2 half-ulps)."""
    qk, v, kwargs = make("v_norm", dim=64, tokens=9, dtype=torch.bfloat16)
    kwargs["q_weight"] = kwargs["q_weight"].float()
    q, k, v_out = qkvfuse.qk_norm_rope(qk, **kwargs)
    rq, rk = reference.rope(qk, **ref_kwargs(kwargs))
    assert_bf16_close(q, rq)
    assert_bf16_close(k, rk)
    assert_bf16_close(v_out, reference.v_norm(v, 1e-6))


def test_v_may_be_the_key_rows_of_qk():
    """Gemma 4's attention_k_eq_v: v is a view of qk's key rows; autograd adds both gradients."""
    qk, _, kwargs = make("v_norm", requires_grad=True)
    kwargs.pop("v")
    q, k, v_out = qkvfuse.qk_norm_rope(qk, v=qk[:, 4:], **kwargs)
    grads = [torch.randn_like(t) for t in (q, k, v_out)]
    (got,) = torch.autograd.grad((q, k, v_out), (qk,), grads)
    ref_qk = qk.detach().clone().requires_grad_()
    rq, rk = reference.rope(ref_qk, **ref_kwargs(kwargs))
    rv = reference.v_norm(ref_qk[:, 4:], 1e-6)
    (want,) = torch.autograd.grad((rq, rk, rv), (ref_qk,), grads)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("dim", [258, 512])
def test_head_width_up_to_512(dim):
    qk, _, kwargs = make("partial_offset", dim=dim, tokens=3)
    q, k = qkvfuse.qk_norm_rope(qk, **kwargs)
    rq, rk = reference.rope(qk, **ref_kwargs(kwargs))
    torch.testing.assert_close(q, rq, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(k, rk, rtol=1e-12, atol=1e-12)


def test_gated_query_view_reads_in_place():
    """Qwen3-Next's q_proj output [T, H, 2D]: the query half is a view of head stride 2D, which a
    query-only call reads as it is (no copy)."""
    tokens, heads, dim = 5, 4, 16
    projection = torch.randn(tokens, heads, 2 * dim, dtype=torch.float64)
    query = projection[..., :dim]
    assert query.stride() == (heads * 2 * dim, 2 * dim, 1)
    cos_sin = rotary_cos_sin(8, 4, dtype=torch.float64)
    positions = torch.arange(tokens)
    kwargs = dict(num_heads=heads, query_only=True, rotary_style="neox", rotary_dim=4,
                  cos_sin=cos_sin, positions=positions, eps=1e-6)
    q, k = qkvfuse.qk_norm_rope(query, **kwargs)
    assert k.shape == (tokens, 0, dim)
    rq, _ = reference.rope(query, **kwargs)
    torch.testing.assert_close(q, rq, rtol=1e-12, atol=1e-12)


# ---- the binding: opcheck, compile, old calls --------------------------------------------------

@pytest.mark.parametrize("name", list(CASES))
def test_opcheck(name):
    qk, v, kwargs = make(name, dtype=torch.float32, requires_grad=True)
    kwargs = {k: val for k, val in kwargs.items() if k != "v"}
    layout = tuple(layout_of(**kwargs))
    if v is None:
        torch.library.opcheck(torch.ops.qkvfuse.qk_norm_rope.default, (qk, *layout))
        q, k = qkvfuse.qk_norm_rope(qk, **kwargs)
        detached = tuple(t.detach() if isinstance(t, torch.Tensor) else t for t in layout)
        torch.library.opcheck(torch.ops.qkvfuse.qk_norm_rope_backward.default,
                              (torch.randn_like(q), torch.randn_like(k), qk.detach(), *detached))
        return
    torch.library.opcheck(torch.ops.qkvfuse.qkv_norm_rope.default, (qk, v, *layout))
    q, k, v_out = qkvfuse.qk_norm_rope(qk, v=v, **kwargs)
    detached = tuple(t.detach() if isinstance(t, torch.Tensor) else t for t in layout)
    torch.library.opcheck(torch.ops.qkvfuse.qkv_norm_rope_backward.default,
                          (torch.randn_like(q), torch.randn_like(k), torch.randn_like(v_out),
                           qk.detach(), v.detach(), *detached))


def test_old_positional_calls_still_work():
    """The ops' schemas grew defaulted fields: a call with the 15 fields of section 8 runs."""
    qk, _, kwargs = make("partial_offset", dtype=torch.bfloat16)
    layout = tuple(layout_of(**kwargs))
    old = layout[:15]
    q, k = torch.ops.qkvfuse.qk_norm_rope(qk, *old)
    q2, k2 = qkvfuse.qk_norm_rope(qk, **kwargs)
    assert torch.equal(q, q2) and torch.equal(k, k2)


@pytest.mark.parametrize("name", ["v_norm", "token_norm", "query_only", "no_angles"])
def test_compile_fullgraph(name):
    qk, v, kwargs = make(name, dtype=torch.float32, requires_grad=True)

    def fn(qk, v):
        extra = {"v": v} if v is not None else {}
        out = qkvfuse.qk_norm_rope(qk, **{**{k: val for k, val in kwargs.items() if k != "v"},
                                          **extra})
        return sum(o.square().sum() for o in out)

    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    loss = compiled(qk, v)
    inputs = [t for t in (qk, v) if t is not None]
    got = torch.autograd.grad(loss, inputs)
    want = torch.autograd.grad(fn(qk, v), inputs)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


# ---- the FP8 backward and the packed op --------------------------------------------------------

def test_qkv_backward_fp8_v_features_are_the_v_norms_gradient():
    qk, v, kwargs = make("v_norm", dim=32, tokens=6, dtype=torch.bfloat16)
    kwargs = {k: val for k, val in kwargs.items() if k != "v"}
    kwargs["q_weight"] = kwargs["q_weight"].float()
    kwargs["k_weight"] = kwargs["k_weight"].float()
    q, k, v_out = qkvfuse.qk_norm_rope(qk, v=v, **kwargs)
    grad_q, grad_k, grad_v = (torch.randn_like(t) * 0.1 for t in (q, k, v_out))
    scale = torch.tensor(1 / 64)
    grad_row, grad_t, gqw, gkw = qkvfuse.qkv_backward_fp8(
        grad_q, grad_k, grad_v, qk, None, None, scale, v=v, **kwargs)
    assert torch.equal(grad_t, grad_row.t())
    # The V features: e4m3 of the bf16 backward's grad_v (the same op's bf16 path).
    _, grad_v_bf16, _, _ = torch.ops.qkvfuse.qkv_norm_rope_backward(
        grad_q, grad_k, grad_v, qk, v, *layout_of(**kwargs))
    qk_features = qk.shape[1] * qk.shape[2]
    want = (grad_v_bf16.float() / scale).reshape(6, -1)
    got = grad_row[:, qk_features:].float()
    # Saturating cast of the same bf16 values: identical codes.
    assert torch.equal(got, want.clamp(-448, 448).to(torch.float8_e4m3fn).float())
    # Against the float64 model: the V norm's gradient within an e4m3 step.
    rv = v.double().requires_grad_()
    (ref_grad_v,) = torch.autograd.grad(reference.v_norm(rv, 1e-6), (rv,), (grad_v.double(),))
    torch.testing.assert_close(got / 64, ref_grad_v.reshape(6, -1).float(), rtol=0.07, atol=2e-3)
    opcheck_args = (grad_q, grad_k, grad_v, qk, scale, *layout_of(**kwargs), v)
    torch.library.opcheck(torch.ops.qkvfuse.qkv_backward_fp8.default, opcheck_args)


def _packed(normalize_v=False, query_only=False, norm_scope="head", angles=True):
    """A small packed FP8 QKV call (CPU): its inputs, outputs, layout keywords, the e4m3 operands
    of its projection and Hq."""
    tokens, channels, heads, kv, dim, v_dim = 16, 32, 4, 0 if query_only else 2, 16, 16
    x = torch.randn(tokens, channels, dtype=torch.bfloat16, requires_grad=True)
    qk_weight = (torch.randn((heads + kv) * dim, channels) * 0.05).to(torch.bfloat16).requires_grad_()
    v_weight = (torch.randn(kv * v_dim, channels) * 0.05).to(torch.bfloat16).requires_grad_()
    weights = qkvfuse.PackedWeightCache([(qk_weight.detach(), v_weight.detach())])[0]
    x_scale = (x.detach().abs().max().float() / 448)
    x_f8, x_f8_t = qkvfuse.quantize_dual_layout(x.detach(), x_scale)
    # The gradients of q, k and v below are N(0, 1); through the norms (rstd about 3.5 at these
    # projections) they stay within 32: that bound maps onto e4m3's 448.
    grad_scale = torch.tensor(32 / 448)
    token = norm_scope == "token"
    q_weight = (1 + 0.2 * torch.randn(heads * dim if token else dim)).requires_grad_()
    k_weight = None if query_only else (1 + 0.2 * torch.randn(kv * dim if token else dim)).requires_grad_()
    cos_sin = rotary_cos_sin(tokens, dim, dtype=torch.float32) if angles else None
    positions = torch.arange(tokens) if angles else None
    kwargs = dict(num_kv_heads=None if query_only else kv, rotary_style="neox", q_weight=q_weight,
                  k_weight=k_weight, eps=1e-6, cos_sin=cos_sin, positions=positions,
                  normalize_v=normalize_v, norm_scope=norm_scope, query_only=query_only)
    q, k, v = qkvfuse.packed_fp8_qkv(x, qk_weight, v_weight, weights.weight_f8, weights.weight_f8_t,
                                     weights.weight_scale, torch.tensor(1.0), x_scale, grad_scale,
                                     None, None, heads, False, False, None, x_f8, x_f8_t, **kwargs)
    operands = (x_f8, weights.weight_f8, x_scale, weights.weight_scale)
    return (x, qk_weight, v_weight, q_weight, k_weight), (q, k, v), kwargs, operands, heads


@pytest.mark.parametrize("variant", ["v_norm", "query_only", "token_norm", "no_angles"])
def test_packed_fp8_qkv_new_options(variant):
    inputs, (q, k, v), kwargs, operands, heads = _packed(
        normalize_v=variant == "v_norm", query_only=variant == "query_only",
        norm_scope="token" if variant == "token_norm" else "head", angles=variant != "no_angles")
    # The model: the FP8 GEMM of the op's e4m3 operands rounded to bf16 (as the op stores it),
    # then the rope (and the V norm) in float64.
    qkv = reference.fp8_gemm(*operands).to(torch.bfloat16)
    qk_features = q.shape[1] * 16 + k.shape[1] * 16
    qk_proj = qkv[:, :qk_features].reshape(16, -1, 16)
    rope_kwargs = {n: kwargs[n] for n in RopeLayout._fields
                   if n in kwargs and n not in ("normalize_v", "num_heads")}
    rq, rk = reference.rope(qk_proj, num_heads=heads, **rope_kwargs)
    assert_bf16_close(q, rq)
    if variant == "query_only":
        assert k.shape == (16, 0, 16) and v.shape[1] == 0
    else:
        assert_bf16_close(k, rk)
    if variant == "v_norm":
        v_proj = qkv[:, qk_features:].reshape(16, 2, 16)
        assert_bf16_close(v, reference.v_norm(v_proj, 1e-6))
    # Gradients of every input against float64 autograd through the same chain (projection,
    # rope, V norm) from the bf16 inputs: the FP8 backward's e4m3 roundings keep each within
    # a few percent (relative norm).
    outs = (q, k, v)
    grads_out = [torch.randn(o.shape) for o in outs]
    leaves = [t for t in inputs if t is not None]
    got = torch.autograd.grad(outs, leaves, [g.to(o.dtype) for g, o in zip(grads_out, outs)])
    model = [t.detach().double().requires_grad_() for t in leaves]
    mx, mqk, mv, mqw = model[:4]
    mkw = model[4] if len(model) > 4 else None
    rope_kwargs.update(q_weight=mqw, k_weight=mkw)
    kv = k.shape[1]
    mq, mk = reference.rope((mx @ mqk.t()).reshape(16, -1, 16), num_heads=heads, **rope_kwargs)
    mv_out = (mx @ mv.t()).reshape(16, kv, 16)
    if variant == "v_norm":
        mv_out = reference.v_norm(mv_out, 1e-6)
    want = torch.autograd.grad((mq, mk, mv_out), model,
                               [g.double() for g in grads_out], allow_unused=True)
    for name, g, w in zip(["x", "qk_weight", "v_weight", "q_weight", "k_weight"], got, want):
        if w is None or w.numel() == 0:
            continue
        assert rel_error(g, w) < 0.1, (name, rel_error(g, w))


# ---- errors: tests/python/test_errors.py has a case for each refusal of these options ----

def float_tables(kwargs):
    """The weights and the cos/sin cache in float32 (CUDA takes bf16 or float32 tables)."""
    return {k: val.float() if isinstance(val, torch.Tensor) and val.is_floating_point() and
            k in ("q_weight", "k_weight", "cos_sin") else val for k, val in kwargs.items()}


@requires_cuda
@without_section9
@pytest.mark.parametrize("name", list(CASES))
def test_cuda_refuses_each_new_option_by_name(name):
    qk, v, kwargs = make(name, dtype=torch.bfloat16, device="cuda")
    kwargs = float_tables(kwargs)
    if name == "partial_offset":
        qkvfuse.qk_norm_rope(qk, **kwargs)  # section 8: runs
        return
    with pytest.raises(RuntimeError, match="not yet on the CUDA backend.*QKVFUSE_CUDA_SECTION9=1"):
        qkvfuse.qk_norm_rope(qk, **kwargs)


@requires_cuda
@requires_section9
@pytest.mark.parametrize("dim", [32, 512])
@pytest.mark.parametrize("name", list(CASES))
def test_cuda_runs_each_new_option(name, dim):
    """QKVFUSE_CUDA_SECTION9=1: the option on CUDA against the CPU backend on the same bf16 inputs
    (which the tests above judge against float64): outputs within two bf16 roundings, every
    input's gradient within 1 % relative error (both round the backward's bf16 results)."""
    qk, v, kwargs = make(name, dim=dim, tokens=37, dtype=torch.bfloat16, device="cuda",
                         requires_grad=True)
    kwargs = float_tables(kwargs)
    for key in ("q_weight", "k_weight"):
        if kwargs.get(key) is not None:
            kwargs[key] = kwargs[key].detach().requires_grad_()
    cpu_kwargs = {k: val.detach().cpu().requires_grad_(val.requires_grad)
                  if isinstance(val, torch.Tensor) else val for k, val in kwargs.items()}
    cpu_qk = qk.detach().cpu().requires_grad_()
    if v is not None:
        cpu_kwargs["v"] = v.detach().cpu().requires_grad_()
    out = qkvfuse.qk_norm_rope(qk, **kwargs)
    want = qkvfuse.qk_norm_rope(cpu_qk, **cpu_kwargs)
    assert len(out) == len(want)
    for got, ref in zip(out, want):
        assert_bf16_close(got.cpu(), ref.detach())
    grads = [torch.randn_like(o) for o in want]
    inputs = [qk] + [t for t in (v, kwargs.get("q_weight"), kwargs.get("k_weight")) if t is not None]
    cpu_inputs = [cpu_qk] + [t for t in (cpu_kwargs.get("v"), cpu_kwargs.get("q_weight"),
                                         cpu_kwargs.get("k_weight")) if t is not None]
    got = torch.autograd.grad(out, inputs, [g.cuda() for g in grads])
    ref = torch.autograd.grad(want, cpu_inputs, grads)
    for g, r in zip(got, ref):
        assert rel_error(g.cpu(), r) < 1e-2, rel_error(g.cpu(), r)

