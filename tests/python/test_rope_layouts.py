"""qk_norm_rope's general layouts (SPEC.md section 8: GQA/MQA, NeoX, partial rotary, no norm, norm
weights with offset and eps, a cos/sin cache read at positions) against the float64 model
reference.rope, their weight gradients, gradcheck, opcheck, the position checks and the errors."""
import os
import subprocess
import sys

import pytest
import torch

import qkvfuse
import reference as ref
from conftest import DEVICES, assert_bf16_close, poison_allocator, raw_bytes, rel_error
from layout_cases import CASES, MAIN_CASES, make, weights_of
from qkvfuse._layout import RopeLayout

BF16 = torch.bfloat16


def assert_weight_grad_close(grad, expected, weight):
    """A norm weight's gradient: the weight's dtype and shape; float32 sums of float32 products
    (rel. error ~1e-7 per term), then one rounding to the weight's dtype."""
    assert grad.dtype == weight.dtype and grad.shape == weight.shape
    if weight.dtype == BF16:
        assert_bf16_close(grad, expected)
    else:
        assert rel_error(grad, expected) < 1e-5, rel_error(grad, expected)


# Rows 16-byte aligned (CUDA's vector kernels where D and r allow) or not (its element kernels).
PADS = [8, 5]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("pad", PADS)
def test_forward_matches_reference(device, case, pad):
    qk, kwargs = make(case, device, pad=pad)
    poison_allocator(device, 2 * qk.numel(), 2 * qk.numel())
    q, k = qkvfuse.qk_norm_rope(qk, **kwargs)
    q_ref, k_ref = ref.rope(qk, **kwargs)
    assert q.shape == q_ref.shape and k.shape == k_ref.shape
    assert q.dtype == k.dtype == BF16 and q.is_contiguous() and k.is_contiguous()
    assert_bf16_close(q, q_ref)
    assert_bf16_close(k, k_ref)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("pad", PADS)
def test_backward_matches_reference(device, case, pad):
    qk, kwargs = make(case, device, requires_grad=True, pad=pad)
    weights = weights_of(kwargs)
    q, k = qkvfuse.qk_norm_rope(qk, **kwargs)
    grad_q, grad_k = torch.randn_like(q), torch.randn_like(k)
    # A transposed-then-transposed-back gradient: arbitrary token/head strides.
    grad_q = grad_q.transpose(0, 1).contiguous().transpose(0, 1)
    grads = torch.autograd.grad((q, k), (qk, *weights.values()), (grad_q, grad_k))
    expected = ref.rope_grads(grad_q, grad_k, qk, **kwargs)
    assert grads[0].dtype == BF16 and grads[0].shape == qk.shape
    assert_bf16_close(grads[0], expected[0])
    wanted = dict(zip(("q_weight", "k_weight"), expected[1:]))
    for (name, weight), grad in zip(weights.items(), grads[1:]):
        assert_weight_grad_close(grad, wanted[name], weight)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ["qwen3_gqa", "gemma3_mqa", "key_offset_weights"])
def test_weight_gradients_are_deterministic(device, case):
    qk, kwargs = make(case, device, tokens=300)  # several of the CPU's 64-token blocks
    q, k = qkvfuse.qk_norm_rope(qk, **kwargs)
    grad_q, grad_k = torch.randn_like(q), torch.randn_like(k)
    args = (grad_q, grad_k, qk, *RopeLayout(**_layout_kwargs(kwargs)))
    first = torch.ops.qkvfuse.qk_norm_rope_backward(*args)
    for _ in range(3):
        again = torch.ops.qkvfuse.qk_norm_rope_backward(*args)
        assert all(torch.equal(raw_bytes(a), raw_bytes(b)) for a, b in zip(first, again))


@pytest.mark.parametrize("case", ["qwen3_gqa", "gemma3_mqa", "partial_interleaved_mqa",
                                  "rotary_only", "neox_tables_q_weight", "paired_weights",
                                  "paired_neox_partial", "key_offset_weights"])
def test_gradcheck_float64(case):
    """float64 on the CPU: the gradient of qk and of both weights, against finite differences."""
    qk, kwargs = make(case, "cpu", qk_dtype=torch.float64, tokens=4)
    qk = qk.detach().requires_grad_()
    names = list(weights_of(kwargs))
    weights = [kwargs[name].detach().requires_grad_() for name in names]

    def fn(x, *ws):
        return qkvfuse.qk_norm_rope(x, **{**kwargs, **dict(zip(names, ws))})

    assert torch.autograd.gradcheck(fn, (qk, *weights))


def test_outputs_keep_to_their_dtype_on_the_cpu():
    """float32 qk on the CPU: float32 outputs, float32 weight gradients for float32 weights."""
    qk, kwargs = make("qwen3_gqa", "cpu", qk_dtype=torch.float32, requires_grad=True)
    q, k = qkvfuse.qk_norm_rope(qk, **kwargs)
    assert q.dtype == k.dtype == torch.float32
    q_ref, k_ref = ref.rope(qk.detach(), **kwargs)
    assert rel_error(q, q_ref) < 1e-6 and rel_error(k, k_ref) < 1e-6


@pytest.mark.parametrize("device", DEVICES)
def test_weights_need_no_gradient(device):
    """Weights that do not require grad get none; qk still does."""
    qk, kwargs = make("qwen3_gqa", device)
    qk = qk.detach().requires_grad_()
    q, k = qkvfuse.qk_norm_rope(qk, **kwargs)
    (q.float().sum() + k.float().sum()).backward()
    assert qk.grad is not None
    assert kwargs["q_weight"].grad is None and kwargs["k_weight"].grad is None


@pytest.mark.parametrize("device", DEVICES)
def test_default_rotary_dim_is_the_cache_width(device):
    qk, kwargs = make("partial_interleaved_mqa", device)
    explicit = qkvfuse.qk_norm_rope(qk, **kwargs)
    kwargs["rotary_dim"] = None
    default = qkvfuse.qk_norm_rope(qk, **kwargs)
    assert all(torch.equal(a, b) for a, b in zip(explicit, default))


@pytest.mark.parametrize("device", DEVICES)
def test_int32_and_int64_positions_agree(device):
    qk, kwargs = make("qwen3_gqa", device)
    wide = qkvfuse.qk_norm_rope(qk, **kwargs)
    kwargs["positions"] = kwargs["positions"].int()
    narrow = qkvfuse.qk_norm_rope(qk, **kwargs)
    assert all(torch.equal(a, b) for a, b in zip(wide, narrow))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("style", ["interleaved", "neox"])
def test_strided_cache_and_positions(device, style):
    """cos_sin may be a column slice (row stride > r), positions any strided view."""
    qk, kwargs = make("qwen3_gqa", device, requires_grad=True)
    kwargs["rotary_style"] = style
    wide = torch.randn(20, 3 + 32 + 5, device=device)
    kwargs["cos_sin"] = wide[:, 3:35]
    kwargs["positions"] = torch.randint(0, 20, (2 * qk.shape[0],), device=device)[::2]
    q, k = qkvfuse.qk_norm_rope(qk, **kwargs)
    q_ref, k_ref = ref.rope(qk.detach(), **kwargs)
    assert_bf16_close(q, q_ref)
    assert_bf16_close(k, k_ref)
    grad_q, grad_k = torch.randn_like(q), torch.randn_like(k)
    grads = torch.autograd.grad((q, k), (qk, kwargs["q_weight"], kwargs["k_weight"]),
                                (grad_q, grad_k))
    expected = ref.rope_grads(grad_q, grad_k, qk, **kwargs)
    assert_bf16_close(grads[0], expected[0])
    for grad, want, weight in zip(grads[1:], expected[1:], weights_of(kwargs).values()):
        assert_weight_grad_close(grad, want, weight)


@pytest.mark.parametrize("device", DEVICES)
def test_zero_tokens(device):
    """T = 0: empty q and k; the weight gradients are sums over no rows, zeros."""
    qk, kwargs = make("qwen3_gqa", device, tokens=0, requires_grad=True)
    q, k = qkvfuse.qk_norm_rope(qk, **kwargs)
    assert q.shape == (0, 4, 32) and k.shape == (0, 2, 32)
    poison_allocator(device, 4 * 32, 4 * 32)
    (q.float().sum() + k.float().sum()).backward()
    assert qk.grad.shape == qk.shape
    for name in ("q_weight", "k_weight"):
        assert torch.equal(kwargs[name].grad, torch.zeros_like(kwargs[name]))


# ---- positions -----------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("position_dtype", [torch.int32, torch.int64])
def test_position_outside_the_cache_gives_nan_in_its_rotary_lanes(device, position_dtype):
    """Never an out-of-bounds read: a token whose position is outside [0, P) has NaN in its rotary
    lanes, its other lanes and every other token are as with valid positions."""
    qk, kwargs = make("partial_interleaved_mqa", device)  # r = 8 of D = 16
    kwargs["positions"] = kwargs["positions"].to(position_dtype)
    valid = qkvfuse.qk_norm_rope(qk, **kwargs)
    rows = kwargs["cos_sin"].shape[0]
    bad = kwargs["positions"].clone()
    bad[2], bad[5] = -1, rows
    if position_dtype == torch.int64:
        bad[7] = 2**40  # beyond int32
    broken = {2, 5, 7} if position_dtype == torch.int64 else {2, 5}
    out = qkvfuse.qk_norm_rope(qk, **{**kwargs, "positions": bad})
    for got, want in zip(out, valid):
        for t in range(qk.shape[0]):
            if t in broken:
                assert got[t, :, :8].isnan().all(), t
                assert torch.equal(got[t, :, 8:], want[t, :, 8:]), t
            else:
                assert torch.equal(got[t], want[t]), t


@pytest.mark.parametrize("device", DEVICES)
def test_check_positions(device):
    positions = torch.tensor([0, 3, 8, 2], device=device)
    qkvfuse.check_positions(positions, 9)
    qkvfuse.check_positions(positions.int(), 9)
    qkvfuse.check_positions(positions[:0], 0)
    with pytest.raises(RuntimeError, match=r"check_positions: positions\[2\] = 8 lies outside "
                                           r"\[0, 8\)"):
        qkvfuse.check_positions(positions, 8)
    with pytest.raises(RuntimeError, match=r"check_positions: positions\[1\] = -4 lies outside"):
        qkvfuse.check_positions(torch.tensor([1, -4, 99], device=device, dtype=torch.int32), 9)
    with pytest.raises(RuntimeError, match="check_positions: positions: .*torch.int32 or "
                                           "torch.int64"):
        qkvfuse.check_positions(positions.float(), 9)
    with pytest.raises(RuntimeError, match="check_positions: positions"):
        qkvfuse.check_positions(positions.view(2, 2), 9)


def test_check_positions_op():
    torch.library.opcheck(torch.ops.qkvfuse.check_positions.default,
                          (torch.tensor([0, 3, 1]), 4))


CHECKED_CALL = """
import torch, qkvfuse
qk = torch.randn(4, 2, 8).to(torch.bfloat16)
cos_sin = torch.randn(6, 8)
positions = torch.tensor([0, 5, {bad}, 1])
try:
    qkvfuse.qk_norm_rope(qk, num_heads=1, rotary_style="neox", cos_sin=cos_sin,
                         positions=positions)
except RuntimeError as error:
    print("raised:", str(error).splitlines()[0])
else:
    print("ran")
"""


@pytest.mark.parametrize("bad, check, expected", [
    (6, "1", "raised: check_positions: positions[2] = 6 lies outside [0, 6)"),
    (6, "0", "ran"),
    (3, "1", "ran"),
])
def test_environment_variable_checks_every_call(bad, check, expected):
    """QKVFUSE_CHECK_POSITIONS=1 (read once per process): every call with a cos/sin cache checks
    its positions and raises, naming the token."""
    env = dict(os.environ, QKVFUSE_CHECK_POSITIONS=check)
    result = subprocess.run([sys.executable, "-c", CHECKED_CALL.format(bad=bad)], env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.strip().splitlines()
    assert lines and lines[-1].startswith(expected), lines


# ---- the binding's description of the layout ----------------------------------------------------

ROPE_OPS = ["qk_norm_rope", "qk_norm_rope_backward", "qkv_norm_rope", "qkv_norm_rope_backward",
            "qkv_backward_fp8", "packed_qkv_forward", "packed_qkv_backward"]
# The ops whose schema has an argument of its own after the layout: the V norm's saved input.
TRAILING = {"qkv_backward_fp8": ["v"], "packed_qkv_backward": ["v"]}


@pytest.mark.parametrize("op", ROPE_OPS)
def test_every_rope_schema_ends_with_the_layout(op):
    """One description: each rope op's schema ends with RopeLayout's fields, in order, the
    tensors optional (then only the op's own trailing optional v); the fields of SPEC.md
    section 9 and v have defaults, so calls written before them still work."""
    arguments = getattr(torch.ops.qkvfuse, op).default._schema.arguments
    trailing = TRAILING.get(op, [])
    assert [a.name for a in arguments[len(arguments) - len(trailing):]] == trailing
    for a in arguments[len(arguments) - len(trailing):]:
        assert str(a.type) == "Optional[Tensor]" and a.default_value is None
    fragment = arguments[:len(arguments) - len(trailing)]
    tail = fragment[len(fragment) - len(RopeLayout._fields):]
    assert [a.name for a in tail] == list(RopeLayout._fields)
    defaults = {a.name: a.default_value for a in tail if a.has_default_value()}
    assert defaults == {"normalize_v": False, "norm_scope": "head", "query_only": False}
    types = {a.name: str(a.type) for a in tail}
    for name in ("factor1", "factor2", "cos_sin", "positions", "q_weight", "k_weight"):
        assert types[name] == "Optional[Tensor]", (name, types[name])
    assert types["rotary_style"] == "str" and types["eps"] == "float"


def _layout_kwargs(kwargs):
    """RopeLayout's fields from qk_norm_rope's keyword arguments (the same names)."""
    return {name: kwargs[name] for name in RopeLayout._fields if name in kwargs}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", MAIN_CASES + ["paired_neox_partial", "no_rotary_lanes"])
def test_opcheck(device, case):
    qk, kwargs = make(case, device, requires_grad=True)
    layout = tuple(RopeLayout(**_layout_kwargs(kwargs)))
    torch.library.opcheck(torch.ops.qkvfuse.qk_norm_rope.default, (qk, *layout))
    q, k = qkvfuse.qk_norm_rope(qk, **kwargs)
    detached = tuple(t.detach() if isinstance(t, torch.Tensor) else t for t in layout)
    torch.library.opcheck(torch.ops.qkvfuse.qk_norm_rope_backward.default,
                          (torch.randn_like(q), torch.randn_like(k), qk.detach(), *detached))
